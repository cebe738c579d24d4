"""Bad input (issue 16, finding 6): sizes from user input are checked, never
wrapped; register refuses memory it cannot keep alive; a sender's bad
arguments are refused before it attaches; the copy path's staging wait is
bounded by the send's timeout. Every refusal is InvalidArgument (a
ValueError), names the argument, and leaves nothing allocated or posted."""

from __future__ import annotations

import gc
import itertools
import time
import weakref

import numpy as np
import pytest

import tensorwire as tw
from conftest import HOST

_names = itertools.count()

POOL_KEYS = ("bytes_in_use", "bytes_reserved", "slabs", "blocks", "registrations")


def unique(prefix: str) -> str:
    return f"{prefix}-{next(_names)}"


def pool(dev: tw.Device) -> dict:
    s = dev.stats()
    return {k: s[k] for k in POOL_KEYS}


@pytest.fixture
def dev():
    with tw.Device(host=HOST, slab_size=1 << 20, pool_limit=64 << 20) as d:
        yield d


# ---------------------------------------------------------------- shapes and sizes


@pytest.mark.parametrize(
    "shape, dtype, match",
    [
        ((1 << 62,), "float32", "too large"),  # 2**64 bytes: wrapped to 0 before
        ((1 << 61,), "float64", "too large"),
        ((1 << 31, 1 << 31, 1 << 31), "int8", "too large"),
        ((1 << 32, 1 << 32), "int8", "too large"),  # 2**64 bytes exactly
        ((3, 1 << 62), "uint8", "too large"),
        ((1 << 63,), "int8", r"shape\[0\].*too large"),  # not an int64
        ((1 << 64,), "int8", r"shape\[0\].*64 bits"),
        ((1 << 100,), "float32", r"shape\[0\].*64 bits"),
        ((2, -1), "float32", r"shape\[1\].*>= 0"),
        ((2.5,), "float32", r"shape\[0\].*integer"),
        (1 << 64, "float32", r"shape.*64 bits"),
    ],
)
def test_empty_overflowing_shapes_raise_and_allocate_nothing(dev, shape, dtype, match):
    before = pool(dev)
    with pytest.raises(tw.InvalidArgument, match=match):
        dev.empty(shape, dtype)
    assert pool(dev) == before


def test_largest_size_is_refused_by_the_pool_not_wrapped(dev):
    # 2**62 bytes is representable: the pool refuses it (its limit), nothing rounds past 2**64
    before = pool(dev)
    with pytest.raises(tw.PoolExhausted):
        dev.empty((1 << 62,), "int8")
    with pytest.raises(tw.PoolExhausted):
        dev.alloc(1 << 62)
    assert pool(dev) == before


@pytest.mark.parametrize(
    "nbytes, match",
    [
        (0, "> 0"),
        (-1, "> 0"),
        ((1 << 62) + 1, "too large"),
        (1 << 64, "too large"),
        (2.0, "integer"),
    ],
)
def test_alloc_bad_nbytes(dev, nbytes, match):
    before = pool(dev)
    with pytest.raises(tw.InvalidArgument, match=match):
        dev.alloc(nbytes)
    assert pool(dev) == before


@pytest.mark.parametrize("alignment", [-1, 1 << 64, 3, 8192, 1 << 63])
def test_alloc_bad_alignment(dev, alignment):
    before = pool(dev)
    with pytest.raises(tw.InvalidArgument, match="alignment"):
        dev.alloc(16, alignment=alignment)
    assert pool(dev) == before


def test_numpy_integer_shapes_work(dev):
    blk = dev.empty(np.int64(6), "float32")
    assert blk.shape == [6] and blk.nbytes == 24
    blk = dev.empty(np.array([2, 3]), "int16")
    assert np.asarray(blk).shape == (2, 3)
    assert dev.alloc(np.uint32(100)).nbytes == 100


