"""The series of `tensorwire bench tensor` by name: the one place that picks a
series class from its name and memory (the CLI's --series and --memory, the
receiver process, the harness), in the order the table and the plot list them."""

from __future__ import annotations

from .base import Series
from .cuda import CudaDynamic, CudaGloo, CudaIpc, CudaZeroCopy, Staged
from .gloo import Gloo
from .grpc_call import Grpc
from .slots import Copy, Dynamic, ZeroCopy
from .tcp_socket import Socket
from .ucx import RpcUcx, UcxTag

SERIES: dict[str, type[Series]] = {c.name: c for c in (ZeroCopy, Dynamic, Copy, RpcUcx, Grpc, Socket, UcxTag, Gloo)}
SERIES_ORDER = tuple(SERIES)  # ("zerocopy", "dynamic", "copy", "rpc-ucx", "grpc", "socket", "ucx-tag", "gloo")
# --memory cuda: the tensor starts and ends in GPU memory (tensorwire.lab.fabric.tensor.cuda)
CUDA_SERIES: dict[str, type[Series]] = {c.name: c for c in (CudaZeroCopy, CudaDynamic, Staged, CudaGloo, CudaIpc)}
MEMORIES = {"host": SERIES, "cuda": CUDA_SERIES}


def series_order(memory: str = "host") -> tuple[str, ...]:
    return tuple(MEMORIES[memory])


def series_class(name: str, memory: str = "host") -> type[Series]:
    return MEMORIES[memory][name]


def select_series(text: str | None, memory: str | None = "host") -> list[str]:
    """The series named in `text` (all of `memory`'s when empty), in table
    order. memory=None accepts a name of any memory (the parser's check,
    which runs before --memory is known)."""
    if memory is None:
        order = tuple(dict.fromkeys(n for series in MEMORIES.values() for n in series))
    else:
        order = series_order(memory)
    if not text:
        return list(order)
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in order]
    if bad:
        if memory is not None and all(any(s in series for series in MEMORIES.values()) for s in bad):
            raise ValueError(
                f"series {', '.join(bad)} not available with --memory {memory}; choose from {', '.join(order)}"
            )
        raise ValueError(f"unknown series {', '.join(bad)}; choose from {', '.join(order)}")
    return [s for s in order if s in names]
