"""The plain-socket series: TCP from Python's socket module on loopback."""

from __future__ import annotations

import socket
from typing import Any

import numpy as np

from .base import DTYPE, HOST, ITEM, START_TIMEOUT_S, Series


class Socket(Series):
    """A plain TCP socket (Python's socket module) on loopback."""

    name = "socket"
    fixed_transport = "tcp"

    @staticmethod
    def _nodelay(sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the 1-byte ack must not wait

    def r_open(self) -> dict[str, Any]:
        self.listener = socket.create_server((HOST, 0))
        self.listener.settimeout(START_TIMEOUT_S + self.timeout)
        return {"port": self.listener.getsockname()[1]}

    def r_connect(self, info: dict[str, Any]) -> None:
        self.sock, _ = self.listener.accept()
        self.listener.close()
        self.sock.settimeout(self.timeout)
        self._nodelay(self.sock)

    def r_prepare(self, size: int) -> dict[str, Any]:
        self.buf = np.empty(size // ITEM, DTYPE)  # reused for every transfer
        self.bytes = self.buf.data.cast("B")
        return {}

    def recv(self) -> np.ndarray:
        got, n = 0, len(self.bytes)
        while got < n:
            k = self.sock.recv_into(self.bytes[got:])
            if k == 0:
                raise ConnectionError("socket: the sender closed the connection")
            got += k
        return self.buf

    def ack(self) -> None:
        self.sock.sendall(b"k")

    def r_close(self) -> None:
        for attr in ("sock", "listener"):
            if getattr(self, attr, None) is not None:
                getattr(self, attr).close()

    def s_open(self, info: dict[str, Any]) -> dict[str, Any]:
        self.port = int(info["port"])
        return {}

    def s_connect(self) -> None:
        self.sock = socket.create_connection((HOST, self.port), timeout=self.timeout)
        self._nodelay(self.sock)

    def s_prepare(self, size: int, info: dict[str, Any]) -> np.ndarray:
        self.tensor = np.empty(size // ITEM, DTYPE)
        self.bytes = self.tensor.data.cast("B")
        return self.tensor

    def transfer(self) -> float | None:
        self.post()
        if self.sock.recv(1) != b"k":
            raise ConnectionError("socket: the receiver closed the connection")
        return None

    def post(self) -> None:
        self.sock.sendall(self.bytes)

    def s_close(self) -> None:
        if getattr(self, "sock", None) is not None:
            self.sock.close()
