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
from .errors import (
    ConnectionError,
    Error,
    InvalidArgument,
    NotFound,
    PeerFailed,  # noqa: A004
    PoolExhausted,
    ProtocolMismatch,
    Timeout,
)

__version__ = "0.1.0"

Block = _core.Block
Registration = _core.Registration
RemoteRegion = _core.RemoteRegion
Channel = _core.Channel
Request = _core.Request
parse_descriptor = _core.parse_descriptor

# dtype name -> (DLPack type code, bits, buffer-protocol format): the core's table
# (bfloat16's format is its raw 16-bit word: the buffer protocol has no code for it)
DTYPE_TABLE = {name: (code, bits, fmt) for name, code, bits, fmt in _core.dtypes()}
_ALIASES = {
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "bool_": "bool",
    "long": "int64",
    "int": "int32",
    "short": "int16",
}


_MAX_BYTES = 1 << 62  # the largest tensor or region (as the core's TensorSpec)


def _size_arg(value: Any, what: str) -> int:
    """An integer argument (Python or numpy int); InvalidArgument naming it otherwise."""
    import operator

    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{what} must be an integer, got {value!r} ({type(value).__name__})") from None


def dtype_name(dtype: Any) -> str:
    """Normalises a dtype given as a string, a numpy dtype or a torch dtype."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch.") :]
    elif not isinstance(dtype, str):
        import numpy as np

        name = np.dtype(dtype).name
    name = _ALIASES.get(name, name)
    if name not in DTYPE_TABLE:
        raise InvalidArgument(f"unsupported dtype {dtype!r}; supported: {', '.join(sorted(DTYPE_TABLE))}")
    return name


_REGISTER_INSTEAD = (
    "pass a numpy array (np.asarray(x)), a CPU torch tensor, a bytearray, or a Block from device.empty()"
)


def _gpu_of(memory: Any) -> int:
    """The GPU ordinal of a ``memory=`` argument: -1 for "host", N for "cuda"/"cuda:N"."""
    if memory == "host" or memory == "cpu":
        return -1
    if isinstance(memory, str) and (memory == "cuda" or memory.startswith("cuda:")):
        index = memory[len("cuda:") :] if ":" in memory else "0"
        if index.isdigit():
            return int(index)
    raise InvalidArgument(f"memory must be 'host', 'cuda' or 'cuda:N', got {memory!r}")


def cuda_info() -> dict:
    """What the CUDA driver offers this process: ``available``, ``reason`` (when not),
    ``driver_version`` and ``devices`` (names). Needs no CUDA at build time."""
    return _core.cuda_info()


def cuda_available() -> bool:
    """Whether GPU memory can be allocated and registered (a driver and a GPU)."""
    return bool(_core.cuda_info()["available"])


def cuda_pointer_of(obj: Any) -> tuple[int, int, Any] | None:
    """(address, nbytes, owner) of a C-contiguous tensor in GPU memory, or None
    when `obj` is not GPU memory: torch CUDA tensors, objects with the CUDA array
    interface (CuPy, Numba) and DLPack producers on a CUDA device."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous") and hasattr(obj, "device"):
        if obj.device.type != "cuda":
            return None
        if not obj.is_contiguous():
            raise InvalidArgument("register needs a contiguous tensor (call .contiguous() first)")
        if obj.numel() == 0:
            raise InvalidArgument("register needs at least one byte, got an empty tensor")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        import math

        shape = tuple(cai["shape"])
        itemsize = int(cai["typestr"][2:])
        strides = cai.get("strides")
        if strides is not None:
            expect, contiguous = itemsize, True
            for dim, stride in zip(reversed(shape), reversed(strides)):
                contiguous = contiguous and (dim == 1 or stride == expect)
                expect *= dim
            if not contiguous:
                raise InvalidArgument("register needs a C-contiguous array")
        nbytes = math.prod(shape) * itemsize
        if nbytes == 0:
            raise InvalidArgument("register needs at least one byte, got an empty array")
        return int(cai["data"][0]), nbytes, obj
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None and dev()[0] == 2:  # kDLCUDA: view it through torch, which reads any DLPack producer
        try:
            import torch
        except ImportError:
            raise InvalidArgument(
                "register of a DLPack CUDA tensor other than torch/CuPy needs torch to read it"
            ) from None
        found = cuda_pointer_of(torch.from_dlpack(obj))  # a torch CUDA tensor: found
        assert found is not None
        return found[:2] + (obj,)
    return None


def _register_refusal(obj: Any, why: str) -> InvalidArgument:
    return InvalidArgument(
        f"register needs memory that outlives the registration, but a {type(obj).__name__} object "
        f"{why}; {_REGISTER_INSTEAD}"
    )


def _address_of(arr: Any) -> int:
    return arr.__array_interface__["data"][0]


