"""The direct path: with a same-host peer over shared memory, write/read to a
region UCX can map (ucp_rkey_ptr) are a memcpy in the calling thread. These
tests check when it is taken, that it moves the right bytes across processes,
and that fence() still orders it after UCX operations."""

from __future__ import annotations

import time

import numpy as np
import pytest

import tensorwire as tw
from conftest import HOST, call_json, remote_crc, start_server
from _peers import crc, pattern

MiB = 1 << 20

# Another device is copied to directly only where UCX names an endpoint's
# transports (1.14 on, cpp/src/ucx/features.h); with an older UCX every
# channel to another process takes the message form.
_UCX = tuple(int(x) for x in tw._core.ucx_header_version().split(".")[:2])
needs_ep_transports = pytest.mark.skipif(
    _UCX < (1, 14), reason=f"UCX {tw._core.ucx_header_version()} cannot report an endpoint's transports"
)


@pytest.fixture
def shm_pair():
    server = tw.Device(host=HOST, transport="shm", slab_size=4 * MiB)
    client = tw.Device(host=HOST, transport="shm", slab_size=4 * MiB)
    try:
        yield server, client
    finally:
        client.close()
        server.close()


@needs_ep_transports
@pytest.mark.parametrize("nbytes", [64, 4 * MiB], ids=["small-slab", "large-dedicated"])
def test_pool_blocks_of_a_same_host_peer_are_written_directly(shm_pair, nbytes):
    server, client = shm_pair
    dst = server.alloc(nbytes)
    server.publish("dst", dst)
    src = client.alloc(nbytes)
    np.asarray(src)[:] = pattern(nbytes, 7)
    ch = client.connect(server.address)
    remote = ch.lookup("dst")
    assert ch.maps(remote, src)
    ch.write(src, remote).wait(10)
    ch.fence()
    assert crc(np.asarray(dst)) == crc(pattern(nbytes, 7))
    np.asarray(dst)[:] = pattern(nbytes, 8)
    ch.read(src, remote).wait(10)
    assert crc(np.asarray(src)) == crc(pattern(nbytes, 8))
    stats = ch.stats()
    assert (stats["direct_writes"], stats["direct_reads"], stats["posted"]) == (1, 1, 0)
    assert stats["direct_bytes"] == 2 * nbytes


def test_registered_user_memory_goes_through_ucx(shm_pair):
    # Memory the caller registered is not UCX's shared memory: no mapping.
    server, client = shm_pair
    target = np.zeros(1 << 16, np.uint8)
    reg = server.register(target)
    server.publish("user", reg)
    src = client.alloc(1 << 16)
    np.asarray(src)[:] = pattern(1 << 16, 3)
    ch = client.connect(server.address)
    remote = ch.lookup("user")
    assert not ch.maps(remote, src)
    ch.write(src, remote).wait(10)
    ch.flush().wait(10)
    assert crc(target) == crc(pattern(1 << 16, 3))
    assert ch.stats()["posted"] == 1 and ch.stats()["direct_writes"] == 0


@pytest.mark.parametrize("how", ["option", "environment"])
def test_mapping_can_be_turned_off(how, monkeypatch):
    kwargs = {}
    if how == "option":
        kwargs["map_shared_memory"] = False
    else:
        monkeypatch.setenv("TENSORWIRE_MAP_SHARED_MEMORY", "0")
    with (
        tw.Device(host=HOST, transport="shm", **kwargs) as server,
        tw.Device(host=HOST, transport="shm", **kwargs) as client,
    ):
        dst = server.alloc(4096)
        server.publish("dst", dst)
        src = client.alloc(4096)
        np.asarray(src)[:] = 5
        ch = client.connect(server.address)
        remote = ch.lookup("dst")
        assert not ch.maps(remote, src)
        ch.write(src, remote).wait(10)
        ch.flush().wait(10)
        assert np.all(np.asarray(dst) == 5)
        assert ch.stats()["posted"] == 1 and ch.stats()["direct_writes"] == 0


