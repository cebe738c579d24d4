"""PyTorch's own distributed test suite against a torch.distributed backend.

``tensorwire conformance`` (or ``python -m tensorwire.lab.conformance``) runs
``torch.testing._internal.distributed.distributed_test`` for one backend as
PyTorch's ``test/distributed/test_distributed_spawn.py`` does: BACKEND, WORLD_SIZE
(default 2) and TEMP_DIR set, the class ``TestDistBackend + _DistTestBase``, each test
spawning its ranks, which meet through a file:// init method.

Which tests run is the suite's own gates: ``skip_if_no_gpu`` and CUDA checks (none
run on a CPU-only host), ``BACKEND == "gloo"`` checks (timeouts, futures, batched p2p,
comm hooks, sparse all_reduce: gloo's name only), ``DistTestCases.skip_collective``
and ``DistTestCases.backend_feature``. A backend outside PyTorch claims features by
adding its name to ``backend_feature[...]`` before the suite is imported; for a
backend that is not built in this claims ``ddp``, ``subgroup`` and ``plugin``
(``--claim``), in the test processes only. ``--gates gloo`` lets the gates see
gloo's name while the tests run on the backend: gloo's whole CPU selection. A test
body that branches on the name itself (``if BACKEND == "gloo"``) then sees the real
one: some (test_accumulate_gradients_no_sync) fail for that alone.

Every test has a time limit (``--timeout``, PyTorch's own mechanism kills its ranks);
a runner that outlives it by a minute is killed with its ranks and the rest run in a
new one, so nothing hangs. The summary (per test: passed, failed, skipped, hung, with
the error's last line; totals) is printed and, with ``--out PREFIX``, written to
PREFIX.txt and PREFIX.json. Exit code 0 when nothing failed or hung, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from . import report
from .runner import CURRENT_OUTPUT, selected  # noqa: F401 - selected: what --tests picks

BUILTIN = ("gloo", "nccl", "ucc", "mpi")
DEFAULT_CLAIM = "ddp,subgroup,plugin"
GRACE_S = 60.0  # past --timeout: the runner's own kill of the ranks, then their tearDown
LIST_TIMEOUT_S = 300.0
# The caller's rendezvous variables would leak into the suite's ranks (it sets MASTER_ADDR itself).
SCRUBBED = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "INIT_METHOD",
    "TEMP_DIR",
    "BACKEND",
    "TORCHELASTIC_RUN_ID",
)


def add_arguments(p) -> None:
    """The options of `tensorwire conformance` and of `python -m tensorwire.lab.conformance`."""
    p.add_argument(
        "--backend",
        default="tensorwire",
        help="the torch.distributed backend's name (default tensorwire; gloo for the reference)",
    )
    p.add_argument("--world-size", type=int, default=2, metavar="N", help="ranks per test (default 2)")
    p.add_argument(
        "-k",
        "--tests",
        action="append",
        default=[],
        metavar="PATTERN",
        help="run only the tests matching PATTERN (repeatable, or a comma list): a glob on the "
        "whole name when it has * ? or [, else a substring; default every test",
    )
    p.add_argument("--exact", action="store_true", help="--tests are whole test names (an unknown one is an error)")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds one test may run (default 300, PyTorch's own default)",
    )
    p.add_argument(
        "--claim",
        default=None,
        metavar="FEATURES",
        help=f"DistTestCases.backend_feature keys claimed for the backend (default {DEFAULT_CLAIM} "
        "for a backend that is not built into torch, none for gloo; '' for none)",
    )
    p.add_argument(
        "--gates",
        default=None,
        metavar="NAME",
        help="decide which tests run by the suite's gates for backend NAME (default: --backend's "
        "own); --gates gloo also runs the tests PyTorch gates to gloo's name (timeouts, "
        "futures, batched p2p, coalesced all_reduce, comm hooks) on --backend",
    )
    p.add_argument(
        "--import",
        dest="imports",
        default="tensorwire.torch",
        metavar="MODULES",
        help="comma list of modules imported first in every test process, to register the "
        "backend (default tensorwire.torch)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set KEY in the test processes' environment (repeatable; recorded in the summary), "
        "e.g. MASTER_PORT=29500, which PyTorch's runner does not set",
    )
    p.add_argument(
        "--start",
        choices=("spawn", "forkserver"),
        default="spawn",
        help="how a test starts its ranks: spawn (default), a fresh interpreter each, as "
        "test_distributed_spawn.py does; forkserver: forked from one process that imported torch, the "
        "suite and the backend once (seconds less per test: make test's selection)",
    )
    p.add_argument("--out", metavar="PREFIX", help="write the summary to PREFIX.txt and PREFIX.json")
    p.add_argument(
        "--baseline",
        metavar="FILE.json",
        help="an earlier run's JSON (gloo's): list the tests it passed that were gated off or failed here",
    )
    p.add_argument("--log", metavar="FILE", help="keep the test processes' output in FILE (default: discarded)")
    p.add_argument("--list", action="store_true", help="list the selected tests and their static gates; run none")
    p.add_argument("--quiet", action="store_true", help="no progress line per test on stderr")


def _kill_group(proc: subprocess.Popen) -> None:
    """Ends the runner and the ranks it spawned (its own session, started here)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue


