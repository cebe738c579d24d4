"""The tensorwire series: static slots (zerocopy, copy) and the dynamic slot,
over one inline-progress Device per side; their GPU forms (cuda.py) change
only where the memory lives and how it is viewed."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from .base import DTYPE, HOST, ITEM, WRITE_ANCHOR_FROM, Series


def _slot_api_missing(device_attr: str, channel_attr: str) -> str | None:
    """None when the lead's slot API (Device.<device_attr>, Channel.<channel_attr>) is there."""
    try:
        import tensorwire as tw
    except ImportError as e:  # pragma: no cover
        return f"tensorwire does not import: {e}"
    missing = [f"Device.{device_attr}"] if not hasattr(tw.Device, device_attr) else []
    if not hasattr(tw.Channel, channel_attr):
        missing.append(f"Channel.{channel_attr}")
    if missing:
        return f"the slot API is not in this build ({', '.join(missing)} missing)"
    return None


class _TwSeries(Series):
    """Common part of the tensorwire series: one inline-progress Device per side."""

    memory = "host"  # where the slots and the sender's Block live ("cuda": --memory cuda)
    # Set by the steps, and None between sizes and after a close (numpy arrays or torch
    # tensors, tensorwire objects): declared, not set, so that an unset one stays unset.
    dev: Any
    ch: Any
    view: Any
    slot: Any
    serial_slot: Any
    stream_slot: Any
    sender: Any
    stream_sender: Any
    tensor: Any

    def _where(self) -> dict[str, Any]:
        """The keyword that places a slot or Block in self.memory (none for
        host memory: the host bench's calls stay as they were)."""
        return {} if self.memory == "host" else {"memory": self.memory}

    def _view(self, block) -> Any:
        """The array the harness fills or the receiver consumes, viewing `block`."""
        return np.asarray(block)

    def _device(self):
        import tensorwire as tw

        return tw.Device(
            host=HOST,
            transport=self.cfg["transport"],
            progress=self.cfg.get("progress", "inline"),
            spin_us=int(self.cfg["spin_us"]),
        )

    def r_open(self) -> dict[str, Any]:
        self.dev = self._device()
        return {"address": self.dev.address}

    def s_open(self, info: dict[str, Any]) -> dict[str, Any]:
        self.dev = self._device()
        self.address = info["address"]
        return {}

    def s_connect(self) -> None:
        self.ch = self.dev.connect(self.address)

    def drive(self, stop: Callable[[], bool]) -> None:
        """Receiver: progress the device until stop() (one-sided traffic over
        tcp needs the target's progress; cma over shm does not)."""
        while True:
            for _ in range(256):
                self.dev.progress()
            if stop():
                return

    def r_close(self) -> None:
        for attr in ("view", "block", "slot", "dslot", "anchor"):
            setattr(self, attr, None)
        if getattr(self, "dev", None) is not None:
            self.dev.close()

    def s_close(self) -> None:
        for attr in ("sender", "tensor", "ch"):
            setattr(self, attr, None)
        if getattr(self, "dev", None) is not None:
            self.dev.close()


