"""`tensorwire bench alltoall|allreduce`: collectives on one-sided writes.

Smoke tests at tiny sizes with validation on 2 and 3 ranks (3: recursive
doubling with a folded-in extra rank, ring chunks of unequal and empty
length), the seed-004 profile and OSU format, a rank killed mid-run, and the
comparison with MPI where mpirun + mpi4py are installed (skipped otherwise)."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

from tensorwire.cli import bench_collectives as coll
from tensorwire.ranks.collectives import RD_RING_THRESHOLD, Layout, choose_allreduce, rd_geometry, ring_chunks

FAST = ["--iters", "20", "--warmup", "2"]


def bench(*args, timeout=60, check=True):
    """Runs the bench as a user would without a launcher (it starts its own ranks)."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tensorwire", "bench", *args], capture_output=True,
                          text=True, timeout=timeout)
    proc.elapsed = time.monotonic() - t0
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def verdict_line(stdout):
    lines = [l for l in stdout.splitlines() if l.split(" ", 1)[0] in ("PASS", "WARN", "FAIL")]
    assert len(lines) == 1, stdout
    return lines[0]


def test_alltoall_two_ranks_validated(tmp_path):
    out = tmp_path / "a2a.json"
    proc = bench("alltoall", "--ranks", "2", "--transport", "tcp", "--sizes", "1,64,4K,64K", "--validate",
                 "--json", str(out), *FAST)
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
    # 3 ranks: rd folds rank 0 into rank 1; 4 B and 8 B leave ring chunks empty, 12 B gives one each
    out = tmp_path / "ar.json"
    proc = bench("allreduce", "--ranks", "3", "--transport", "shm", "--algorithm", algorithm, "--type", "int",
                 "--sizes", "4,8,12,4K,100K", "--validate", "--json", str(out), *FAST)
    report = json.loads(out.read_text())
    assert report["verdict"] in ("PASS", "WARN"), proc.stdout
    assert all(r["validation"] == "Pass" and r["algorithm"] == algorithm for r in report["rows"])
    assert "FAIL" not in proc.stdout


def test_allreduce_recursive_halving_four_ranks(tmp_path):
    # 4 B and 12 B leave halving ranges empty on some ranks; 100 K splits unevenly
    out = tmp_path / "rh.json"
    proc = bench("allreduce", "--ranks", "4", "--transport", "shm", "--algorithm", "rh", "--type", "int",
                 "--sizes", "4,12,4K,100K", "--validate", "--json", str(out), *FAST)
    report = json.loads(out.read_text())
    assert report["verdict"] in ("PASS", "WARN"), proc.stdout
    assert all(r["validation"] == "Pass" and r["algorithm"] == "rh" for r in report["rows"])


def test_recursive_halving_refuses_odd_rank_counts():
    proc = bench("allreduce", "--ranks", "3", "--algorithm", "rh", "--sizes", "4K", *FAST, check=False)
    assert proc.returncode != 0 and "power-of-two" in proc.stdout + proc.stderr


def test_allreduce_auto_float_osu_format():
    proc = bench("allreduce", "--ranks", "2", "--sizes", "4,128K", "--format", "osu", "--validate", *FAST)
    assert "# OSU MPI Allreduce Latency Test" in proc.stdout and "# Datatype: MPI_FLOAT." in proc.stdout
    rows = [l.split() for l in proc.stdout.splitlines() if l[:1].isdigit()]
    assert [r[0] for r in rows] == ["4", "131072"] and all(r[-1] == "Pass" for r in rows)


def test_1mi_int32_profile_small(tmp_path):
    out = tmp_path / "seed.json"
    proc = bench("alltoall", "--ranks", "2", "--profile", "1mi-int32", "--sizes", "64K", "--iters", "5",
                 "--warmup", "1", "--validate", "--json", str(out))
    assert "algbw[GB/s]" in proc.stdout and "busbw[GB/s]" in proc.stdout
    row = json.loads(out.read_text())["rows"][0]
    assert row["validation"] == "Pass" and row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] / 2)


