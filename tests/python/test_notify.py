"""Notifications (issue 19): channel.write(..., notify=b"...") delivers a small
message to the target after the data is visible there: exactly once, in order,
through the fenced tail-flag of a static slot (not an RPC)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import tensorwire as tw
from _peers import notify_target, pattern
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
            view[k * size:(k + 1) * size] = pattern(size, k)
            reqs.append(ch.write(src, remote, local_offset=k * size, remote_offset=k * size, nbytes=size,
                                 notify=str(k)))
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
        with pytest.raises(tw.NotFound, match="takes no notifications yet"):
            ch.write(src, remote, notify=b"early")
        assert target.notifications() == []  # opens it
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