def pointer_of(obj: Any) -> tuple[int, int, Any]:
    """(address, nbytes, owner) of memory that `obj` owns and that stays put
    while `owner` lives; raises InvalidArgument for anything numpy would copy
    (the registration would then point at a temporary freed at once)."""
    if isinstance(obj, (bytes, str)):
        raise _register_refusal(obj, "is immutable (numpy would register a temporary copy of it)")
    if obj is None or isinstance(obj, (list, tuple, dict, set, int, float, complex)):
        raise _register_refusal(obj, "has no buffer of its own (numpy would register a temporary copy of it)")
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):  # torch.Tensor
        if not obj.is_contiguous():
            raise InvalidArgument("register needs a contiguous tensor")
        if obj.device.type != "cpu":
            raise InvalidArgument(f"register takes CPU and CUDA tensors, not {obj.device.type} ones")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj
    import numpy as np

    owner: Any  # what keeps the memory alive: obj, or obj with the view taken of it
    if isinstance(obj, np.ndarray):
        arr, owner = obj, obj
    else:
        try:
            view = memoryview(obj)  # buffer protocol: bytearray, array.array, mmap, memoryview, Block
        except TypeError:
            view = None
        if view is not None:
            if view.readonly:
                raise InvalidArgument(
                    f"register needs writable memory, but this {type(obj).__name__} is read-only; {_REGISTER_INSTEAD}"
                )
            if not view.c_contiguous:
                raise InvalidArgument("register needs a C-contiguous buffer")
            if view.nbytes == 0:
                raise InvalidArgument("register needs at least one byte, got an empty buffer")
            # The held export also stops a bytearray from resizing (moving) under the registration.
            arr, owner = np.frombuffer(view, dtype=np.uint8), (obj, view)
        elif hasattr(obj, "__dlpack__"):
            try:
                arr = np.from_dlpack(obj)  # a view; it holds the producer's memory
            except (BufferError, RuntimeError, TypeError, ValueError) as e:
                raise InvalidArgument(
                    f"register cannot view this {type(obj).__name__} through DLPack (CPU memory only): {e}"
                ) from None
            owner = (obj, arr)
        elif hasattr(obj, "__array_interface__") or hasattr(obj, "__array_struct__") or hasattr(obj, "__array__"):
            arr = np.asarray(obj)
            # Two conversions at one address: the memory is obj's own, not a copy made per call.
            if arr.dtype == object or arr.size == 0 or _address_of(np.asarray(obj)) != _address_of(arr):
                raise _register_refusal(obj, "converts to a fresh numpy copy each time")
            owner = (obj, arr)
        else:
            raise _register_refusal(obj, "exposes no memory (no buffer protocol, DLPack or array interface)")
    if arr.dtype == object:
        raise InvalidArgument("register cannot register an array of Python objects (dtype=object)")
    if not arr.flags.c_contiguous:
        raise InvalidArgument("register needs a C-contiguous array")
    if not arr.flags.writeable:
        raise InvalidArgument("register needs writable memory")
    return _address_of(arr), arr.nbytes, owner


