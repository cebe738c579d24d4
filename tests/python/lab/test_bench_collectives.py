"""`tensorwire bench alltoall|allreduce`: the World's C++ collectives layer.

Smoke tests at tiny sizes with validation on 2, 3 and 4 ranks (3: recursive
doubling with a folded-in extra rank, ring blocks of unequal and empty
length), --threshold, the seed-004 profile and OSU format, a rank killed
mid-run, and the comparison with MPI where mpirun + mpi4py are installed
(skipped otherwise)."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

import tensorwire as tw

from tensorwire.lab.commands import bench_collectives as coll

FAST = ["--iters", "20", "--warmup", "2"]


def bench(*args, timeout=60, check=True):
    """Runs the bench as a user would without a launcher (it starts its own ranks)."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tensorwire", "bench", *args], capture_output=True, text=True, timeout=timeout
    )
    proc.elapsed = time.monotonic() - t0
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def verdict_line(stdout):
    lines = [line for line in stdout.splitlines() if line.split(" ", 1)[0] in ("PASS", "WARN", "FAIL")]
    assert len(lines) == 1, stdout
    return lines[0]


def test_alltoall_two_ranks_validated(tmp_path):
    out = tmp_path / "a2a.json"
    proc = bench(
        "alltoall",
        "--ranks",
        "2",
        "--transport",
        "tcp",
        "--sizes",
        "1,64,4K,64K",
        "--validate",
        "--json",
        str(out),
        *FAST,
    )
    assert "Avg Latency(us)" in proc.stdout and "Validation" in proc.stdout
    assert verdict_line(proc.stdout).split()[0] in ("PASS", "WARN")
    report = json.loads(out.read_text())
    assert report["test"] == "alltoall" and report["verdict"] in ("PASS", "WARN")
    assert [r["size"] for r in report["rows"]] == [1, 64, 4096, 65536]
    for r in report["rows"]:
        assert r["validation"] == "Pass" and r["errors"] == 0
        assert r["min_us"] <= r["avg_us"] <= r["max_us"]
        assert len(r["samples_us"]) == 2 and all(len(s) == 20 for s in r["samples_us"])  # raw, every rank


@pytest.mark.parametrize("algorithm", ["ring", "rd"])
def test_allreduce_three_ranks_odd_counts(tmp_path, algorithm):
    # 3 ranks: rd folds rank 0 into rank 1; 4 B and 8 B leave ring blocks empty, 12 B gives one each
    out = tmp_path / "ar.json"
    proc = bench(
        "allreduce",
        "--ranks",
        "3",
        "--transport",
        "shm",
        "--algorithm",
        algorithm,
        "--type",
        "int",
        "--sizes",
        "4,8,12,4K,100K",
        "--validate",
        "--json",
        str(out),
        *FAST,
    )
    report = json.loads(out.read_text())
    assert report["verdict"] in ("PASS", "WARN"), proc.stdout
    assert all(r["validation"] == "Pass" and r["algorithm"] == algorithm for r in report["rows"])
    assert "FAIL" not in proc.stdout


def test_allreduce_auto_four_ranks_moves_at_the_threshold(tmp_path):
    # --threshold 4K: auto takes recursive doubling up to 4 KiB and below one element per rank, then the ring
    out = tmp_path / "auto.json"
    proc = bench(
        "allreduce",
        "--ranks",
        "4",
        "--transport",
        "shm",
        "--type",
        "int",
        "--threshold",
        "4K",
        "--sizes",
        "12,4K,100K",
        "--validate",
        "--json",
        str(out),
        *FAST,
    )
    report = json.loads(out.read_text())
    assert report["verdict"] in ("PASS", "WARN"), proc.stdout
    assert report["config"]["rd_ring_threshold"] == 4096
    assert [(r["size"], r["algorithm"]) for r in report["rows"]] == [(12, "rd"), (4096, "rd"), (102400, "ring")]
    assert all(r["validation"] == "Pass" for r in report["rows"])


def test_recursive_halving_is_gone_and_says_so():
    proc = bench("allreduce", "--ranks", "4", "--algorithm", "rh", "--sizes", "4K", *FAST, check=False)
    assert proc.returncode == 2 and "went with the Python collectives engine" in proc.stderr, proc.stderr


def test_allreduce_auto_float_osu_format():
    proc = bench("allreduce", "--ranks", "2", "--sizes", "4,128K", "--format", "osu", "--validate", *FAST)
    assert "# OSU MPI Allreduce Latency Test" in proc.stdout and "# Datatype: MPI_FLOAT." in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert [r[0] for r in rows] == ["4", "131072"] and all(r[-1] == "Pass" for r in rows)


