"""`tensorwire bench report`: re-measures the numbers README.md states, in one command.

It runs the existing benchmark commands behind the README's performance section, one
after the other (no benchmark loop of its own), each with the settings its committed
file was made with (the project's alternating best of 3: about 28 minutes on the
2-vCPU development VM; ``--repeat 1`` takes about 11 and its files say so); writes each one's output to the file the README cites in
bench/results/ (replacing it: the file's first lines say command, date and code), and
regenerates the README's blocks between the markers

    <!-- bench-report:begin --> ... <!-- bench-report:end -->            (performance)
    <!-- bench-report:demo:begin --> ... <!-- bench-report:demo:end -->  (make demo's output)

from those files, so the README states what the files hold. A step that fails keeps
the old file (its output is kept in a temporary folder, named at the end). The GPU
numbers come from bench/gpu/checks.sh on a GPU machine, not from here.

Which claim each file backs, and the commands in full: bench/results/README.md.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .common import BenchError

RESULTS = Path("bench") / "results"
BEGIN, END = "<!-- bench-report:begin -->", "<!-- bench-report:end -->"
DEMO_BEGIN, DEMO_END = "<!-- bench-report:demo:begin -->", "<!-- bench-report:demo:end -->"
OUT = "{out}"  # in a step's command: the folder its files are written to


@dataclass(frozen=True)
class Step:
    """One benchmark command of the report. `argv` starts with "tensorwire" (run as
    `python -m tensorwire`) or names a script of the checkout; {out} in it is the
    folder of its output files. `txt` is the file its output goes to (stdout and
    stderr, with a header), None where the command writes its own (`writes`)."""

    name: str
    backs: str  # what it re-measures, in the README's words
    argv: tuple[str, ...]
    txt: str | None
    writes: tuple[str, ...] = ()  # the other files it leaves in {out}
    minutes: float = 1.0  # about how long it takes on the 2-vCPU VM
    ok_codes: tuple[int, ...] = (0,)  # exit codes of a run that measured (a missed target included)
    stderr: bool = True  # its stderr into the file too

    def files(self) -> tuple[str, ...]:
        return ((self.txt,) if self.txt else ()) + self.writes

    def command(self, out: str) -> list[str]:
        return [a.replace(OUT, out) for a in self.argv]

    def with_repeat(self, n: int) -> "Step":
        """This step with `n` passes instead of its own (its --repeat/--reps), its time scaled."""
        argv = list(self.argv)
        for i, a in enumerate(argv[:-1]):
            if a in ("--repeat", "--reps"):
                own = int(argv[i + 1])
                argv[i + 1] = str(n)
                return replace(self, argv=tuple(argv), minutes=self.minutes * n / own)
        return self

    def shown(self, out: str = str(RESULTS)) -> str:
        """The command as a person types it (from the checkout's root)."""
        text = shlex.join(self.command(out))
        return f"{text} > {out}/{self.txt}" if self.txt else text


def _bench(*args: str) -> tuple[str, ...]:
    return ("tensorwire", "bench", *args)


STEPS: tuple[Step, ...] = (
    Step("demo", "make demo's output", ("tensorwire", "demo"), "demo.txt", minutes=0.1, stderr=False),
    Step(
        "p2p",
        "point to point vs ucx_perftest (write_bw, write_lat) and a plain TCP socket",
        ("bash", "bench/compare_ucx_perftest.sh", "--reps", "3"),
        None,
        writes=("compare_ucx_perftest.txt", "compare_ucx_perftest.json"),
        minutes=4.0,
        ok_codes=(0, 1),
    ),
    Step(
        "tensor-shm",
        "Figure 7 over shared memory: slots vs RPC over UCX, gRPC, UCX tag, gloo",
        _bench(
            "tensor",
            "--transport",
            "shm",
            "--repeat",
            "3",
            "--no-progress",
            "--json",
            f"{OUT}/tensor_shm.json",
            "--plot",
            f"{OUT}/tensor_shm.png",
        ),
        "tensor_shm.txt",
        writes=("tensor_shm.json", "tensor_shm.png"),
        minutes=5.0,
        ok_codes=(0, 2),
    ),
    Step(
        "tensor-tcp",
        "Figure 7 over tcp",
        _bench(
            "tensor",
            "--transport",
            "tcp",
            "--repeat",
            "3",
            "--no-progress",
            "--json",
            f"{OUT}/tensor_tcp.json",
            "--plot",
            f"{OUT}/tensor_tcp.png",
        ),
        "tensor_tcp.txt",
        writes=("tensor_tcp.json", "tensor_tcp.png"),
        minutes=4.0,
        ok_codes=(0, 2),
    ),
    Step(
        "torch-dist-shm",
        "the torch.distributed backend vs gloo, tensorwire over shared memory",
        _bench(
            "torch-dist", "--transport", "shm", "--repeat", "3", "--no-progress", "--json", f"{OUT}/torch_dist_shm.json"
        ),
        "torch_dist_shm.txt",
        writes=("torch_dist_shm.json",),
        minutes=2.5,
    ),
    Step(
        "torch-dist-tcp",
        "the torch.distributed backend vs gloo, tensorwire over tcp",
        _bench(
            "torch-dist", "--transport", "tcp", "--repeat", "3", "--no-progress", "--json", f"{OUT}/torch_dist_tcp.json"
        ),
        "torch_dist_tcp.txt",
        writes=("torch_dist_tcp.json",),
        minutes=2.5,
    ),
    Step(
        "train-shm",
        "PS training vs gloo (Figure 8, batch 1) over shared memory",
        _bench(
            "train",
            "--transport",
            "shm",
            "--figures",
            "fig8",
            "--batches",
            "1",
            "--steps",
            "20",
            "--repeat",
            "3",
            "--json",
            f"{OUT}/train_shm_b1.json",
        ),
        "train_shm_b1.txt",
        writes=("train_shm_b1.json",),
        minutes=6.0,
    ),
    Step(
        "train-tcp",
        "PS training vs gloo (Figure 8, batch 1) over tcp, with the TCP floor",
        _bench(
            "train",
            "--transport",
            "tcp",
            "--figures",
            "fig8",
            "--batches",
            "1",
            "--steps",
            "20",
            "--repeat",
            "2",
            "--json",
            f"{OUT}/net_tcp_train_b1.json",
        ),
        "net_tcp_train_b1.txt",
        writes=("net_tcp_train_b1.json",),
        minutes=4.0,
    ),
)
STEP_NAMES = tuple(s.name for s in STEPS)


def select(only: str | None) -> list[Step]:
    """The steps named in `only` (a comma list; None: all), in the report's order."""
    if not only:
        return list(STEPS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    bad = [n for n in names if n not in STEP_NAMES]
    if bad or not names:
        raise ValueError(f"--only takes {', '.join(STEP_NAMES)}; got {only!r}")
    return [s for s in STEPS if s.name in names]


def steps_table() -> str:
    """The steps, for --help: name, minutes, what it re-measures, its files."""
    lines = []
    for s in STEPS:
        lines.append(f"  {s.name:<15}~{s.minutes:>3.1f} min  {s.backs}\n  {'':<15}           -> {', '.join(s.files())}")
    total = sum(s.minutes for s in STEPS)
    return "\n".join(lines) + f"\n  all: about {total:.0f} minutes"


# --- running ---------------------------------------------------------------------------------------


def _minutes(steps: list[Step]) -> str:
    total = sum(s.minutes for s in steps)
    return f"about {total:.0f} min" if total >= 1 else "under a minute"


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds} s"


def _code(root: Path) -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        # the files this report writes itself do not make the code it ran uncommitted
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":(exclude)bench/results",
                ":(exclude)README.md",
            ],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "code unknown"
    if not head:
        return "code unknown"
    return f"code {head}" + (" + uncommitted changes" if dirty else "")


