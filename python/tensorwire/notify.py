"""Notifications: ``channel.write(..., notify=b"...")`` delivers a small message
to the target once the written data is visible there (NIXL users rely
on such notifications).

Not an RPC (``tensorwire/notify.h``): each sending device gets, on first use, its
own static slot at the target (64 entries of 256 bytes, made by the target's
``tw.notify`` call handler); a notification is a static-slot send on the same
channel as the data: entry, fence, sequence word, so the target sees it only
after the data. In the message form (tcp) the target places the data when it
arrives, so the write waits for its data to land before the notification goes.

A device takes notifications from its start (its inbox is made with it), so a
peer may notify it before it ever looks. Each sender's slot is a bounded queue:
at most 64 unread notifications of at most 252 bytes. A write with notify= to
a target that holds 64 unread ones of this sender waits up to 1 s for the
target to read one, then raises ``PoolExhausted`` naming the bound before any
of its data moves; the queued notifications stay.

Target::

    for peer_id, message in device.notifications(): ...   # what has arrived, in order per sender
    peer_id, message = await device.next_notification(timeout=5)
"""

from __future__ import annotations

import asyncio

from .errors import Timeout

# How long one executor wait of next_notification lasts. Not a liveness check
# (an inbox takes notifications from any sender; none of them failing ends its
# wait): a thread cannot be interrupted, so this bounds how long a cancelled
# await leaves its executor thread waiting (the default executor's threads are
# joined at exit).
_SLICE_S = 0.25


def _pending(device) -> list:
    """Notifications a wait took but did not hand out yet (they come one at a time)."""
    items = getattr(device, "_notify_pending", None)
    if items is None:
        items = device._notify_pending = []
    return items


def notifications(device) -> list[tuple[int, bytes]]:
    items = _pending(device)
    out, items[:] = list(items), []
    return out + device.take_notifications()


async def next_notification(device, timeout: float | None) -> tuple[int, bytes]:
    """The next notification without blocking the event loop: an executor thread
    waits in short slices (a cancelled await leaves no thread waiting long and
    loses nothing: what a slice took waits in the pending list)."""
    items = _pending(device)
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while not items:
        left = _SLICE_S if deadline is None else min(_SLICE_S, deadline - loop.time())
        if left <= 0:
            raise Timeout(f"no notification within {timeout} s")
        try:
            items.extend(await loop.run_in_executor(None, device.wait_notifications, left))
        except Timeout:
            continue
    return items.pop(0)


def close(device) -> None:
    """Forgets what a wait took but did not hand out (Device.close; the core
    closes the inbox with the device)."""
    items = getattr(device, "_notify_pending", None)
    if items:
        items.clear()