def test_1mi_int32_profile_small(tmp_path):
    out = tmp_path / "seed.json"
    proc = bench(
        "alltoall",
        "--ranks",
        "2",
        "--profile",
        "1mi-int32",
        "--sizes",
        "64K",
        "--iters",
        "5",
        "--warmup",
        "1",
        "--validate",
        "--json",
        str(out),
    )
    assert "algbw[GB/s]" in proc.stdout and "busbw[GB/s]" in proc.stdout
    row = json.loads(out.read_text())["rows"][0]
    assert row["validation"] == "Pass" and row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] / 2)


def test_killed_rank_fails_the_run_naming_it():
    proc = bench("alltoall", "--ranks", "3", "--sizes", "64", "--iters", "100000", "--kill-rank", "2", check=False)
    ended = time.time()
    assert proc.returncode != 0
    assert "rank 2 was killed by SIGKILL" in proc.stderr, proc.stderr
    killed_at = float(re.search(r"SIGKILL to rank 2 at t=([0-9.]+)", proc.stderr).group(1))
    assert ended - killed_at < 10, (ended - killed_at, proc.stderr)


def test_compare_mpi_without_mpirun_says_why():
    env = dict(os.environ, PATH="/nonexistent")
    proc = subprocess.run(
        [sys.executable, "-m", "tensorwire", "bench", "alltoall", "--compare", "mpi"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert proc.returncode == 2 and "mpirun not found" in proc.stderr


@pytest.mark.skipif(coll.mpi_unavailable() is not None, reason=f"MPI: {coll.mpi_unavailable()}")
def test_compare_mpi_same_run(tmp_path):
    out = tmp_path / "mpi.json"
    proc = bench(
        "allreduce", "--ranks", "2", "--sizes", "4,64K", "--compare", "mpi", "--validate", "--json", str(out), *FAST
    )
    report = json.loads(out.read_text())
    assert {r["series"] for r in report["rows"]} == {"tensorwire", "mpi"}
    assert all(r["validation"] == "Pass" for r in report["rows"])
    assert "Open MPI" in report["config"]["mpi"] and "MPI/tw" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@pytest.mark.parametrize("op, sizes", [("allreduce", "4,64K"), ("alltoall", "1,4K")])
def test_api_path_beside_gloo(tmp_path, op, sizes):
    """--api times world.allreduce/alltoall (the library path); --compare gloo puts
    torch.distributed's gloo beside it in the same processes."""
    out = tmp_path / "api.json"
    proc = bench(
        op,
        "--ranks",
        "3",
        "--transport",
        "shm",
        "--sizes",
        sizes,
        "--api",
        "--compare",
        "gloo",
        "--validate",
        "--json",
        str(out),
        "--iters",
        "6",
        "--warmup",
        "1",
        timeout=120,
    )
    report = json.loads(out.read_text())
    assert {r["series"] for r in report["rows"]} == {"tensorwire", "gloo"}
    assert all(r["validation"] == "Pass" for r in report["rows"]), proc.stdout
    assert report["config"]["path"].startswith("api") and "gloo" in report["config"]["gloo"]
    assert "gloo/tw" in proc.stdout and all("gloo_over_tw" in r for r in report["rows"] if r["series"] == "tensorwire")


def test_one_rank_is_refused_saying_why():
    proc = bench("allreduce", "--ranks", "1", check=False)
    assert proc.returncode == 2 and "needs 2 or more ranks" in proc.stderr, proc.stderr


def test_api_refuses_an_algorithm():
    proc = bench("allreduce", "--api", "--algorithm", "ring", check=False)
    assert proc.returncode == 2 and "chooses its algorithm itself" in proc.stderr


def test_the_stated_threshold_is_the_layers(monkeypatch):
    """The command's help states the C++ layer's default switch from rd to the ring;
    a one-rank layer says what it takes on either side of it."""
    from tensorwire import Device, _core

    monkeypatch.delenv("TENSORWIRE_COLL_SMALL_BYTES", raising=False)
    store = {}
    with Device() as dev:
        m = _core.Messenger(dev, 0, 1, store.__setitem__, lambda key, timeout: store[key])
        c = _core.Collectives(m)
        limit = c.small_allreduce_limit
        assert limit == coll.SMALL_ALLREDUCE_BYTES
        assert c.allreduce_algorithm(limit // 4, "float32") == "doubling"
        assert c.allreduce_algorithm(limit // 4 + 1, "float32") == "ring"
        m.close()
        with pytest.raises(tw.ConnectionError):
            c.barrier(1)  # the engine is closed: refused, not a dangling engine


def test_argv_round_trip():
    """The ranks run the same command (`tensorwire bench ...`) with the arguments _argv_of gives."""
    from tensorwire.cli import build_parser

    p = build_parser()
    a = p.parse_args(["bench", "allreduce", "--sizes", "4,1M", "--algorithm", "rd", "--validate", "--iters", "7"])
    b = p.parse_args(["bench", *coll._argv_of(a)])
    assert vars(a) == vars(b)
