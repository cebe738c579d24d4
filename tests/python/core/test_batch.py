"""Batched transfers (issue 19): one call posts many (local, remote, offsets,
length) transfers and returns one Request; every item is checked before any
is posted."""

from __future__ import annotations

import numpy as np
import pytest

import tensorwire as tw
from _peers import crc, pattern
from conftest import TRANSPORTS, call_json, remote_crc, start_server

N = 1000
ITEM = 4096


@pytest.fixture(scope="module", params=TRANSPORTS)
def server(request):
    with start_server(request.param, {"region": N * ITEM}) as peer:
        peer.transport = request.param
        yield peer


def test_a_batch_of_1000_writes_then_reads(server):
    with tw.Device(transport=server.transport) as dev:
        ch = dev.connect(server.address)
        call_json(ch, "zero", name="region")
        remote = ch.lookup("region")
        src, dst = dev.alloc(N * ITEM), dev.alloc(N * ITEM)
        data = pattern(N * ITEM, seed=7)
        np.asarray(src)[:] = data
        # item i moves local block i to remote block N-1-i (reversed: the offsets matter)
        ch.write_batch([(src, remote, i * ITEM, (N - 1 - i) * ITEM, ITEM) for i in range(N)]).wait(60)
        ch.flush().wait(60)
        expect = data.reshape(N, ITEM)[::-1].reshape(-1)
        assert remote_crc(ch, "region", 0, N * ITEM) == crc(expect)
        ch.read_batch([(dst, remote, i * ITEM, i * ITEM, ITEM) for i in range(N)]).wait(60)
        assert crc(np.asarray(dst)) == crc(expect)


def test_a_bad_item_refuses_the_whole_batch_before_posting(server):
    with tw.Device(transport=server.transport) as dev:
        ch = dev.connect(server.address)
        call_json(ch, "zero", name="region")
        remote = ch.lookup("region")
        src = dev.alloc(ITEM)
        np.asarray(src)[:] = 1
        items = [(src, remote, 0, i * ITEM) for i in range(10)]
        with pytest.raises(tw.InvalidArgument, match="write_batch item 10: the local region holds 4096 bytes"):
            ch.write_batch(items + [(src, remote, 0, N * ITEM)])  # no room for the whole source
        with pytest.raises(
            tw.InvalidArgument, match="write_batch item 10: nbytes 4096 at remote_offset 4095900 exceeds"
        ):
            ch.write_batch(items + [(src, remote, 0, N * ITEM - 100, ITEM)])
        with pytest.raises(tw.InvalidArgument, match="batch item 0: expected a tuple"):
            ch.write_batch([src])
        with pytest.raises(tw.InvalidArgument, match="batch item 0: the second field must be a RemoteRegion"):
            ch.write_batch([(src, src)])
        ch.flush().wait(10)
        assert remote_crc(ch, "region", 0, 10 * ITEM) == crc(np.zeros(10 * ITEM, np.uint8))  # nothing was posted
        assert ch.write_batch([]).done()  # an empty batch is complete at once