def test_tcp_never_maps_another_device():
    with tw.Device(host=HOST, transport="tcp") as server, tw.Device(host=HOST, transport="tcp") as client:
        dst = server.alloc(4096)
        server.publish("dst", dst)
        src = client.alloc(4096)
        ch = client.connect(server.address)
        assert not ch.maps(ch.lookup("dst"), src)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_channel_to_its_own_device_copies_directly(transport):
    """One process hosting both ends (a colocated worker and server): the peer's
    pool blocks are its own memory, so writes, reads and slots are memcpys, even
    over tcp. Registered user memory goes through UCX: its owner may free it,
    and a copy into freed memory would crash where UCX fails the operation."""
    with tw.Device(host=HOST, transport=transport) as dev:
        dst = dev.alloc(4 * MiB)
        dev.publish("dst", dst)
        user = np.zeros(4096, np.uint8)
        dev.publish("user", dev.register(user))
        src = dev.alloc(4 * MiB)
        np.asarray(src)[:] = pattern(4 * MiB, 11)
        ch = dev.connect(dev.address)
        remote = ch.lookup("dst")
        assert ch.maps(remote, src)
        ch.write(src, remote).wait(10)
        assert crc(np.asarray(dst)) == crc(pattern(4 * MiB, 11))
        np.asarray(dst)[:] = pattern(4 * MiB, 12)
        ch.read(src, remote).wait(10)
        assert crc(np.asarray(src)) == crc(pattern(4 * MiB, 12))
        assert not ch.maps(ch.lookup("user"), src)
        ch.write(src, ch.lookup("user"), nbytes=4096).wait(10)
        ch.flush().wait(10)
        assert crc(user) == crc(pattern(4 * MiB, 12)[:4096])
        # slots through the same channel: static (write + flag) and dynamic (record + read)
        slot = dev.static_slot("s", (1024,), "float32", depth=2)
        dyn = dev.dynamic_slot("d")
        sender, dsender = ch.static_sender("s"), ch.dynamic_sender("d")
        for i in range(5):
            a = np.full(1024, i, np.float32)
            sender.send(a, 10).wait(10)
            v = slot.recv(10)
            assert np.array_equal(np.asarray(v), a)
            slot.release(v)
            b = np.arange(i + 3, dtype=np.int64)
            req = dsender.send(b, 10)
            got = dyn.recv(10)
            assert np.array_equal(np.asarray(got), b)
            del got
            req.wait(10)
        stats = ch.stats()
        # The registered array went through UCX: over shm as a put; over tcp the data context's
        # only transport is UCX's self, which maps it for a copy in this process.
        posted = 0 if transport == "tcp" else 1
        assert stats["posted"] == posted and stats["direct_writes"] >= 1 + 10 and stats["direct_reads"] >= 1 + 5, stats


def test_a_channel_to_its_own_device_keeps_a_freed_block_mapped():
    """A direct write into a block its owner already freed (a protocol error,
    as an RDMA write after deregistration) must neither crash the process nor
    land in memory the pool has handed out since: the remote region pins the
    memory it points to."""
    with tw.Device(host=HOST, transport="tcp", slab_size=4 * MiB, pool_limit=160 * MiB) as dev:
        dst = dev.alloc(64 * MiB)  # a dedicated slab each
        src = dev.alloc(64 * MiB)
        np.asarray(src)[:] = 7
        dev.publish("dst", dst)
        ch = dev.connect(dev.address)
        remote = ch.lookup("dst")
        assert ch.maps(remote, src)
        del dst  # freed: the pool caches its slab ...
        fresh = dev.alloc(80 * MiB)  # ... and drops (unmaps) it to stay under its limit
        np.asarray(fresh)[:] = 1
        ch.write(src, remote).wait(10)
        assert ch.stats()["direct_writes"] == 1
        assert np.all(np.asarray(fresh) == 1)