class Device(_core.Device):
    """A local endpoint of the fabric.

    Args:
        host, port: where to listen (port 0 picks one); ``address`` tells peers.
        workers: UCP workers, each with a progress thread (the paper's CQs).
        progress: "blocking" (default: poll, then sleep on the event fd),
            "polling" (spin; lowest latency, one core per worker) or "inline"
            (no threads; waiters drive progress).
        transport: "auto" (UCX_TLS as set), "tcp", "shm" or "rdma". A named transport is a
            promise: if UCX does not offer it here, the Device fails with InvalidArgument
            naming what is missing (never a silent fall-back to another transport).
        require: more transport families the device must offer ("cuda", or a list such as
            ["rdma", "cuda"]), checked the same way. ``channel.transports()`` tells which UCX
            transports a channel's endpoint actually uses.
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

    def close(self) -> None:
        """Fails pending work, closes connections, stops threads. Blocks stay readable."""
        from . import notify

        notify.close(self)
        super().close()

    def notifications(self) -> list[tuple[int, bytes]]:
        """Notifications that arrived (``channel.write(..., notify=...)`` of peers): a list of
        (sender device id, message), in order per sender; never blocks. A device takes
        notifications from its start; each sender may have 64 unread here (contracts §1)."""
        from . import notify

        return notify.notifications(self)

    async def next_notification(self, timeout: float | None = None) -> tuple[int, bytes]:
        """Awaits the next notification: (sender device id, message). Timeout after `timeout` s."""
        from . import notify

        return await notify.next_notification(self, timeout)

    def alloc(self, nbytes: int, alignment: int = 64, memory: str = "host") -> Block:
        """A block of ``nbytes`` registered bytes (uint8 view) in host memory, or
        in GPU memory with ``memory="cuda"`` / ``"cuda:N"`` (the device's CUDA arena)."""
        n = _size_arg(nbytes, "nbytes")
        if n <= 0:
            raise InvalidArgument(f"nbytes must be > 0, got {n}")
        if n > _MAX_BYTES:
            raise InvalidArgument(f"nbytes {n} is too large (at most 2**62)")
        return self.alloc_view([n], 1, 8, "B", alignment, _gpu_of(memory))

    def empty(
        self, shape: int | Sequence[int], dtype: Any = "float32", alignment: int = 64, memory: str = "host"
    ) -> Block:
        """An uninitialised tensor in registered memory; view it with
        ``numpy.asarray(block)``, ``numpy.from_dlpack(block)`` or ``torch.from_dlpack(block)``.
        ``memory="cuda"`` (or ``"cuda:N"``) puts it in GPU memory: ``torch.from_dlpack(block)``
        is then a CUDA tensor with no copy (numpy cannot view it)."""
        code, bits, fmt = DTYPE_TABLE[dtype_name(dtype)]
        # checks the shape (overflow included)
        return self.alloc_view(shape, code, bits, fmt, alignment, _gpu_of(memory))

    def register(self, array: Any) -> Registration:
        """Registers the memory of an existing C-contiguous, writable numpy array, torch tensor
        (CPU or CUDA), CuPy array, DLPack producer or buffer (bytearray, mmap, ...); the result
        keeps it alive. GPU memory is registered by its whole allocation, so the tensors of one
        allocator segment share one registration. Objects with no memory of their own (list,
        tuple, bytes, str) are refused: numpy would register a copy."""
        gpu = cuda_pointer_of(array)
        if gpu is not None:
            ptr, nbytes, owner = gpu
            reg = self.register_memory(ptr, nbytes, True)
            setattr(reg, "_keepalive", owner)  # an instance attribute (nb::dynamic_attr), not in the stub
            return reg
        ptr, nbytes, owner = pointer_of(array)
        reg = self.register_memory(ptr, nbytes)
        setattr(reg, "_keepalive", owner)  # the memory lives as long as the Registration
        return reg

    def connect(self, address: str, lane: int = 0) -> Channel:
        """A channel to the device at ``host:port`` on ``lane``."""
        ch = super().connect(address, lane)
        setattr(ch, "_device", self)  # an instance attribute (nb::dynamic_attr), not in the stub
        return ch

    def channel_to(self, peer_id: int, lane: int = 0) -> Channel:
        """A channel back to a peer that connected to us."""
        ch = super().channel_to(peer_id, lane)
        setattr(ch, "_device", self)
        return ch

    def static_slot(
        self,
        name: str,
        shape: int | Sequence[int],
        dtype: Any = "float32",
        depth: int = 2,
        first_seq: int = 1,
        memory: str = "host",
    ) -> "_core.StaticSlot":
        """Receiver side of static placement: `depth` buffers of `shape`/`dtype`
        in registered memory, published as `name` (see tensorwire.slots).
        ``memory="cuda"``: the buffers are GPU memory and ``recv()`` returns a DLPack
        array on the GPU; the sequence words stay in host memory."""
        code, bits, _ = DTYPE_TABLE[dtype_name(dtype)]
        return _core.StaticSlot(self, name, shape, code, bits, depth, first_seq, _gpu_of(memory))

    def dynamic_slot(
        self, name: str, max_ndim: int = 8, max_nbytes: int = 1 << 32, memory: str = "host"
    ) -> "_core.DynamicSlot":
        """Receiver side of dynamic allocation: tensors of any shape up to `max_ndim`
        dimensions and `max_nbytes` bytes (see tensorwire.slots). ``memory="cuda"``:
        each tensor is allocated in the GPU's arena and read there."""
        return _core.DynamicSlot(self, name, max_ndim, max_nbytes, _gpu_of(memory))


# Device(transport=...): the one list every command's --transport offers.
TRANSPORTS = ("auto", "tcp", "shm", "rdma")

StaticSlot = _core.StaticSlot
DynamicSlot = _core.DynamicSlot
wait_any = _core.wait_any  # which of several slots/requests/words is ready (releases the GIL)
Word = _core.Word  # a flag word a peer writes, for wait_any

__all__ = [
    "Device",
    "Block",
    "Registration",
    "RemoteRegion",
    "Channel",
    "Request",
    "parse_descriptor",
    "Error",
    "InvalidArgument",
    "Timeout",
    "ConnectionError",
    "PeerFailed",
    "PoolExhausted",
    "ProtocolMismatch",
    "NotFound",
    "dtype_name",
    "StaticSlot",
    "DynamicSlot",
    "wait_any",
    "Word",
    "cuda_info",
    "cuda_available",
    "TRANSPORTS",
]
