"""The conformance run's summary: totals, the text printed and written, the JSON."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from collections import Counter

OUTCOMES = ("passed", "failed", "hung", "skipped")


def totals(results: dict) -> dict:
    counts = Counter(r["outcome"] for r in results.values())
    return {o: counts.get(o, 0) for o in OUTCOMES}


def _code() -> str:
    """The commit this package was run from (+ "with changes" when its tree differs)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--", "../../..", "../../../../cpp"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + (" with uncommitted changes" if dirty else "")) if head else "unknown (not a git tree)"


def load_baseline(path: str, prog: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return {"file": path, "backend": data["backend"], "tests": data["tests"]}
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{prog}: --baseline {path}: not a conformance JSON ({e})") from None


def summary(args, order: list[str], results: dict, seconds: float, command: str, baseline: dict | None) -> dict:
    import torch

    tests = {t: results.get(t, {"outcome": "hung", "error": "never reported"}) for t in order}
    out = {
        "backend": args.backend,
        "world_size": args.world_size,
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "code": _code(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
        "claimed": [c for c in args.claim.split(",") if c],
        "timeout_s": args.timeout,
        "gates": args.gates or args.backend,
        "env": args.env,
        "start": args.start,
        "seconds": round(seconds, 1),
        "selection": args.tests,
        "totals": totals(tests),
        "tests": tests,
    }
    if baseline is not None:
        theirs = baseline["tests"]
        passed = {t for t, r in theirs.items() if r["outcome"] == "passed"}
        out["baseline"] = {
            "file": baseline["file"],
            "backend": baseline["backend"],
            "passed_there_gated_here": sorted(t for t in passed if tests.get(t, {}).get("outcome") == "skipped"),
            "passed_there_failed_here": sorted(
                t for t in passed if tests.get(t, {}).get("outcome") in ("failed", "hung")
            ),
        }
    return out


def text(s: dict) -> str:
    t, tests = s["totals"], s["tests"]
    lines = [
        f"# PyTorch's distributed suite (torch.testing._internal.distributed.distributed_test, as "
        f"test/distributed/test_distributed_spawn.py runs it) on {s['backend']!r}, {s['world_size']} ranks",
        f"# command: {s['command']}",
        f"# date: {s['date']}; code: {s['code']}; torch {s['torch']}, Python {s['python']}, "
        f"{s['host_cpus']} CPUs; per-test limit {s['timeout_s']:.0f} s",
        f"# claimed for the backend (DistTestCases.backend_feature): {', '.join(s['claimed']) or 'nothing'}; "
        f"the gates decided as for {s['gates']!r}; environment set: {' '.join(s['env']) or 'nothing'}"
        + (f"; ranks started by {s['start']}" if s.get("start", "spawn") != "spawn" else ""),
        *([f"# {s['interrupted'].upper()}: the other selected tests did not run"] if "interrupted" in s else []),
        "",
        f"totals: {t['passed']} passed, {t['failed']} failed, {t['hung']} hung, {t['skipped']} skipped "
        f"({len(tests)} tests, {s['seconds'] / 60:.1f} min)",
    ]
    for outcome in ("failed", "hung"):
        bad = [n for n, r in tests.items() if r["outcome"] == outcome]
        if bad:
            lines += ["", f"{outcome}:"] + [f"  {n}: {tests[n].get('error', '')}" for n in bad]
    gates = Counter(r.get("message", "") for r in tests.values() if r["outcome"] == "skipped")
    if gates:
        lines += ["", "skipped, by the gate's reason:"]
        lines += [f"  {n:4d}  {reason}" for reason, n in gates.most_common()]
    if "baseline" in s:
        b = s["baseline"]
        for key, what in (
            ("passed_there_gated_here", "gated off here"),
            ("passed_there_failed_here", "failed or hung here"),
        ):
            lines += ["", f"passed on {b['backend']} ({b['file']}), {what}: {len(b[key])}"]
            lines += [f"  {n}" for n in b[key]]
    lines += ["", "per test (outcome, seconds):"]
    lines += [f"  {r['outcome']:<7} {r.get('seconds', 0):7.1f}  {n}" for n, r in tests.items()]
    return "\n".join(lines) + "\n"


def write(prefix: str, s: dict, txt: str, prog: str) -> None:
    try:
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        with open(prefix + ".txt", "w") as f:
            f.write(txt)
        with open(prefix + ".json", "w") as f:
            json.dump(s, f, indent=1)
            f.write("\n")
    except OSError as e:
        raise SystemExit(f"{prog}: --out {prefix}: {e}") from None