def _load() -> str:
    try:
        return "%.2f" % os.getloadavg()[0]
    except OSError:
        return "?"


def _verdict(text: str) -> str:
    """The last PASS/WARN/FAIL/MISS line of a command's output ('' if none)."""
    for line in reversed(text.splitlines()):
        if re.match(r"(PASS|WARN|FAIL|MISS)\b", line):
            return line.strip()
    return ""


@dataclass
class Outcome:
    step: Step
    ok: bool
    seconds: float
    summary: str
    kept: str | None = None  # where a failed step's output is
    written: list[str] = field(default_factory=list)


def run_step(step: Step, root: Path, timeout: float, keep_dir: Path) -> Outcome:
    """Runs one step from `root`; on success moves its files into root/bench/results."""
    results = root / RESULTS
    out = Path(tempfile.mkdtemp(prefix=f"tw-report-{step.name}-"))
    argv = step.command(str(out))
    if argv[0] == "tensorwire":
        argv = [sys.executable, "-m", "tensorwire", *argv[1:]]
    env = dict(os.environ, TENSORWIRE_PROGRESS_BAR="0", PYTHONUNBUFFERED="1")
    start, wall, load0 = time.monotonic(), time.strftime("%Y-%m-%d %H:%M", time.gmtime()), _load()
    log = out / "output.txt"
    with open(log, "w") as f:
        try:
            proc = subprocess.Popen(
                argv,
                cwd=root,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT if step.stderr else subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as e:
            return Outcome(step, False, 0.0, f"could not start: {e}")
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    if rc is None or rc not in step.ok_codes:
        kept = keep_dir / step.name
        shutil.rmtree(kept, ignore_errors=True)
        shutil.move(str(out), kept)
        why = f"timed out after {_clock(timeout)}" if rc is None else f"exit {rc}"
        return Outcome(step, False, seconds, f"FAILED ({why}): {_verdict(text) or text.strip()[-200:]}", kept=str(kept))
    written = []
    if step.txt:
        header = (
            f"# command: {step.shown()}   (step {step.name} of tensorwire bench report)\n"
            f"# date: {wall}-{time.strftime('%H:%M', time.gmtime())} UTC, {_code(root)}, "
            f"{os.cpu_count()} CPUs, load average {load0} at start, {_load()} at end\n"
        )
        (results / step.txt).write_text(header + text)
        written.append(step.txt)
    for name in step.writes:
        if (out / name).exists():
            shutil.move(str(out / name), results / name)
            written.append(name)
        elif step.txt is None and (results / name).exists():
            written.append(name)  # the command wrote it there itself
    shutil.rmtree(out, ignore_errors=True)
    return Outcome(step, True, seconds, _verdict(text) or "done", written=written)


# --- the README's blocks, from the files -------------------------------------------------------------


def _read(results: Path, name: str) -> str | None:
    path = results / name
    return path.read_text(errors="replace") if path.exists() else None


def _provenance(text: str, how: bool = True) -> str:
    """'2026-11-22, code 51bfc75, best of 3' from a results file's first lines (how: the repeats)."""
    head = "\n".join(text.splitlines()[:6])
    parts = []
    date = re.search(r"\b(20\d\d-\d\d-\d\d)", head)
    if date:
        parts.append(date.group(1))
    code = re.search(r"\b(?:code|commit|at) ([0-9a-f]{7,12})\b", head)
    if code:
        parts.append(f"code {code.group(1)}")
    repeats = re.search(r"\b(best of \d+|median of \d+ runs)", text) if how else None
    if repeats:
        parts.append(repeats.group(1))
    return ", ".join(parts)


def _link(name: str) -> str:
    return f"[{name}]({RESULTS.as_posix()}/{name})"


def _size(text: str) -> str:
    n = int(text)
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _missing(name: str, step: str) -> list[str]:
    return [f"* {_link(name)}: not measured yet (`tensorwire bench report --only {step}`)"]


COMPARE_ROW = re.compile(
    r"^(tcp|shm|rdma)\s+(bw|lat)\s+(\d+)\s+([\d.]+)\s+(.+?)\s+([\d.]+)\s+(\S+)\s+([\d.]+)x\s+"
    r"\(target >= ([\d.]+)x\)\s+(PASS|FAIL)"
)


def compare_lines(text: str) -> tuple[str, list[str]]:
    rows = [m.groups() for m in map(COMPARE_ROW.match, text.splitlines()) if m]
    met = sum(r[-1] == "PASS" for r in rows)
    lines = []
    for tr, metric, size, ours, anchor, theirs, unit, ratio, target, verdict in rows:
        what = "write_bw" if metric == "bw" else "write_lat"
        lines.append(
            f"  * {verdict} {tr} `{what}` {_size(size)}: {float(ours):g} against {float(theirs):g} {unit} "
            f"of {anchor}, {ratio}x (target >= {target}x)"
        )
    return f"{met} of {len(rows)} ratios meet their targets", lines


TENSOR_TARGET = re.compile(
    r"^#\s+(PASS|MISS|INFO)\s+(.+?)\s{2,}([\d.]+)(x| us)\s+\(bar ([^)]+)\)\s+"
    r"worst at (\S+) of (\d+) size"
)
TENSOR_VERDICT = re.compile(r"^(PASS|WARN|FAIL) tensor \S+ (?:\S+ )?zerocopy=([\d.]+)MB/s@(\S+) speed-up: ([^(;]+)")


def tensor_lines(text: str) -> tuple[str, list[str]]:
    lines, counts = [], {"PASS": 0, "MISS": 0}
    for m in map(TENSOR_TARGET.match, text.splitlines()):
        if m:
            verdict, what, value, unit, bar, at, n = m.groups()
            value = f"{value}x" if unit == "x" else f"{value} us"
            where = f"at {at}" if n == "1" else f"worst of the {n} sizes it covers, at {at}"
            shown = "INFO (a bar set for shm)" if verdict == "INFO" else verdict
            lines.append(f"  * {shown} `{what}`: {value} ({where}; bar {bar})")
            counts[verdict] = counts.get(verdict, 0) + 1
    summary = (
        f"{counts['PASS']} of {counts['PASS'] + counts['MISS']} bars met"
        if counts["PASS"] + counts["MISS"]
        else "no bars for this transport in that run"
    )
    verdict = next((m for m in map(TENSOR_VERDICT.match, text.splitlines()) if m), None)
    if verdict:
        sanity, mbps, at, speedups = verdict.groups()
        lines.append(
            f"  * at {at}: zerocopy {float(mbps):,.0f} MB/s; the other series' time over zerocopy's: "
            f"{speedups.strip().rstrip(',')}; sanity checks {sanity}"
        )
    return summary, lines


TORCH_TARGET = re.compile(r"^# target (.+?): ([\d.]+x(?: \([^)]*\))?) (PASS|MISS)$")  # (a compute ceiling)


def torch_dist_lines(text: str) -> tuple[str, list[str]]:
    lines = [f"  * {m.group(3)} {m.group(1)}: {m.group(2)}" for m in map(TORCH_TARGET.match, text.splitlines()) if m]
    # the tables' ratio columns (tensorwire over gloo: > 1 = tensorwire faster), one line for all
    tables: list[tuple[str | None, list[tuple[str, str]]]] = []
    title: str | None = None
    rows: list[tuple[str, str]] | None = None
    for line in text.splitlines():
        if (
            line.startswith("# ")
            and not line.startswith(("# target", "# python"))
            and "Size" not in line
            and "Model" not in line
        ):
            title = line[2:].split(":")[0].split(",")[0].strip()
        elif re.match(r"^\s*# (Size|Model)\b", line):
            kind = "latency" if "Lat (us)" in line else "bandwidth" if "BW" in line else None
            rows = []
            tables.append((f"send/recv {kind}" if kind else title, rows))
        elif rows is not None and re.match(r"^\s*\S+\s+[\d.]+\s+[\d.]+\s+[\d.]+x$", line):
            label, _, _, ratio = line.split()
            rows.append((_size(label) if label.isdigit() else label, ratio))
        elif line.startswith("---") and rows:
            rows = None
    if tables:
        parts = [f"{t} " + ", ".join(f"{r} ({label})" for label, r in rows) for t, rows in tables if rows]
        lines.append("  * tensorwire against gloo (> 1x: tensorwire faster): " + "; ".join(parts))
    met = sum(line.startswith("  * PASS") for line in lines)
    missed = sum(line.startswith("  * MISS") for line in lines)
    failed = next((line for line in text.splitlines() if line.startswith("FAIL")), "")
    return failed or f"{met} of {met + missed} targets met", lines


TRAIN_ROW = re.compile(r"^(\w+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)x$")
TRAIN_TARGET = re.compile(
    r"^\s+(\w+) batch (\d+): zerocopy/(copy|gloo) = ([\d.]+)x \(target >= ([\d.]+)x\): "
    r"(met|NOT met)"
)


def train_lines(text: str) -> tuple[str, list[str]]:
    targets: dict[tuple[str, str], dict[str, tuple[str, str, str]]] = {}
    for m in map(TRAIN_TARGET.match, text.splitlines()):
        if m:
            model, batch, other, ratio, target, met = m.groups()
            targets.setdefault((model, batch), {})[other] = (ratio, target, "met" if met == "met" else "MISS")
    lines, in_fig8 = [], False
    for line in text.splitlines():
        if line.startswith("Figure 8"):
            in_fig8 = True
            continue
        m = TRAIN_ROW.match(line) if in_fig8 else None
        if not m:
            if in_fig8 and not line.strip():
                in_fig8 = False
            continue
        model, batch, zc, copy, gloo, zc_copy, zc_gloo = m.groups()
        t = targets.get((model, batch), {})
        bars = "; ".join(
            f"zerocopy/{k} {v[0]}x (target >= {v[1]}x) {v[2]}"
            for k, v in sorted(t.items(), key=lambda kv: kv[0] != "gloo")
        )
        lines.append(
            f"  * {model} batch {batch}: zerocopy {zc}, copy {copy}, gloo {gloo} samples/s"
            + (f"; {bars}" if bars else f"; zerocopy/gloo {zc_gloo}x, zerocopy/copy {zc_copy}x")
        )
    every = [v for t in targets.values() for v in t.values()]
    met = sum(v[2] == "met" for v in every)
    return (f"{met} of {len(every)} targets met" if every else "no targets in the file"), lines


# (title, file, the step that writes it, its lines)
SECTIONS = (
    ("Point to point against `ucx_perftest`", "compare_ucx_perftest.txt", "p2p", compare_lines),
    (
        "Figure 7 over shared memory (zerocopy = a static slot; the grpc and rpc-ucx bars cover 1 MiB up)",
        "tensor_shm.txt",
        "tensor-shm",
        tensor_lines,
    ),
    ("Figure 7 over tcp", "tensor_tcp.txt", "tensor-tcp", tensor_lines),
    (
        "torch.distributed backend against gloo, tensorwire over shared memory",
        "torch_dist_shm.txt",
        "torch-dist-shm",
        torch_dist_lines,
    ),
    (
        "torch.distributed backend against gloo, tensorwire over tcp",
        "torch_dist_tcp.txt",
        "torch-dist-tcp",
        torch_dist_lines,
    ),
    (
        "Parameter server against gloo (Figure 8, 2 workers x 2 servers, samples/s) over shared memory",
        "train_shm_b1.txt",
        "train-shm",
        train_lines,
    ),
    ("Parameter server against gloo over tcp", "net_tcp_train_b1.txt", "train-tcp", train_lines),
)


# The headline table: one row per number a newcomer asks for first, each from a file above.
# (label, file, what to pick: ("compare", transport, metric, bytes) | ("tensor", the bar's text) |
#  ("torch", the target's first words) | ("train", model, batch))
HEADLINES = (
    ("tcp one-sided write, 1 MiB", "compare_ucx_perftest.txt", ("compare", "tcp", "bw", "1048576")),
    ("shm one-sided write, 1 MiB", "compare_ucx_perftest.txt", ("compare", "shm", "bw", "1048576")),
    ("tcp write latency, 8 B", "compare_ucx_perftest.txt", ("compare", "tcp", "lat", "8")),
    ("shm write latency, 8 B", "compare_ucx_perftest.txt", ("compare", "shm", "lat", "8")),
    ("tensor over shm (static slot) vs gRPC, 1 MiB up", "tensor_shm.txt", ("tensor", "zerocopy >= 10x grpc")),
    ("tensor over shm vs an RPC over UCX, 1 MiB up", "tensor_shm.txt", ("tensor", "zerocopy >= 1.5x rpc-ucx")),
    ("tensor over tcp vs gloo", "tensor_tcp.txt", ("tensor", "zerocopy >= gloo")),
    ("torch.distributed send/recv 8 B vs gloo, shm", "torch_dist_shm.txt", ("torch", "send/recv 8 B latency")),
    ("torch.distributed all_reduce 1 MiB vs gloo, shm", "torch_dist_shm.txt", ("torch", "all_reduce 1M")),
    ("torch.distributed DDP FCN-5 vs gloo, shm", "torch_dist_shm.txt", ("torch", "DDP FCN-5")),
    ("torch.distributed send/recv 8 B vs gloo, tcp", "torch_dist_tcp.txt", ("torch", "send/recv 8 B latency")),
    ("torch.distributed all_reduce 1 MiB vs gloo, tcp", "torch_dist_tcp.txt", ("torch", "all_reduce 1M")),
    ("parameter server FCN-5 vs gloo, shm", "train_shm_b1.txt", ("train", "fcn5", "1")),
    ("parameter server FCN-5 vs gloo, tcp", "net_tcp_train_b1.txt", ("train", "fcn5", "1")),
)


def _verdict_word(v: str) -> str:
    return {"met": "PASS", "NOT met": "MISS"}.get(v, v)


def headline(text: str, pick: tuple[str, ...]) -> tuple[str, str] | None:
    """(result, bar) of one headline row from a file's text; None when the file has no such line."""
    kind = pick[0]
    lines = text.splitlines()
    if kind == "compare":
        for m in map(COMPARE_ROW.match, lines):
            if m and m.groups()[:3] == pick[1:] and m.group(5).startswith("ucx_perftest ucp_put"):
                _, _, _, ours, anchor, theirs, unit, ratio, target, verdict = m.groups()
                return (
                    f"{float(ours):g} against {float(theirs):g} {unit} (`{anchor.split()[-1]}`): {ratio}x",
                    f">= {target}x {verdict}",
                )
    elif kind == "tensor":
        for m in map(TENSOR_TARGET.match, lines):
            if m and m.group(2) == pick[1]:
                verdict, _, value, unit, bar, at, n = m.groups()
                where = f"at {at}" if n == "1" else f"worst of {n} sizes, at {at}"
                return f"{value}{unit.strip() if unit == 'x' else ' us'} ({where})", f"{bar} {verdict}"
    elif kind == "torch":
        for m in map(TORCH_TARGET.match, lines):
            if m and m.group(1).startswith(pick[1]):
                bar = re.search(r"(<=|>=) .+$", m.group(1))
                return m.group(2), f"{bar.group(0) if bar else m.group(1)} {m.group(3)}"
    elif kind == "train":
        rows: dict[tuple[str, ...], tuple[Any, ...]] = {
            (r.group(1), r.group(2)): r.groups() for r in map(TRAIN_ROW.match, lines) if r
        }
        for m in map(TRAIN_TARGET.match, lines):
            if m and m.group(1, 2) == pick[1:] and m.group(3) == "gloo":
                row = rows.get(pick[1:])
                nums = f"{row[2]} against {row[4]} samples/s: " if row else ""
                return f"{nums}{m.group(4)}x", f">= {m.group(5)}x {_verdict_word(m.group(6))}"
    return None


def render_table(results: Path) -> list[str]:
    """The headline table: what, result (> 1x: tensorwire faster), the bar, the file and its date."""
    out = ["| measure | result (> 1x: tensorwire faster) | bar | file |", "|---|---|---|---|"]
    for label, name, pick in HEADLINES:
        text = _read(results, name)
        got = headline(text, pick) if text is not None else None
        result, bar = got or ("not in the file" if text is not None else "not measured yet", "")
        date = re.search(r"\b(20\d\d-\d\d-\d\d)", "\n".join((text or "").splitlines()[:6]))
        out.append(f"| {label} | {result} | {bar} | {_link(name)}{', ' + date.group(1) if date else ''} |")
    return out


def render_block(results: Path) -> str:
    """The performance block (without its markers) from the files in `results`: the headline
    table, then every bar of every file, one line per file, folded."""
    out = [
        "<!-- generated by `tensorwire bench report` (make bench) from the files named; "
        "edit python/tensorwire/lab/fabric/report.py, not this text -->",
        *render_table(results),
        "",
        "<details><summary>Every bar of those files (each file's first lines give its command, date and "
        "code)</summary>",
        "",
    ]
    for title, name, step, lines_of in SECTIONS:
        text = _read(results, name)
        if text is None:
            out += _missing(name, step)
            continue
        summary, lines = lines_of(text)
        items = [line.strip().removeprefix("* ") for line in lines] or ["(no result lines found in the file)"]
        out.append(f"* **{title}** ({_link(name)}, {_provenance(text)}): {summary}<br>" + "<br>".join(items))
    out += ["", "</details>"]
    return "\n".join(out)


def render_demo(results: Path) -> str:
    text = _read(results, "demo.txt")
    body = [line for line in (text or "").splitlines() if line.strip() and not line.startswith("# ")]
    if not body:
        body = ["(not run yet: tensorwire bench report --only demo)"]
    prov = f" ({_link('demo.txt')}, {_provenance(text, how=False)})" if text else ""
    return "\n".join([f"`make demo` prints something like{prov}:", "", "```", *body, "```"])


def replace_block(readme: str, begin: str, end: str, body: str) -> str:
    """`readme` with the text between the markers replaced by `body` (the markers stay)."""
    i, j = readme.find(begin), readme.find(end)
    if i < 0 or j < 0 or j < i:
        raise BenchError(f"README.md has no {begin} ... {end} block")
    return readme[: i + len(begin)] + "\n" + body.strip("\n") + "\n" + readme[j:]


def update_readme(root: Path) -> bool:
    """Regenerates the README's blocks from root/bench/results; True if the README changed."""
    path = root / "README.md"
    old = path.read_text()
    new = replace_block(old, BEGIN, END, render_block(root / RESULTS))
    new = replace_block(new, DEMO_BEGIN, DEMO_END, render_demo(root / RESULTS))
    if new != old:
        path.write_text(new)
    return new != old


# --- the command -------------------------------------------------------------------------------------


def find_root(given: str | None) -> Path:
    """The checkout to measure in: --root, else the one this package lies in, else the working directory."""
    here = Path(__file__).resolve().parents[3]
    for candidate in [Path(given)] if given else [here, Path.cwd()]:
        if (candidate / "README.md").exists() and (candidate / RESULTS).is_dir():
            return candidate.resolve()
    raise SystemExit(
        "tensorwire bench report: run it in a checkout of tensorwire (README.md and bench/results/); "
        f"{'--root ' + given if given else 'none found'}"
    )


def run(args) -> int:
    try:
        steps = select(args.only)
    except ValueError as e:
        raise SystemExit(f"tensorwire bench report: {e}") from None
    if args.repeat is not None:
        steps = [s.with_repeat(args.repeat) for s in steps]
    root = find_root(args.root)
    if args.dry_run:
        print(f"# from {root}; {_minutes(steps)}")
        for s in steps:
            print(s.shown())
        if not args.no_readme:
            print(f"# then README.md's blocks ({BEGIN} ..., {DEMO_BEGIN} ...) from {RESULTS}/")
        return 0
    failed, total = [], time.monotonic()
    keep_dir = Path(tempfile.mkdtemp(prefix="tw-report-failed-"))
    if not args.readme_only:
        print(
            f"tensorwire bench report: {len(steps)} step(s), {_minutes(steps)}, results to {root / RESULTS}", flush=True
        )
        for i, s in enumerate(steps, 1):
            print(f"[{i}/{len(steps)}] {s.name} ({s.shown()}) ... ", end="", flush=True)
            r = run_step(s, root, args.step_timeout or max(300.0, 4 * 60 * s.minutes), keep_dir)
            print(
                f"{_clock(r.seconds)}, total {_clock(time.monotonic() - total)}: {r.summary}"
                + (f" -> {', '.join(r.written)}" if r.written else ""),
                flush=True,
            )
            if not r.ok:
                failed.append(r)
    if not args.no_readme:
        changed = update_readme(root)
        print(f"README.md: performance and demo blocks {'regenerated' if changed else 'unchanged'} from {RESULTS}/")
    if failed:
        print(
            f"{len(failed)} step(s) failed, their old files kept; output in " + ", ".join(r.kept or "?" for r in failed)
        )
        return 1
    shutil.rmtree(keep_dir, ignore_errors=True)
    return 0
