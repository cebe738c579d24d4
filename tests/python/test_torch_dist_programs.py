"""Unchanged PyTorch programs (examples/) on the "tensorwire" backend: DDP and FSDP2 end with
gloo's parameters, pipelining with the unsplit model's loss, checkpointing round-trips, p2p
rings deliver; under torchrun and under `tensorwire run`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tensorwire.launch import free_port  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # the same threads under both launchers: the same float sums


def torchrun(n: int, example: str, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
           "--master-port", str(free_port()), str(EXAMPLES / example), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=ENV)
    # gloo's own teardown may abort after the results are printed: the lines are what is compared
    if "--backend" not in args or "tensorwire" in args:
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run.stdout


def params(out: str, n: int, backend: str) -> list[tuple[float, float]]:
    got = re.findall(rf"rank \d+/{n} {backend}: loss [-\d.]+ params ([-\d.]+) ([-\d.]+)", out)
    assert len(got) == n, out
    return [(float(a), float(b)) for a, b in got]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("example,n", [("ddp.py", 2), ("ddp.py", 3), ("fsdp.py", 2)])
def test_training_ends_with_gloos_parameters(example: str, n: int) -> None:
    tw = params(torchrun(n, example, "--backend", "tensorwire"), n, "tensorwire")
    gl = params(torchrun(n, example, "--backend", "gloo"), n, "gloo")
    assert len(set(tw)) == 1, tw  # every rank holds the same model
    for (a, b), (c, d) in zip(tw, gl):
        assert a == pytest.approx(c, rel=1e-5, abs=1e-4) and b == pytest.approx(d, rel=1e-5), (tw, gl)


@pytest.mark.timeout(150)
def test_pipelining_gpipe_and_1f1b_match_the_unsplit_model() -> None:
    out = torchrun(2, "pipeline.py")
    for schedule in ("ScheduleGPipe", "Schedule1F1B"):
        assert re.search(rf"{schedule} tensorwire: loss [-\d.]+ unsplit [-\d.]+ OK", out), out


@pytest.mark.timeout(150)
def test_checkpoint_round_trips(tmp_path: Path) -> None:
    out = torchrun(2, "checkpoint.py", "--dir", str(tmp_path / "ckpt"))
    assert out.count("tensorwire: checkpoint OK") == 2, out


@pytest.mark.timeout(150)
def test_p2p_ring_under_tensorwire_run() -> None:
    cmd = [sys.executable, "-m", "tensorwire", "run", "-n", "3", "--", sys.executable, str(EXAMPLES / "p2p.py")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=140, env=ENV)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert (run.stdout + run.stderr).count("tensorwire: p2p OK") == 3, run.stdout + run.stderr
