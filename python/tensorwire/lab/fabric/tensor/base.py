"""The common ground of every series of `tensorwire bench tensor`: the constants,
the tensor's contents and header, and the Series base class (the protocol
each series implements on both sides)."""

from __future__ import annotations

import importlib.util
import struct
from typing import Any, Callable

import numpy as np

HOST = "127.0.0.1"
DEFAULT_SIZES = "1K:256M"
DTYPE = np.float32
ITEM = 4
START_TIMEOUT_S = 60.0
STREAM_FROM = 1 << 20  # stream passes and the memcpy anchor from this size up
WRITE_ANCHOR_FROM = 16 << 20  # the one-sided write anchor from this size up


# --- tensor contents --------------------------------------------------------------------------


def fill_pattern(out: np.ndarray) -> None:
    """Deterministic values in [0, 1) (both sides can rebuild them)."""
    step = 1 << 20
    for i in range(0, out.size, step):
        j = min(out.size, i + step)
        out[i:j] = (np.arange(i, j, dtype=np.uint32) % 997).astype(DTYPE) / DTYPE(997)


def encode_meta(arr: np.ndarray) -> bytes:
    """Header of a serialized tensor: dtype string, ndim, shape."""
    dt = arr.dtype.str.encode()
    return struct.pack(f"<B{len(dt)}sB{arr.ndim}Q", len(dt), dt, arr.ndim, *arr.shape)


def decode_meta(buf) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, header length) of encode_meta's bytes at the start of `buf`."""
    mv = memoryview(buf)
    n = mv[0]
    dt = np.dtype(bytes(mv[1 : 1 + n]).decode())
    ndim = mv[1 + n]
    shape = struct.unpack_from(f"<{ndim}Q", mv, 2 + n)
    return dt, tuple(shape), 2 + n + 8 * ndim


# --- the series -------------------------------------------------------------------------------


class Series:
    """One way of moving a tensor. Receiver methods (r_*, serve, recv, ack)
    run in the spawned receiver process, sender methods (s_*, transfer) in
    the benchmark process. `cfg` holds transport, timeout, max_size, spin_us.

    Set-up order: r_open -> s_open(info) -> [r_connect(info) || s_connect()]
    (concurrently: some joins block until both sides are in); then per size
    r_prepare(size) -> s_prepare(size, info); serve(count) || transfer() x count."""

    name = ""
    fixed_transport: str | None = None  # series that ignore --transport (always tcp)
    # Stream passes (no per-transfer bench ack): when the receiver still acks.
    # "after" the consumption (static slots: release is the flow control),
    # "before" it (an RPC returns once the server has the bytes) or "none".
    stream_ack = "none"
    # Also the transfer-only stream pass and the one-sided write and memcpy
    # anchors (needs write_bandwidth): zerocopy, the series the bars judge.
    anchors = False
    # An optional package the series needs: (import name, pip name), or None.
    requires: tuple[str, str] | None = None

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.timeout = float(cfg["timeout"])

    @classmethod
    def unavailable(cls) -> str | None:
        """Why the series cannot run here (checked in the sender), or None."""
        if cls.requires is not None and importlib.util.find_spec(cls.requires[0]) is None:
            return f"{cls.requires[1]} is not installed (pip install {cls.requires[1]})"
        return None

    # receiver side
    def r_open(self) -> dict[str, Any]:
        return {}

    def r_connect(self, info: dict[str, Any]) -> None:
        pass

    def r_prepare(self, size: int) -> dict[str, Any]:
        return {}

    def serve(self, count: int, consume: Callable[[np.ndarray], None], stream: bool = False) -> None:
        for _ in range(count):
            arr = self.recv()
            if stream and self.stream_ack == "before":
                self.ack()
            consume(arr)
            del arr
            if not stream or self.stream_ack == "after":
                self.ack()

    def recv(self) -> np.ndarray:
        raise NotImplementedError

    def ack(self) -> None:
        raise NotImplementedError

    def r_close(self) -> None:
        pass

    # sender side
    def s_open(self, info: dict[str, Any]) -> dict[str, Any]:
        return {}

    def s_connect(self) -> None:
        pass

    def s_prepare(self, size: int, info: dict[str, Any]) -> Any:
        """Makes the tensor to send and returns a view of it (to fill): a numpy
        array, or for --memory cuda a torch tensor on the GPU."""
        raise NotImplementedError

    # The sender's tensor between transfers, untimed: filled once per size,
    # stamped before each send (--refresh rewrites it from a snapshot first).
    # A GPU series overrides these with torch and synchronises in stamp().
    def fill(self, view: Any) -> None:
        fill_pattern(view)

    def stamp(self, view: Any, k: int) -> None:
        view[0] = 1.0 + k

    def snapshot(self, view: Any) -> Any:
        return view.copy()

    def restore(self, view: Any, fresh: Any) -> None:
        np.copyto(view, fresh)

    def make_checker(self, size: int, count: int, verify: bool, reduce: bool, serial: bool) -> Any:
        """Receiver: the consumption and checks of one serve, or None for the
        harness's numpy checker (GPU series consume a torch tensor)."""
        return None

    def transfer(self) -> float | None:
        """Sends the tensor and returns when the receiver's ack arrived. A
        series that times its own one-way part (the cuda_ipc anchor: the copy
        into the peer's memory) returns those seconds; the others None."""
        raise NotImplementedError

    def post(self) -> None:
        """Stream passes: sends the tensor and returns as soon as the series'
        own protocol lets the sender go on (no bench ack)."""
        self.transfer()

    # the anchors (a series with anchors = True)

    def drive(self, stop: Callable[[], bool]) -> None:
        """Receiver: progresses the transport until stop() (the one-sided write anchor's target)."""
        raise NotImplementedError

    def write_bandwidth(self, size: int, count: int) -> float | None:
        """Sender: MB/s of plain one-sided writes of the tensor to the receiver, or None."""
        raise NotImplementedError

    def s_close(self) -> None:
        pass
