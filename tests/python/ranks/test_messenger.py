"""tensorwire._core.Messenger (the C++ tagged-message engine) from Python:
processes that meet through a directory store, numpy buffers, eager and placed
messages, any-source receives, wait_any on the requests, a failed rank named."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

import numpy as np
import pytest

SIZES = [0, 8, 4096, 128 << 10, (1 << 20) + 5]


class DirStore:
    """set/get on files of one directory (get waits): a rendezvous without torch."""

    def __init__(self, path: str) -> None:
        self.path = path

    def set(self, key: str, value: bytes) -> None:
        f = os.path.join(self.path, key.replace("/", "_"))
        with open(f + ".tmp", "wb") as out:
            out.write(value)
        os.replace(f + ".tmp", f)

    def get(self, key: str, timeout: float) -> bytes:
        f = os.path.join(self.path, key.replace("/", "_"))
        deadline = time.monotonic() + timeout
        while not os.path.exists(f):
            if time.monotonic() > deadline:
                raise TimeoutError(key)
            time.sleep(0.005)
        with open(f, "rb") as inp:
            return inp.read()


def data(n: int, seed: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7 + seed).astype(np.uint8)


def _rank(rank: int, size: int, path: str, transport: str, scenario: str, q) -> None:
    try:
        import tensorwire as tw
        from tensorwire import _core

        dev = tw.Device(transport=transport)
        store = DirStore(path)
        m = _core.Messenger(dev, rank, size, store.set, store.get, timeout=30.0)
        out = {}
        if scenario == "sizes":
            if rank == 0:
                for n in SIZES:
                    a = data(n, n % 251)
                    m.isend(a.ctypes.data, a.nbytes, 1, 3, keep=a).wait(10)
            else:
                for n in SIZES:
                    b = np.zeros(n, dtype=np.uint8)
                    r = m.irecv(b.ctypes.data, b.nbytes, 0, 3, keep=b)
                    r.request.wait(10)
                    out[n] = bool(np.array_equal(b, data(n, n % 251))) and r.source == 0
        elif scenario == "any":
            if rank > 0:
                a = data(300 << 10, rank)
                m.isend(a.ctypes.data, a.nbytes, 0, 7, keep=a).wait(10)
                b = np.zeros(1, dtype=np.uint8)
                m.irecv(b.ctypes.data, 1, 0, 8, keep=b).request.wait(10)  # stay until rank 0 has both
            else:
                bufs = [np.zeros(300 << 10, dtype=np.uint8) for _ in range(size - 1)]
                recvs = [m.irecv(b.ctypes.data, b.nbytes, _core.ANY_SOURCE, 7, keep=b) for b in bufs]
                pending = list(range(len(recvs)))
                while pending:
                    i = _core.wait_any([recvs[j].request for j in pending], 10)
                    recvs[pending.pop(i)].request.wait(0)
                out["sources"] = sorted(r.source for r in recvs)
                out["ok"] = all(np.array_equal(b, data(b.nbytes, r.source)) for b, r in zip(bufs, recvs))
                one = np.ones(1, dtype=np.uint8)
                for p in range(1, size):
                    m.isend(one.ctypes.data, 1, p, 8, keep=one).wait(10)
        elif scenario == "dies":
            if rank == 1:
                time.sleep(0.3)
                os._exit(0)  # no goodbye
            b = np.zeros(16, dtype=np.uint8)
            r = m.irecv(b.ctypes.data, 16, 1, 0, keep=b)
            try:
                r.request.wait(20)
                out["error"] = None
            except tw.Error as e:
                out["error"] = type(e).__name__
            out["failed_rank"] = r.request.failed_rank
        m.close()
        q.put((rank, out))
    except BaseException:
        q.put((rank, {"exception": traceback.format_exc()}))


def run(size: int, transport: str, scenario: str, tmp_path) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, size, str(tmp_path), transport, scenario, q)) for r in range(size)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(size - (1 if scenario == "dies" else 0)):
            rank, out = q.get(timeout=90)
            results[rank] = out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for rank, out in results.items():
        assert "exception" not in out, f"rank {rank}: {out['exception']}"
    return results


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_every_size_arrives_whole(transport, tmp_path):
    got = run(2, transport, "sizes", tmp_path)[1]
    assert got == {n: True for n in SIZES}


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_any_source_receives_name_their_senders(transport, tmp_path):
    got = run(3, transport, "any", tmp_path)[0]
    assert got == {"sources": [1, 2], "ok": True}


def test_a_rank_that_dies_is_named(tmp_path):
    got = run(2, "tcp", "dies", tmp_path)[0]
    assert got["error"] in ("PeerFailed", "ConnectionError"), got
    assert got["failed_rank"] == 1