def test_dlpack_of_a_valid_block_after_refusals(dev):
    """The block the old code returned for (1<<62,) aborted torch.from_dlpack;
    now the refusal leaves the device fully usable for DLPack consumers."""
    with pytest.raises(tw.InvalidArgument):
        dev.empty((1 << 62,), "float32")
    blk = dev.empty((4, 8), "float32")
    np.asarray(blk)[:] = 3.0
    assert np.from_dlpack(blk).shape == (4, 8) and float(np.from_dlpack(blk).sum()) == 96.0
    torch = pytest.importorskip("torch")
    t = torch.from_dlpack(blk)
    assert t.shape == (4, 8) and float(t.sum()) == 96.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(shape=(1 << 60,), depth=1024), "too large"),  # depth x slot stride wraps 64 bits
        (dict(shape=(1 << 61,), depth=2), "too large"),
        (dict(shape=(1 << 64,)), r"shape\[0\]"),
        (dict(shape=(4,), depth=1 << 64), "depth"),
        (dict(shape=(4,), depth=0), "depth"),
        (dict(shape=(4,), first_seq=-1), "first_seq"),
    ],
)
def test_static_slot_bad_sizes(dev, kwargs, match):
    before = pool(dev)
    with pytest.raises(tw.InvalidArgument, match=match):
        dev.static_slot(unique("bad"), dtype="float32", **kwargs)
    assert pool(dev) == before


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_nbytes=-1), "max_nbytes"),
        (dict(max_nbytes=1 << 64), "max_nbytes"),
        (dict(max_ndim=1 << 64), "max_ndim"),
        (dict(max_ndim=-1), "max_ndim"),
    ],
)
def test_dynamic_slot_bad_sizes(dev, kwargs, match):
    with pytest.raises(tw.InvalidArgument, match=match):
        dev.dynamic_slot(unique("bad"), **kwargs)


# ---------------------------------------------------------------- register


class _FreshCopies:
    """Converts to a new numpy array on every call (as a list does)."""

    def __array__(self, dtype=None, copy=None):
        return np.arange(16, dtype=np.int64)


@pytest.mark.parametrize(
    "obj, match",
    [
        ([1, 2, 3] * 100, "list"),
        ((1, 2, 3), "tuple"),
        (b"\x00" * 64, "bytes"),
        ("text", "str"),
        (42, "int"),
        (_FreshCopies(), "fresh numpy copy"),
        (memoryview(b"\x00" * 64), "read-only"),
        (np.array([object()] * 4), "dtype=object"),
    ],
)
def test_register_refuses_memory_it_cannot_keep(dev, obj, match):
    before = pool(dev)
    with pytest.raises(tw.InvalidArgument, match=match) as info:
        dev.register(obj)
    if "read-only" in match or "fresh" in match or match in ("list", "tuple", "bytes", "str", "int"):
        assert "np.asarray" in str(info.value) and "device.empty()" in str(info.value)  # says what to pass
    assert pool(dev) == before


def test_register_keeps_the_owner_alive(dev):
    arr = np.arange(1024, dtype=np.int64)
    ptr, ref = arr.ctypes.data, weakref.ref(arr)
    reg = dev.register(arr)
    assert reg.ptr == ptr and reg.nbytes == 8192
    del arr
    gc.collect()
    assert ref() is not None  # the registration holds the array
    del reg
    gc.collect()
    assert ref() is None


def test_register_bytearray_is_pinned_and_reachable(device_pair):
    server, client = device_pair
    buf = bytearray(b"\x00" * 256)
    reg = server.register(buf)
    assert reg.ptr == np.frombuffer(buf, np.uint8).ctypes.data and reg.nbytes == 256
    with pytest.raises(BufferError):
        buf.extend(b"x" * 4096)  # a resize would move the registered memory: refused while registered
    server.publish("ba", reg)
    src = client.empty((256,), "uint8")
    np.asarray(src)[:] = np.arange(256, dtype=np.uint8)
    ch = device_pair.channel()
    ch.write(src, ch.lookup("ba")).wait(10)
    ch.flush().wait(10)
    assert bytes(buf) == bytes(range(256))


def test_register_accepts_arrays_tensors_and_dlpack(dev):
    arr, ba = np.zeros(64, np.float32), bytearray(64)
    regs = [dev.register(arr), dev.register(ba)]
    assert regs[0].ptr == arr.ctypes.data and regs[0].nbytes == 256
    assert regs[1].ptr == np.frombuffer(ba, np.uint8).ctypes.data and regs[1].nbytes == 64

    class Producer:  # a DLPack producer that is neither numpy nor torch
        def __init__(self):
            self.arr = np.ones(32, np.int32)

        def __dlpack__(self, **kwargs):
            return self.arr.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.arr.__dlpack_device__()

    p = Producer()
    regs.append(dev.register(p))
    assert regs[-1].ptr == p.arr.ctypes.data and regs[-1].nbytes == 128
    blk = dev.empty((16,), "float64")
    regs.append(dev.register(blk))
    assert regs[-1].ptr == blk.ptr and regs[-1].nbytes == 128
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        t = torch.zeros(10, dtype=torch.float32)
        regs.append(dev.register(t))
        assert regs[-1].ptr == t.data_ptr() and regs[-1].nbytes == 40


