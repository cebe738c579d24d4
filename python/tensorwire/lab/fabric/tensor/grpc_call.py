"""The gRPC series: a unary call over loopback TCP (grpcio)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np

from ..common import BenchError
from .base import DTYPE, HOST, ITEM, Series, decode_meta, encode_meta

GRPC_METHOD = "/tensorwire.lab.fabric.Tensor/Send"
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.enable_http_proxy", 0),
]  # loopback only: never through a proxy


class Grpc(Series):
    """gRPC unary call with raw-bytes (generic) handlers: no protoc."""

    name = "grpc"
    fixed_transport = "tcp"
    requires = ("grpc", "grpcio")

    def r_open(self) -> dict[str, Any]:
        import grpc
        from concurrent import futures

        self._lock = threading.Condition()
        self._consume: Callable[[np.ndarray], None] | None = None
        self._left = 0
        self._error: str | None = None
        handler = grpc.method_handlers_generic_handler(
            "tensorwire.lab.fabric.Tensor", {"Send": grpc.unary_unary_rpc_method_handler(self._handle)}
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), handlers=[handler], options=GRPC_OPTIONS)
        port = self.server.add_insecure_port(f"{HOST}:0")
        self.server.start()
        return {"port": port}

    def _handle(self, request: bytes, context) -> bytes:
        dt, shape, off = decode_meta(request)
        arr = np.frombuffer(request, dtype=dt, offset=off).reshape(shape)  # a view of the request bytes
        with self._lock:
            # The sender starts right after posting "serve": wait until serve() is in.
            self._lock.wait_for(lambda: self._consume is not None, self.timeout)
            consume = self._consume
        try:
            if consume is None:
                raise BenchError("a request arrived outside serve()")
            consume(arr)
        except Exception as e:
            with self._lock:
                self._error = f"{type(e).__name__}: {e}"
        with self._lock:
            self._left -= 1
            self._lock.notify_all()
        return b"ok"

    def serve(self, count: int, consume: Callable[[np.ndarray], None], stream: bool = False) -> None:
        # a unary call returns after the handler: stream passes are serial for gRPC
        with self._lock:
            self._consume, self._left = consume, count
            self._lock.notify_all()
            seen, last = count, time.monotonic()
            while self._left > 0 and self._error is None:
                if self._left != seen:
                    seen, last = self._left, time.monotonic()
                elif time.monotonic() - last > self.timeout:
                    raise TimeoutError(f"grpc: {self._left} of {count} requests did not arrive")
                self._lock.wait(0.5)
            self._consume = None
            if self._error:
                raise BenchError(self._error)

    def r_close(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.stop(None)

    def s_open(self, info: dict[str, Any]) -> dict[str, Any]:
        import grpc

        self.channel = grpc.insecure_channel(f"{HOST}:{info['port']}", options=GRPC_OPTIONS)
        self.call = self.channel.unary_unary(GRPC_METHOD)  # no serializers: raw bytes
        return {}

    def s_connect(self) -> None:
        import grpc

        grpc.channel_ready_future(self.channel).result(timeout=self.timeout)

    def s_prepare(self, size: int, info: dict[str, Any]) -> np.ndarray:
        self.tensor = np.empty(size // ITEM, DTYPE)
        return self.tensor

    def transfer(self) -> None:
        t = self.tensor
        request = b"".join((encode_meta(t), t.data.cast("B")))  # serialization: one copy
        self.call(request, timeout=self.timeout)

    def s_close(self) -> None:
        if getattr(self, "channel", None) is not None:
            self.channel.close()
