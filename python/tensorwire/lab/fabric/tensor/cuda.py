"""`tensorwire bench tensor --memory cuda`: the tensor starts in the sender's
GPU memory and must end in the receiver's.

  zerocopy  tensorwire static slot in GPU memory; the sender's tensor is a CUDA
            Block (device.empty(..., memory="cuda")), sent with no copy.
  dynamic   tensorwire dynamic slot in GPU memory; the sender's tensor a CUDA Block.
  staged    the paper's "GDR off": the sender copies the tensor GPU -> host into a
            page-locked host Block, sends that through a host static slot (zero
            copy), the receiver copies it host -> GPU from its page-locked slot
            buffer. Both copies are timed.
  gloo      torch.distributed gloo. Gloo has no send/recv for CUDA tensors, so
            the tensor goes GPU -> pinned host, gloo send/recv, pinned host -> GPU;
            both copies are timed.
  cuda_ipc  the same-host limit: the receiver shares its GPU buffer through a
            CUDA IPC handle (torch's reduce_tensor); the sender copies into it
            (dst.copy_(src) + synchronize), then says so with one byte on a
            socket; the receiver consumes and acks like the others. Its one-way
            time is the copy + synchronize alone, timed by the sender.

The method is the host bench's, with torch tensors for numpy arrays: the
sender stamps element 0 with 1 + k and synchronises the GPU (untimed; a tensor
handed to a send must be complete), takes t0, sends; the receiver gets a CUDA
tensor, reduces it on the GPU (max, read back as one float: that also waits
for the kernel), acks. One-way: from the sender's t0 to the moment recv()
returned the usable CUDA tensor at the receiver, both read from the host's
CLOCK_MONOTONIC (time.perf_counter, the same clock in both processes);
cuda_ipc's is its own timed copy. The receiver of every serial pass compares
the first tensor with the pattern element by element (--verify: every tensor).
torch is imported only inside the series: the module imports without it.
"""

from __future__ import annotations

import importlib.util
import mmap
import statistics
import time
from typing import Any

import numpy as np

from ..common import BenchError
from .base import DTYPE, ITEM, Series, fill_pattern
from .gloo import Gloo
from .slots import Dynamic, StaticSeries, ZeroCopy
from .tcp_socket import Socket

PAGE = mmap.PAGESIZE


