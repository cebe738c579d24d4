"""The collectives as a library (world.allreduce / alltoall / broadcast / barrier, on the
C++ collectives layer): results equal numpy's on 1..4 ranks, numpy arrays and CPU torch
tensors, sizes on both sides of every algorithm switch, and bad input refused with
InvalidArgument on every rank.

Each case is one `tensorwire run -n N` of SCRIPT: every rank computes every rank's
input from (rank, seed), so it knows numpy's answer without any exchange."""

import importlib.util
import subprocess
import sys
import textwrap

import pytest

HAVE_TORCH = importlib.util.find_spec("torch") is not None

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorwire as tw, tensorwire.ranks.world as w

    transport, use_torch = sys.argv[1], sys.argv[2] == "1"
    if use_torch:
        import torch

    def inp(rank, count, dtype, seed):
        # integer values: sums and products are exact in every dtype, so == is fair
        rng = np.random.default_rng(1000 * seed + rank)
        return rng.integers(-50, 50, count).astype(dtype)

    def refused(fn, *words):
        try:
            fn()
        except tw.InvalidArgument as e:
            assert all(x in str(e) for x in words), (str(e), words)
            return
        raise AssertionError(f"not refused: {words}")

    with w.World(transport=transport, timeout=20, progress="inline") as world:
        r, n = world.rank, world.size
        seed = 0
        # allreduce: sizes from 1 element to 1.2 MB (recursive doubling, then the ring)
        for count, dtype, op in ((1, "float32", "sum"), (5, "int32", "max"), (1000, "float64", "min"),
                                 (33, "int64", "prod"), (70_000, "float32", "sum"), (300_001, "int32", "sum"),
                                 (300_001, "float32", "max"), (7, "complex64", "sum"), (9, "float16", "sum")):
            seed += 1
            every = [inp(k, count, dtype, seed) for k in range(n)]
            if op == "prod":
                every = [np.sign(a) + (a == 0) for a in every]  # +-1: no overflow
            expect = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}[op](
                np.stack(every), axis=0).astype(dtype)
            mine = every[r].copy()
            assert world.allreduce(mine, op=op) is mine
            assert np.array_equal(mine, expect), (count, dtype, op)
        layer = world.collectives if n > 1 else None  # one layer per World, made by the first call
        # 2-D
        seed += 1
        every = [inp(k, 12 * 34, "float32", seed).reshape(12, 34) for k in range(n)]
        mine = every[r].copy()
        world.allreduce(mine)
        assert np.array_equal(mine, sum(every)) and (n == 1 or world.collectives is layer)

        # alltoall: block s of out is block r of rank s's inp
        for rows, cols, dtype in ((1, 1, "uint8"), (3, 5, "int32"), (2, 40_000, "float64"), (1, 3, "bool")):
            seed += 1
            every = [inp(k, n * rows * cols, dtype, seed).reshape(n * rows, cols) for k in range(n)]
            out = np.full_like(every[r], 7)
            assert world.alltoall(out, every[r]) is out
            expect = np.concatenate([every[s][r * rows:(r + 1) * rows] for s in range(n)])
            assert np.array_equal(out, expect), (rows, cols, dtype)
        # in place (out is inp)
        a = np.repeat(np.arange(n, dtype=np.int16) + 10 * r, 3)
        world.alltoall(a, a)
        assert np.array_equal(a, np.repeat(np.arange(n, dtype=np.int16) * 10 + r, 3))

        # broadcast: exact bytes (NaN payloads too) from every root; objects still on the control plane
        for root in range(n):
            for nbytes in (1, 4096, 200_000):
                src = np.random.default_rng(root * 7 + nbytes).integers(0, 256, nbytes, dtype=np.uint8)
                buf = src.copy() if r == root else np.zeros(nbytes, np.uint8)
                world.broadcast(buf, root=root)
                assert np.array_equal(buf, src), (root, nbytes)
        nan = np.array([0x7FC00001, 0xFFFFFFFF, 0x7F800001], np.uint32).view(np.float32)
        buf = nan.copy() if r == 0 else np.zeros(3, np.float32)
        world.broadcast(buf, root=0)
        assert buf.tobytes() == nan.tobytes()
        assert world.broadcast({"k": [1, 2]} if r == n - 1 else None, root=n - 1) == {"k": [1, 2]}
        assert world.allgather(r) == list(range(n))  # the store, between calls of the layer
        world.barrier()

        if use_torch:
            t = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1)
            assert world.allreduce(t) is t
            assert torch.equal(t, torch.arange(6, dtype=torch.float32).reshape(2, 3) * (n * (n + 1) // 2))
            t = torch.full((100_000,), r, dtype=torch.int64)
            world.allreduce(t, op="max")
            assert bool((t == n - 1).all())
            src = torch.arange(n * 4, dtype=torch.int32) + 100 * r
            out = torch.empty_like(src)
            world.alltoall(out, src)
            assert out.tolist() == [100 * s + 4 * r + j for s in range(n) for j in range(4)]
            b = torch.randn(1000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
            got = b.clone() if r == 0 else torch.zeros(1000, dtype=torch.bfloat16)
            world.broadcast(got, root=0)  # exact bytes, even for a dtype numpy lacks
            assert torch.equal(got.view(torch.int16), b.view(torch.int16))
            refused(lambda: world.allreduce(torch.zeros(4, dtype=torch.bfloat16)), "bfloat16", "not supported")
            refused(lambda: world.allreduce(torch.zeros(4, 4).t()), "contiguous")
            refused(lambda: world.alltoall(torch.zeros(n * 2, 2).t(), torch.zeros(2, n * 2)), "contiguous")

        # bad input: refused on every rank before anything moves (so the layer stays usable)
        refused(lambda: world.allreduce(np.zeros(4, np.float32), op="avg"), "'avg'", "sum, prod, min, max")
        refused(lambda: world.allreduce(np.zeros(4, np.float32), op=[1]), "[1]", "supported")
        refused(lambda: world.allreduce(np.zeros(4, np.complex64), op="max"), "complex")
        refused(lambda: world.allreduce(np.zeros(4, bool)), "bool")
        refused(lambda: world.allreduce(np.zeros(8, np.float32)[::2]), "contiguous")
        refused(lambda: world.allreduce(np.zeros(8, np.int8).reshape(2, 4).T), "contiguous")
        ro = np.zeros(4, np.int32); ro.flags.writeable = False
        refused(lambda: world.allreduce(ro), "writable")
        refused(lambda: world.allreduce(np.zeros(4, ">i4")), "byte order")
        refused(lambda: world.allreduce(np.zeros(4, np.longdouble)), "not supported")
        refused(lambda: world.allreduce([1, 2, 3]), "numpy array", "list")
        refused(lambda: world.broadcast(np.zeros(8)[::2], root=0), "contiguous")
        refused(lambda: world.broadcast(np.zeros(4), root=n), "root")
        refused(lambda: world.alltoall(np.zeros(n * 2, np.int32), np.zeros(n * 2, np.int64)), "one dtype and size")
        refused(lambda: world.alltoall(np.zeros(n * 4)[::2], np.zeros(n * 2)), "contiguous")
        if n > 1:
            refused(lambda: world.alltoall(np.zeros(n + 1), np.zeros(n + 1)), f"{n} equal blocks")
            refused(lambda: world.alltoall(np.zeros((n - 1 or 1, 2 * n)), np.zeros((n - 1 or 1, 2 * n))),
                    "equal blocks")
        refused(lambda: world.alltoall(np.zeros(n), np.float32(1.0)), "one dtype and size")
        # and it still works afterwards
        x = np.ones(10, np.int32)
        world.allreduce(x)
        assert (x == n).all()
        print("rank", r, "ok", flush=True)
""")


def _run(n, transport, use_torch, timeout=120):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tensorwire",
            "run",
            "-n",
            str(n),
            "--timeout",
            "100",
            "--",
            sys.executable,
            "-c",
            SCRIPT,
            transport,
            "1" if use_torch else "0",
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("n, transport", [(1, "shm"), (2, "shm"), (3, "shm"), (4, "shm"), (3, "tcp")])
def test_results_equal_numpy(n, transport):
    # torch on one rank count only: importing it costs ~1 s per rank on a small machine
    r = _run(n, transport, use_torch=HAVE_TORCH and n in (2, 4))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(" ok") == n, r.stdout + r.stderr


MISMATCH = textwrap.dedent("""
    import numpy as np, tensorwire as tw, tensorwire.ranks.world as w
    with w.World(transport="shm", timeout=5, progress="inline") as world:
        world.allreduce(np.ones(64, np.float32))          # the layer exists
        try:
            world.allreduce(np.ones(10 + 2 * world.rank, np.float32))  # ranks disagree: 10 vs 12
        except tw.InvalidArgument as e:
            print("rank", world.rank, "refused:", e, flush=True)
        try:
            world.allreduce(np.ones(10, np.float32))
        except tw.Error as e:
            print("rank", world.rank, "then:", e, flush=True)
""")


def test_ranks_that_disagree_are_told_not_mixed():
    """Shapes equal on all ranks is the caller's contract; a message whose size differs
    from its receive fails both ranks at once (not after the timeout), naming both,
    and the World refuses further tensor collectives."""
    r = subprocess.run(
        [sys.executable, "-m", "tensorwire", "run", "-n", "2", "--timeout", "60", "--", sys.executable, "-c", MISMATCH],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert out.count("refused:") == 2 and "send and receive sizes must match" in out, out
    assert out.count("then:") == 2 and "cannot be used any more" in out, out


SILENT = textwrap.dedent("""
    import time, numpy as np, tensorwire as tw, tensorwire.ranks.world as w
    with w.World(transport="shm", timeout=1, progress="inline") as world:
        world.allreduce(np.ones(64, np.float32))
        if world.rank == 1:
            time.sleep(2)  # never makes the second call
        else:
            t0 = time.monotonic()
            try:
                world.allreduce(np.ones(64, np.float32))
            except tw.Timeout as e:
                print("timeout after", round(time.monotonic() - t0, 1), "s:", e, flush=True)
""")


def test_a_silent_rank_is_named():
    r = subprocess.run(
        [sys.executable, "-m", "tensorwire", "run", "-n", "2", "--timeout", "60", "--", sys.executable, "-c", SILENT],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "allreduce on rank 0 timed out" in r.stdout and "waiting for rank(s) 1" in r.stdout, r.stdout
    assert float(r.stdout.split("timeout after ")[1].split()[0]) < 3, r.stdout
