"""The series `tensorwire bench alltoall|allreduce` times (see collectives.py): the
World's C++ collectives layer called directly (the algorithm as asked), the library
path (world.allreduce / world.alltoall, --api), MPI (--compare mpi) and
torch.distributed gloo (--compare gloo), all filled and checked with the same
iteration-dependent patterns."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

# the C++ layer's algorithm names -> the bench's (its --algorithm and table column)
ALGORITHM_LABEL = {"doubling": "rd", "ring": "ring"}


class Series:
    """One implementation of the operation at one size: setup(size, pat), then per
    iteration prepare(i), call(), check(out, i); sync() is the barrier between calls.
    `inp` is the array prepare() fills (the input of the next call)."""

    name = ""
    label = ""  # in the table's column heads
    algo_used = ""
    op = ""
    version = ""  # the compared library's (gloo's series)
    inp: Any = None
    pat: Any = None

    call: Callable[[], Any]  # set by setup()
    dtype: np.dtype | None = None  # allreduce's element type (alltoall moves bytes: None)

    def _dtype(self) -> np.dtype:
        assert self.dtype is not None, "an allreduce series has its element type"
        return self.dtype

    def setup(self, size: int, pat: "Patterns") -> None: ...
    def sync(self) -> None: ...
    def close(self) -> None: ...

    def prepare(self, i: int) -> None:
        (self.pat.fill_a2a if self.op == "alltoall" else self.pat.fill_ar)(self.inp, i)

    def check(self, out: Any, i: int) -> bool:
        return self.pat.check_a2a(out, i) if self.op == "alltoall" else self.pat.check_ar(out, i)


class Patterns:
    """Iteration-dependent inputs and their expected outputs, shared by both series.

    alltoall: byte j of the block rank s sends to rank d in iteration i is
    (j + 31 s + 7 d + i) mod 256. allreduce: element j of rank r's vector is
    (r + 1) * ((i + j) mod 7 + 1), so the sum is N(N+1)/2 * ((i + j) mod 7 + 1)
    (exact in float32 and int32)."""

    def __init__(self, op: str, rank: int, n: int, size: int, dtype: np.dtype | None) -> None:
        self.op, self.rank, self.n, self.size = op, rank, n, size
        if op == "alltoall":
            self.seq = (np.arange(size + 256) & 0xFF).astype(np.uint8)
        else:
            assert dtype is not None  # allreduce's
            self.count = size // dtype.itemsize
            self.base = (np.arange(self.count + 7) % 7 + 1).astype(dtype)
            self.expected_scale = n * (n + 1) // 2

    def a2a_block(self, src: int, dst: int, i: int) -> np.ndarray:
        off = (31 * src + 7 * dst + i) & 0xFF
        return self.seq[off : off + self.size]

    def fill_a2a(self, send: np.ndarray, i: int) -> None:
        for d in range(self.n):
            send[d] = self.a2a_block(self.rank, d, i)

    def check_a2a(self, recv: np.ndarray, i: int) -> bool:
        return all(np.array_equal(recv[s], self.a2a_block(s, self.rank, i)) for s in range(self.n))

    def ar_base(self, i: int) -> np.ndarray:
        return self.base[i % 7 : i % 7 + self.count]

    def fill_ar(self, src: np.ndarray, i: int) -> None:
        np.multiply(self.ar_base(i), self.rank + 1, out=src)

    def check_ar(self, out: np.ndarray, i: int) -> bool:
        return bool(np.array_equal(out, self.ar_base(i) * self.expected_scale))


class TensorwireSeries(Series):
    """The World's C++ collectives layer (world.collectives) on numpy arrays, the allreduce
    algorithm as asked: no Python checks, no copies (the layer works in the arrays)."""

    name, label = "tensorwire", "tw"

    def __init__(self, world: Any, op: str, dtype: np.dtype | None, algorithm: str, timeout: float) -> None:
        self.coll, self.n, self.op, self.dtype = world.collectives, world.size, op, dtype
        self.algorithm, self.timeout = algorithm, timeout
        self.algo_used = ""

    def setup(self, size: int, pat: Patterns) -> None:
        self.pat, coll, timeout = pat, self.coll, self.timeout
        if self.op == "alltoall":
            self.inp, out = np.zeros((self.n, size), np.uint8), np.zeros((self.n, size), np.uint8)
            inp = self.inp
            self.call = lambda: (
                coll.alltoall(inp.ctypes.data, out.ctypes.data, size, in_keep=inp, out_keep=out, timeout=timeout),
                out,
            )[1]
            self.algo_used = "pairwise"
        else:
            count, dt = size // self._dtype().itemsize, self._dtype().name
            self.inp = inp = np.zeros(count, self.dtype)
            algo = {"auto": "auto", "rd": "doubling", "ring": "ring"}[self.algorithm]
            self.algo_used = ALGORITHM_LABEL[coll.allreduce_algorithm(count, dt) if algo == "auto" else algo]
            self.call = lambda: (
                coll.allreduce(inp.ctypes.data, count, dt, keep=inp, timeout=timeout, algorithm=algo),
                inp,
            )[1]

    def sync(self) -> None:
        self.coll.barrier(self.timeout)


class ApiSeries(Series):
    """The library path: world.alltoall(out, inp) / world.allreduce(array) on plain numpy
    arrays (the World's checks of its arguments inside the timer; the layer works in
    the arrays themselves)."""

    name, label = "tensorwire", "tw"

    def __init__(self, world: Any, op: str, dtype: np.dtype | None) -> None:
        self.world, self.op, self.dtype = world, op, dtype

    def setup(self, size: int, pat: Patterns) -> None:
        self.pat, n = pat, self.world.size
        if self.op == "alltoall":
            self.inp, out = np.zeros((n, size), np.uint8), np.zeros((n, size), np.uint8)
            self.call = lambda: self.world.alltoall(out, self.inp)
            self.algo_used = "pairwise"
        else:
            count = size // self._dtype().itemsize
            self.inp = np.zeros(count, self.dtype)
            self.call = lambda: self.world.allreduce(self.inp)  # in place, as torch's all_reduce
            self.algo_used = (
                ALGORITHM_LABEL[self.world.collectives.allreduce_algorithm(count, self._dtype().name)] if n > 1 else "-"
            )

    def sync(self) -> None:
        self.world.barrier()


class MpiSeries(Series):
    name, label = "mpi", "MPI"

    def __init__(self, comm: Any, op: str, dtype: np.dtype | None) -> None:
        self.comm, self.op, self.dtype = comm, op, dtype
        self.algo_used = "Open MPI's choice"

    def setup(self, size: int, pat: Patterns) -> None:
        from mpi4py import MPI

        self.pat = pat
        n = self.comm.Get_size()
        if self.op == "alltoall":
            self.inp = np.zeros((n, size), np.uint8)
            self.rbuf = np.zeros((n, size), np.uint8)
            s, r = [self.inp, MPI.BYTE], [self.rbuf, MPI.BYTE]
            self.call = lambda: (self.comm.Alltoall(s, r), self.rbuf)[1]
        else:
            count = size // self._dtype().itemsize
            self.inp = np.zeros(count, self.dtype)
            self.rbuf = np.zeros(count, self.dtype)
            self.call = lambda: (self.comm.Allreduce(self.inp, self.rbuf, op=MPI.SUM), self.rbuf)[1]

    def sync(self) -> None:
        self.comm.Barrier()


class GlooSeries(Series):
    """torch.distributed with the gloo backend in the same processes: all_to_all_single /
    all_reduce (in place, SUM) on CPU tensors viewing numpy arrays, dist.barrier() between
    calls. gloo moves data over TCP (it has no shared-memory transport)."""

    name, label = "gloo", "gloo"

    def __init__(self, world: Any, op: str, dtype: np.dtype | None, quiesce: Any) -> None:
        import torch
        import torch.distributed as dist

        self.dist, self.torch, self.op, self.dtype = dist, torch, op, dtype
        self.algo_used = "gloo's choice"
        self.version = f"torch {torch.__version__} gloo"
        from ...ranks.rendezvous import TorchStore

        if isinstance(world.store, TorchStore):  # the World met in torch's store (torchrun): gloo meets there too
            store, prefix = world.store, f"{world.store_prefix}/gloo"
        else:  # rank 0 hosts one on a free port; its address through the World's store
            host = world.placement.root.rpartition(":")[0]
            hosted = TorchStore.host(host, 0) if world.rank == 0 else None
            address = world.broadcast(hosted.address if hosted is not None else None, root=0)
            store, prefix = hosted or TorchStore.connect(address), "gloo"
        # gloo's rendezvous may block holding the GIL: nobody may still need rank 0's
        # control-plane handlers then (an engine barrier: every rank is past the broadcast)
        quiesce()
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(prefix, store.store), rank=world.rank, world_size=world.size
        )

    def setup(self, size: int, pat: Patterns) -> None:
        self.pat, n, dist = pat, self.dist.get_world_size(), self.dist
        if self.op == "alltoall":
            self.inp, out = np.zeros((n, size), np.uint8), np.zeros((n, size), np.uint8)
            ti, to = self.torch.from_numpy(self.inp.reshape(-1)), self.torch.from_numpy(out.reshape(-1))
            self.call = lambda: (dist.all_to_all_single(to, ti), out)[1]
        else:
            self.inp = np.zeros(size // self._dtype().itemsize, self.dtype)
            t = self.torch.from_numpy(self.inp)
            self.call = lambda: (dist.all_reduce(t), self.inp)[1]

    def sync(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        self.dist.destroy_process_group()