@pytest.mark.parametrize(
    "ptr, nbytes, match",
    [
        (-1, 8, "ptr"),
        (1 << 64, 8, "ptr"),
        (4096, -8, "nbytes"),
        (4096, 1 << 64, "nbytes"),
        ((1 << 64) - 4096, 1 << 20, "wraps"),
        (0, 8, "null"),
    ],
)
def test_register_memory_low_level_ranges(dev, ptr, nbytes, match):
    with pytest.raises(tw.InvalidArgument, match=match):
        dev.register_memory(ptr, nbytes)


# ---------------------------------------------------------------- write / read arguments


BAD_RANGES = [
    (dict(nbytes=2**63), "nbytes"),
    (dict(nbytes=2**64), "nbytes"),
    (dict(nbytes=2**64 - 1), "nbytes"),
    (dict(nbytes=-1), "nbytes"),
    (dict(nbytes=1.5), "nbytes"),
    (dict(nbytes=65), "nbytes"),
    (dict(local_offset=2**64 - 1), "local_offset"),
    (dict(local_offset=2**64), "local_offset"),
    (dict(local_offset=-1), "local_offset"),
    (dict(remote_offset=2**64 - 8, nbytes=16), "remote_offset"),
    (dict(remote_offset=2**70), "remote_offset"),
    (dict(local_offset=8, nbytes=2**64 - 8), "nbytes"),  # offset + nbytes wraps to 0
    (dict(local_offset=8, nbytes=64), "local region"),
    (dict(remote_offset=32, nbytes=48), "remote region"),
]


@pytest.mark.parametrize("op", ["write", "read", "write_ordered"])
def test_bad_ranges_raise_and_the_channel_still_works(device_pair, op):
    server, client = device_pair
    dst = server.empty((16,), "int32")
    np.asarray(dst)[:] = -1
    server.publish("dst", dst)
    src = client.empty((16,), "int32")
    np.asarray(src)[:] = np.arange(16)
    ch = device_pair.channel()
    remote = ch.lookup("dst")
    posted = ch.stats()["posted"] + ch.stats()["direct_writes"] + ch.stats()["direct_reads"]
    for kwargs, match in BAD_RANGES:
        with pytest.raises(tw.InvalidArgument, match=match):
            getattr(ch, op)(src, remote, **kwargs)
    assert ch.stats()["posted"] + ch.stats()["direct_writes"] + ch.stats()["direct_reads"] == posted
    # a good operation afterwards: the data arrives
    if op == "read":
        np.asarray(dst)[:] = np.arange(16) * 3
        ch.read(src, remote, local_offset=8, remote_offset=8, nbytes=56).wait(10)
        np.testing.assert_array_equal(np.asarray(src), np.r_[np.arange(2), np.arange(2, 16) * 3])
    else:
        getattr(ch, op)(src, remote, local_offset=4, remote_offset=4, nbytes=60).wait(10)
        ch.flush().wait(10)
        np.testing.assert_array_equal(np.asarray(dst), np.r_[-1, np.arange(1, 16)])


@pytest.mark.parametrize("op", ["write", "read", "write_ordered"])
def test_a_source_larger_than_its_destination_is_refused_not_cut(device_pair, op):
    """nbytes=None moves the whole local region (what a write sends, what a read
    fills); a remote range too small for it is an error, not a silent cut."""
    server, client = device_pair
    small, big = server.empty((16,), "uint8"), client.empty((32,), "uint8")
    np.asarray(small)[:] = 7
    np.asarray(big)[:] = 1
    server.publish(f"small-{op}", small)
    ch = device_pair.channel()
    remote = ch.lookup(f"small-{op}")
    with pytest.raises(
        tw.InvalidArgument,
        match=f"{op.split('_')[0]}: the local region holds 32 bytes .* remote one only 16; pass nbytes",
    ):
        getattr(ch, op)(big, remote)
    ch.flush().wait(10)
    assert (np.asarray(small) == 7).all() and (np.asarray(big) == 1).all()  # nothing moved
    if op == "read":
        part = client.empty((8,), "uint8")
        ch.read(part, remote).wait(10)  # 8 bytes: the local buffer, which the remote holds
        assert (np.asarray(part) == 7).all()
        return
    getattr(ch, op)(big, remote, nbytes=16).wait(10)
    ch.flush().wait(10)
    assert (np.asarray(small) == 1).all()


def test_an_unknown_slot_is_named_as_a_slot(device_pair):
    server, client = device_pair
    ch = device_pair.channel()
    for kind in ("static", "dynamic"):
        with pytest.raises(tw.NotFound, match=f"no {kind} slot named 'nope' on .*device.{kind}_slot"):
            getattr(ch, f"{kind}_sender")("nope")


