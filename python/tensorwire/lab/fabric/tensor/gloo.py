"""The gloo series: torch.distributed send/recv over TCP on loopback."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..common import BenchError
from .base import DTYPE, HOST, ITEM, Series


class Gloo(Series):
    """torch.distributed with the gloo backend (TCP on loopback)."""

    name = "gloo"
    fixed_transport = "tcp"
    requires = ("torch", "torch")

    def _init(self, port: int, rank: int) -> None:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
        import datetime

        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            raise BenchError("this torch has no gloo backend")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{HOST}:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=self.timeout),
        )
        self.dist = dist

    def s_open(self, info: dict[str, Any]) -> dict[str, Any]:
        from ....ranks.launch import free_port

        self.port = free_port(HOST)  # gloo's store binds it in s_connect
        return {"port": self.port}

    def s_connect(self) -> None:
        import torch

        self._init(self.port, 0)
        self.ack_t = torch.zeros(1)

    def r_connect(self, info: dict[str, Any]) -> None:
        import torch

        torch.set_num_threads(1)  # the receiver's work is numpy's max-reduction
        self._init(int(info["port"]), 1)
        self.ack_t = torch.zeros(1)

    def r_prepare(self, size: int) -> dict[str, Any]:
        import torch

        self.buf = torch.zeros(size // ITEM, dtype=torch.float32)  # reused for every transfer
        return {}

    def recv(self) -> np.ndarray:
        self.dist.recv(self.buf, src=0)
        return self.buf.numpy()

    def ack(self) -> None:
        self.dist.send(self.ack_t, dst=0)

    def s_prepare(self, size: int, info: dict[str, Any]) -> np.ndarray:
        import torch

        arr = np.empty(size // ITEM, DTYPE)
        self.tensor = torch.from_numpy(arr)
        return arr

    def transfer(self) -> None:
        self.post()
        self.dist.recv(self.ack_t, src=1)

    def post(self) -> None:
        self.dist.send(self.tensor, dst=1)

    def r_close(self) -> None:
        if getattr(self, "dist", None) is not None and self.dist.is_initialized():
            self.dist.destroy_process_group()

    s_close = r_close
