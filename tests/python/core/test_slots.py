"""Tensor slots (static placement and dynamic allocation) across processes,
over tcp and shm, in both protocol forms (one-sided RMA and messages, forced
with TENSORWIRE_LANE_FORM: contracts §12), and over tcp with every static
tensor placed (TENSORWIRE_PLACE).

The peer process (tests/python/_peers.py:slot_peer) holds the slots, or the
senders, and is driven through its pipe: it reports what it received (raw
bytes, or the value every element was filled with) and the tests compare on
this side. One peer per transport serves most of the module; tests that kill
a peer start their own.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
import threading
import time

import numpy as np
import pytest

import tensorwire as tw
from _peers import slot_tensor
from conftest import LANE_FORMS, TRANSPORTS, lane_form, start_slot_peer

DTYPES = sorted(tw.DTYPE_TABLE)
SHAPES = [(), (0,), (3, 0), (7,), (2, 3, 5)]
DEAD_PEER_ERRORS = (tw.PeerFailed, tw.ConnectionError)
DETECT_S = 10.0  # a dead peer must fail pending slot work within this

_names = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{next(_names)}"


def op(_peer, _op: str, _timeout: float = 30.0, **kwargs) -> dict:
    """One request {"op": _op, **kwargs} to the slot peer; its reply."""
    return _peer.request({"op": _op, **kwargs}, _timeout)


# ---------------------------------------------------------------- fixtures


# Placed sends (contracts §12) are a tcp matter: over shared memory a forced
# message form would place by a direct copy, which the rma form covers.
TRANSPORT_FORMS = [(t, f) for t in TRANSPORTS for f in LANE_FORMS] + [("tcp", "placed")]
TRANSPORT_FORM_IDS = [f"{t}-{f}" for t, f in TRANSPORT_FORMS]


@pytest.fixture(scope="module", params=TRANSPORT_FORMS, ids=TRANSPORT_FORM_IDS)
def peer(request):
    """One slot peer per transport and protocol form for the module."""
    transport, form = request.param
    with lane_form(form), start_slot_peer(transport) as p:
        p.transport, p.form = transport, form
        yield p


@pytest.fixture(scope="module")
def client(peer):
    with lane_form(peer.form), tw.Device(transport=peer.transport, slab_size=4 << 20) as dev:
        yield dev


@pytest.fixture(scope="module")
def channel(peer, client):
    return client.connect(peer.address)


@pytest.fixture(scope="module")
def reverse_peer(peer, client, channel):
    """The module's peer, connected back to `client` to act as a sender."""
    op(peer, "connect", address=client.address)
    return peer


def fill_block(block, values: np.ndarray) -> None:
    np.asarray(block)[...] = values  # bfloat16 blocks view as uint16 words: the raw bits


def expect_items(got: dict, expected: list[np.ndarray]) -> None:
    assert "raised" not in got, got.get("message")
    assert len(got["items"]) == len(expected)
    for item, want in zip(got["items"], expected):
        assert tuple(item["shape"]) == want.shape
        assert item["dtype"] == want.dtype.name
        assert item["data"] == want.tobytes()


