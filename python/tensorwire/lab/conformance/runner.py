"""The process that runs the suite's tests (``python -m tensorwire.lab.conformance.runner
EVENTS JOB``): one after another, in unittest's way, each spawning its ranks.
It appends a JSON line to EVENTS when a test starts and when it ends, so that the
conformance command can show progress and, when a test outlives its limit, kill
this process's group and start another runner on the tests left. JOB (JSON) names
the tests ({"tests": [...]}), or selects them ({"patterns": [...], "exact": bool}):
then it first writes a line per test of the suite, whether it is selected and the
gate that skips it without spawning a rank, if any.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import sys
import tempfile
import time
import traceback
import unittest

# The message of MultiProcessTestCase when a rank outlived its limit and was killed.
HUNG_MARKS = ("terminated or timed out", "Timing out after")
# Where the test now running writes (in the run's temporary directory): what the command
# reads of a runner it had to kill.
CURRENT_OUTPUT = "current_test.out"
# A traceback's last line: "RuntimeError: ...", "tensorwire.errors.InvalidArgument: ..."
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: \S")


def _error_line(text: str) -> str:
    """The exception line of the first failed rank's traceback in a test's error text
    ("Process 0 exited with error code 10 and exception:", then the rank's traceback),
    else of the text's own traceback, else the text's last line."""
    mark = text.find("exited with error code")
    found = _first_exception(text[mark:]) if mark >= 0 else None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return found or _first_exception(text) or (lines[-1] if lines else "")[:500]


class _Events(unittest.TestResult):
    """A TestResult that writes each test's start and outcome as a JSON line."""

    def __init__(self, out) -> None:
        super().__init__()
        self.out, self.t0 = out, 0.0
        self.outcome: tuple[str, str] = ("passed", "")
        self.record: dict = {}  # the last test's end record (written by main, with its ranks' output)

    def _write(self, record: dict) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    def startTest(self, test) -> None:
        super().startTest(test)
        self.t0, self.outcome = time.monotonic(), ("passed", "")
        self._write({"event": "start", "test": test._testMethodName})

    def _set(self, outcome: str, message: str) -> None:
        self.outcome = (outcome, message)

    def addError(self, test, err) -> None:
        text = "".join(traceback.format_exception(*err))
        self._set("hung" if any(m in text for m in HUNG_MARKS) else "failed", text)

    addFailure = addError

    def addSkip(self, test, reason) -> None:
        self._set("skipped", str(reason))

    def addExpectedFailure(self, test, err) -> None:
        self._set("passed", "expected failure")

    def addUnexpectedSuccess(self, test) -> None:
        self._set("failed", "unexpected success")

    def stopTest(self, test) -> None:
        super().stopTest(test)
        outcome, message = self.outcome
        self.record = {
            "event": "end",
            "test": test._testMethodName,
            "outcome": outcome,
            "seconds": round(time.monotonic() - self.t0, 2),
            "message": message[-8000:],
        }
        if outcome in ("failed", "hung"):
            self.record["error"] = _error_line(message)


def _first_exception(output: str) -> str | None:
    """The exception line ("Type: message", unindented) ending the first traceback in the ranks' output."""
    in_traceback = False
    for line in output.splitlines():
        if line.startswith("Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback and EXCEPTION_LINE.match(line):
            return line.strip()[:500]
    return None


def _run_captured(test: unittest.TestCase, result: _Events) -> str:
    """Runs one test with this process's stdout and stderr, which its ranks inherit, in a file of its
    own; copies that to the runner's own output (the log) and returns it."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(os.path.join(tempfile.gettempdir(), CURRENT_OUTPUT), "w+b") as cap:
        os.dup2(cap.fileno(), 1)
        os.dup2(cap.fileno(), 2)
        try:
            test.run(result)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        cap.seek(0)
        data = cap.read()
    sys.stdout.buffer.write(data)
    sys.stdout.flush()
    return data.decode(errors="replace")


def selected(name: str, patterns: list[str], exact: bool) -> bool:
    """Whether a test is picked by --tests: an exact name (exact), a glob on the whole
    name (a pattern with * ? or [), else a substring; no pattern picks every test."""
    if not patterns:
        return True
    if exact:
        return name in patterns
    return any(fnmatch.fnmatchcase(name, p) if any(c in p for c in "*?[") else p in name for p in patterns)


def main(argv: list[str]) -> int:
    events, job = argv[0], json.loads(argv[1])
    with open(events, "a") as out:

        def write(record: dict) -> None:
            out.write(json.dumps(record) + "\n")
            out.flush()

        try:
            from . import suite

            cls = suite.TestDistBackendWithSpawn  # the claims, the backend's modules, the suite
            import torch.distributed as dist

            backend = os.environ["BACKEND"].lower()
            if backend not in dist.Backend.backend_list:  # (dist.Backend(name) accepts any name)
                raise ValueError(
                    f"no torch.distributed backend {backend!r} is registered (registered: "
                    f"{', '.join(dist.Backend.backend_list[1:])}; --import names the modules "
                    "that register one)"
                )
        except Exception as e:  # noqa: BLE001 - reported to the command, which stops with it
            write({"event": "error", "message": f"{type(e).__name__}: {e}"})
            return 1
        tests = job.get("tests")
        if tests is None:  # the first runner: the whole suite, then the selected tests
            tests = []
            for name in suite.test_names():
                pick = selected(name, job["patterns"], job["exact"])
                write({"event": "list", "test": name, "selected": pick, "skip": suite.static_skip(name)})
                tests += [name] if pick else []
            write({"event": "listed"})
        if job.get("list_only"):
            return 0
        cls.setUpClass()
        result = _Events(out)
        for name in tests:
            output = _run_captured(cls(name), result)
            record = result.record
            # a rank that raised before the test ran (init_process_group) exits 1: its traceback is
            # only in its output
            if "error" in record and record["error"].startswith("Expected exit code"):
                record["error"] = _first_exception(output) or record["error"]
            if record["outcome"] in ("failed", "hung"):
                record["output_tail"] = output[-4000:]
            write(record)
        cls.tearDownClass()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
