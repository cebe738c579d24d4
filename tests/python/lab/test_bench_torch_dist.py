"""`tensorwire bench torch-dist`: a short run prints both backends' rows, the targets and a
verdict, writes JSON; bad arguments are usage errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from conftest import cli_in_process  # noqa: E402


def bench(*args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tensorwire", "bench", "torch-dist", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(240)
def test_short_run_prints_both_backends_and_a_verdict(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    run = bench(
        "--suite",
        "p2p,coll",
        "--lat-sizes",
        "8",
        "--sizes",
        "64K,1M",
        "--coll-sizes",
        "1M",
        "--iters",
        "40",
        "--repeat",
        "1",
        "--json",
        str(out),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    text = run.stdout
    assert "tw Lat (us)" in text and "gloo Lat (us)" in text and "# all_reduce, 2 ranks" in text, text
    assert "python dispatch: dist.isend of 8 B returns after" in text, text
    assert "on torch's fake backend, which moves nothing" in text, text  # the floor beside it
    assert "# target dist.isend 8 B returns in <= 1.5 us" in text, text
    assert "# target send/recv 8 B latency" in text, text
    assert text.strip().splitlines()[-1].startswith(("PASS", "MISS")), text
    data = json.loads(out.read_text())
    for backend in ("tensorwire", "gloo"):
        best = data["best"][backend]
        assert best["latency/8"] > 0 and best["bandwidth/65536"] > 0 and best["all_reduce/1048576"] > 0, best
        assert best["cma-limit/1048576"] > 0 and "cma-limit/65536" not in best, best  # from 1 MiB up
    assert 0 < data["best"]["tensorwire"]["dispatch-floor/isend"] < 100, data["best"]["tensorwire"]
    assert "# cma limit, both ranks copying at once" in text, text
    assert len(data["rounds"]["tensorwire"]) == 1 and data["targets"], data


@pytest.mark.parametrize(
    "args,words",
    [(["--suite", "p2p,nope"], "--suite takes"), (["--ranks", "1"], "at least 2"), (["--sizes", "1Q"], "bad size")],
)
def test_bad_arguments_are_usage_errors(args: list[str], words: str, capsys: pytest.CaptureFixture) -> None:
    run = cli_in_process(["bench", "torch-dist", "--no-progress", *args], capsys)
    assert run.returncode == 2, run.stdout + run.stderr
    assert words in run.stderr, run.stderr


def test_a_training_target_names_its_compute_ceiling() -> None:
    """DDP and GPipe rows carry what the compute alone allows (no all_reduce; the slowest
    stage), the better of the two backends' measurements, over gloo's samples/s."""
    import argparse

    from tensorwire.lab import torch_dist

    args = argparse.Namespace(transport="shm", ranks=2, lat_sizes=[], sizes=[], coll_sizes=[])
    tw = {"ddp/fcn5": 50.0, "ddp-ceiling/fcn5": 90.0, "pipe/fcn5": 60.0}
    gl = {"ddp/fcn5": 40.0, "ddp-ceiling/fcn5": 100.0, "pipe/fcn5": 60.0, "pipe-ceiling/fcn5": 57.0}
    got = {what: (met, said) for what, met, said in torch_dist._targets(args, tw, gl)}
    assert got["DDP FCN-5 batch 8 samples/s >= 1.3x gloo"] == (False, "1.25x (compute ceiling 2.50x gloo)"), got
    assert got["GPipe FCN-5 samples/s >= 1.2x gloo"] == (False, "1.00x (compute ceiling 0.95x gloo)"), got
    assert torch_dist._ceiling(tw, gl, "ddp", "resnet") is None


def test_a_failed_round_fails_the_run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """A backend's best of fewer rounds than --repeat is not the comparison asked for: the
    run says which rounds it kept and fails, whatever the ratios."""
    import argparse

    from tensorwire.lab import torch_dist

    calls = {"gloo": 0}

    def fake_round(args: argparse.Namespace, backend: str, suite: list[str]) -> dict:
        if backend == "gloo":
            calls["gloo"] += 1
            if calls["gloo"] > 1:
                return {"error": "gloo round failed (exit 1)"}
            return {"latency/8": 80.0}
        return {"latency/8": 5.0}

    monkeypatch.setattr(torch_dist, "_round", fake_round)
    args = argparse.Namespace(
        transport="shm",
        ranks=2,
        suite="p2p",
        repeat=3,
        lat_sizes=[8],
        sizes=[],
        coll_sizes=[],
        json=None,
        plot=None,
        progress=False,
    )
    assert torch_dist.run(args) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == "FAIL: rounds kept tensorwire 3 of 3, gloo 1 of 3", last


def test_a_shm_bandwidth_target_names_the_cma_limit() -> None:
    """Over shm a send/recv bandwidth bar states what the kernel's cross-process copy with both
    ranks copying moved in the same run (the better backend round), over gloo's bandwidth."""
    import argparse

    from tensorwire.lab import torch_dist

    args = argparse.Namespace(transport="shm", ranks=2, lat_sizes=[], sizes=[1 << 24], coll_sizes=[])
    tw = {"bandwidth/16777216": 12000.0, "cma-limit/16777216": 12500.0}
    gl = {"bandwidth/16777216": 5000.0, "cma-limit/16777216": 13000.0}
    got = {what: (met, said) for what, met, said in torch_dist._targets(args, tw, gl)}
    assert got["send/recv bandwidth 16M >= 3x gloo"] == (False, "2.40x (cma limit 2.60x gloo)"), got
    args.transport = "tcp"
    said = [s for w, _, s in torch_dist._targets(args, tw, gl) if w.startswith("send/recv bandwidth 16M")]
    assert said == ["2.40x"], said  # over tcp the copy is not the path
