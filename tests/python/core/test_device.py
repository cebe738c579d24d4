"""Device construction, registered memory and its zero-copy views, stats,
closed-device behaviour, pool limits and asyncio."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import re
import threading
import time

import numpy as np
import pytest

import tensorwire as tw
from conftest import HOST, TRANSPORTS, free_port, wait_until

# ---------------------------------------------------------------- construction


@pytest.mark.parametrize("transport", ["auto", *TRANSPORTS])
@pytest.mark.parametrize("progress", ["blocking", "polling", "inline"])
def test_device_options(transport, progress):
    with tw.Device(
        host=HOST,
        transport=transport,
        progress=progress,
        workers=2,
        spin_us=10,
        token="secret",
        slab_size=1 << 20,
        pool_limit=8 << 20,
        connect_timeout=3.0,
        keepalive=0.5,
    ) as dev:
        assert dev.workers == 2
        assert not dev.closed
        assert isinstance(dev.id, int) and dev.id != 0
        text = dev.describe()
        assert dev.address in text and f"progress: {progress}" in text
        if transport == "tcp":  # tcp lanes are tensorwire's sockets; UCX keeps self (registration, own channel)
            assert "UCX_TLS): self" in text and "control: tensorwire's tcp sockets" in text
        elif transport == "shm":
            assert "UCX_TLS): sm" in text
    assert dev.closed


def test_device_defaults_and_context_manager():
    dev = tw.Device()
    try:
        assert dev.workers == 1
        assert dev.address.startswith(HOST + ":")
    finally:
        dev.close()
    dev.close()  # idempotent
    assert dev.closed


def test_two_devices_have_distinct_ids_and_ports():
    with tw.Device() as a, tw.Device() as b:
        assert a.id != b.id
        assert a.address != b.address


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(port=-1), "port"),
        (dict(port=65536), "port"),
        (dict(workers=0), "workers"),
        (dict(workers=-3), "workers"),
        (dict(workers=257), "workers"),
        (dict(progress="bogus"), "progress"),
        (dict(transport="bogus"), "transport"),
        (dict(slab_size=100), "slab_size"),
        (dict(connect_timeout=0), "connect_timeout"),
        (dict(connect_timeout=-1.0), "connect_timeout"),
    ],
)
def test_bad_options_raise_invalid_argument(kwargs, match):
    with pytest.raises(tw.InvalidArgument, match=match) as info:
        tw.Device(**kwargs)
    # also catchable as the matching built-in
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, tw.Error)


def test_bad_option_does_not_poison_the_next_device():
    with pytest.raises(tw.InvalidArgument):
        tw.Device(transport="bogus")
    with tw.Device(transport="tcp") as dev:
        assert dev.alloc(16).nbytes == 16


def test_address_format():
    with tw.Device(host=HOST) as dev:
        m = re.fullmatch(r"127\.0\.0\.1:(\d+)", dev.address)
        assert m, dev.address
        assert 0 < int(m.group(1)) < 65536


def test_fixed_port_is_used_and_busy_port_is_refused():
    port = free_port()
    with tw.Device(host=HOST, port=port) as dev:
        assert dev.address == f"{HOST}:{port}"
        # a second listener on the same port cannot start: a clear error, no crash
        with pytest.raises(tw.ConnectionError, match=str(port)):
            tw.Device(host=HOST, port=port)


@pytest.mark.parametrize(
    "address", ["nonsense", "127.0.0.1", "127.0.0.1:", ":1234", "127.0.0.1:0", "127.0.0.1:99999", "127.0.0.1:12ab"]
)
def test_connect_to_malformed_address(address):
    with tw.Device() as dev:
        with pytest.raises(tw.InvalidArgument):
            dev.connect(address)


# ---------------------------------------------------------------- memory views


def _dlpack_dtype(block) -> tuple[int, int, int, tuple[int, ...], int]:
    """(code, bits, lanes, shape, data pointer) read straight from the DLPack
    capsule the block exports (works for dtypes numpy cannot import, e.g. bfloat16)."""

    class DLDevice(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

    class DLDataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class DLTensor(ctypes.Structure):
        _fields_ = [
            ("data", ctypes.c_void_p),
            ("device", DLDevice),
            ("ndim", ctypes.c_int32),
            ("dtype", DLDataType),
            ("shape", ctypes.POINTER(ctypes.c_int64)),
            ("strides", ctypes.POINTER(ctypes.c_int64)),
            ("byte_offset", ctypes.c_uint64),
        ]

    capsule = block.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    ptr = get(capsule, b"dltensor")
    t = DLTensor.from_address(ptr)  # DLManagedTensor starts with its DLTensor
    shape = tuple(t.shape[i] for i in range(t.ndim))
    out = (t.dtype.code, t.dtype.bits, t.dtype.lanes, shape, t.data)
    del capsule  # unconsumed: its destructor calls the deleter
    return out


@pytest.mark.parametrize("dtype", sorted(tw.DTYPE_TABLE))
def test_empty_every_dtype_zero_copy_views(dtype):
    code, bits, fmt = tw.DTYPE_TABLE[dtype]
    itemsize = bits // 8
    with tw.Device() as dev:
        blk = dev.empty((3, 5), dtype)
        assert blk.shape == [3, 5]
        assert blk.format == fmt
        assert blk.nbytes == len(blk) == 15 * itemsize
        assert blk.capacity >= blk.nbytes

        buf = np.asarray(blk)  # buffer protocol
        assert buf.shape == (3, 5)
        # (numpy reads the buffer format "Zf"/"Zd" but np.dtype does not take it)
        assert buf.dtype == (np.dtype("uint16") if dtype == "bfloat16" else np.dtype(dtype))
        assert memoryview(blk).format == fmt
        assert buf.ctypes.data == blk.ptr  # zero copy
        assert buf.flags.writeable and buf.flags.c_contiguous

        # the DLPack export describes the same memory with the right type
        assert blk.__dlpack_device__() == (1, 0)
        assert _dlpack_dtype(blk) == (code, bits, 1, (3, 5), blk.ptr)

        if dtype == "bfloat16":
            # numpy has no bfloat16: it refuses the import (cleanly), the
            # buffer protocol serves the raw 16-bit words
            with pytest.raises((RuntimeError, TypeError, BufferError, ValueError)):
                np.from_dlpack(blk)
            dl = buf
        else:
            dl = np.from_dlpack(blk)
            assert dl.shape == (3, 5)
            assert dl.dtype == np.dtype(dtype)
            assert dl.ctypes.data == blk.ptr

        # writes through one view are visible through the other
        one = np.ones(1, dtype=buf.dtype)[0]
        buf[1, 2] = one
        assert dl[1, 2] == one
        dl[2, 4] = one
        assert buf[2, 4] == one
        assert np.asarray(blk)[2, 4] == one
        # and through the block's own numpy() (bfloat16: raw uint16 words, as the buffer protocol)
        assert blk.numpy().dtype == buf.dtype and blk.numpy().shape == (3, 5)
        assert blk.numpy()[1, 2] == one


def test_dtype_spellings():
    with tw.Device() as dev:
        assert np.asarray(dev.empty(4, np.float32)).dtype == np.float32
        assert np.asarray(dev.empty(4, np.dtype("int16"))).dtype == np.int16
        assert np.asarray(dev.empty(4, "double")).dtype == np.float64
        assert np.asarray(dev.empty(4, "half")).dtype == np.float16
        assert np.asarray(dev.empty(4, "bool_")).dtype == np.bool_
        assert tw.dtype_name("torch.bfloat16") == "bfloat16"
        assert np.asarray(dev.empty(4, np.complex128)).dtype == np.complex128
        with pytest.raises(tw.InvalidArgument, match="unsupported dtype"):
            dev.empty(4, "complex32")
        with pytest.raises(tw.InvalidArgument):
            dev.empty(4, np.clongdouble)


def test_alloc_is_uint8_and_aligned():
    with tw.Device() as dev:
        blk = dev.alloc(1000, alignment=4096)
        assert blk.ptr % 4096 == 0
        a = np.asarray(blk)
        assert a.shape == (1000,) and a.dtype == np.uint8
        for align in (1, 8, 64, 256):
            assert dev.alloc(10, alignment=align).ptr % align == 0
        with pytest.raises(tw.InvalidArgument):
            dev.alloc(0)
        with pytest.raises(tw.InvalidArgument):
            dev.alloc(-5)
        with pytest.raises(tw.InvalidArgument):
            dev.alloc(16, alignment=3)
        with pytest.raises(tw.InvalidArgument):
            dev.alloc(16, alignment=8192)
        with pytest.raises(tw.InvalidArgument):
            dev.empty((2, -1), "float32")


def test_fresh_blocks_do_not_overlap():
    with tw.Device(slab_size=1 << 16) as dev:
        blocks = [dev.alloc(n) for n in (1, 63, 64, 65, 1000, 4096, 20000)]
        spans = sorted((b.ptr, b.ptr + b.capacity) for b in blocks)
        for (s0, e0), (s1, _) in zip(spans, spans[1:]):
            assert e0 <= s1
        for i, b in enumerate(blocks):
            np.asarray(b)[:] = i
        for i, b in enumerate(blocks):
            assert (np.asarray(b) == i).all()


def test_zero_dim_shape():
    with tw.Device() as dev:
        blk = dev.empty((), "float64")
        assert blk.shape == []
        assert blk.nbytes == 8
        a = np.asarray(blk)
        assert a.shape == () and a.dtype == np.float64
        d = np.from_dlpack(blk)
        assert d.shape == ()
        a[()] = 2.5
        assert d[()] == 2.5
        assert float(blk.numpy()) == 2.5


def test_empty_shape():
    with tw.Device() as dev:
        blk = dev.empty((0,), "float32")
        assert blk.nbytes == 0 and len(blk) == 0
        assert blk.capacity > 0  # still a real lease
        a = np.asarray(blk)
        assert a.shape == (0,) and a.dtype == np.float32
        assert np.from_dlpack(blk).shape == (0,)
        blk2 = dev.empty((4, 0, 3), "int8")
        assert np.asarray(blk2).shape == (4, 0, 3)


def test_view_keeps_block_alive():
    with tw.Device() as dev:
        blk = dev.empty(1024, "int32")
        view = np.asarray(blk)
        dl = np.from_dlpack(blk)
        before = dev.stats()["blocks"]
        del blk
        gc.collect()
        assert dev.stats()["blocks"] == before  # the views hold the lease
        view[:] = 7
        assert (dl == 7).all()
        del view, dl
        gc.collect()
        assert dev.stats()["blocks"] == before - 1


def test_release_block():
    with tw.Device() as dev:
        blk = dev.alloc(4096)
        in_use = dev.stats()["bytes_in_use"]
        blk.release()
        assert blk.released
        assert dev.stats()["bytes_in_use"] == in_use - 4096
        assert "released" in repr(blk)
        with pytest.raises(tw.InvalidArgument):
            blk.nbytes
        with pytest.raises(BufferError):
            memoryview(blk)
        with pytest.raises(tw.InvalidArgument):
            blk.numpy()
        with pytest.raises(tw.InvalidArgument):
            np.from_dlpack(blk)
        with pytest.raises(tw.InvalidArgument):
            dev.publish("gone", blk)
        blk.release()  # twice is harmless


def test_descriptor_roundtrip():
    with tw.Device() as dev:
        blk = dev.alloc(1000)
        d = tw.parse_descriptor(blk.descriptor())
        assert d["device_id"] == dev.id
        assert d["address"] == blk.ptr
        assert d["nbytes"] == blk.nbytes == 1000  # the view, as publish() advertises it
        assert d["rkey_bytes"] > 0
        with pytest.raises(tw.InvalidArgument):
            tw.parse_descriptor(b"garbage")
        with pytest.raises(tw.InvalidArgument):
            tw.parse_descriptor(blk.descriptor()[:-1])
        bad_version = bytearray(blk.descriptor())
        bad_version[4] = 99
        with pytest.raises(tw.ProtocolMismatch):
            tw.parse_descriptor(bytes(bad_version))


# ---------------------------------------------------------------- register


def test_register_numpy_array_and_remote_writes_land_in_it(device_pair):
    server, client = device_pair
    target = np.zeros(4096, dtype=np.int32)
    reg = server.register(target)
    assert reg.nbytes == target.nbytes
    assert reg.ptr == target.ctypes.data
    server.publish("target", reg)

    src = client.empty(4096, "int32")
    np.asarray(src)[:] = np.arange(4096, dtype=np.int32)
    ch = device_pair.channel()
    remote = ch.lookup("target")
    assert remote.nbytes == target.nbytes
    ch.write(src, remote).wait(10)
    ch.flush().wait(10)
    np.testing.assert_array_equal(target, np.arange(4096, dtype=np.int32))


def test_write_ordered_lands_after_the_earlier_writes(device_pair):
    # The flag is watched at the target, not checked after a flush: once it
    # shows a round, that round's payload must be there in full.
    server, client = device_pair
    n = 4 << 20
    dst = server.alloc(n + 64)
    server.publish("dst", dst)
    src = client.alloc(n + 64)
    ch = device_pair.channel()
    remote = ch.lookup("dst")
    seen = np.asarray(dst)[n : n + 8].view(np.uint64)
    for rnd in range(1, 6):
        np.asarray(src)[:n] = rnd
        np.asarray(src)[n : n + 8].view(np.uint64)[0] = rnd
        data = ch.write(src, remote, nbytes=n)
        flag = ch.write_ordered(src, remote, local_offset=n, remote_offset=n, nbytes=8)
        assert wait_until(lambda: seen[0] == rnd, 10, interval=0.0005)
        payload = np.asarray(dst)[:n]
        assert payload.min() == rnd and payload.max() == rnd, f"round {rnd}"
        data.wait(10)
        flag.wait(10)


def test_writes_and_reads_from_a_registered_array(device_pair):
    server, client = device_pair
    dst = server.empty(1000, "float64")
    np.asarray(dst)[:] = 0
    server.publish("dst", dst)

    local = np.linspace(0, 1, 1000)
    reg = client.register(local)
    ch = device_pair.channel()
    remote = ch.lookup("dst")
    ch.write(reg, remote).wait(10)
    ch.flush().wait(10)
    np.testing.assert_array_equal(np.asarray(dst), local)

    # read back into another registered array, at an offset
    back = np.zeros(500)
    reg_back = client.register(back)
    ch.read(reg_back, remote, remote_offset=500 * 8).wait(10)
    np.testing.assert_array_equal(back, local[500:])


def test_register_rejects_unusable_arrays():
    with tw.Device() as dev:
        a = np.zeros(100)
        with pytest.raises(tw.InvalidArgument, match="contiguous"):
            dev.register(a[::2])
        ro = np.zeros(10)
        ro.flags.writeable = False
        with pytest.raises(tw.InvalidArgument, match="writable"):
            dev.register(ro)
        with pytest.raises(tw.InvalidArgument):
            dev.register(np.zeros(0))
        with pytest.raises(tw.InvalidArgument):
            dev.publish("x", a)  # neither a Block nor a Registration


def test_register_cache_and_stats():
    with tw.Device() as dev:
        s0 = dev.stats()
        arr = np.zeros(1 << 16, dtype=np.uint8)
        r1 = dev.register(arr)
        s1 = dev.stats()
        assert s1["registrations"] == s0["registrations"] + 1
        assert s1["registration_cache_misses"] == s0["registration_cache_misses"] + 1
        r2 = dev.register(arr[100:200])  # inside a live registration: served from the cache
        s2 = dev.stats()
        assert s2["registration_cache_hits"] == s1["registration_cache_hits"] + 1
        assert s2["registrations"] == s1["registrations"]
        assert r2.ptr == arr.ctypes.data + 100 and r2.nbytes == 100
        del r1, r2
        gc.collect()
        assert dev.stats()["registrations"] == s0["registrations"]


# ---------------------------------------------------------------- stats


def test_stats():
    with tw.Device(slab_size=1 << 20) as dev:
        s = dev.stats()
        for key in (
            "bytes_in_use",
            "bytes_reserved",
            "slabs",
            "blocks",
            "registrations",
            "registration_cache_hits",
            "registration_cache_misses",
            "refusals",
        ):
            assert isinstance(s[key], int) and s[key] >= 0, key
        assert s["blocks"] == 0 and s["bytes_in_use"] == 0 and s["refusals"] == 0

        a = dev.alloc(1000)
        b = dev.alloc(64)
        s = dev.stats()
        assert s["blocks"] == 2
        assert s["bytes_in_use"] == a.capacity + b.capacity
        assert s["slabs"] == 1 and s["bytes_reserved"] == 1 << 20

        big = dev.alloc(3 << 20)  # larger than half a slab: its own slab
        s = dev.stats()
        assert s["slabs"] == 2 and s["bytes_reserved"] >= (1 << 20) + (3 << 20)
        big_ptr, reserved = big.ptr, s["bytes_reserved"]
        del big
        gc.collect()
        s = dev.stats()
        assert s["slabs"] == 2 and s["bytes_reserved"] == reserved  # kept for reuse
        again = dev.alloc(3 << 20)  # a similar size reuses the cached slab
        assert again.ptr == big_ptr and dev.stats()["slabs"] == 2
        again.release()
        a.release()
        b.release()
        assert dev.stats()["bytes_in_use"] == 0 and dev.stats()["blocks"] == 0


def test_freed_memory_is_reused():
    with tw.Device(slab_size=1 << 16, pool_limit=1 << 16) as dev:
        for _ in range(50):  # 50 x 16 KiB through a 64 KiB pool
            blk = dev.alloc(1 << 14)
            np.asarray(blk)[:] = 1
            blk.release()
        assert dev.stats()["slabs"] == 1


# ---------------------------------------------------------------- closed device


def test_block_after_device_closed():
    server = tw.Device(transport="tcp")
    client = tw.Device(transport="tcp")
    try:
        blk = server.empty(256, "int64")
        view = np.asarray(blk)
        view[:] = np.arange(256)
        server.publish("blk", blk)
        src = client.empty(256, "int64")
        np.asarray(src)[:] = -1
        ch = client.connect(server.address)
        remote = ch.lookup("blk")
        ch.write(src, remote, nbytes=8).wait(10)
        ch.flush().wait(10)
        assert view[0] == -1

        client.close()
        server.close()
        assert server.closed and client.closed
        # memory stays mapped and readable through views taken earlier ...
        np.testing.assert_array_equal(view[1:], np.arange(1, 256))
        # ... and through new views of the live Block
        assert np.asarray(blk)[5] == 5
        assert np.asarray(src)[0] == -1
        view[3] = 42
        assert np.asarray(blk)[3] == 42

        # channel operations raise (no crash)
        for op in (
            lambda: ch.write(src, remote).wait(5),
            lambda: ch.read(src, remote).wait(5),
            lambda: ch.flush().wait(5),
            lambda: ch.fence(),
            lambda: ch.lookup("blk", timeout=2),
            lambda: ch.call("x", b"", timeout=2),
        ):
            with pytest.raises(tw.ConnectionError):
                op()
        # device operations raise too
        for op in (
            lambda: client.connect(server.address),
            lambda: client.alloc(16),
            lambda: client.empty(4),
            lambda: client.stats(),
            lambda: client.publish("x", src),
            lambda: client.wait_for_peer(0.1),
            lambda: client.register(np.zeros(4)),
        ):
            with pytest.raises(tw.ConnectionError):
                op()
        assert server.address  # still answerable
    finally:
        client.close()
        server.close()


# Against Debian's UCX 1.13 (make test-system-ucx) this test aborts the process in about half
# of the runs, inside close() with requests pending; not yet understood (see the issue note).
@pytest.mark.skipif(
    tuple(int(x) for x in tw._core.ucx_header_version().split(".")[:2]) < (1, 14),
    reason="aborts intermittently in close() with requests pending on UCX 1.13 (not yet understood)",
)
def test_pending_requests_fail_when_own_device_closes():
    with tw.Device(transport="tcp") as server:
        dst = server.alloc(8 << 20)
        server.publish("dst", dst)
        client = tw.Device(transport="tcp")
        src = client.alloc(1 << 20)
        ch = client.connect(server.address)
        remote = ch.lookup("dst")
        reqs = [ch.write(src, remote, remote_offset=(i % 8) << 20) for i in range(64)]
        client.close()
        for r in reqs:  # every request settles: done, or failed with ConnectionError
            try:
                r.wait(10)
            except tw.ConnectionError:
                assert r.failed and r.error
        with pytest.raises(tw.ConnectionError):
            ch.write(src, remote)


# ---------------------------------------------------------------- pool limit


def test_pool_exhausted_then_usable(device_pair):
    server, _ = device_pair
    with tw.Device(transport=device_pair.transport, pool_limit=1 << 20, slab_size=1 << 16) as dev:
        held = [dev.alloc(1 << 15) for _ in range(32)]  # exactly the limit
        with pytest.raises(tw.PoolExhausted) as info:
            dev.alloc(1 << 15)
        assert isinstance(info.value, MemoryError)
        assert "limit" in str(info.value)
        with pytest.raises(tw.PoolExhausted):
            dev.alloc(2 << 20)  # a dedicated slab beyond the limit
        with pytest.raises(tw.PoolExhausted):
            dev.empty((1 << 20,), "float32")
        assert dev.stats()["bytes_reserved"] <= 1 << 20

        # free some and the device is fully usable again, transfers included
        del held[:4]
        gc.collect()
        blk = dev.alloc(1 << 15)
        np.asarray(blk)[:] = 9
        dst = server.alloc(1 << 15)
        server.publish("dst", dst)
        ch = dev.connect(server.address)
        ch.write(blk, ch.lookup("dst")).wait(10)
        ch.flush().wait(10)
        assert (np.asarray(dst) == 9).all()


# ---------------------------------------------------------------- asyncio


def test_asyncio_await_requests(device_pair):
    server, client = device_pair
    dst = server.alloc(1 << 20)
    server.publish("dst", dst)
    src = client.alloc(1 << 20)
    np.asarray(src)[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
    back = client.alloc(1 << 20)
    ch = device_pair.channel()
    remote = ch.lookup("dst")

    async def main():
        # many writes awaited together, then a flush and a read
        await asyncio.wait_for(
            asyncio.gather(
                *[ch.write(src, remote, local_offset=i << 16, remote_offset=i << 16, nbytes=1 << 16) for i in range(16)]
            ),
            10,
        )
        await asyncio.wait_for(ch.flush(), 10)
        assert await asyncio.wait_for(ch.read(back, remote), 10) is None
        # the loop stays responsive while a request is pending
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        await asyncio.wait_for(ch.read(back, remote), 10)
        t.cancel()
        return ticks

    asyncio.run(main())
    np.testing.assert_array_equal(np.asarray(dst), np.asarray(src))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(src))


def test_asyncio_await_raises_the_operation_error():
    server = tw.Device(transport="tcp")
    client = tw.Device(transport="tcp")
    try:
        dst = server.alloc(4096)
        server.publish("dst", dst)
        src = client.alloc(4096)
        ch = client.connect(server.address)
        remote = ch.lookup("dst")
        client.close()

        async def main():
            await ch.write(src, remote)

        with pytest.raises(tw.ConnectionError):
            asyncio.run(main())
    finally:
        client.close()
        server.close()


# ---------------------------------------------------------------- peers


def test_peers_and_channel_back_to_a_client(device_pair):
    server, client = device_pair
    with pytest.raises(tw.Timeout):
        server.wait_for_peer(0.05)
    inbox = client.empty(64, "int32")
    np.asarray(inbox)[:] = 0
    client.publish("inbox", inbox)

    ch = device_pair.channel()
    assert ch.peer["device_id"] == server.id
    assert ch.peer["address"] == server.address
    assert ch.peer["same_host"]
    info = server.wait_for_peer(10)
    assert info["device_id"] == client.id
    assert info["address"] == client.address
    assert info["workers"] == 1
    assert [p["device_id"] for p in server.peers()] == [client.id]
    assert [p["device_id"] for p in client.peers()] == [server.id]
    assert device_pair.channel().peer == ch.peer  # a second connect reuses the connection
    assert len(server.peers()) == 1

    # the server reaches back to the client over the same connection
    back = server.channel_to(info["device_id"])
    remote = back.lookup("inbox")
    src = server.empty(64, "int32")
    np.asarray(src)[:] = np.arange(64)
    back.write(src, remote).wait(10)
    back.flush().wait(10)
    np.testing.assert_array_equal(np.asarray(inbox), np.arange(64))
    with pytest.raises(tw.NotFound):
        server.channel_to(12345)
    assert "tcp" in ch.transport_info() or device_pair.transport == "shm"


def test_a_channel_back_sends_on_the_lane_its_peer_dialled():
    """Over tcp one socket carries both directions of a lane (as UCX's tcp matches
    connections): the server's channel back to a client whose lane it already holds
    sends on that lane, and traffic both ways at once lands intact."""
    with tw.Device(host=HOST, transport="tcp") as server, tw.Device(host=HOST, transport="tcp") as client:
        n, rounds = 4096, 50
        at_server, at_client = server.alloc(n), client.alloc(n)
        server.publish("in", at_server)
        client.publish("in", at_client)
        ch = client.connect(server.address)
        to_server = ch.lookup("in")
        src_c = client.alloc(n)
        ch.write(src_c, to_server).wait(10)  # the server has taken the lane once this is acknowledged
        back = server.channel_to(client.id)
        assert "used both ways" in back.transport_info(), back.transport_info()
        assert "used both ways" not in ch.transport_info()
        to_client, src_s = back.lookup("in"), server.alloc(n)
        errors = []

        def stream(channel, src, remote, seed):
            try:
                for i in range(rounds):
                    np.asarray(src)[:] = (seed + i) % 251
                    channel.write(src, remote).wait(10)
            except tw.Error as e:
                errors.append(e)

        threads = [
            threading.Thread(target=stream, args=(ch, src_c, to_server, 1)),
            threading.Thread(target=stream, args=(back, src_s, to_client, 100)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and not any(t.is_alive() for t in threads), errors
        assert (np.asarray(at_server) == (1 + rounds - 1) % 251).all()
        assert (np.asarray(at_client) == (100 + rounds - 1) % 251).all()
        # the lane's owner is the client: its channel closing ends the lane, and the server's
        # channel back fails with it rather than hanging
        client.close()
        with pytest.raises((tw.PeerFailed, tw.ConnectionError)):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                back.write(src_s, to_client).wait(1)
                time.sleep(0.01)


def test_a_channel_back_made_before_the_dialers_lane_shares_it():
    """The accepting side's channel back, made before (or without) the dialer's lane, asks
    the dialer for that lane instead of dialling a second socket: one socket per lane and
    connection, both ways, also for a lane the dialer never opened (lane 3 here)."""
    with tw.Device(host=HOST, transport="tcp") as server, tw.Device(host=HOST, transport="tcp") as client:
        n = 1024
        at_server, at_client = server.alloc(n), client.alloc(n)
        server.publish("in", at_server)
        client.publish("in", at_client)
        ch = client.connect(server.address)
        for lane in (0, 3):
            back = server.channel_to(client.id, lane)  # at once: lane 3 does not exist yet
            assert "used both ways" in back.transport_info(), (lane, back.transport_info())
            mine = client.connect(server.address, lane=lane)
            assert "used both ways" not in mine.transport_info(), (lane, mine.transport_info())
            src_c, src_s = client.alloc(n), server.alloc(n)
            np.asarray(src_c)[:] = lane + 1
            np.asarray(src_s)[:] = lane + 100
            mine.write(src_c, mine.lookup("in")).wait(10)
            back.write(src_s, back.lookup("in")).wait(10)
            assert (np.asarray(at_server) == lane + 1).all()
            assert (np.asarray(at_client) == lane + 100).all()
        assert ch is not None


def test_the_lane_call_is_refused_when_misused():
    """tw.lane (a lane asked of the connection's dialer) from the dialer itself, for a
    lane past the bound or with a malformed payload: a clear refusal, and nothing dialled."""
    import struct

    with tw.Device(host=HOST, transport="tcp") as server, tw.Device(host=HOST, transport="tcp") as client:
        ch = client.connect(server.address)
        with pytest.raises(tw.InvalidArgument, match="did not dial"):
            ch.call("tw.lane", struct.pack("<I", 5))
        back = server.channel_to(client.id)
        with pytest.raises(tw.InvalidArgument, match="lanes are 0..1023"):
            back.call("tw.lane", struct.pack("<I", 1024))
        with pytest.raises(tw.Error):
            back.call("tw.lane", b"\x01\x02")
        assert back.call("tw.lane", struct.pack("<I", 6)) == b""
        assert "used both ways" in server.channel_to(client.id, 6).transport_info()


def test_loopback_device_refuses_remote_address_clearly():
    """A device on 127.0.0.1 has its UCX limited to `lo`: connecting elsewhere
    says so (instead of UCX's 'Destination is unreachable')."""
    with tw.Device() as dev:
        with pytest.raises(tw.InvalidArgument, match="loopback only"):
            dev.connect("10.255.255.1:5000")


def test_progress_from_the_environment_overrides_the_arguments(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_PROGRESS", "inline")
    monkeypatch.setenv("TENSORWIRE_SPIN_US", "7")
    with tw.Device(host="127.0.0.1", transport="tcp", progress="blocking", spin_us=100) as dev:
        assert dev.progress_mode == "inline"
        assert dev.spin_us == 7
    monkeypatch.delenv("TENSORWIRE_PROGRESS")
    monkeypatch.delenv("TENSORWIRE_SPIN_US")
    with tw.Device(host="127.0.0.1", transport="tcp", progress="polling", spin_us=100) as dev:
        assert dev.progress_mode == "polling"
        assert dev.spin_us == 100


@pytest.mark.parametrize(
    "name,value",
    [
        ("TENSORWIRE_PROGRESS", "busy"),
        ("TENSORWIRE_SPIN_US", "abc"),
        ("TENSORWIRE_SPIN_US", ""),
        ("TENSORWIRE_SPIN_US", "99999999"),
        ("TENSORWIRE_STREAMING_COPY_MIN", "16M"),
        ("TENSORWIRE_STREAMING_COPY_MIN", ""),
        ("TENSORWIRE_STREAMING_COPY_MIN", "-1"),
        ("TENSORWIRE_REP_MOVSB_MIN", "64K"),
        ("TENSORWIRE_SHARED_COPY_MIN", "256K"),
        ("TENSORWIRE_PLACE", "256K-4M"),
        ("TENSORWIRE_PLACE", "4096"),
        ("TENSORWIRE_PLACE", "9-8"),
        ("TENSORWIRE_PLACE", "-1-8"),
        ("TENSORWIRE_PLACE", ""),
    ],
)
def test_bad_progress_settings_in_the_environment_are_refused(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(tw.InvalidArgument, match=name):
        tw.Device(host="127.0.0.1", transport="tcp")
