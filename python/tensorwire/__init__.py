"""tensorwire: zero-copy one-sided tensor transport over UCX (RDMA, TCP, shared memory).

Quick start::

    import numpy as np, tensorwire as tw
    with tw.Device() as server, tw.Device() as client:
        dst = server.empty((1024,), "float32"); server.publish("dst", dst)
        src = client.empty((1024,), "float32"); np.asarray(src)[:] = 1
        ch = client.connect(server.address)
        ch.write(src, ch.lookup("dst")).wait(); ch.flush().wait()
"""

from __future__ import annotations

from typing import Any, Sequence

from . import _core
from .errors import (ConnectionError, Error, InvalidArgument, NotFound, PeerFailed,  # noqa: A004
                     PoolExhausted, ProtocolMismatch, Timeout)

__version__ = "0.1.0"

Block = _core.Block
Registration = _core.Registration
RemoteRegion = _core.RemoteRegion
Channel = _core.Channel
Request = _core.Request
parse_descriptor = _core.parse_descriptor

# dtype name -> (DLPack type code, bits, buffer-protocol format)
_DTYPES = {
    "float16": (2, 16, "e"), "float32": (2, 32, "f"), "float64": (2, 64, "d"),
    "bfloat16": (4, 16, "H"),  # no buffer-protocol code: numpy sees raw uint16
    "int8": (0, 8, "b"), "int16": (0, 16, "h"), "int32": (0, 32, "i"), "int64": (0, 64, "q"),
    "uint8": (1, 8, "B"), "uint16": (1, 16, "H"), "uint32": (1, 32, "I"), "uint64": (1, 64, "Q"),
    "bool": (6, 8, "?"),
}
_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "bool_": "bool",
            "long": "int64", "int": "int32", "short": "int16"}


def dtype_name(dtype: Any) -> str:
    """Normalises a dtype given as a string, a numpy dtype or a torch dtype."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    elif not isinstance(dtype, str):
        import numpy as np
        name = np.dtype(dtype).name
    name = _ALIASES.get(name, name)
    if name not in _DTYPES:
        raise InvalidArgument(f"unsupported dtype {dtype!r}; supported: {', '.join(sorted(_DTYPES))}")
    return name


def _pointer_of(obj: Any) -> tuple[int, int]:
    """(address, nbytes) of a C-contiguous array-like; raises InvalidArgument otherwise."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):  # torch.Tensor
        if not obj.is_contiguous():
            raise InvalidArgument("register needs a contiguous tensor")
        if obj.device.type != "cpu":
            raise InvalidArgument(f"register of {obj.device.type} tensors needs a GPU-enabled build")
        return obj.data_ptr(), obj.numel() * obj.element_size()
    import numpy as np
    arr = np.asarray(obj) if not isinstance(obj, np.ndarray) else obj
    if not arr.flags.c_contiguous:
        raise InvalidArgument("register needs a C-contiguous array")
    if not arr.flags.writeable:
        raise InvalidArgument("register needs writable memory")
    return arr.__array_interface__["data"][0], arr.nbytes


class Device(_core.Device):
    """A local endpoint of the fabric.

    Args:
        host, port: where to listen (port 0 picks one); ``address`` tells peers.
        workers: UCP workers, each with a progress thread (the paper's CQs).
        progress: "blocking" (default: poll, then sleep on the event fd),
            "polling" (spin; lowest latency, one core per worker) or "inline"
            (no threads; waiters drive progress).
        transport: "auto" (UCX_TLS as set), "tcp", "shm" or "rdma".
        token: shared secret; peers with another token are refused.
        pool_limit, slab_size: registered memory pool bounds (bytes).
        map_shared_memory: with a same-host peer whose region a shared-memory
            transport maps, write/read are a memcpy in the calling thread
            (default True; False posts every operation to UCX).
    """

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def alloc(self, nbytes: int, alignment: int = 64) -> Block:
        """A block of ``nbytes`` registered bytes (uint8 view)."""
        if nbytes <= 0:
            raise InvalidArgument(f"nbytes must be > 0, got {nbytes}")
        return self.alloc_view([int(nbytes)], 1, 8, "B", alignment)

    def empty(self, shape: int | Sequence[int], dtype: Any = "float32", alignment: int = 64) -> Block:
        """An uninitialised tensor in registered memory; view it with
        ``numpy.asarray(block)``, ``numpy.from_dlpack(block)`` or ``torch.from_dlpack(block)``."""
        if isinstance(shape, int):
            shape = (shape,)
        code, bits, fmt = _DTYPES[dtype_name(dtype)]
        return self.alloc_view([int(s) for s in shape], code, bits, fmt, alignment)

    def register(self, array: Any) -> Registration:
        """Registers an existing C-contiguous array/tensor (kept alive by the result)."""
        ptr, nbytes = _pointer_of(array)
        reg = self.register_memory(ptr, nbytes)
        reg._keepalive = array
        return reg

    def connect(self, address: str, lane: int = 0) -> Channel:
        """A channel to the device at ``host:port`` on ``lane``."""
        ch = super().connect(address, lane)
        ch._device = self
        return ch

    def channel_to(self, peer_id: int, lane: int = 0) -> Channel:
        """A channel back to a peer that connected to us."""
        ch = super().channel_to(peer_id, lane)
        ch._device = self
        return ch

    def static_slot(self, name: str, shape: int | Sequence[int], dtype: Any = "float32", depth: int = 2,
                    first_seq: int = 1) -> "_core.StaticSlot":
        """Receiver side of static placement: `depth` buffers of `shape`/`dtype`
        in registered memory, published as `name` (see tensorwire.slots)."""
        if isinstance(shape, int):
            shape = (shape,)
        code, bits, _ = _DTYPES[dtype_name(dtype)]
        return _core.StaticSlot(self, name, [int(s) for s in shape], code, bits, depth, first_seq)

    def dynamic_slot(self, name: str, max_ndim: int = 8, max_nbytes: int = 1 << 32) -> "_core.DynamicSlot":
        """Receiver side of dynamic allocation: tensors of any shape up to `max_ndim`
        dimensions and `max_nbytes` bytes (see tensorwire.slots)."""
        return _core.DynamicSlot(self, name, max_ndim, max_nbytes)


from . import slots as _slots  # noqa: E402

Channel.static_sender = _slots._static_sender
Channel.dynamic_sender = _slots._dynamic_sender
StaticSlot = _core.StaticSlot
DynamicSlot = _core.DynamicSlot

__all__ = [
    "Device", "Block", "Registration", "RemoteRegion", "Channel", "Request", "parse_descriptor",
    "Error", "InvalidArgument", "Timeout", "ConnectionError", "PeerFailed", "PoolExhausted",
    "ProtocolMismatch", "NotFound", "dtype_name", "StaticSlot", "DynamicSlot",
]