class _Run:
    """The runners of one conformance run, and the records they wrote."""

    def __init__(self, args, env: dict, tmp: str, log) -> None:
        self.args, self.env, self.tmp, self.log = args, env, tmp, log
        self.listed: dict[str, dict] = {}  # every test of the suite: selected, static gate
        self.results: dict[str, dict] = {}  # test -> outcome, seconds, message, error
        self.order: list[str] = []  # the selected tests, in order
        self.error = ""

    def _start(self, job: dict, events: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "tensorwire.lab.conformance.runner", events, json.dumps(job)]
        return subprocess.Popen(
            cmd,
            env=self.env,
            cwd=self.tmp,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def drive(self, job: dict) -> list[str]:
        """Runs one runner until it ends or a test outlives its limit; returns the tests it left."""
        events = os.path.join(self.tmp, f"events{len(self.results)}.jsonl")
        open(events, "w").close()
        proc = self._start(job, events)
        try:
            return self._watch(proc, job, events)
        finally:  # this command interrupted (Ctrl-C, a signal): its runner and ranks go with it
            if proc.poll() is None:
                _kill_group(proc)

    def _watch(self, proc: subprocess.Popen, job: dict, events: str) -> list[str]:
        current = None
        t_list = time.monotonic()
        limit = self.args.timeout + GRACE_S
        with open(events) as f:
            buf, done = "", False
            while True:
                buf += f.readline()
                if buf.endswith("\n"):
                    current = self._event(json.loads(buf), current)
                    buf = ""
                    continue
                if done:
                    break
                rc = proc.poll()
                now = time.monotonic()
                late = (current is not None and now - current[1] > limit) or (
                    not self.order and job.get("tests") is None and now - t_list > LIST_TIMEOUT_S
                )
                if rc is None and not late:
                    time.sleep(0.2)
                    continue
                if rc is None:
                    _kill_group(proc)
                done = True  # read what it wrote before it ended, then judge the test it was in
        now = time.monotonic()
        if current is not None:
            why = (
                f"hung: the runner was killed {limit:.0f} s after the test started"
                if late
                else f"the runner exited (status {rc}) during the test"
            )
            try:
                with open(os.path.join(self.tmp, CURRENT_OUTPUT), errors="replace") as out:
                    tail = out.read()[-4000:]
            except OSError:
                tail = ""
            self._record(
                {
                    "test": current[0],
                    "outcome": "hung" if late else "failed",
                    "seconds": round(now - current[1], 2),
                    "message": why,
                    "error": why,
                    "output_tail": tail,
                }
            )
        elif late and not self.error:
            self.error = f"listing the suite took more than {LIST_TIMEOUT_S:.0f} s"
        elif rc and not self.error and not self.order:
            self.error = f"the runner exited with status {rc} before listing the suite"
        return [t for t in self.order if t not in self.results]

    def _event(self, rec: dict, current):
        """Takes in one line of the runner's; returns the test now running (name, start) or None."""
        kind = rec["event"]
        if kind == "list":
            self.listed[rec["test"]] = rec
        elif kind == "listed":
            self.order = [t for t, r in self.listed.items() if r["selected"]]
        elif kind == "error":
            self.error = rec["message"]
        elif kind == "start":
            return rec["test"], time.monotonic()
        elif kind == "end":
            self._record(rec)
            return None
        return current

    def _record(self, rec: dict) -> None:
        name = rec["test"]
        self.results[name] = {
            k: rec.get(k) for k in ("outcome", "seconds", "error", "message", "output_tail") if rec.get(k)
        }
        if self.args.quiet:
            return
        counts = report.totals(self.results)
        n = len(self.results)
        print(
            f"[{n:3d}/{len(self.order)}] {rec['outcome']:<7} {rec.get('seconds', 0):6.1f} s  {name}   "
            f"({counts['passed']} passed, {counts['failed']} failed, {counts['hung']} hung, "
            f"{counts['skipped']} skipped)",
            file=sys.stderr,
            flush=True,
        )


def _pairs(items: list[str]) -> dict:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"tensorwire conformance: --env {item!r}: expected KEY=VALUE")
        pairs[key] = value
    return pairs


