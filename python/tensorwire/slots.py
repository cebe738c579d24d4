"""Tensor slots: static placement and dynamic allocation (the paper's
RdmaSend/RdmaRecv and RdmaSendDyn/RdmaRecvDyn).

Receiver::

    slot = device.static_slot("grad", (1024, 1024), "float32", depth=2)
    view = slot.recv(timeout=5)      # zero-copy numpy view of the received tensor
    ...consume view...
    slot.release(view)               # tells the sender the buffer is free again

Sender::

    sender = channel.static_sender("grad")
    sender.send(block).wait()        # a Block from device.empty(): zero copy
    sender.send(numpy_array).wait()  # anything else: copied into the pool (path="copy")
                                     # or registered in place (path="register")

Dynamic slots take tensors of any shape and dtype::

    dslot = device.dynamic_slot("sparse")          # receiver
    block = dslot.recv(timeout=5)                  # a Block with shape and dtype
    channel.dynamic_sender("sparse").send(t).wait()  # completes on the receiver's ack
"""

from __future__ import annotations

import asyncio
import math
import numbers
from typing import Any, overload

from . import _core
from .errors import InvalidArgument, Timeout

PATHS = ("copy", "register")


def _check_path(path: Any) -> str:
    if path not in PATHS:
        raise InvalidArgument(f"path must be one of {PATHS}, got {path!r}")
    return path


@overload
def _check_timeout(timeout: None) -> None: ...
@overload
def _check_timeout(timeout: float) -> float: ...
def _check_timeout(timeout: Any) -> float | None:
    """A sender's timeout: seconds >= 0 (inf allowed) or None (no bound)."""
    if timeout is None:
        return None
    if type(timeout) is float or type(timeout) is int:  # the common case, without the ABC check below
        if timeout != timeout or timeout < 0:
            raise InvalidArgument(f"timeout must be >= 0 seconds or None (forever), got {timeout!r}")
        return float(timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):  # numpy floats are Real
        raise InvalidArgument(f"timeout must be a number of seconds or None, got {timeout!r}")
    timeout = float(timeout)
    if math.isnan(timeout) or timeout < 0:
        raise InvalidArgument(f"timeout must be >= 0 seconds or None (forever), got {timeout!r}")
    return timeout


def _gpu_memory_of(tensor: Any) -> str | None:
    """ "cuda:N" for a torch tensor on GPU N, else None (host memory)."""
    device: Any = getattr(tensor, "device", None)
    if getattr(device, "type", None) == "cuda":
        return f"cuda:{device.index or 0}"
    return None


def _nbytes_of(tensor: Any) -> int:
    return int(tensor.nbytes) if hasattr(tensor, "nbytes") else tensor.numel() * tensor.element_size()


def _spec_of(tensor: Any) -> tuple[list[int], str]:
    """(shape, dtype name) of a numpy array or torch tensor."""
    from . import dtype_name

    shape = [int(s) for s in tensor.shape]
    return shape, dtype_name(tensor.dtype)


class _Sender:
    """Shared logic of static and dynamic senders. A tensor that is not in a
    Block is handed to the core, which copies it into the sender's staging
    block (path="copy") or registers it in place (path="register"); here is
    only where a Python tensor's bytes are."""

    def __init__(self, core, device, path: str) -> None:
        self._core = core
        self._device = device
        self.path = _check_path(path)

    def _outside(self, tensor: Any) -> tuple[int, int, Any]:
        """(address, gpu or -1, owner) of the tensor's bytes, contiguous: for
        path="copy" a non-contiguous tensor is made contiguous first (the core
        copies it at once); path="register" takes only memory that stays put."""
        from . import Registration, cuda_pointer_of, pointer_of

        if isinstance(tensor, Registration):
            raise InvalidArgument("send(registration) needs a typed tensor: pass the registered array itself")
        gpu = _gpu_memory_of(tensor)
        if gpu is not None:
            # The stream contract (docs/contracts.md §1.1): UCX reads the tensor
            # outside torch's streams, so the kernels writing it must be done.
            import torch

            torch.cuda.current_stream(tensor.device).synchronize()
            if self.path == "copy":
                tensor = tensor.contiguous()
            found = cuda_pointer_of(tensor)
            assert found is not None  # a tensor in GPU memory (above)
            address, _, owner = found
            return address, int(gpu.split(":")[1]), owner
        if self.path == "copy":
            if hasattr(tensor, "data_ptr"):  # torch
                tensor = tensor.contiguous()
                return tensor.data_ptr(), -1, tensor
            import numpy as np

            arr = np.ascontiguousarray(tensor)
            return arr.__array_interface__["data"][0], -1, arr
        address, _, owner = pointer_of(tensor)
        return address, -1, owner

    def send(self, tensor: Any, timeout: float | None = 10.0):
        """Sends `tensor`; returns a Request (see the class docs for when it
        completes). Every wait of the call is bounded by `timeout` in all
        (None: no bound); past it, Timeout."""
        if isinstance(tensor, _core.Block):
            return self._core.send_block(tensor, timeout)  # the binding checks the timeout
        from . import DTYPE_TABLE

        timeout = _check_timeout(timeout)
        shape, name = _spec_of(tensor)
        code, bits, _ = DTYPE_TABLE[name]
        if _nbytes_of(tensor) == 0:
            address, gpu, owner = 0, -1, None
        else:
            address, gpu, owner = self._outside(tensor)
        return self._core.send_outside(address, gpu, shape, code, bits, self.path, timeout, owner)

    def stats(self) -> dict:
        return self._core.stats()

    @property
    def region(self):
        """The slot's memory at the receiver (a RemoteRegion), exported to this
        sender alone by its attach (a static slot's buffers, a dynamic slot's record)."""
        return self._core.region