def test_bad_timeouts_are_refused(device_pair):
    server, client = device_pair
    ch = device_pair.channel()
    req = ch.flush()
    for bad in (float("nan"), "soon"):
        with pytest.raises(tw.InvalidArgument, match="timeout"):
            req.wait(bad)
    req.wait(10)


# ---------------------------------------------------------------- sender arguments


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(path="bogus"), "path"),
        (dict(path=None), "path"),
        (dict(timeout=-1.0), "timeout"),
        (dict(timeout=float("nan")), "timeout"),
        (dict(timeout="10"), "timeout"),
    ],
)
def test_bad_sender_arguments_leave_the_slot_attachable(device_pair, kind, kwargs, match):
    server, client = device_pair
    name = unique(kind)
    if kind == "static":
        slot = server.static_slot(name, (4,), "int32", depth=1)
        make = lambda ch, **kw: ch.static_sender(name, **kw)  # noqa: E731
    else:
        slot = server.dynamic_slot(name)
        make = lambda ch, **kw: ch.dynamic_sender(name, **kw)  # noqa: E731
    ch = device_pair.channel()
    with pytest.raises(tw.InvalidArgument, match=match):
        make(ch, **kwargs)
    if kind == "static":
        assert not slot.has_sender  # the refused sender never attached
    sender = make(ch, path="copy")  # a correct sender still attaches
    want = np.array([7, 8, 9, 10], np.int32)
    req = sender.send(want, timeout=10)
    got = slot.recv(timeout=10)
    np.testing.assert_array_equal(np.asarray(got), want)
    req.wait(10)
    if kind == "static":
        slot.release(got)
    with pytest.raises(tw.InvalidArgument, match="timeout"):
        sender.send(want, timeout=-1)


# ---------------------------------------------------------------- copy-path staging wait


TIMEOUT_S = 1.0


def test_dynamic_copy_path_staging_wait_honours_the_timeout(device_pair):
    """A dynamic send reads the staging block until the receiver takes the
    tensor: with a receiver that does not, the next send must give up (Timeout)
    within its timeout instead of waiting forever."""
    server, client = device_pair
    name = unique("stage")
    slot = server.dynamic_slot(name)
    sender = device_pair.channel().dynamic_sender(name, path="copy")
    first = np.full(64, 1, np.int64)
    req1 = sender.send(first, timeout=TIMEOUT_S)  # pending: nobody receives
    start = time.monotonic()
    with pytest.raises(tw.Timeout, match="staging buffer"):
        sender.send(np.full(64, 2, np.int64), timeout=TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S + 5
    # nothing was lost: once the receiver takes the first, sending goes on
    np.testing.assert_array_equal(np.asarray(slot.recv(timeout=10)), first)
    req1.wait(10)
    third = np.full(64, 3, np.int64)
    req3 = sender.send(third, timeout=10)
    np.testing.assert_array_equal(np.asarray(slot.recv(timeout=10)), third)
    req3.wait(10)


def test_static_copy_path_send_honours_the_timeout(device_pair):
    """A static slot of depth 1 whose receiver never releases: the second send
    (copy path) raises Timeout within its timeout."""
    server, client = device_pair
    name = unique("stage")
    slot = server.static_slot(name, (64,), "int64", depth=1)
    sender = device_pair.channel().static_sender(name, path="copy")
    sender.send(np.full(64, 1, np.int64), timeout=TIMEOUT_S).wait(10)
    held = slot.recv(timeout=10)  # received, never released
    start = time.monotonic()
    with pytest.raises(tw.Timeout):
        sender.send(np.full(64, 2, np.int64), timeout=TIMEOUT_S).wait(TIMEOUT_S + 5)
    assert time.monotonic() - start < TIMEOUT_S + 5
    assert int(np.asarray(held)[0]) == 1


def test_infinite_timeouts_mean_no_bound(device_pair):
    """inf (or a timeout past what a clock deadline holds) waits without bound
    rather than overflowing into an immediate Timeout."""
    server, client = device_pair
    name = unique("inf")
    slot = server.dynamic_slot(name)
    sender = device_pair.channel().dynamic_sender(name, timeout=float("inf"))
    want = np.arange(8, dtype=np.int16)
    req = sender.send(want, timeout=1e300)
    np.testing.assert_array_equal(np.asarray(slot.recv(timeout=float("inf"))), want)
    req.wait(float("inf"))
    assert req.done()
