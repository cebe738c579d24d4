"""Notifications: ``channel.write(..., notify=b"...")`` delivers a small message
to the target once the written data is visible there (issue 19; NIXL users
rely on such notifications).

Not an RPC: each sending device gets, on first use, its own static slot at the
target (``tw.notify/<sender id>``: ``DEPTH`` entries of ``ENTRY`` bytes, made by
the target's ``tw.notify`` call handler). A notification is a static-slot send
on the same channel as the data: entry, fence, sequence word, so the target
sees it only after the data (docs/contracts.md §10.1). In the message form
(tcp) the data is placed by the target when it arrives, so the write waits for
its data to land before the notification goes.

Target::

    for peer_id, message in device.notifications(): ...   # what has arrived, in order per sender
    peer_id, message = await device.next_notification(timeout=5)
"""

from __future__ import annotations

import asyncio
import struct
import threading
import time
from typing import Any

from .errors import InvalidArgument, NotFound, Timeout

ENTRY = 256                  # bytes per notification entry: u32 length + the message
MAX_MESSAGE = ENTRY - 4
DEPTH = 64                   # entries a sender may have unread at the target
_CALL = "tw.notify"
_HEADER = struct.Struct("<I")


def _message(notify: Any) -> bytes:
    """The notification as bytes, checked before anything is written."""
    if isinstance(notify, str):
        notify = notify.encode()
    try:
        message = bytes(notify)
    except TypeError:
        raise InvalidArgument(f"notify must be bytes or str, got {type(notify).__name__}") from None
    if len(message) > MAX_MESSAGE:
        raise InvalidArgument(f"notify takes at most {MAX_MESSAGE} bytes, got {len(message)}")
    return message


class _Outbox:
    """A channel's sending side: the static sender to its target's notification
    slot, and one staging Block per entry (a Block is sent with no copy)."""

    def __init__(self, channel) -> None:
        try:
            name = channel.call(_CALL, b"", 10.0).decode()
        except NotFound:
            raise NotFound("the target takes no notifications yet: it accepts them once it calls "
                           "device.notifications() or device.next_notification()") from None
        self.send_block = channel.static_sender(name)._core.send_block  # Blocks go with no copy
        device = channel._device
        self.blocks = [device.alloc(ENTRY) for _ in range(DEPTH)]
        self.views = [memoryview(b).cast("B") for b in self.blocks]
        self.pending: list = [None] * DEPTH
        self.next = 0

    def send(self, message: bytes):
        k = self.next % DEPTH
        self.next += 1
        last = self.pending[k]
        if last is not None and not last.done():
            last.wait(10.0)  # the entry's last send still reads this block
        view = self.views[k]
        _HEADER.pack_into(view, 0, len(message))
        view[4:4 + len(message)] = message
        self.pending[k] = req = self.send_block(self.blocks[k], 10.0)
        return req


def _send(channel, message: bytes) -> None:
    outbox = getattr(channel, "_notify_outbox", None)
    if outbox is None:
        outbox = channel._notify_outbox = _Outbox(channel)
    outbox.send(message)


class Inbox:
    """A device's notifications: one static slot per sending device, made when
    that device first notifies (the ``tw.notify`` call)."""

    def __init__(self, device) -> None:
        self._device = device
        self._slots: dict[int, Any] = {}
        self._lock = threading.Lock()
        device.on_call(_CALL, self._attach, with_caller=True)

    def _attach(self, caller: int, payload: bytes) -> bytes:
        name = f"{_CALL}/{caller:x}"
        with self._lock:
            if caller not in self._slots:
                self._slots[caller] = self._device.static_slot(name, (ENTRY,), "uint8", depth=DEPTH)
        return name.encode()

    def take(self) -> list[tuple[int, bytes]]:
        """Every notification that has arrived: (sender device id, message), in
        order per sender. Never blocks."""
        with self._lock:
            slots = list(self._slots.items())
        out = []
        for peer, slot in slots:
            while (view := slot.poll()) is not None:
                n = _HEADER.unpack_from(view, 0)[0]
                out.append((peer, bytes(view[4:4 + min(n, MAX_MESSAGE)])))
                slot.release(view)
        return out

    def wait(self, timeout: float | None) -> list[tuple[int, bytes]]:
        """Waits (bounded) until at least one notification arrived; returns them all."""
        from . import _core
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            got = self.take()
            if got:
                return got
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                raise Timeout(f"no notification within {timeout} s")
            with self._lock:
                slots = list(self._slots.values())
            if not slots:  # no sender yet: nothing to wait on but time
                time.sleep(min(left, 0.01))
                continue
            try:
                _core.wait_any(slots, left)  # slices: a sender's first notification makes a new slot
            except Timeout:
                pass

    def close(self) -> None:
        self._device.on_call(_CALL, None)  # the handler held this inbox (and the device)
        with self._lock:
            self._slots.clear()


def inbox(device) -> Inbox:
    box = getattr(device, "_notify_inbox", None)
    if box is None:
        box = device._notify_inbox = Inbox(device)
    return box


def _pending(device) -> list[tuple[int, bytes]]:
    """Notifications a wait took but did not hand out yet (they come one at a time)."""
    items = getattr(device, "_notify_pending", None)
    if items is None:
        items = device._notify_pending = []
    return items


def notifications(device) -> list[tuple[int, bytes]]:
    items = _pending(device)
    out, items[:] = list(items), []
    return out + inbox(device).take()


async def next_notification(device, timeout: float | None) -> tuple[int, bytes]:
    """The next notification without blocking the event loop: an executor thread
    waits in short slices (a cancelled await leaves no thread waiting long and
    loses nothing: what a slice took waits in the pending list)."""
    items = _pending(device)
    box = inbox(device)
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while not items:
        left = 0.25 if deadline is None else min(0.25, deadline - loop.time())
        if left <= 0:
            raise Timeout(f"no notification within {timeout} s")
        try:
            items.extend(await loop.run_in_executor(None, box.wait, left))
        except Timeout:
            continue
    return items.pop(0)