class StaticSender(_Sender):
    """Sender of a static slot. `send()` refuses a tensor of another shape or
    dtype before writing (or copying) anything, and waits (bounded by
    `timeout`) while the buffer it would overwrite has not been released by
    the receiver. The request completes when the local bytes may be reused."""

    def wait_consumed(self, seq: int, timeout: float | None = 10.0) -> None:
        self._core.wait_consumed(seq, timeout)

    @property
    def sent(self) -> int:
        return self._core.sent

    @property
    def consumed(self) -> int:
        return self._core.consumed

    @property
    def shape(self) -> list[int]:
        return self._core.shape

    @property
    def dtype(self) -> str:
        return self._core.dtype


class DynamicSender(_Sender):
    """Sender of a dynamic slot: any shape and dtype. The request completes on
    the receiver's ack (the tensor may then be reused or freed) and fails if
    the receiver refused the record."""


# The arguments are checked before the core sender attaches: a slot takes one
# sender, so a sender refused after attaching would leave the slot taken.


def _static_sender(channel, name: str, path: str = "copy", timeout: float | None = 10.0) -> StaticSender:
    """A sender for the static slot `name` on this channel's peer."""
    path, timeout = _check_path(path), _check_timeout(timeout)
    device = channel._device
    return StaticSender(_core.StaticSender(channel, name, timeout), device, path)


def _dynamic_sender(channel, name: str, path: str = "copy", timeout: float | None = 10.0) -> DynamicSender:
    """A sender for the dynamic slot `name` on this channel's peer."""
    path, timeout = _check_path(path), _check_timeout(timeout)
    device = channel._device
    return DynamicSender(_core.DynamicSender(channel, name, timeout), device, path)


# How long one executor wait of recv_async lasts. Not a liveness check (the
# C++ wait fails by itself as soon as the slot's sender dies): a thread cannot
# be interrupted, so this bounds how long a cancelled recv_async leaves its
# executor thread waiting (never forever: the default executor's threads are
# joined at exit, and a thread still waiting would also hold the slot).
_ASYNC_SLICE_S = 0.25


async def _recv_async(slot, timeout: float | None = None):
    """Awaits the next tensor without blocking the event loop: a thread of the
    default executor waits (tw.wait_any, GIL released; it consumes nothing),
    then the tensor is taken on the loop's thread, so a cancelled await loses
    no tensor."""
    out = slot.poll()
    if out is not None:
        return out
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + _check_timeout(timeout)
    while True:
        left = _ASYNC_SLICE_S if deadline is None else min(_ASYNC_SLICE_S, max(0.0, deadline - loop.time()))
        try:
            await loop.run_in_executor(None, _core.wait_any, [slot], left)
        except Timeout:
            if deadline is not None and loop.time() >= deadline:
                raise Timeout(f"no tensor within {timeout} s") from None
            continue
        # Ready: recv returns at once (or says why it cannot: a static slot
        # holding `depth` tensors is ready too, and poll() would spin on None).
        return slot.recv(timeout=0)