class StaticSeries(_TwSeries):
    """tensorwire static slot (zerocopy: Block from device.empty; copy: numpy array)."""

    registered = True
    path = "copy"
    stream_ack = "after"

    @classmethod
    def unavailable(cls) -> str | None:
        return _slot_api_missing("static_slot", "static_sender")

    def r_prepare(self, size: int) -> dict[str, Any]:
        # Two slots: depth 1 for the serial pass (one tensor in flight: one
        # receive buffer, as ucx-tag's), depth 2 for the stream pass (the
        # sender writes tensor k+1 while the receiver consumes tensor k).
        # A depth-2 slot in the serial pass alternates two buffers: twice the
        # receiver's working set (8 MiB tensors: 16 MiB of a 32 MiB L3).
        self.view = None
        self.slot = self.serial_slot = self.stream_slot = None  # the previous size's slots go first
        name = f"bench.tensor.{self.name}.{size}"
        self.serial_slot = self.dev.static_slot(name, (size // ITEM,), "float32", depth=1, **self._where())
        self.stream_slot = self.dev.static_slot(name + ".stream", (size // ITEM,), "float32", depth=2, **self._where())
        return {"name": name, "stream_name": name + ".stream"}

    def serve(self, count: int, consume: Callable[[np.ndarray], None], stream: bool = False) -> None:
        self.slot = self.stream_slot if stream else self.serial_slot
        super().serve(count, consume, stream)

    def recv(self) -> Any:
        self.view = self.slot.recv(self.timeout)
        return self._view(self.view)

    def ack(self) -> None:
        view, self.view = self.view, None
        self.slot.release(view)

    def s_prepare(self, size: int, info: dict[str, Any]) -> Any:
        self.sender = self.stream_sender = None
        self.tensor = None
        self.sender = self.ch.static_sender(info["name"], path=self.path)
        self.stream_sender = self.ch.static_sender(info["stream_name"], path=self.path)
        if self.registered:
            self.tensor = self.dev.empty((size // ITEM,), "float32", **self._where())
            return self._view(self.tensor)
        self.tensor = np.empty(size // ITEM, DTYPE)
        return self.tensor

    def transfer(self) -> None:
        self.sender.send(self.tensor).wait(self.timeout)
        self.sender.wait_consumed(self.sender.sent, self.timeout)

    def post(self) -> None:
        # waits only if the buffer it would overwrite is not released yet (depth 2)
        self.stream_sender.send(self.tensor).wait(self.timeout)


class ZeroCopy(StaticSeries):
    name = "zerocopy"
    registered = True
    anchors = True

    def r_prepare(self, size: int) -> dict[str, Any]:
        info = super().r_prepare(size)
        self.anchor = None
        if size >= WRITE_ANCHOR_FROM:  # a plain region for the one-sided write anchor
            self.anchor = self.dev.empty((size // ITEM,), "float32", **self._where())
            info["anchor"] = info["name"] + ".anchor"
            self.dev.publish(info["anchor"], self.anchor)
        return info

    def s_prepare(self, size: int, info: dict[str, Any]) -> Any:
        self.anchor_name = info.get("anchor")
        return super().s_prepare(size, info)

    def write_bandwidth(self, size: int, count: int) -> float | None:
        """MB/s of plain one-sided writes of the same block into a region of
        the same receiver (two in flight, then a flush): the bar the slot's
        streaming rate is held to."""
        if not self.anchor_name:
            return None
        remote = self.ch.lookup(self.anchor_name, self.timeout)
        # untimed first write: a mapped region faults its pages in on first touch
        self.ch.write(self.tensor, remote).wait(self.timeout)
        self.ch.flush().wait(self.timeout)
        clock = time.perf_counter
        pending = []
        t0 = clock()
        for _ in range(count):
            pending.append(self.ch.write(self.tensor, remote))
            if len(pending) > 2:
                pending.pop(0).wait(self.timeout)
        for r in pending:
            r.wait(self.timeout)
        self.ch.flush().wait(self.timeout)
        return count * size / (clock() - t0) / 1e6


class Copy(StaticSeries):
    name = "copy"
    registered = False


class Dynamic(_TwSeries):
    """tensorwire dynamic slot; the sender's tensor is in registered memory."""

    name = "dynamic"
    SLOT = "bench.tensor.dynamic"
    stream_ack = "after"  # ack() only drops the block: the slot acked the read already

    @classmethod
    def unavailable(cls) -> str | None:
        return _slot_api_missing("dynamic_slot", "dynamic_sender")

    def r_open(self) -> dict[str, Any]:
        info = super().r_open()
        self.dslot = self.dev.dynamic_slot(self.SLOT, max_ndim=8, **self._where())
        return info

    def recv(self) -> Any:
        self.block = self.dslot.recv(self.timeout)  # the sender was acked when this returns
        return self._view(self.block)

    def ack(self) -> None:
        self.block = None  # frees the received block

    def s_connect(self) -> None:
        super().s_connect()
        self.sender = self.ch.dynamic_sender(self.SLOT)

    def s_prepare(self, size: int, info: dict[str, Any]) -> Any:
        self.tensor = None
        self.tensor = self.dev.empty((size // ITEM,), "float32", **self._where())
        return self._view(self.tensor)

    def transfer(self) -> None:
        self.sender.send(self.tensor).wait(self.timeout)