def test_a_channel_to_its_own_device_goes_through_ucx_when_mapping_is_off():
    with tw.Device(host=HOST, transport="tcp", map_shared_memory=False) as dev:
        dst = dev.alloc(4096)
        dev.publish("dst", dst)
        src = dev.alloc(4096)
        np.asarray(src)[:] = 9
        ch = dev.connect(dev.address)
        assert not ch.maps(ch.lookup("dst"), src)
        ch.write(src, ch.lookup("dst")).wait(10)
        ch.flush().wait(10)
        assert np.all(np.asarray(dst) == 9)
        assert ch.stats()["posted"] == 1 and ch.stats()["direct_writes"] == 0


@needs_ep_transports
def test_a_direct_copy_after_a_fence_waits_for_earlier_ucx_operations(shm_pair):
    # UCX write into registered memory (posted), fence, then a flag into a
    # pool block (direct): the flag must not overtake the data, so the direct
    # copy drains the channel first; a second direct copy needs no drain.
    server, client = shm_pair
    data = np.zeros(1 << 20, np.uint8)
    server.publish("data", server.register(data))
    flag = server.alloc(64)
    server.publish("flag", flag)
    src = client.alloc(1 << 20)
    np.asarray(src)[:] = pattern(1 << 20, 11)
    one = client.alloc(64)
    np.asarray(one)[:] = 1
    ch = client.connect(server.address)
    rdata, rflag = ch.lookup("data"), ch.lookup("flag")
    ch.write(src, rdata)
    ch.fence()
    ch.write(one, rflag).wait(10)
    assert np.asarray(flag)[0] == 1
    assert crc(data) == crc(pattern(1 << 20, 11))
    ch.write(one, rflag).wait(10)
    stats = ch.stats()
    assert stats["drains"] == 1 and stats["posted"] == 1 and stats["direct_writes"] == 2


@pytest.mark.parametrize(
    "map_shared_memory", [pytest.param(True, marks=needs_ep_transports), False], ids=["direct", "ucx"]
)
def test_direct_and_ucx_paths_move_the_same_bytes_across_processes(map_shared_memory):
    sizes = [1, 100, 4096, 3 * MiB + 5]
    with (
        start_server("shm", {"region": 8 * MiB}) as server,
        tw.Device(host=HOST, transport="shm", map_shared_memory=map_shared_memory) as client,
    ):
        ch = client.connect(server.address)
        call_json(ch, "zero", name="region")
        remote = ch.lookup("region")
        src = client.alloc(8 * MiB)
        back = client.alloc(8 * MiB)
        assert ch.maps(remote, src) == map_shared_memory
        offset = 0
        for i, n in enumerate(sizes):
            np.asarray(src)[:n] = pattern(n, i)
            ch.write(src, remote, 0, offset, n).wait(10)
            ch.flush().wait(10)
            assert remote_crc(ch, "region", offset, n) == crc(pattern(n, i))
            ch.read(back, remote, 0, offset, n).wait(10)
            assert crc(np.asarray(back)[:n]) == crc(pattern(n, i))
            offset += n
        stats = ch.stats()
        direct = stats["direct_writes"] + stats["direct_reads"]
        assert (direct, stats["posted"]) == ((2 * len(sizes), 0) if map_shared_memory else (0, 2 * len(sizes)))


@needs_ep_transports
def test_writes_to_a_dead_peer_fail_even_when_mapped():
    server = start_server("shm", {"region": MiB})
    with server, tw.Device(host=HOST, transport="shm", keepalive=0.2) as client:
        ch = client.connect(server.address)
        remote = ch.lookup("region")
        src = client.alloc(MiB)
        assert ch.maps(remote, src)
        server.kill()
        with pytest.raises(tw.ConnectionError):
            for _ in range(2000):  # bounded: the control plane notices within a few keepalives
                ch.write(src, remote).wait(10)
                ch.flush().wait(10)
                time.sleep(0.01)
