"""The raw UCX baselines: an RPC over active messages (rpc-ucx) and tagged
send/recv (ucx-tag), on their own context and worker."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import DTYPE, ITEM, Series, decode_meta, encode_meta

TAG_DATA = 0x7457_0001
TAG_ACK = 0x7457_0002


class _UcxSeries(Series):
    """Raw UCX on its own context/worker (tensorwire._core.UcxBaseline)."""

    def _baseline(self):
        from .... import _core

        return _core.UcxBaseline(self.cfg["transport"], int(self.cfg["spin_us"]), True)

    @classmethod
    def unavailable(cls) -> str | None:
        from .... import _core

        return None if hasattr(_core, "UcxBaseline") else "this build has no UcxBaseline (rebuild tensorwire)"

    def r_open(self) -> dict[str, Any]:
        self.ucx = self._baseline()
        # Receive buffer, reused: a user of UCX would preallocate it.
        self.buf = np.empty(max(64, int(self.cfg["max_size"])), np.uint8)
        self.ack_buf = np.zeros(1, np.uint64)
        self.buf[:] = 0  # touch the pages outside the timed loop
        return {"address": self.ucx.address}

    def r_connect(self, info: dict[str, Any]) -> None:
        self.ucx.connect(info["address"])

    def s_open(self, info: dict[str, Any]) -> dict[str, Any]:
        self.ucx = self._baseline()
        self.ucx.connect(info["address"])
        self.ack_buf = np.zeros(1, np.uint64)
        return {"address": self.ucx.address}

    def s_prepare(self, size: int, info: dict[str, Any]) -> np.ndarray:
        self.tensor = np.empty(size // ITEM, DTYPE)
        return self.tensor

    def r_close(self) -> None:
        if getattr(self, "ucx", None) is not None:
            self.ucx.close()

    s_close = r_close


class RpcUcx(_UcxSeries):
    name = "rpc-ucx"
    stream_ack = "before"

    def recv(self) -> np.ndarray:
        header, nbytes = self.ucx.am_recv(self.buf.ctypes.data, self.buf.nbytes, self.timeout)
        dt, shape, _ = decode_meta(header)
        return self.buf[:nbytes].view(dt).reshape(shape)

    def ack(self) -> None:
        self.ucx.am_reply(b"ok", self.timeout)

    def transfer(self) -> None:
        t = self.tensor
        self.ucx.am_request(encode_meta(t), t.ctypes.data, t.nbytes, self.timeout)


class UcxTag(_UcxSeries):
    name = "ucx-tag"

    def recv(self) -> np.ndarray:
        n = self.ucx.tag_recv(self.buf.ctypes.data, self.buf.nbytes, TAG_DATA, self.timeout)
        return self.buf[:n].view(DTYPE)  # the type is agreed, as with MPI datatypes

    def ack(self) -> None:
        self.ucx.tag_send(self.ack_buf.ctypes.data, 8, TAG_ACK, self.timeout)

    def transfer(self) -> None:
        self.post()
        self.ucx.tag_recv(self.ack_buf.ctypes.data, 8, TAG_ACK, self.timeout)

    def post(self) -> None:
        t = self.tensor
        self.ucx.tag_send(t.ctypes.data, t.nbytes, TAG_DATA, self.timeout)