def _environment(args, tmp: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    env.update(_pairs(args.env))
    os.makedirs(os.path.join(tmp, "barrier"), exist_ok=True)
    env.update(
        BACKEND=args.backend,
        WORLD_SIZE=str(args.world_size),
        TEMP_DIR=tmp,
        TMPDIR=tmp,
        TENSORWIRE_CONFORMANCE_CLAIM=args.claim,
        TENSORWIRE_CONFORMANCE_IMPORT=args.imports,
        TENSORWIRE_CONFORMANCE_TIMEOUT=str(max(1, round(args.timeout))),
        TENSORWIRE_CONFORMANCE_GATES=args.gates or "",
        TENSORWIRE_CONFORMANCE_START=args.start,
        PYTHONUNBUFFERED="1",
    )
    return env


def run(args, prog: str = "tensorwire conformance", command: str | None = None) -> int:
    """The command: runs the selection, prints (and writes) the summary; the exit code.
    `command` is the command line recorded in the summary (default: this process's)."""
    if args.world_size < 2:
        raise SystemExit(f"{prog}: --world-size must be at least 2 (the suite's tests need two ranks)")
    if args.timeout <= 0:
        raise SystemExit(f"{prog}: --timeout must be positive")
    patterns = [p for item in args.tests for p in item.split(",") if p]
    _pairs(args.env)  # a malformed --env stops here, not after listing the suite
    if args.claim is None:
        args.claim = "" if args.backend in BUILTIN else DEFAULT_CLAIM
    for opt, path in (("--out", args.out and args.out + ".txt"), ("--log", args.log)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise SystemExit(f"{prog}: {opt}: the directory {folder} does not exist or is not writable")
    baseline = report.load_baseline(args.baseline, prog) if args.baseline else None
    try:  # a SIGTERM (timeout, pytest's subprocess timeout) ends the runner's group too (drive's finally)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    except ValueError:  # not the main thread: the caller's signals
        pass
    tmp = tempfile.mkdtemp(prefix="tw-conformance-")
    log: Any = open(args.log, "w") if args.log else subprocess.DEVNULL
    t0 = time.monotonic()
    try:
        r = _Run(args, _environment(args, tmp), tmp, log)
        left = r.drive({"patterns": patterns, "exact": args.exact, "list_only": args.list})
        if r.error or not r.listed:
            raise SystemExit(
                f"{prog}: the suite could not be loaded for {args.backend!r}: "
                f"{r.error or 'no test listed'} (--log FILE shows the runner's output)"
            )
        unknown = [p for p in patterns if args.exact and p not in r.listed]
        if unknown:
            raise SystemExit(f"{prog}: no such test in the suite: {', '.join(unknown)}")
        if not r.order:
            raise SystemExit(f"{prog}: no test matches {', '.join(patterns)}")
        if args.list:
            for name in r.order:
                gate = r.listed[name]["skip"]
                print(f"{name}{'   [skipped: ' + gate + ']' if gate else ''}")
            return 0
        interrupted = ""
        try:
            while left:
                before = len(r.results)
                left = r.drive({"tests": left})
                if left and len(r.results) == before:  # a runner that ends before its first test: no loop
                    for name in left:
                        r._record(
                            {
                                "test": name,
                                "outcome": "failed",
                                "error": f"the runner ended before the test started: {r.error or 'see --log'}",
                                "seconds": 0,
                            }
                        )
                    break
        except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C, SIGTERM: the summary of what ran
            interrupted = f"interrupted ({type(e).__name__}) after {len(r.results)} of {len(r.order)} tests"
            r.order = [t for t in r.order if t in r.results]
    finally:
        if log is not subprocess.DEVNULL:
            log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    command = command or shlex.join([os.path.basename(sys.argv[0])] + sys.argv[1:])
    summary = report.summary(args, r.order, r.results, time.monotonic() - t0, command, baseline)
    if interrupted:
        summary["interrupted"] = interrupted
    text = report.text(summary)
    print(text)
    if args.out:
        report.write(args.out, summary, text, prog)
    totals = summary["totals"]
    if interrupted:
        return 130
    return 0 if totals["failed"] == 0 and totals["hung"] == 0 else 1
