"""`tensorwire bench torch-dist`: a short run prints both backends' rows, the targets and a
verdict, writes JSON; bad arguments are usage errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")


def bench(*args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorwire", "bench", "torch-dist", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(240)
def test_short_run_prints_both_backends_and_a_verdict(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    run = bench("--suite", "p2p,coll", "--lat-sizes", "8", "--sizes", "64K", "--coll-sizes", "1M", "--iters", "40",
                "--repeat", "1", "--json", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    text = run.stdout
    assert "tw Lat (us)" in text and "gloo Lat (us)" in text and "# all_reduce, 2 ranks" in text, text
    assert "python dispatch: dist.isend of 8 B returns after" in text, text
    assert "# target send/recv 8 B latency" in text, text
    assert text.strip().splitlines()[-1].startswith(("PASS", "MISS")), text
    data = json.loads(out.read_text())
    for backend in ("tensorwire", "gloo"):
        best = data["best"][backend]
        assert best["latency/8"] > 0 and best["bandwidth/65536"] > 0 and best["all_reduce/1048576"] > 0, best
    assert len(data["rounds"]["tensorwire"]) == 1 and data["targets"], data


@pytest.mark.parametrize("args,words", [(["--suite", "p2p,nope"], "--suite takes"), (["--ranks", "1"], "at least 2"),
                                        (["--sizes", "1Q"], "bad size")])
def test_bad_arguments_are_usage_errors(args: list[str], words: str) -> None:
    run = bench(*args, timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert words in run.stderr, run.stderr