# ---------------------------------------------------------------- contents, every dtype and shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_slot_contents_every_dtype_and_shape(peer, client, channel, dtype):
    for k, shape in enumerate(SHAPES):
        name = unique("static")
        assert op(peer, "static_slot", name=name, shape=shape, dtype=dtype, depth=2)["next_seq"] == 1
        sender = channel.static_sender(name)
        assert list(sender.shape) == list(shape) and sender.dtype == dtype
        expected = []
        blk = client.empty(shape, dtype)  # zero copy from a pool block
        want = slot_tensor(dtype, shape, seed=100 * k + 1)
        fill_block(blk, want)
        sender.send(blk).wait(10)
        expected.append(want)
        if dtype != "bfloat16":  # numpy has no bfloat16: only the block path above
            want = slot_tensor(dtype, shape, seed=100 * k + 2)
            sender.send(want).wait(10)  # copy path
            expected.append(want)
        got = op(peer, "recv", name=name, count=len(expected))
        expect_items(got, expected)
        assert got["next_seq"] == 1 + len(expected)
        assert got["stats"]["received"] == len(expected)
        assert got["stats"]["bytes"] == sum(e.nbytes for e in expected)
        op(peer, "drop", name=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dynamic_slot_contents_every_dtype_and_shape(peer, client, channel, dtype):
    name = unique("dynamic")
    op(peer, "dynamic_slot", name=name)
    sender = channel.dynamic_sender(name)
    expected, blocks = [], []
    for k, shape in enumerate(SHAPES):
        want = slot_tensor(dtype, shape, seed=100 * k + 3)
        blk = client.empty(shape, dtype)
        fill_block(blk, want)
        blocks.append(blk)
        expected.append(want)
        if dtype != "bfloat16":
            expected.append(slot_tensor(dtype, shape, seed=100 * k + 4))
    # each send waits for the previous one's ack: the peer receives meanwhile
    peer.send({"op": "recv", "name": name, "count": len(expected)})
    sends = iter(expected)
    for blk in blocks:
        next(sends)
        sender.send(blk).wait(10)
        if dtype != "bfloat16":
            sender.send(next(sends)).wait(10)
    got = peer.recv(30)
    expect_items(got, expected)
    for item, want in zip(got["items"], expected):
        assert item["block_shape"] == list(want.shape)
        assert item["format"] == tw.DTYPE_TABLE[dtype][2]
    assert got["stats"]["received"] == len(expected) and got["stats"]["rejected"] == 0
    assert got["next_seq"] == 1 + len(expected)
    st = sender.stats()
    assert st["sent"] == len(expected) and st["rejected"] == 0
    op(peer, "drop", name=name)


# ---------------------------------------------------------------- sequence numbers


def test_static_sequence_numbers_past_2_32(peer, channel):
    first = 2**32 - 3
    name = unique("seq")
    assert op(peer, "static_slot", name=name, shape=[8], dtype="uint64", depth=2, first_seq=first)["next_seq"] == first
    sender = channel.static_sender(name)
    count = 8
    peer.send({"op": "recv", "name": name, "count": count, "mode": "fill"})
    for i in range(count):
        sender.send(np.full(8, first + i, dtype=np.uint64)).wait(10)
    got = peer.recv(30)
    assert got["values"] == [first + i for i in range(count)] and got["nonuniform"] == 0
    assert got["next_seq"] == first + count
    assert sender.sent == first + count - 1
    sender.wait_consumed(first + count - 1, 10)
    assert sender.consumed == first + count - 1
    op(peer, "drop", name=name)


# ---------------------------------------------------------------- back-to-back, flow control


@pytest.mark.parametrize("via", ["copy", "block"])
@pytest.mark.parametrize("depth", [1, 2])
def test_static_back_to_back_never_overwrites(peer, client, channel, depth, via):
    count, shape = (2000 if via == "copy" else 1000), (16,)
    name = unique("b2b")
    op(peer, "static_slot", name=name, shape=shape, dtype="int64", depth=depth)
    sender = channel.static_sender(name)
    peer.send({"op": "recv", "name": name, "count": count, "mode": "fill"})
    if via == "copy":
        for i in range(count):
            sender.send(np.full(shape, i, dtype=np.int64))
    else:  # a ring of pool blocks: one is refilled only once its send completed
        ring = [client.empty(shape, "int64") for _ in range(depth + 1)]
        reqs = [None] * len(ring)
        for i in range(count):
            j = i % len(ring)
            if reqs[j] is not None:
                reqs[j].wait(10)
            np.asarray(ring[j])[:] = i
            reqs[j] = sender.send(ring[j])
        for r in reqs:
            r.wait(10)
    got = peer.recv(60)
    assert "raised" not in got, got.get("message")
    assert got["nonuniform"] == 0
    assert got["values"] == list(range(count))
    sender.wait_consumed(count, 10)
    st = sender.stats()
    assert st["sent"] == count and st["bytes"] == count * 128
    op(peer, "drop", name=name)


def test_dynamic_back_to_back(peer, channel):
    count = 1000
    name = unique("dynb2b")
    op(peer, "dynamic_slot", name=name)
    sender = channel.dynamic_sender(name)
    peer.send({"op": "recv", "name": name, "count": count, "mode": "fill"})
    last = None
    for i in range(count):
        last = sender.send(np.full((i % 7 + 1, 3), i, dtype=np.int32))
    last.wait(10)
    got = peer.recv(60)
    assert "raised" not in got, got.get("message")
    assert got["nonuniform"] == 0 and got["values"] == list(range(count))
    assert got["stats"]["received"] == count
    assert sender.stats()["sent"] == count
    op(peer, "drop", name=name)


def test_static_slow_receiver_makes_sender_wait(peer, channel):
    count = 60
    name = unique("slow")
    op(peer, "static_slot", name=name, shape=[32], dtype="float64", depth=2)
    sender = channel.static_sender(name)
    peer.send({"op": "recv", "name": name, "count": count, "mode": "fill", "sleep": 0.004})
    for i in range(count):
        sender.send(np.full(32, i, dtype=np.float64), timeout=10)
    got = peer.recv(60)
    assert got["values"] == list(range(count)) and got["nonuniform"] == 0  # each once, in order
    assert sender.stats()["waits_for_ack"] > 0
    op(peer, "drop", name=name)


def test_dynamic_slow_receiver_makes_sender_wait(peer, client, channel):
    count = 40
    name = unique("dynslow")
    op(peer, "dynamic_slot", name=name)
    sender = channel.dynamic_sender(name)
    peer.send({"op": "recv", "name": name, "count": count, "mode": "fill", "sleep": 0.004})
    ring = [client.empty((8,), "int16") for _ in range(2)]
    reqs = [None, None]
    for i in range(count):
        j = i % 2
        if reqs[j] is not None:
            reqs[j].wait(10)
        np.asarray(ring[j])[:] = i
        reqs[j] = sender.send(ring[j], timeout=10)  # waits for the previous tensor's ack
    for r in reqs:
        r.wait(10)
    got = peer.recv(60)
    assert got["values"] == list(range(count)) and got["nonuniform"] == 0
    assert sender.stats()["waits_for_ack"] > 0
    op(peer, "drop", name=name)


# ---------------------------------------------------------------- refusals on the sender's side


@pytest.mark.parametrize("path", ["copy", "register"])
def test_static_refuses_wrong_shape_or_dtype(peer, client, channel, path):
    name = unique("refuse")
    op(peer, "static_slot", name=name, shape=[4], dtype="float32", depth=2)
    sender = channel.static_sender(name, path=path)
    stats_before, pool_before = sender.stats(), client.stats()
    wrong = [
        np.zeros(5, np.float32),
        np.zeros(4, np.float64),
        np.zeros((2, 2), np.float32),
        np.zeros((), np.float32),
        np.zeros((4, 1), np.float32),
        np.zeros(4, np.int32),
        client.empty(5, "float32"),
        client.empty(4, "int32"),
        client.empty((1, 4), "float32"),
        client.empty(4, "bfloat16"),
        client.empty((), "float32"),
    ]
    for t in wrong:
        with pytest.raises(tw.InvalidArgument, match="refusing"):
            sender.send(t)
    assert sender.stats() == stats_before
    assert sender.sent == 0
    pool_after = client.stats()
    assert pool_after["registrations"] == pool_before["registrations"]  # nothing registered either
    assert op(peer, "poll", name=name)["none"]  # nothing arrived
    good = np.arange(4, dtype=np.float32) + 0.5
    sender.send(good).wait(10)
    got = op(peer, "recv", name=name)
    expect_items(got, [good])
    assert got["next_seq"] == 2 and got["stats"]["received"] == 1
    op(peer, "drop", name=name)


@pytest.mark.parametrize("path", ["copy", "register"])
def test_dynamic_sender_refuses_over_limits(peer, client, channel, path):
    name = unique("dynrefuse")
    op(peer, "dynamic_slot", name=name, max_ndim=2, max_nbytes=1024)
    sender = channel.dynamic_sender(name, path=path)
    before = sender.stats()
    for t in [
        client.empty((2, 2, 2), "int8"),
        client.empty((257,), "float32"),
        np.zeros((2, 2, 2), np.int8),
        np.zeros(257, np.float32),
    ]:
        with pytest.raises(tw.InvalidArgument, match="dimensions|limit"):
            sender.send(t)
    assert sender.stats() == before
    assert op(peer, "poll", name=name)["none"]
    good = slot_tensor("int16", (16, 32), seed=5)  # 1024 bytes: at the limit
    req = sender.send(good)
    got = op(peer, "recv", name=name)
    req.wait(10)
    expect_items(got, [good])
    op(peer, "drop", name=name)


# ---------------------------------------------------------------- lying dynamic records

RECORD_MAGIC = 0x52445754
RECORD_HEADER = 40
MAX_RKEY = 2048
LIE_MAX_NDIM = 4
LIE_MAX_NBYTES = 4096


def _align64(n: int) -> int:
    return (n + 63) & ~63


def _rkey_of_descriptor(d: bytes) -> bytes:
    """The packed rkey inside a region descriptor (see RegionDescriptor::to_bytes)."""
    (rkey_len,) = struct.unpack_from("<I", d, 32)
    return bytes(d[36 : 36 + rkey_len])


def _record(
    max_ndim: int,
    *,
    code: int,
    bits: int,
    dims: list[int],
    nbytes: int,
    address: int,
    device_id: int,
    rkey: bytes,
    version: int = 1,
    magic: int = RECORD_MAGIC,
    ndim: int | None = None,
    rkey_len: int | None = None,
) -> bytes:
    """A dynamic-slot record as the layout at the top of dynamic_slot.cc documents it."""
    rec = bytearray(RECORD_HEADER + 8 * max_ndim + len(rkey))
    struct.pack_into(
        "<IHBBIIQQQ",
        rec,
        0,
        magic,
        version,
        code,
        bits,
        len(dims) if ndim is None else ndim,
        len(rkey) if rkey_len is None else rkey_len,
        nbytes,
        address,
        device_id,
    )
    struct.pack_into(f"<{len(dims)}q", rec, RECORD_HEADER, *dims)
    rec[RECORD_HEADER + 8 * max_ndim :] = rkey
    return bytes(rec)


def _write_record(client, channel, remote, record_size: int, seq: int, record: bytes) -> None:
    """Writes the record, fences, then its sequence word (as a sender does)."""
    body = client.alloc(len(record))
    np.asarray(body)[:] = np.frombuffer(record, dtype=np.uint8)
    word = client.alloc(8)
    np.asarray(word).view(np.uint64)[0] = seq
    a = channel.write(body, remote)
    channel.fence()
    b = channel.write(word, remote, remote_offset=record_size - 64)
    a.wait(10)
    b.wait(10)
    channel.flush().wait(10)


LIES = {
    "size_mismatch": ({"nbytes": 68}, "nbytes does not match"),
    "over_max_nbytes": ({"dims": [2048], "nbytes": 8192}, "exceeds the slot's limit"),
    "overflowing_dims": ({"dims": [1 << 40, 1 << 40], "nbytes": 64}, "exceeds the slot's limit"),
    "unknown_dtype_code": ({"code": 3}, "unknown dtype"),
    "unknown_dtype_bits": ({"code": 2, "bits": 8, "nbytes": 16}, "unknown dtype"),
    "bad_version": ({"version": 2}, "unknown record version"),
    "bad_magic": ({"magic": 0x12345678}, "bad magic"),
    "ndim_over_max": ({"ndim": LIE_MAX_NDIM + 1}, "too many dimensions"),
    "negative_dim": ({"dims": [-4, -4]}, "negative dimension"),
    "no_rkey": ({"rkey_len": 0}, "bad remote key"),
    "rkey_too_long": ({"rkey_len": MAX_RKEY + 1}, "bad remote key"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_dynamic_slot_rejects_lying_record(peer, client, channel, lie):
    name = unique("lie")
    created = op(peer, "dynamic_slot", name=name, max_ndim=LIE_MAX_NDIM, max_nbytes=LIE_MAX_NBYTES)
    record_size = created["record_size"]
    assert record_size == _align64(RECORD_HEADER + 8 * LIE_MAX_NDIM + MAX_RKEY) + 64
    sender = channel.dynamic_sender(name)  # attaches: the receiver now knows this device
    remote = sender.region  # the record memory, exported to this sender by the attach
    assert remote.nbytes >= record_size
    first = slot_tensor("float32", (4, 4), seed=11)
    req = sender.send(first)
    expect_items(op(peer, "recv", name=name), [first])
    req.wait(10)

    data = client.empty((4, 4), "float32")
    want = slot_tensor("float32", (4, 4), seed=12)
    fill_block(data, want)
    exported = channel.export_region(data)  # the receiver reads only exported ranges, with the key exported
    good = dict(
        code=2,
        bits=32,
        dims=[4, 4],
        nbytes=64,
        address=data.ptr,
        device_id=client.id,
        rkey=_rkey_of_descriptor(exported),
    )
    change, message = LIES[lie]
    seq = op(peer, "next_seq", name=name)["next_seq"]
    assert seq == 2
    _write_record(client, channel, remote, record_size, seq, _record(LIE_MAX_NDIM, **{**good, **change}))
    got = op(peer, "recv", name=name, timeout=10)
    assert got.get("raised") == "InvalidArgument", got
    assert message in got["message"] and f"record {seq}" in got["message"]
    assert got["in_use_after_error"] == got["in_use_before_error"]  # nothing allocated for it
    assert got["stats"]["rejected"] == 1 and got["stats"]["received"] == 1
    assert got["next_seq"] == seq + 1

    # the next valid record is received, and read from our memory
    _write_record(client, channel, remote, record_size, seq + 1, _record(LIE_MAX_NDIM, **good))
    got = op(peer, "recv", name=name, timeout=10)
    expect_items(got, [want])
    before, after = got["in_use"][0]
    assert after - before >= want.nbytes  # a received tensor does show in the pool's stats
    assert got["stats"]["rejected"] == 1 and got["stats"]["received"] == 2
    op(peer, "drop", name=name)


# ---------------------------------------------------------------- paths: copy, register, zero copy


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_copy_register_and_zero_copy_paths(peer, client, channel, kind):
    shape, dtype = (64,), "float32"
    for path in ["copy", "register"]:
        name = unique(f"path-{path}")
        if kind == "static":
            op(peer, "static_slot", name=name, shape=shape, dtype=dtype, depth=2)
            sender = channel.static_sender(name, path=path)
        else:
            op(peer, "dynamic_slot", name=name)
            sender = channel.dynamic_sender(name, path=path)
        assert sender.path == path
        peer.send({"op": "recv", "name": name, "count": 2})
        arr = slot_tensor(dtype, shape, seed=21)
        pool = client.stats()
        lookups_before = pool["registration_cache_hits"] + pool["registration_cache_misses"]
        sender.send(arr).wait(10)
        st = sender.stats()
        if path == "copy":
            assert (st["copies"], st["registrations"], st["zero_copy"]) == (1, 0, 0)
        else:
            assert (st["copies"], st["registrations"], st["zero_copy"]) == (0, 1, 0)
            pool = client.stats()
            assert pool["registration_cache_hits"] + pool["registration_cache_misses"] > lookups_before
        blk = client.empty(shape, dtype)
        want = slot_tensor(dtype, shape, seed=22)
        fill_block(blk, want)
        sender.send(blk).wait(10)  # a pool block: neither copied nor registered
        st2 = sender.stats()
        assert st2["zero_copy"] == 1 and st2["copies"] == st["copies"]
        assert st2["registrations"] == st["registrations"] and st2["sent"] == 2
        expect_items(peer.recv(30), [arr, want])
        op(peer, "drop", name=name)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_register_path_keeps_temporaries_alive(peer, channel, kind):
    """send(temporary) on the register path: the sent bytes are those of the
    temporary, even when it is dropped right away and its memory reused."""
    count, shape = 200, (4096,)  # 32 KiB: malloc reuses freed chunks at once
    name = unique("tmp")
    if kind == "static":
        op(peer, "static_slot", name=name, shape=shape, dtype="int64", depth=2)
        sender = channel.static_sender(name, path="register")
    else:
        op(peer, "dynamic_slot", name=name)
        sender = channel.dynamic_sender(name, path="register")
    peer.send({"op": "recv", "name": name, "count": count, "mode": "fill"})
    reqs = []
    for i in range(count):
        reqs.append(sender.send(np.full(shape, i, dtype=np.int64)))
        scribble = np.full(shape, -1, dtype=np.int64)  # likely lands on the freed temporary
        del scribble
    for r in reqs:
        r.wait(10)
    got = peer.recv(60)
    assert got["nonuniform"] == 0 and got["values"] == list(range(count))
    op(peer, "drop", name=name)


TORCH_DTYPES = ["float32", "bfloat16", "float16", "int64", "int8", "uint8", "bool"]


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_torch_tensors(peer, channel, kind):
    """torch tensors in; the receiver views them with torch.from_numpy (static
    slot views) or torch.from_dlpack (dynamic Blocks), zero copy."""
    torch = pytest.importorskip("torch")

    def tensor(dtype: str, seed: int, shape=(3, 4)):
        t = torch.arange(12, dtype=torch.int64).reshape(shape) * (seed + 3) % 11 - 5
        return t.bool() if dtype == "bool" else t.to(getattr(torch, dtype))

    def raw(t) -> bytes:
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    if kind == "dynamic":
        dyn = {path: unique(f"torchdyn-{path}") for path in ["copy", "register"]}
        for name in dyn.values():
            op(peer, "dynamic_slot", name=name)
        senders = {path: channel.dynamic_sender(name, path=path) for path, name in dyn.items()}
    for dtype in TORCH_DTYPES:
        t1, t2 = tensor(dtype, 1), tensor(dtype, 2)
        strided = tensor(dtype, 3, shape=(4, 3)).T  # (3, 4), not contiguous
        assert not strided.is_contiguous()
        if kind == "static":
            names = {path: unique("torchst") for path in ["copy", "register"]}
            for name in names.values():
                op(peer, "static_slot", name=name, shape=[3, 4], dtype=dtype, depth=2)
            s_copy = channel.static_sender(names["copy"], path="copy")
            s_reg = channel.static_sender(names["register"], path="register")
        else:
            s_copy, s_reg = senders["copy"], senders["register"]
            peer.send({"op": "recv", "name": dyn["copy"], "count": 2, "mode": "torch"})
        c0, r0 = s_copy.stats(), s_reg.stats()
        s_copy.send(t1).wait(10)
        s_copy.send(strided).wait(10)  # the copy path makes it contiguous
        with pytest.raises(tw.InvalidArgument, match="contiguous"):
            s_reg.send(strided)  # register needs contiguous memory
        if kind == "static":
            got_copy = op(peer, "recv", name=names["copy"], count=2, mode="torch")
            peer.send({"op": "recv", "name": names["register"], "count": 1, "mode": "torch"})
        else:
            got_copy = peer.recv(30)
            peer.send({"op": "recv", "name": dyn["register"], "count": 1, "mode": "torch"})
        s_reg.send(t2).wait(10)
        got_reg = peer.recv(30)
        assert s_copy.stats()["copies"] - c0["copies"] == 2
        assert s_reg.stats()["registrations"] - r0["registrations"] == 1 and s_reg.stats()["copies"] == 0
        items = got_copy["items"] + got_reg["items"]
        assert len(items) == 3
        for item, t in zip(items, [t1, strided, t2]):
            assert item["dtype"] == str(t.dtype)
            assert item["shape"] == list(t.shape)
            assert item["data"] == raw(t)
            assert item["zero_copy"]
        if kind == "static":
            for name in names.values():
                op(peer, "drop", name=name)


# ---------------------------------------------------------------- poll and asyncio (this process receives)


def _make_slot(client, kind: str, name: str):
    return client.static_slot(name, (5,), "int16", depth=2) if kind == "static" else client.dynamic_slot(name)


def _value_and_release(slot, kind: str, got) -> np.ndarray:
    arr = np.array(got if kind == "static" else np.asarray(got))
    if kind == "static":
        slot.release(got)
    else:
        got.release()
    return arr


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_poll_before_and_after_arrival(client, reverse_peer, kind):
    peer = reverse_peer
    name = unique(f"poll-{kind}")
    slot = _make_slot(client, kind, name)
    assert slot.poll() is None  # no sender yet
    op(peer, "sender", kind=kind, name=name)
    if kind == "static":
        assert slot.has_sender
    for _ in range(20):
        assert slot.poll() is None  # attached, nothing sent
    peer.send({"op": "send", "name": name, "shape": [5], "dtype": "int16", "start": 7, "count": 1})
    deadline = time.monotonic() + 10
    got = None
    while got is None and time.monotonic() < deadline:
        got = slot.poll()
        if got is None:
            time.sleep(0.0005)
    assert got is not None, "poll() never returned the tensor"
    arr = _value_and_release(slot, kind, got)
    assert arr.shape == (5,) and arr.dtype == np.int16 and (arr == 7).all()
    reply = peer.recv(10)
    assert reply["sent"] == 1 and "raised" not in reply
    assert slot.poll() is None
    assert slot.stats()["received"] == 1
    op(peer, "drop", name=name)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_recv_async(client, reverse_peer, kind):
    peer = reverse_peer
    name = unique(f"async-{kind}")
    slot = _make_slot(client, kind, name)
    op(peer, "sender", kind=kind, name=name)
    count = 3

    async def main():
        with pytest.raises(tw.Timeout):
            await slot.recv_async(timeout=0.05)  # nothing sent yet
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        tick_task = asyncio.create_task(ticker())
        peer.send(
            {"op": "send", "name": name, "shape": [5], "dtype": "int16", "start": 40, "count": count, "delay": 0.2}
        )
        values = []
        for _ in range(count):
            got = await slot.recv_async(timeout=10)
            arr = _value_and_release(slot, kind, got)
            values.append(int(arr[0]))
            assert (arr == arr[0]).all()
        done.set()
        await tick_task
        return values, ticks

    values, ticks = asyncio.run(main())
    assert values == [40, 41, 42]
    assert ticks >= 10, "recv_async blocked the event loop"
    assert peer.recv(10)["sent"] == count
    op(peer, "drop", name=name)


def test_recv_async_on_a_full_slot_says_so_at_once(client, reverse_peer):
    """A static slot holding `depth` tensors cannot receive: recv_async raises
    at once (wait_any reports such a slot ready so that the receive says why)."""
    peer = reverse_peer
    name = unique("async-full")
    slot = client.static_slot(name, (5,), "int16", depth=1)
    op(peer, "sender", kind="static", name=name)
    peer.send({"op": "send", "name": name, "shape": [5], "dtype": "int16", "start": 3, "count": 1})
    held = slot.recv(timeout=10)
    assert peer.recv(10)["sent"] == 1
    start = time.monotonic()
    with pytest.raises(tw.InvalidArgument, match="held"):
        asyncio.run(slot.recv_async(timeout=5))
    assert time.monotonic() - start < 2
    slot.release(held)
    op(peer, "drop", name=name)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_cancelled_recv_async_loses_no_tensor(client, reverse_peer, kind):
    """A cancelled recv_async consumed nothing: the tensor sent afterwards is
    the next recv's."""
    peer = reverse_peer
    name = unique(f"cancel-{kind}")
    slot = _make_slot(client, kind, name)
    op(peer, "sender", kind=kind, name=name)

    async def main():
        task = asyncio.create_task(slot.recv_async(timeout=30))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    peer.send({"op": "send", "name": name, "shape": [5], "dtype": "int16", "start": 5, "count": 1})
    arr = _value_and_release(slot, kind, slot.recv(timeout=10))
    assert (arr == 5).all()
    assert peer.recv(10)["sent"] == 1
    op(peer, "drop", name=name)


def test_wait_any_says_which_slot_is_ready(client, reverse_peer):
    """tw.wait_any: which of several slots has a tensor (nothing consumed), a
    request's completion, the deadline, bad input."""
    peer = reverse_peer
    names = {kind: unique(f"any-{kind}") for kind in ("static", "dynamic")}
    slots = [_make_slot(client, kind, names[kind]) for kind in ("static", "dynamic")]
    for kind in ("static", "dynamic"):
        op(peer, "sender", kind=kind, name=names[kind])
    start = time.monotonic()
    with pytest.raises(tw.Timeout, match="none became ready"):
        tw.wait_any(slots, timeout=0.05)
    assert time.monotonic() - start < 5
    with pytest.raises(tw.InvalidArgument):
        tw.wait_any([])
    with pytest.raises(tw.InvalidArgument, match="static slots, dynamic slots, requests, words and channels"):
        tw.wait_any([slots[0], "slot"])
    for k, kind in ((1, "dynamic"), (0, "static")):
        peer.send({"op": "send", "name": names[kind], "shape": [5], "dtype": "int16", "start": 9 + k, "count": 1})
        assert tw.wait_any(slots, timeout=10) == k
        assert tw.wait_any(slots, timeout=0) == k  # still there: waiting consumed nothing
        arr = _value_and_release(slots[k], kind, slots[k].recv(timeout=0))
        assert (arr == 9 + k).all()
        assert peer.recv(10)["sent"] == 1
    done = client.connect(peer.address).flush()
    assert tw.wait_any([slots[0], done], timeout=10) == 1 and done.done()
    for kind in ("static", "dynamic"):
        op(peer, "drop", name=names[kind])


# ---------------------------------------------------------------- peer death


def _kill_after(peer, delay: float) -> tuple[threading.Timer, dict]:
    when: dict = {}

    def kill():
        when["t"] = time.monotonic()
        peer.kill()

    timer = threading.Timer(delay, kill)
    timer.start()
    return timer, when


def _assert_failed_in_time(timer, when, excinfo_value) -> None:
    timer.join(15)
    assert "t" in when, "the peer was never killed"
    took = time.monotonic() - when["t"]
    assert took < DETECT_S, f"the failure was seen only {took:.1f} s after the peer died ({excinfo_value!r})"


@pytest.mark.parametrize("transport, form", TRANSPORT_FORMS, ids=TRANSPORT_FORM_IDS)
def test_static_sender_blocked_on_ack_fails_when_receiver_dies(transport, form):
    with lane_form(form), start_slot_peer(transport) as peer, tw.Device(transport=transport) as client:
        op(peer, "static_slot", name="s", shape=[4], dtype="int32", depth=1)
        sender = client.connect(peer.address).static_sender("s")
        sender.send(np.zeros(4, np.int32)).wait(10)  # fills the only buffer; never released
        timer, when = _kill_after(peer, 0.5)
        with pytest.raises(DEAD_PEER_ERRORS) as info:
            sender.send(np.ones(4, np.int32), timeout=30)  # blocks waiting for the ack
        _assert_failed_in_time(timer, when, info.value)
        assert sender.stats()["waits_for_ack"] == 1 and sender.stats()["sent"] == 1


@pytest.mark.parametrize("transport, form", TRANSPORT_FORMS, ids=TRANSPORT_FORM_IDS)
def test_dynamic_send_pending_on_ack_fails_when_receiver_dies(transport, form):
    with lane_form(form), start_slot_peer(transport) as peer, tw.Device(transport=transport) as client:
        op(peer, "dynamic_slot", name="d")
        sender = client.connect(peer.address).dynamic_sender("d")
        req = sender.send(np.arange(4, dtype=np.int32))  # the receiver never takes it
        time.sleep(0.1)
        assert not req.test()
        timer, when = _kill_after(peer, 0.5)
        with pytest.raises(DEAD_PEER_ERRORS) as info:
            req.wait(30)
        _assert_failed_in_time(timer, when, info.value)
        assert req.failed


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("transport, form", TRANSPORT_FORMS, ids=TRANSPORT_FORM_IDS)
def test_recv_fails_when_sender_dies(transport, form, kind):
    with lane_form(form), tw.Device(transport=transport) as dev, start_slot_peer(transport) as peer:
        slot = _make_slot(dev, kind, "r")
        op(peer, "connect", address=dev.address)
        op(peer, "sender", kind=kind, name="r")
        peer.send({"op": "send", "name": "r", "shape": [5], "dtype": "int16", "start": 1, "count": 2})
        for i in range(2):
            arr = _value_and_release(slot, kind, slot.recv(timeout=10))
            assert (arr == i + 1).all()
        assert peer.recv(10)["sent"] == 2
        timer, when = _kill_after(peer, 0.5)
        with pytest.raises(DEAD_PEER_ERRORS) as info:
            slot.recv(timeout=30)  # nothing more comes: the sender dies
        _assert_failed_in_time(timer, when, info.value)


@pytest.mark.parametrize("transport, form", TRANSPORT_FORMS, ids=TRANSPORT_FORM_IDS)
def test_wait_any_fails_when_sender_dies(transport, form):
    with lane_form(form), tw.Device(transport=transport) as dev, start_slot_peer(transport) as peer:
        slots = [_make_slot(dev, kind, f"w-{kind}") for kind in ("static", "dynamic")]
        op(peer, "connect", address=dev.address)
        for kind in ("static", "dynamic"):
            op(peer, "sender", kind=kind, name=f"w-{kind}")
        timer, when = _kill_after(peer, 0.5)
        with pytest.raises(DEAD_PEER_ERRORS) as info:
            tw.wait_any(slots, timeout=30)  # nothing comes: the senders die
        _assert_failed_in_time(timer, when, info.value)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_wait_any_watches_a_channel_and_a_word(transport):
    """A Word is ready once a peer's one-sided write set it; a channel in the
    list is never ready and fails the wait when its peer dies."""
    with tw.Device(transport=transport) as dev, start_slot_peer(transport) as peer:
        flags = dev.empty((4,), "uint64")
        np.asarray(flags)[:] = 0
        with pytest.raises(tw.InvalidArgument, match="8-byte aligned and inside"):
            tw.Word(flags, 4, 1)
        with pytest.raises(tw.InvalidArgument, match="8-byte aligned and inside"):
            tw.Word(flags, 32, 1)
        ch = dev.connect(peer.address)
        word = tw.Word(flags, 16, 7, ch)
        with pytest.raises(tw.Timeout, match="the word at offset 16 to become 7"):
            tw.wait_any([ch, word], timeout=0.05)
        np.asarray(flags)[2] = 7  # as a peer's write would land
        assert tw.wait_any([ch, word], timeout=10) == 1
        timer, when = _kill_after(peer, 0.5)
        with pytest.raises(DEAD_PEER_ERRORS) as info:
            tw.wait_any([ch, tw.Word(flags, 0, 1, ch)], timeout=30)
        _assert_failed_in_time(timer, when, info.value)


# ---------------------------------------------------------------- forms


@pytest.mark.parametrize("progress", ["inline", "blocking"])
@pytest.mark.parametrize("transport, form", TRANSPORT_FORMS, ids=TRANSPORT_FORM_IDS)
def test_release_reaches_sender_while_receiver_does_other_things(transport, form, progress):
    """A receiver that releases and then leaves tensorwire alone (here: blocks
    on its pipe) still lets its sender go on: a release is never held back
    for a flush that would not come (inline progress has no thread to send a
    deferred release; the message form once deferred it there too)."""
    with (
        lane_form(form),
        start_slot_peer(transport, progress=progress) as peer,
        tw.Device(transport=transport) as client,
    ):
        name = unique("idle-release")
        op(peer, "static_slot", name=name, shape=[16], dtype="int32", depth=1)
        sender = client.connect(peer.address).static_sender(name)
        for i in range(3):
            # Not waited yet: over emulated RMA an inline receiver must drive
            # progress for the send itself to complete, which its recv does.
            request = sender.send(np.full(16, i, np.int32))
            got = op(peer, "recv", name=name, count=1, mode="fill")  # received and released; then idle
            assert "raised" not in got, got.get("message")
            assert got["values"] == [i]
            request.wait(10)
            sender.wait_consumed(sender.sent, 10)  # Timeout here: the release never left the receiver
        assert sender.consumed == 3


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("progress", ["blocking", "inline"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_napping_receiver_is_rung_by_its_sender(transport, progress, kind):
    """A slot's receiver that waited past its spin naps. In the one-sided form
    over shared memory it first raises a flag in its sender's ack block, and
    the sender, having set the sequence word, rings (a wake message that ends
    the nap; stats()['doorbells']). Over tcp every tensor is a message, which
    wakes it by itself: no doorbell. Contents intact either way."""
    with (
        start_slot_peer(transport, progress=progress) as peer,
        tw.Device(transport=transport, progress=progress) as dev,
    ):
        name = unique("rung")
        if kind == "static":
            op(peer, "static_slot", name=name, shape=[16], dtype="int32", depth=2)
            sender = dev.connect(peer.address).static_sender(name)
        else:
            op(peer, "dynamic_slot", name=name)
            sender = dev.connect(peer.address).dynamic_sender(name)
        for i in range(3):
            peer.send({"op": "recv", "name": name, "count": 1, "mode": "fill"})
            time.sleep(0.2)  # the receiver spun out and naps
            sender.send(np.full(16, i, np.int32)).wait(10)
            got = peer.recv(30)
            assert "raised" not in got, got.get("message")
            assert got["values"] == [i]
            if kind == "static":
                sender.wait_consumed(i + 1, 10)
        one_sided = transport == "shm" and not dev.connect(peer.address).form == "messages"
        assert sender.stats()["doorbells"] == (3 if one_sided else 0), sender.stats()


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_receiver_napping_in_wait_any_is_rung(transport, kind):
    """wait_any on a slot naps like its recv() and asks the sender to ring the
    same way (over shared memory, one-sided: the sender's stats()['doorbells'];
    over tcp the tensor's message wakes it). What it waited for is there."""
    with start_slot_peer(transport) as peer, tw.Device(transport=transport) as dev:
        name = unique("anyrung")
        slot = dev.static_slot(name, (16,), "int32", depth=2) if kind == "static" else dev.dynamic_slot(name)
        op(peer, "connect", address=dev.address)
        op(peer, "sender", kind=kind, name=name)
        for i in range(3):
            # the sender waits 0.2 s: the wait below spins out and naps first
            peer.send(
                {"op": "send", "name": name, "shape": [16], "dtype": "int32", "start": i, "count": 1, "delay": 0.2}
            )
            assert tw.wait_any([slot], 10) == 0
            got = slot.recv(0)
            assert np.asarray(got).tolist() == [i] * 16
            if kind == "static":
                slot.release(got)
            del got
            sent = peer.recv(30)
            assert "raised" not in sent and sent["sent"] == 1, sent
        one_sided = transport == "shm" and dev.connect(peer.address).form != "messages"
        assert sent["stats"]["doorbells"] == (3 if one_sided else 0), sent["stats"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_wait_any_naps_on_sources_that_ring_and_sources_that_do_not(transport):
    """One wait_any over a slot (which asks its sender to ring) and a request
    that does not (over tcp a dynamic send's ack is a message) naps until the
    slot's tensor comes, as TeraSort's shuffle waits: it asks only the sources
    that ring, and each wakes it."""
    with start_slot_peer(transport) as peer, tw.Device(transport=transport) as dev:
        inbound, outbound = unique("any-in"), unique("any-out")
        slot = dev.dynamic_slot(inbound)
        op(peer, "dynamic_slot", name=outbound)
        op(peer, "connect", address=dev.address)
        op(peer, "sender", kind="dynamic", name=inbound)
        pending = dev.connect(peer.address).dynamic_sender(outbound).send(np.full(16, 5, np.int32))
        peer.send(
            {"op": "send", "name": inbound, "shape": [16], "dtype": "int32", "start": 3, "count": 1, "delay": 0.2}
        )
        assert tw.wait_any([slot, pending], 10) == 0  # the peer is away 0.2 s: the wait naps meanwhile
        assert np.asarray(slot.recv(0)).tolist() == [3] * 16
        sent = peer.recv(30)
        assert "raised" not in sent and sent["sent"] == 1, sent
        peer.send({"op": "recv", "name": outbound, "count": 1, "mode": "fill"})
        assert tw.wait_any([pending], 10) == 0
        pending.wait(0)
        got = peer.recv(30)
        assert "raised" not in got and got["values"] == [5], got


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dynamic_sender_napping_in_wait_any_is_rung(transport):
    """wait_any on a dynamic send's request naps like its wait() and asks the
    receiver to ring once the ack is written (over shared memory: the slot's
    stats()['doorbells']; over tcp the ack is a message)."""
    with start_slot_peer(transport) as peer, tw.Device(transport=transport) as dev:
        name = unique("anyack")
        op(peer, "dynamic_slot", name=name)
        sender = dev.connect(peer.address).dynamic_sender(name)
        tensor = dev.empty((16,), "int32")
        for i in range(3):
            np.asarray(tensor)[:] = i
            request = sender.send(tensor)
            later = threading.Timer(0.2, peer.send, [{"op": "recv", "name": name, "count": 1, "mode": "fill"}])
            later.start()
            try:
                assert tw.wait_any([request], 10) == 0  # the ack comes ~0.2 s later: the wait naps
            finally:
                later.join()
            request.wait(0)
            got = peer.recv(30)
            assert "raised" not in got and got["values"] == [i] and got["nonuniform"] == 0, got
        one_sided = transport == "shm" and dev.connect(peer.address).form != "messages"
        stats = op(peer, "stats", name=name)["stats"]
        assert stats["doorbells"] == (3 if one_sided else 0), stats


@pytest.mark.parametrize(
    "progress, place", [("inline", None), ("blocking", None), ("blocking", "0-4096"), ("inline", "off")]
)
def test_static_tensors_on_message_lanes_are_placed_by_size(monkeypatch, progress, place):
    """On a UCX lane in the message form (UD; here shared memory forced to
    it: a tcp lane is a socket and places nothing) a slot whose device has no progress thread
    (inline) asks its sender to place tensors of 256 KiB-64 MiB (to 4 MiB where
    the kernel's tcp congestion control is bbr): put into the buffer, announced
    by a header once the put landed (contracts §10.3, §12); other sizes, and
    every size for a slot with a progress thread (which answers a rendezvous
    while its caller consumes), travel in their message. TENSORWIRE_PLACE at
    the slot's device sets the sizes in any mode, or turns it off. Contents
    intact either way; the sender counts (stats()['placed'])."""
    sizes = {"small": 4 << 10, "middle": 1 << 20, "large": 8 << 20}
    none = dict.fromkeys(sizes, 0)
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:  # this test's network namespace
        large = 0 if f.read().strip() == "bbr" else 2
    placed = {
        ("inline", None): {"small": 0, "middle": 2, "large": large},
        ("blocking", None): none,
        ("blocking", "0-4096"): {"small": 2, "middle": 0, "large": 0},
        ("inline", "off"): none,
    }[progress, place]
    for forced in ("TENSORWIRE_LANE_FORM", "TENSORWIRE_PLACE"):  # a module fixture's lane_form may have set them
        monkeypatch.delenv(forced, raising=False)
    monkeypatch.setenv("TENSORWIRE_LANE_FORM", "messages")
    if place is not None:  # the slot's device decides
        monkeypatch.setenv("TENSORWIRE_PLACE", place)
    with start_slot_peer("shm", progress=progress) as peer:
        monkeypatch.delenv("TENSORWIRE_PLACE", raising=False)  # not read by the sender
        with tw.Device(transport="shm") as dev:
            ch = dev.connect(peer.address)
            assert ch.form == "messages"
            for label, nbytes in sizes.items():
                name = unique(f"place-{label}")
                op(peer, "static_slot", name=name, shape=[nbytes // 4], dtype="int32", depth=2)
                sender = ch.static_sender(name)
                peer.send({"op": "recv", "name": name, "count": 2, "mode": "fill"})
                tensor = dev.empty((nbytes // 4,), "int32")
                for i in (7, 8):
                    np.asarray(tensor)[:] = i
                    sender.send(tensor).wait(10)
                got = peer.recv(30)
                assert "raised" not in got, got.get("message")
                assert got["values"] == [7, 8] and got["nonuniform"] == 0, (label, got)
                assert sender.stats()["placed"] == placed[label], (label, sender.stats())


@pytest.mark.parametrize("progress", ["inline", "blocking"])
def test_dynamic_tensors_on_message_lanes_are_placed_in_the_offered_block(monkeypatch, progress):
    """On a UCX lane in the message form (shared memory forced to it here) a
    dynamic slot on an inline-progress device offers, with each
    ack, a block for the next tensor of the same size (256 KiB-4 MiB); its
    sender puts that tensor there and sends the record after it (contracts
    §10.4, §12). A tensor of another size travels in its message, and the
    offer follows the new size. A slot with a progress thread offers none.
    Contents intact either way."""
    for forced in ("TENSORWIRE_LANE_FORM", "TENSORWIRE_PLACE"):
        monkeypatch.delenv(forced, raising=False)
    monkeypatch.setenv("TENSORWIRE_LANE_FORM", "messages")
    sizes = [1 << 20, 1 << 20, 1 << 20, 4 << 10, 1 << 20, 1 << 20]  # placed: 2nd, 3rd, 6th (inline)
    with start_slot_peer("shm", progress=progress) as peer, tw.Device(transport="shm") as dev:
        name = unique("dplace")
        op(peer, "dynamic_slot", name=name)
        sender = dev.connect(peer.address).dynamic_sender(name)
        peer.send({"op": "recv", "name": name, "count": len(sizes), "mode": "fill"})
        for i, nbytes in enumerate(sizes):
            tensor = dev.empty((nbytes // 4,), "int32")
            np.asarray(tensor)[:] = i
            sender.send(tensor).wait(10)
        got = peer.recv(30)
        assert "raised" not in got, got.get("message")
        assert got["values"] == list(range(len(sizes))) and got["nonuniform"] == 0, got
        assert sender.stats()["placed"] == (3 if progress == "inline" else 0), sender.stats()
        assert sender.stats()["rejected"] == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_static_sender_napping_on_a_release_is_rung(transport):
    """A static sender that waits for the receiver to release a buffer (a full
    slot) raises a flag next to the receiver's sequence word 0 once its naps
    grow; the receiver, having written the release in place, rings it (the
    slot's stats()['doorbells']). Over tcp a release is a message: no doorbell."""
    with start_slot_peer(transport) as peer, tw.Device(transport=transport) as dev:
        name = unique("relrung")
        op(peer, "static_slot", name=name, shape=[16], dtype="int32", depth=1)
        sender = dev.connect(peer.address).static_sender(name)
        peer.send({"op": "recv", "name": name, "count": 3, "mode": "fill", "sleep": 0.2})
        for i in range(3):  # depth 1: sends 2 and 3 wait for a release held 0.2 s
            sender.send(np.full(16, i, np.int32)).wait(10)
        sender.wait_consumed(3, 10)  # and so does the last release
        got = peer.recv(30)
        assert "raised" not in got, got.get("message")
        assert got["values"] == [0, 1, 2]
        one_sided = transport == "shm" and dev.connect(peer.address).form != "messages"
        stats = op(peer, "stats", name=name)["stats"]
        assert stats["doorbells"] == (3 if one_sided else 0), stats


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dynamic_sender_napping_on_its_ack_is_rung(transport):
    """A dynamic send completes on the receiver's ack. A sender whose wait for
    it outgrew short naps raises a flag next to the record's sequence word;
    the receiver, having written the ack in place, rings it (the slot's
    stats()['doorbells']). Over tcp the ack is a message: no doorbell."""
    with start_slot_peer(transport) as peer, tw.Device(transport=transport) as dev:
        name = unique("ackrung")
        slot = dev.dynamic_slot(name)
        op(peer, "connect", address=dev.address)
        op(peer, "sender", kind="dynamic", name=name)
        for i in range(3):
            peer.send({"op": "send", "name": name, "shape": [16], "dtype": "int32", "start": i, "count": 1})
            time.sleep(0.2)  # the sender's wait for the ack naps meanwhile
            block = slot.recv(10)
            assert np.asarray(block).tolist() == [i] * 16
            got = peer.recv(30)
            assert "raised" not in got and got["sent"] == 1, got
        one_sided = transport == "shm" and dev.connect(peer.address).form != "messages"
        assert slot.stats()["doorbells"] == (3 if one_sided else 0), slot.stats()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dynamic_sender_napping_before_its_next_send_is_rung(transport):
    """A dynamic sender that did not wait for its previous send waits for that
    ack before the next record; a long wait asks to be rung as a wait on the
    request does (over shared memory: the slot's stats()['doorbells'])."""
    with start_slot_peer(transport) as peer, tw.Device(transport=transport) as dev:
        name = unique("presend")
        op(peer, "dynamic_slot", name=name)
        sender = dev.connect(peer.address).dynamic_sender(name)
        a, b = dev.empty((16,), "int32"), dev.empty((16,), "int32")  # zero copy: no staging block to wait for
        np.asarray(a)[:], np.asarray(b)[:] = 1, 2
        first = sender.send(a)  # not waited on
        later = threading.Timer(0.3, peer.send, [{"op": "recv", "name": name, "count": 1, "mode": "fill"}])
        later.start()
        try:
            second = sender.send(b)  # waits ~0.3 s for the first ack, then sends
        finally:
            later.join()
        got = peer.recv(30)
        assert "raised" not in got and got["values"] == [1] and got["nonuniform"] == 0, got
        first.wait(10)
        assert sender.stats()["waits_for_ack"] == 1, sender.stats()
        one_sided = transport == "shm" and dev.connect(peer.address).form != "messages"
        stats = op(peer, "stats", name=name)["stats"]  # before anything waits on the second send
        assert stats["doorbells"] == (1 if one_sided else 0), stats
        peer.send({"op": "recv", "name": name, "count": 1, "mode": "fill"})
        second.wait(10)
        got = peer.recv(30)
        assert "raised" not in got and got["values"] == [2] and got["nonuniform"] == 0, got


@pytest.mark.parametrize("progress", ["blocking", "inline"])
@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("forms", ["rma,messages", "messages,rma"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_mixed_channel_one_lane_native_one_emulated(transport, forms, kind, progress):
    """Lane 0 and lane 1 of one peer use different forms: the sender sends on
    lane 1, the receiver releases (acks) on its lane 0 back, so one direction
    goes as messages and the other as one-sided writes; contents intact. The
    receiver waits before the first tensor is sent: with inline progress its
    wait is the only thread that can take in a message on the other lane."""
    with (
        lane_form(forms),
        start_slot_peer(transport, progress=progress) as peer,
        tw.Device(transport=transport, progress=progress) as client,
    ):
        name = unique("mixed")
        if kind == "static":
            op(peer, "static_slot", name=name, shape=[3, 5], dtype="float32", depth=2)
        else:
            op(peer, "dynamic_slot", name=name)
        ch = client.connect(peer.address, 1)
        sender = ch.static_sender(name) if kind == "static" else ch.dynamic_sender(name)
        expected = [slot_tensor("float32", (3, 5), seed=7 + i) for i in range(5)]
        peer.send({"op": "recv", "name": name, "count": len(expected)})
        for want in expected:  # five sends through a depth-2 slot: each waits for a release
            sender.send(want).wait(10)
        expect_items(peer.recv(30), expected)
        assert sender.stats()["sent"] == len(expected)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dynamic_slot_takes_pushed_tensors_on_a_one_sided_lane(transport):
    """A dynamic sender pushes GPU memory in the message form whatever its lane's
    form (UCX emulates a get of GPU memory), so a receiver whose lane is one-sided
    takes pushed records and acks them with one-sided writes. The two forms are
    forced per process here, with host memory."""
    with lane_form("rma"), start_slot_peer(transport) as peer:
        peer.request({"op": "dynamic_slot", "name": "mixed"})
        with lane_form("messages"), tw.Device(transport=transport) as dev:
            sender = dev.connect(peer.address).dynamic_sender("mixed")
            for i in range(4):
                t = np.full((100 + i, 3), i, dtype=np.float32)
                req = sender.send(t)
                got = peer.request({"op": "recv", "name": "mixed", "count": 1, "mode": "bytes"})
                req.wait(10)
                assert "raised" not in got, got
                item = got["items"][0]
                assert item["shape"] == [100 + i, 3] and item["data"] == t.tobytes()
            assert sender.stats()["sent"] == 4


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_inline_receiver_waiting_on_a_one_sided_lane_takes_a_pushed_tensor(transport):
    """The bench's order with GPU memory (a dynamic sender pushes it as a message
    on any lane): the receiver, with inline progress and a one-sided lane back,
    already waits in recv() when the first tensor comes as a message. Its wait
    must drive the worker the message arrives on (the hang of
    bench/results/gpu_tests_h100.txt, call 4). Host memory, forms forced per process."""
    with lane_form("rma"), start_slot_peer(transport, progress="inline") as peer:
        peer.request({"op": "dynamic_slot", "name": "pushed"})
        with lane_form("messages"), tw.Device(transport=transport, progress="inline") as dev:
            sender = dev.connect(peer.address).dynamic_sender("pushed")
            sent = [np.full((64 + i, 5), i, dtype=np.float32) for i in range(3)]
            peer.send({"op": "recv", "name": "pushed", "count": len(sent), "mode": "bytes"})
            time.sleep(0.3)  # the receiver is in recv() before the first tensor leaves
            for t in sent:
                sender.send(t).wait(10)
            got = peer.recv(30)
            assert "raised" not in got, got
            assert [item["data"] for item in got["items"]] == [t.tobytes() for t in sent]


def test_a_static_slot_returns_each_buffer_s_one_view_and_frees_its_memory_when_dropped():
    """recv() hands back the same array each time its buffer comes round (made once: a new numpy
    array per tensor cost a third of a small tensor's one-way time), and those cached views hold
    the buffers, not the slot: a dropped slot frees its memory (no reference cycle)."""
    import gc

    with tw.Device(transport="shm") as a, tw.Device(transport="shm") as b:
        before = b.stats()["bytes_in_use"]
        slot = b.static_slot("views", (1 << 16,), "float32", depth=2)
        sender = a.connect(b.address).static_sender("views", timeout=10)
        seen = []
        for i in range(4):
            sender.send(np.full(1 << 16, i, np.float32), 10).wait(10)
            view = slot.recv(10)
            assert view[0] == i and view[-1] == i
            seen.append(view)  # (held: ids of freed arrays could repeat by chance)
            slot.release(view)
        assert seen[0] is seen[2] and seen[1] is seen[3] and seen[0] is not seen[1]
        kept = view  # a view outlives its slot safely: it holds the buffers' memory
        del view, slot, sender, seen
        gc.collect()
        assert kept[-1] == 3.0
        del kept
        gc.collect()
        assert b.stats()["bytes_in_use"] == before