def cuda_unavailable() -> str | None:
    """Why torch has no CUDA GPU here, or None."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch)"
    import torch

    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def _gpu_memory_missing() -> str | None:
    """Why tensorwire itself cannot use GPU memory here (torch may still see the GPU)."""
    import tensorwire as tw

    return None if tw.cuda_available() else f"tensorwire sees no GPU ({tw.cuda_info()['reason']})"


def pattern(n: int, device: Any) -> Any:
    """fill_pattern's n values as a float32 tensor on `device`, made by numpy:
    the same bits as the host bench's (torch divides by a scalar as a multiply
    by its reciprocal, which can differ in the last bit)."""
    import torch

    host = np.empty(n, DTYPE)
    fill_pattern(host)
    return torch.from_numpy(host).to(device)


class CudaChecker:
    """The receiver's consumption and checks of one serve, on the GPU (the
    harness's _Checker does the same on numpy arrays). `serial`: a serial
    pass, whose first tensor is compared element by element and whose
    arrival times are kept (the one-way times)."""

    def __init__(
        self, size: int, count: int, verify: bool, reduce: bool = True, serial: bool = False, device: Any = "cuda"
    ) -> None:
        import torch

        self.torch = torch
        self.n = size // ITEM
        self.count, self.verify, self.reduce, self.serial = count, verify, reduce, serial
        self.device = torch.device(device)
        self.k = 0
        self.errors: list[str] = []
        self.verified = 0
        self.first_verified: bool | None = None
        self.arrived: list[float] = []
        self.expected = pattern(self.n, self.device) if verify or serial else None

    def error(self, msg: str) -> None:
        if len(self.errors) < 5:
            self.errors.append(msg)

    def consume(self, arr: Any) -> None:
        if self.serial:
            self.arrived.append(time.perf_counter())  # recv() returned: the tensor is usable
        torch = self.torch
        k = self.k
        self.k += 1
        if (
            not isinstance(arr, torch.Tensor)
            or arr.dtype != torch.float32
            or arr.numel() != self.n
            or arr.device.type != self.device.type
        ):
            got = f"{arr.dtype}[{arr.numel()}] on {arr.device}" if isinstance(arr, torch.Tensor) else type(arr).__name__
            self.error(f"transfer {k}: got {got}, expected float32[{self.n}] on {self.device.type}")
            return
        flat = arr.reshape(-1)
        m = float(flat.max() if self.reduce else flat[0])  # one float back: waits for the kernel
        ok = m == 1.0 + k
        if not ok:
            self.error(f"transfer {k}: max {m} != {1.0 + k} (stale or corrupted tensor)")
        if self.verify or (self.serial and k == 0):
            expected = self.expected
            assert expected is not None  # made for verify or serial
            same = bool(torch.equal(flat[1:], expected[1:]))
            if not same:
                bad = torch.nonzero(flat[1:] != expected[1:]).reshape(-1)
                self.error(f"transfer {k}: {bad.numel()} element(s) differ, the first at index {int(bad[0]) + 1}")
            good = same and ok and float(flat[0]) == 1.0 + k
            if k == 0:
                self.first_verified = good
            if self.verify and good:
                self.verified += 1

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"received": self.k, "verified": self.verified, "errors": self.errors}
        if self.serial:
            out["first_verified"] = self.first_verified
            out["arrived"] = self.arrived
        return out


class Pins:
    """Page-locks host memory for fast GPU copies (cudaHostRegister), each page
    once: the staged series' host Block and the receiver's slot buffers, so
    that neither copy is a pageable one (which favours the baseline, as the
    host bench's reused buffers do). clear() unlocks them, and must run before
    that memory is freed."""

    def __init__(self, cudart: Any = None) -> None:
        self._cudart = cudart  # torch.cuda.cudart() when None (a fake in the CPU tests)
        self.ranges: list[tuple[int, int]] = []  # ours: registered, page-aligned, disjoint
        self.known: list[tuple[int, int]] = []  # page-locked by someone else (UCX may lock what it registers)

    def _uncovered(self, start: int, end: int) -> list[tuple[int, int]]:
        pieces = [(start, end)]
        for s, e in self.ranges + self.known:
            nxt = []
            for a, b in pieces:
                if e <= a or s >= b:
                    nxt.append((a, b))
                    continue
                if a < s:
                    nxt.append((a, s))
                if e < b:
                    nxt.append((e, b))
            pieces = nxt
        return pieces

    def pin(self, t: Any) -> None:
        """Page-locks the pages of the CPU tensor `t` not locked yet (cheap
        when all are: it runs on every receive)."""
        ptr = t.data_ptr()
        start = ptr // PAGE * PAGE
        end = -(-(ptr + t.numel() * t.element_size()) // PAGE) * PAGE
        pieces = self._uncovered(start, end)
        if not pieces:
            return
        # Locked by someone else? Asking first keeps a refused cudaHostRegister
        # (already registered) from leaving a CUDA error pending for torch's
        # next kernel launch. is_pinned() looks at t's first byte only, which
        # says nothing when that page is one of ours (a neighbour's buffer).
        if not any(s <= start < e for s, e in self.ranges) and t.is_pinned():
            self.known.append((start, end))
            return
        cudart = self._cudart
        if cudart is None:
            import torch

            cudart = torch.cuda.cudart()
        for a, b in pieces:
            err = int(cudart.cudaHostRegister(a, b - a, 0))
            if err:
                raise BenchError(f"cudaHostRegister of {b - a} B of host memory failed (cudaError {err})")
            self.ranges.append((a, b))

    def clear(self) -> None:
        ranges, self.ranges, self.known = self.ranges, [], []
        if not ranges:
            return
        cudart = self._cudart
        if cudart is None:
            import torch

            cudart = torch.cuda.cudart()
        for a, _ in ranges:
            cudart.cudaHostUnregister(a)


class _Cuda(Series):
    """What every --memory cuda series shares (first among their bases): torch tensors
    on `device` where the host series have numpy arrays. `device` "cpu" is the CPU tests' stand-in."""

    device = "cuda"
    requires = ("torch", "torch")
    gpu_memory = False  # whether the series moves tensorwire GPU memory (not only torch's)

    @classmethod
    def unavailable(cls) -> str | None:
        return cuda_unavailable() or super().unavailable() or (_gpu_memory_missing() if cls.gpu_memory else None)

    def _sync(self) -> None:
        if self.device != "cpu":
            import torch

            torch.cuda.synchronize()

    def _view(self, block) -> Any:
        import torch

        return torch.from_dlpack(block)  # a CUDA Block: a CUDA tensor viewing it, no copy

    def fill(self, view: Any) -> None:
        view.copy_(pattern(view.numel(), "cpu"))
        self._sync()

    def stamp(self, view: Any, k: int) -> None:
        view[0] = 1.0 + k
        self._sync()  # the stream contract: the tensor is complete before it is sent

    def snapshot(self, view: Any) -> Any:
        return view.clone()

    def restore(self, view: Any, fresh: Any) -> None:
        view.copy_(fresh)  # stamp() synchronises

    def make_checker(self, size: int, count: int, verify: bool, reduce: bool, serial: bool) -> CudaChecker:
        return CudaChecker(size, count, verify, reduce, serial, self.device)

    def _gpu_tensor(self, size: int) -> Any:
        import torch

        return torch.empty(size // ITEM, dtype=torch.float32, device=self.device)

    def _host_tensor(self, size: int) -> Any:
        import torch

        return torch.zeros(size // ITEM, dtype=torch.float32, pin_memory=self.device != "cpu")


class CudaZeroCopy(_Cuda, ZeroCopy):
    """tensorwire static slot in GPU memory, the sender's tensor a CUDA Block."""

    memory = "cuda"
    gpu_memory = True

    def copy_bandwidth(self, size: int, reps: int = 5) -> float:
        """MB/s of one device-to-device copy of `size` bytes in this process
        (the GPU's own rate; the host bench's memcpy anchor): median of `reps`."""
        src = self._gpu_tensor(size).fill_(1.0)
        dst = self._gpu_tensor(size)
        clock = time.perf_counter
        times = []
        for _ in range(reps + 1):  # the first one untimed
            t0 = clock()
            dst.copy_(src)
            self._sync()
            times.append(clock() - t0)
        return size / statistics.median(times[1:]) / 1e6


class CudaDynamic(_Cuda, Dynamic):
    """tensorwire dynamic slot in GPU memory, the sender's tensor a CUDA Block."""

    memory = "cuda"
    gpu_memory = True


class Staged(_Cuda, StaticSeries):
    """GPU -> page-locked host Block -> host static slot -> GPU ("GDR off")."""

    name = "staged"
    registered = True  # the host Block goes with zero copy: only the two GPU copies are extra
    gpu: Any  # torch tensors (None while a size's are dropped)
    host: Any

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        self.pins = Pins()

    def r_prepare(self, size: int) -> dict[str, Any]:
        self.pins.clear()  # before super() drops the previous size's slots
        info = super().r_prepare(size)
        self.gpu = None
        self.gpu = self._gpu_tensor(size)
        return info

    def recv(self) -> Any:
        import torch

        self.view = self.slot.recv(self.timeout)
        host = torch.from_dlpack(self.view)
        self.pins.pin(host)  # each slot buffer once (a warm-up transfer), until the next size
        self.gpu.copy_(host)
        self._sync()  # in GPU memory before it counts as received
        return self.gpu

    def s_prepare(self, size: int, info: dict[str, Any]) -> Any:
        self.pins.clear()  # before super() frees the previous staging Block
        self.host = None
        self.host = super().s_prepare(size, info)  # the senders and the host Block, viewed by torch
        self.pins.pin(self.host)
        self.gpu = self._gpu_tensor(size)
        return self.gpu

    def _stage(self) -> None:
        self.host.copy_(self.gpu)
        self._sync()  # on the host before the send reads it

    def transfer(self) -> None:
        self._stage()
        super().transfer()

    def post(self) -> None:
        self._stage()  # the previous send's request completed: the Block is free to rewrite
        super().post()

    def r_close(self) -> None:
        try:
            self.pins.clear()
        finally:
            super().r_close()

    def s_close(self) -> None:
        try:
            self.pins.clear()
        finally:
            super().s_close()


class CudaGloo(_Cuda, Gloo):
    """gloo send/recv of a GPU tensor through pinned host copies (gloo has no
    send/recv for CUDA tensors)."""

    buf: Any  # torch tensors (None while a size's are dropped)
    gpu: Any
    tensor: Any

    def r_prepare(self, size: int) -> dict[str, Any]:
        self.buf = self.gpu = None
        self.buf = self._host_tensor(size)  # what gloo receives into, reused
        self.gpu = self._gpu_tensor(size)
        return {}

    def recv(self) -> Any:
        self.dist.recv(self.buf, src=0)
        self.gpu.copy_(self.buf)
        self._sync()
        return self.gpu

    def s_prepare(self, size: int, info: dict[str, Any]) -> Any:
        self.tensor = self.gpu = None
        self.tensor = self._host_tensor(size)  # what Gloo.post sends
        self.gpu = self._gpu_tensor(size)
        return self.gpu

    def post(self) -> None:
        self.tensor.copy_(self.gpu)
        self._sync()
        super().post()


class CudaIpc(_Cuda, Socket):
    """The anchor: a copy into the receiver's GPU buffer through CUDA IPC."""

    name = "cuda_ipc"
    fixed_transport = "cuda-ipc"
    # Stream passes: the receiver still acks, and the sender waits for the
    # previous ack before it overwrites the one buffer (a depth-1 slot).
    stream_ack = "after"
    buf: Any  # torch tensors (None while a size's are dropped)
    dst: Any
    src: Any

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        self.unacked = 0

    def r_prepare(self, size: int) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        self.buf = None
        self.buf = self._gpu_tensor(size).zero_()
        self._sync()  # zeroed before the sender writes into it
        # (rebuild function, arguments): plain picklable values holding the IPC handle
        return {"ipc": reduce_tensor(self.buf)}

    def recv(self) -> Any:
        if self.sock.recv(1) != b"n":
            raise ConnectionError("cuda_ipc: the sender closed the connection")
        return self.buf  # the sender's copy completed before it wrote the byte

    def r_close(self) -> None:
        self.buf = None
        super().r_close()

    def s_prepare(self, size: int, info: dict[str, Any]) -> Any:
        rebuild, args = info["ipc"]
        self.dst = self.src = None
        self.dst = rebuild(*args)  # the receiver's buffer, opened here through its IPC handle
        self.src = self._gpu_tensor(size)
        return self.src

    def _read_ack(self) -> None:
        if self.sock.recv(1) != b"k":
            raise ConnectionError("cuda_ipc: the receiver closed the connection")

    def _copy(self) -> float:
        while self.unacked:  # a stream pass's acks: the receiver is done with its buffer
            self._read_ack()
            self.unacked -= 1
        clock = time.perf_counter
        t0 = clock()
        self.dst.copy_(self.src)
        self._sync()
        return clock() - t0

    def transfer(self) -> float:
        own = self._copy()
        self.sock.sendall(b"n")
        self._read_ack()
        return own

    def post(self) -> None:
        self._copy()
        self.sock.sendall(b"n")
        self.unacked += 1

    def s_close(self) -> None:
        self.dst = self.src = None
        super().s_close()