def test_killed_rank_fails_the_run_naming_it():
    proc = bench("alltoall", "--ranks", "3", "--sizes", "64", "--iters", "100000", "--kill-rank", "2",
                 check=False)
    ended = time.time()
    assert proc.returncode != 0
    assert "rank 2 was killed by SIGKILL" in proc.stderr, proc.stderr
    killed_at = float(re.search(r"SIGKILL to rank 2 at t=([0-9.]+)", proc.stderr).group(1))
    assert ended - killed_at < 10, (ended - killed_at, proc.stderr)


def test_compare_mpi_without_mpirun_says_why():
    env = dict(os.environ, PATH="/nonexistent")
    proc = subprocess.run([sys.executable, "-m", "tensorwire", "bench", "alltoall", "--compare", "mpi"],
                          capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 2 and "mpirun not found" in proc.stderr


@pytest.mark.skipif(coll.mpi_unavailable() is not None, reason=f"MPI: {coll.mpi_unavailable()}")
def test_compare_mpi_same_run(tmp_path):
    out = tmp_path / "mpi.json"
    proc = bench("allreduce", "--ranks", "2", "--sizes", "4,64K", "--compare", "mpi", "--validate",
                 "--json", str(out), *FAST)
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
    proc = bench(op, "--ranks", "3", "--transport", "shm", "--sizes", sizes, "--api", "--compare", "gloo",
                 "--validate", "--json", str(out), "--iters", "6", "--warmup", "1", timeout=120)
    report = json.loads(out.read_text())
    assert {r["series"] for r in report["rows"]} == {"tensorwire", "gloo"}
    assert all(r["validation"] == "Pass" for r in report["rows"]), proc.stdout
    assert report["config"]["path"].startswith("api") and "gloo" in report["config"]["gloo"]
    assert "gloo/tw" in proc.stdout and all("gloo_over_tw" in r for r in report["rows"] if r["series"] == "tensorwire")


def test_api_refuses_an_algorithm():
    proc = bench("allreduce", "--api", "--algorithm", "ring", check=False)
    assert proc.returncode == 2 and "chooses its algorithm itself" in proc.stderr


def test_helpers():
    assert rd_geometry(3) == (2, 1, 1) and rd_geometry(4) == (4, 0, 2) and rd_geometry(7) == (4, 3, 2)
    assert ring_chunks(10, 4) == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert ring_chunks(1, 3) == [(0, 1), (1, 0), (1, 0)]
    assert choose_allreduce(64, 4, 1024) == "rd" and choose_allreduce(4096, 4, 1024) == "rh"
    assert choose_allreduce(4096, 3, 1024) == "ring" and choose_allreduce(4096, 2, 1024) == "ring"
    lay = Layout(3, 1 << 20, 1 << 20)
    assert lay.slots >= 2 * (2 * 2 + 1 + 2) and lay.total >= 2 * 3 * (1 << 20)
    # recursive doubling's landing slots only up to rd_bytes; rh's halves fit in about one vector
    small = Layout(4, 0, 8 << 20, rd_bytes=512 << 10)
    assert small.land < 2 * (8 << 20) < Layout(4, 0, 8 << 20).land
    assert small.rh_offsets[-1] <= (8 << 20) + 4 * 128
    assert coll.RD_RING_THRESHOLD == RD_RING_THRESHOLD  # the bench's mirror of the engine's


def test_argv_round_trip():
    """The ranks run the same command (`tensorwire bench ...`) with the arguments _argv_of gives."""
    from tensorwire.cli import build_parser
    p = build_parser()
    a = p.parse_args(["bench", "allreduce", "--sizes", "4,1M", "--algorithm", "rd", "--validate", "--iters", "7"])
    b = p.parse_args(["bench", *coll._argv_of(a)])
    assert vars(a) == vars(b)
