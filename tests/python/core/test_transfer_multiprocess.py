"""One-sided transfers to a server in another process, over tcp and shm.

The server (tests/python/_peers.py:serve) publishes zeroed regions and checks
contents on its side through call handlers (crc32), or fills them with a
pattern the client reads back and verifies.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tensorwire as tw
from _peers import crc, pattern
from conftest import TRANSPORTS, call_json, remote_crc, start_server

MiB = 1 << 20
REGION = 64 * MiB
SIZES = [1, 1 << 10, 64 << 10, 1 * MiB, 16 * MiB, 64 * MiB]
SERVER_WORKERS = 2


@pytest.fixture(scope="module", params=TRANSPORTS)
def server(request):
    """One server process per transport for the whole module."""
    with start_server(request.param, {"region": REGION, "small": 4096, "other": 12345}, workers=SERVER_WORKERS) as peer:
        peer.transport = request.param
        yield peer


@pytest.fixture
def client(server):
    with tw.Device(transport=server.transport, workers=2) as dev:
        yield dev


@pytest.fixture
def channel(server, client):
    ch = client.connect(server.address)
    call_json(ch, "zero", name="region")
    return ch


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"{n}B")
def test_write_then_read_back(server, client, channel, size):
    ch = channel
    remote = ch.lookup("region")
    assert remote.nbytes == REGION
    offset = 0 if size == REGION else 4096 + 3  # unaligned remote offset where there is room

    src = client.alloc(size)
    data = pattern(size, seed=size)
    np.asarray(src)[:] = data
    ch.write(src, remote, remote_offset=offset).wait(30)
    ch.flush().wait(30)
    # verified on the server's side
    assert remote_crc(ch, "region", offset, size) == crc(data)
    if offset:
        assert remote_crc(ch, "region", 0, offset) == crc(bytes(offset))  # nothing before it touched

    # the server writes a fresh pattern; the client reads it back
    call_json(ch, "fill", name="region", offset=offset, nbytes=size, seed=size + 1)
    dst = client.alloc(size)
    np.asarray(dst)[:] = 0
    ch.read(dst, remote, remote_offset=offset).wait(30)
    np.testing.assert_array_equal(np.asarray(dst), pattern(size, seed=size + 1))


def test_offsets_and_partial_lengths(server, client, channel):
    ch = channel
    remote = ch.lookup("region")
    src = client.alloc(10000)
    data = pattern(10000, seed=7)
    np.asarray(src)[:] = data
    ch.write(src, remote, local_offset=1000, remote_offset=777, nbytes=5000).wait(10)
    ch.flush().wait(10)
    assert remote_crc(ch, "region", 777, 5000) == crc(data[1000:6000])
    assert remote_crc(ch, "region", 777 + 5000, 4096) == crc(bytes(4096))
    # nbytes=0 is a no-op that completes at once
    req = ch.write(src, remote, nbytes=0)
    assert req.done()
    req.wait(1)
    # default length: as much as fits from the offsets
    back = client.alloc(5000)
    ch.read(back, remote, remote_offset=777).wait(10)
    np.testing.assert_array_equal(np.asarray(back), data[1000:6000])


def test_typed_tensors_roundtrip(server, client, channel):
    ch = channel
    remote = ch.lookup("region")
    for i, dtype in enumerate(sorted(tw.DTYPE_TABLE)):
        t = client.empty((17, 3), dtype)
        raw = np.asarray(t).reshape(-1).view(np.uint8)
        raw[:] = pattern(raw.size, seed=100 + i)
        if dtype == "bool":
            raw[:] &= 1
        off = i * 4096
        ch.write(t, remote, remote_offset=off).wait(10)
        ch.flush().wait(10)
        back = client.empty((17, 3), dtype)
        ch.read(back, remote, remote_offset=off).wait(10)
        np.testing.assert_array_equal(np.asarray(back).reshape(-1).view(np.uint8), raw)


def test_several_lanes(server, client):
    assert client.workers == 2
    chans = [client.connect(server.address, lane=lane) for lane in range(4)]
    assert [c.lane for c in chans] == [0, 1, 2, 3]
    call_json(chans[0], "zero", name="region")
    # every lane reaches the same peer, through its own endpoint
    assert len({c.peer["device_id"] for c in chans}) == 1
    assert chans[0].peer["device_id"] == server.info["device_id"]
    assert chans[0].peer["workers"] == SERVER_WORKERS
    assert chans[0].peer["pid"] == server.pid
    assert chans[0].peer["same_host"]
    assert client.connect(server.address, lane=2).lane == 2  # reused, not duplicated

    chunk = 1 * MiB
    srcs, reqs = [], []
    for lane, ch in enumerate(chans):
        remote = ch.lookup("region")
        src = client.alloc(chunk)
        np.asarray(src)[:] = pattern(chunk, seed=lane)
        srcs.append(src)
        for rep in range(4):  # 4 writes per lane, all in flight together
            off = (lane * 4 + rep) * chunk
            reqs.append(ch.write(src, remote, remote_offset=off))
    for r in reqs:
        r.wait(30)
    for ch in chans:
        ch.flush().wait(30)
    for lane in range(4):
        for rep in range(4):
            off = (lane * 4 + rep) * chunk
            assert remote_crc(chans[0], "region", off, chunk) == crc(pattern(chunk, seed=lane))
    # reads on every lane
    for lane, ch in enumerate(chans):
        dst = client.alloc(chunk)
        ch.read(dst, ch.lookup("region"), remote_offset=lane * 4 * chunk).wait(30)
        np.testing.assert_array_equal(np.asarray(dst), pattern(chunk, seed=lane))
    with pytest.raises(tw.InvalidArgument):
        client.connect(server.address, lane=-1)


def test_many_requests_in_flight(server, client, channel):
    ch = channel
    remote = ch.lookup("region")
    n, size = 512, 4096
    src = client.alloc(n * size)
    data = pattern(n * size, seed=512)
    np.asarray(src)[:] = data
    # distinct, interleaved remote offsets (reverse order), all posted before any wait
    reqs = [
        ch.write(src, remote, local_offset=i * size, remote_offset=(n - 1 - i) * size, nbytes=size) for i in range(n)
    ]
    for r in reqs:
        r.wait(30)
        assert r.done() and not r.failed
    ch.flush().wait(30)
    expected = data.reshape(n, size)[::-1].reshape(-1)
    assert remote_crc(ch, "region", 0, n * size) == crc(expected)

    # and as many reads in flight
    dst = client.alloc(n * size)
    reqs = [ch.read(dst, remote, local_offset=i * size, remote_offset=i * size, nbytes=size) for i in range(n)]
    for r in reqs:
        r.wait(30)
    np.testing.assert_array_equal(np.asarray(dst), expected)


def test_two_threads_share_one_channel(server, client, channel):
    ch = channel
    remote = ch.lookup("region")
    per_thread, size, nthreads = 256, 16 << 10, 2
    srcs = []
    for t in range(nthreads):
        src = client.alloc(per_thread * size)
        np.asarray(src)[:] = pattern(per_thread * size, seed=1000 + t)
        srcs.append(src)
    errors: list[BaseException] = []
    start = threading.Barrier(nthreads, timeout=10)

    def writer(t: int) -> None:
        try:
            start.wait()
            base = t * per_thread * size
            window = []
            for i in range(per_thread):
                window.append(
                    ch.write(srcs[t], remote, local_offset=i * size, remote_offset=base + i * size, nbytes=size)
                )
                if len(window) >= 32:
                    window.pop(0).wait(30)
            for r in window:
                r.wait(30)
            ch.flush().wait(30)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a writer thread hung"
    assert not errors, errors
    ch.flush().wait(30)
    for t in range(nthreads):
        base = t * per_thread * size
        assert remote_crc(ch, "region", base, per_thread * size) == crc(np.asarray(srcs[t]))


def test_two_threads_each_with_own_lane(server, client):
    remote_chans = [client.connect(server.address, lane=t) for t in range(2)]
    size = 4 * MiB
    srcs = [client.alloc(size) for _ in range(2)]
    for t, s in enumerate(srcs):
        np.asarray(s)[:] = pattern(size, seed=2000 + t)
    errors = []

    def worker(t):
        try:
            ch = remote_chans[t]
            remote = ch.lookup("region")
            for _ in range(3):
                ch.write(srcs[t], remote, remote_offset=t * size).wait(30)
            ch.flush().wait(30)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    for t in range(2):
        assert remote_crc(remote_chans[0], "region", t * size, size) == crc(np.asarray(srcs[t]))


def test_lookup_named_regions(server, client, channel):
    ch = channel
    region = ch.lookup("region")
    small = ch.lookup("small")
    other = ch.lookup("other")
    assert region.nbytes == REGION
    assert small.nbytes == 4096
    assert other.nbytes == 12345  # the published view, not the cache-line-rounded lease
    assert len({region.address, small.address, other.address}) == 3
    for r in (region, small, other):
        assert r.device_id == server.info["device_id"]
        d = tw.parse_descriptor(r.descriptor())
        assert d["address"] == r.address and d["nbytes"] == r.nbytes
    # a lookup again gives the same region
    assert ch.lookup("small").address == small.address

    # writes to one named region leave the others alone
    src = client.alloc(4096)
    np.asarray(src)[:] = 0xAB
    ch.write(src, small).wait(10)
    ch.flush().wait(10)
    assert remote_crc(ch, "small", 0, 4096) == crc(np.asarray(src))
    assert remote_crc(ch, "region", 0, 4096) == crc(bytes(4096))


def test_lookup_unknown_name_raises_not_found(server, client, channel):
    ch = channel
    with pytest.raises(tw.NotFound, match="nope") as info:
        ch.lookup("nope", timeout=10)
    assert isinstance(info.value, KeyError)
    # the channel stays usable after
    assert ch.lookup("small").nbytes == 4096


def test_unpublished_name_is_not_found(server, client):
    # a private server: unpublishing must not disturb the module's server
    with start_server(server.transport, {"a": 4096, "b": 4096}) as peer:
        ch = client.connect(peer.address)
        ch.lookup("a")
        call_json(ch, "unpublish", name="a")
        with pytest.raises(tw.NotFound):
            ch.lookup("a")
        assert ch.lookup("b").nbytes == 4096


def test_server_sees_the_client_as_peer(server, client, channel):
    peers = server.request("peers")
    assert client.id in {p["device_id"] for p in peers}
    mine = next(p for p in peers if p["device_id"] == client.id)
    assert mine["address"] == client.address
    assert mine["workers"] == 2
