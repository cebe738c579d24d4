"""Notifications (issue 19): channel.write(..., notify=b"...") delivers a small
message to the target after the data is visible there: exactly once, in order,
through the fenced tail-flag of a static slot (not an RPC). A device takes them
from its start, into a bounded queue per sender whose overflow the sender is
told of (issue 36)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import tensorwire as tw
from _peers import notify_target, pattern, quiet_target
from conftest import TRANSPORTS, PeerProcess

COUNT = 200  # more than the 64 entries a sender may have unread: the flow control runs too


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("size", [8, 64 << 10], ids=["8B", "64KiB"])
def test_notifications_arrive_once_in_order_after_their_data(transport, size):
    with PeerProcess(notify_target, transport, COUNT, size) as peer, tw.Device(transport=transport) as dev:
        ch = dev.connect(peer.address)
        remote = ch.lookup("region")
        src = dev.alloc(COUNT * size)
        view = np.asarray(src)
        reqs = []
        for k in range(COUNT):
            view[k * size : (k + 1) * size] = pattern(size, k)
            reqs.append(
                ch.write(src, remote, local_offset=k * size, remote_offset=k * size, nbytes=size, notify=str(k))
            )
        for r in reqs:
            r.wait(30)
        out = peer.recv(90)
        assert out["got"] == list(range(COUNT)), "lost, duplicated or reordered notifications"
        assert out["late_data"] == [], "a notification arrived before its data"
        assert out["senders"] == [dev.id]


def test_notification_api_in_one_process():
    with tw.Device() as target, tw.Device() as sender:
        dst = target.alloc(64)
        target.publish("x", dst)
        ch = sender.connect(target.address)
        remote = ch.lookup("x")
        src = sender.alloc(64)
        with pytest.raises(tw.InvalidArgument, match="at most 252 bytes"):
            ch.write(src, remote, notify=b"x" * 253)
        with pytest.raises(tw.InvalidArgument, match="notify must be bytes or str"):
            ch.write(src, remote, notify=3.5)
        ch.write(src, remote, notify="text").wait(5)
        ch.write(src, remote, notify=b"").wait(5)
        assert target.notifications() == [(sender.id, b"text"), (sender.id, b"")]
        ch.write(src, remote, notify=b"later").wait(5)
        assert asyncio.run(target.next_notification(timeout=5)) == (sender.id, b"later")
        with pytest.raises(tw.Timeout):
            asyncio.run(target.next_notification(timeout=0.1))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_notifications_before_the_target_ever_looks_are_delivered_once_it_does(transport):
    """The race of two processes: the sender notifies a target that has not yet
    called notifications(); each notification waits there and arrives once."""
    with PeerProcess(quiet_target, transport, 64) as peer, tw.Device(transport=transport) as dev:
        ch = dev.connect(peer.address)
        remote = ch.lookup("region")
        src = dev.alloc(64)
        for k in range(5):
            np.asarray(src)[k] = k + 1
            ch.write(src, remote, local_offset=k, remote_offset=k, nbytes=1, notify=b"early %d" % k).wait(10)
        out = peer.request({"take": 5}, 30)  # only now does the target look
        assert out["got"] == [[dev.id, f"early {k}"] for k in range(5)]
        assert out["data"] == [1, 2, 3, 4, 5], "a notification arrived before its data"
        assert out["again"] == [], "a notification arrived twice"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_full_queue_is_an_error_at_the_sender_and_loses_nothing(transport):
    """64 unread notifications of one sender fill its queue at the target: the
    65th write raises PoolExhausted naming the bound (within about 1 s, not a
    hang), moves none of its data, and every queued notification is still
    delivered, in order; once the target reads, the sender goes on."""
    depth = 64
    with tw.Device(transport=transport) as target, tw.Device(transport=transport) as sender:
        dst = target.alloc(depth + 2)
        np.asarray(dst)[:] = 0
        target.publish("x", dst)
        ch = sender.connect(target.address)
        remote = ch.lookup("x")
        src = sender.alloc(depth + 2)
        np.asarray(src)[:] = 7
        for k in range(depth):
            ch.write(src, remote, local_offset=k, remote_offset=k, nbytes=1, notify=str(k)).wait(10)
        start = time.monotonic()
        with pytest.raises(
            tw.PoolExhausted,
            match=r"queue for this device is full: 64 unread notifications, "
            r"the bound per sending device \(each at most 252 bytes\)",
        ):
            ch.write(src, remote, local_offset=depth, remote_offset=depth, nbytes=1, notify=b"one too many")
        assert time.monotonic() - start < 5, "a full queue must fail fast, not hang"
        ch.flush().wait(10)
        assert np.asarray(dst)[depth] == 0, "the refused write moved its data"
        got = target.notifications()
        assert got == [(sender.id, str(k).encode()) for k in range(depth)], "a queued notification was lost"
        ch.write(src, remote, local_offset=depth + 1, remote_offset=depth + 1, nbytes=1, notify=b"room again").wait(10)
        assert asyncio.run(target.next_notification(timeout=10)) == (sender.id, b"room again")
        assert np.asarray(dst)[depth + 1] == 7


def test_a_closed_device_takes_no_notifications():
    dev = tw.Device()
    dev.close()
    with pytest.raises(tw.ConnectionError, match="closed"):
        dev.notifications()
    with pytest.raises(tw.ConnectionError, match="closed"):
        asyncio.run(dev.next_notification(timeout=1))
