"""The series of `tensorwire bench tensor` by name: the one place that picks a
series class from its name (the CLI's --series, the receiver process, the
harness), in the order the table and the plot list them."""

from __future__ import annotations

from .base import Series
from .gloo import Gloo
from .grpc_call import Grpc
from .slots import Copy, Dynamic, ZeroCopy
from .tcp_socket import Socket
from .ucx import RpcUcx, UcxTag

SERIES: dict[str, type[Series]] = {c.name: c for c in (ZeroCopy, Dynamic, Copy, RpcUcx, Grpc, Socket, UcxTag, Gloo)}
SERIES_ORDER = tuple(SERIES)  # ("zerocopy", "dynamic", "copy", "rpc-ucx", "grpc", "socket", "ucx-tag", "gloo")


def select_series(text: str | None) -> list[str]:
    if not text:
        return list(SERIES_ORDER)
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SERIES]
    if bad:
        raise ValueError(f"unknown series {', '.join(bad)}; choose from {', '.join(SERIES_ORDER)}")
    return [s for s in SERIES_ORDER if s in names]
