"""Isolation between peers (issue 16, "A peer reaches only what was exported
to it"), written as the attacker would.

Every test forges or withholds something, asserts the refusal and its
exception type, then shows that the victim still serves a good peer (a good
transfer, contents checked). Findings:

1. forged region descriptors (channel.remote_region) and, over shared memory,
   keys that map more or other memory than the range they describe;
2. identity of a slot's sender: a third peer cannot take a slot over, nor
   inject tensors; a killed sender's slot can be taken by a new one;
3. a lying dynamic-slot record from the attached sender (the receiver runs in
   its own process: over shm such a record used to SIGSEGV it);
4. liveness: a SIGSTOPped peer fails pending work with PeerFailed;
5. pool exhaustion on the receiving side of a dynamic slot; fill/free/large.

Forged wire forms are built by tests/python/core/_attack.py.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import zlib

import numpy as np
import pytest

import tensorwire as tw
import _attack
from _attack import attach_payload, forge, make_descriptor, parse_descriptor, record_body
from _peers import crc
from conftest import (
    PAIR_SLAB_SIZE,
    PeerError,
    PeerProcess,
    TRANSPORTS,
    lane_form,
    remote_crc,
    start_server,
    start_slot_peer,
)

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
GiB = 1 << 30
MAX_NDIM = 8  # the slots below keep the default max_ndim (record rkey at 40 + 8 * 8)


def _device(transport: str, **kw) -> tw.Device:
    kw.setdefault("slab_size", PAIR_SLAB_SIZE)
    return tw.Device(transport=transport, **kw)


def _filled(dev: tw.Device, n: int, value: int, dtype: str = "int64") -> tw.Block:
    blk = dev.empty((n,), dtype)
    np.asarray(blk)[:] = value
    return blk


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)


def _write_and_check(
    ch: tw.Channel, src_dev: tw.Device, remote: tw.RemoteRegion, target: np.ndarray, seed: int
) -> None:
    """A good one-sided write through `ch` into `remote` (whose bytes `target` views), contents checked."""
    n = remote.nbytes
    src = src_dev.alloc(n)
    np.asarray(src)[:] = _pattern(n, seed)
    ch.write(src, remote).wait(10)
    ch.flush().wait(10)
    assert np.array_equal(target[:n], _pattern(n, seed))


def _good_peer_write(victim: tw.Device, transport: str, seed: int) -> None:
    """The victim still serves a good peer: a fresh device publishes a block,
    the victim writes a pattern into it; the bytes arrive intact."""
    with _device(transport) as good:
        dst = good.alloc(8192)
        good.publish("good", dst)
        ch = victim.connect(good.address)
        _write_and_check(ch, victim, ch.lookup("good"), np.asarray(dst), seed)


def _attach_when_free(make_sender, timeout: float = 15.0):
    """Attaches as soon as the slot's previous sender is seen gone (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return make_sender()
        except tw.InvalidArgument as e:
            if "already has a sender" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _receiver_reply(peer: PeerProcess, msg: dict, timeout: float = 20.0) -> dict:
    """A request to a receiver process; its death (a crash) fails the test with the exit code."""
    try:
        return peer.request(msg, timeout)
    except (EOFError, OSError, PeerError) as e:
        peer.proc.join(5)
        code = peer.proc.exitcode
        sig = f" (signal {signal.Signals(-code).name})" if code is not None and code < 0 else ""
        pytest.fail(f"the receiver process died handling {msg['op']!r}: exit code {code}{sig} ({e!r})")


# =============================================================================================
# finding 1: forged region descriptors


FORGERIES = [
    "neighbour",
    "grown",
    "grown_over_neighbour",
    "before_start",
    "numpy_array",
    "address_0x10000",
    "garbage_rkey",
    "other_device_id",
]


@pytest.mark.parametrize("forgery", FORGERIES)
def test_finding1_forged_descriptor_refused(device_pair, forgery):
    server, client = device_pair
    published = server.alloc(4096)
    neighbour = server.alloc(4096)  # never published: same slab, same key over shm
    np.asarray(published)[:] = 0x5A
    np.asarray(neighbour)[:] = 0x33
    never_registered = np.full(4096, 0x77, dtype=np.uint8)
    server.publish("pub", published)
    ch = device_pair.channel()
    good = ch.lookup("pub")
    desc = good.descriptor()
    rkey = parse_descriptor(desc)["rkey"]
    forged = {
        "neighbour": lambda: forge(desc, address=neighbour.ptr),
        "grown": lambda: forge(desc, nbytes=4097),
        "grown_over_neighbour": lambda: forge(desc, nbytes=8192),
        "before_start": lambda: forge(desc, address=published.ptr - 64),
        "numpy_array": lambda: forge(desc, address=never_registered.ctypes.data),
        "address_0x10000": lambda: forge(desc, address=0x10000),
        "garbage_rkey": lambda: forge(desc, rkey=bytes((37 * i + 11) & 0xFF for i in range(len(rkey)))),
        "other_device_id": lambda: forge(desc, device_id=server.id ^ 1),
    }[forgery]()
    match = "another device" if forgery == "other_device_id" else "was not exported by"
    with pytest.raises(tw.InvalidArgument, match=match) as info:
        ch.remote_region(forged)
    assert isinstance(info.value, ValueError)
    # nothing was touched, and the published region still works, also re-made from its own descriptor
    assert (np.asarray(neighbour) == 0x33).all()
    assert (never_registered == 0x77).all()
    _write_and_check(ch, client, good, np.asarray(published), seed=1)
    _write_and_check(ch, client, ch.remote_region(desc), np.asarray(published), seed=2)
    assert (np.asarray(neighbour) == 0x33).all()


def test_finding1_exported_ranges_accepted(device_pair):
    """The checks refuse only what was not exported: a sub-range of a published
    block, and a block the peer exports explicitly (channel.export_region)."""
    server, client = device_pair
    published = server.alloc(4096)
    extra = server.alloc(4096)
    np.asarray(published)[:] = 0
    np.asarray(extra)[:] = 0
    server.publish("pub", published)
    ch = device_pair.channel()
    desc = ch.lookup("pub").descriptor()
    sub = ch.remote_region(forge(desc, address=published.ptr + 1024, nbytes=1024))
    assert sub.nbytes == 1024
    _write_and_check(ch, client, sub, np.asarray(published)[1024:], seed=3)
    assert (np.asarray(published)[:1024] == 0).all() and (np.asarray(published)[2048:] == 0).all()
    with pytest.raises(tw.InvalidArgument, match="not exported"):
        ch.remote_region(extra.descriptor())  # not yet
    server.channel_to(client.id).export_region(extra)
    _write_and_check(ch, client, ch.remote_region(extra.descriptor()), np.asarray(extra), seed=4)


def test_finding1_shm_export_longer_than_memory_refused():
    """A peer exports (tw.export) a range of its own far longer than the
    memory its key maps: the victim refuses the key before any access."""
    with _device("shm") as victim, _device("shm") as attacker:
        blk = attacker.alloc(4096)
        np.asarray(blk)[:] = 0x42
        ach = attacker.connect(victim.address)
        vch = victim.channel_to(attacker.id)
        src = victim.alloc(4096)
        np.asarray(src)[:] = 0xEE
        dst = victim.alloc(4096)
        for length in (64 * MiB, 1 << 40):
            lie = forge(blk.descriptor(), nbytes=length)
            ach.call(_attack.EXPORT_CALL, lie, 10)  # any peer may export its own ranges
            region = vch.remote_region(lie)  # exported, so accepted as a region ...
            assert region.nbytes == length
            with pytest.raises(tw.InvalidArgument, match="does not map the whole region"):
                vch.write(src, region, nbytes=4096).wait(10)  # ... but its key is refused before any access
            with pytest.raises(tw.InvalidArgument, match="does not map the whole region"):
                vch.read(dst, region, nbytes=4096).wait(10)
        assert (np.asarray(blk) == 0x42).all()
        # the honest export of the same block works
        ach.call(_attack.EXPORT_CALL, blk.descriptor(), 10)
        _write_and_check(vch, victim, vch.remote_region(blk.descriptor()), np.asarray(blk), seed=5)
        _good_peer_write(victim, "shm", seed=6)


def _victim_writes_to(victim: tw.Device, attacker_id: int, descriptor: bytes) -> tw.InvalidArgument | None:
    """The victim writes 4 KiB of 0xEE to what the attacker's `descriptor`
    describes; returns the refusal, or None if the write went through."""
    vch = victim.channel_to(attacker_id)
    src = victim.alloc(4096)
    np.asarray(src)[:] = 0xEE
    try:
        vch.write(src, vch.remote_region(descriptor)).wait(10)
        vch.flush().wait(10)
    except tw.InvalidArgument as e:
        return e
    return None


def test_finding1_shm_peer_key_aliasing_victims_own_pool():
    """An attacker process looks up one of the victim's published blocks (over
    shm its descriptor carries the victim's slab key), then exports "its own"
    region made of that key and the address of the victim's unpublished
    neighbour block. The victim, writing to what it takes for the attacker's
    memory, must not write into its own pool (the key maps the victim's own
    segment a second time, at another address)."""
    with _device("shm") as victim, PeerProcess(_attack.forger, "shm") as attacker:
        published = victim.alloc(4096)
        secret = victim.alloc(4096)  # never published nor exported
        np.asarray(published)[:] = 0
        np.asarray(secret)[:] = 0x11
        victim.publish("pub", published)
        attacker.request({"op": "connect", "address": victim.address})
        pub_desc = attacker.request({"op": "lookup", "address": victim.address, "name": "pub"})["descriptor"]
        lie = make_descriptor(attacker.info["device_id"], secret.ptr, 4096, parse_descriptor(pub_desc)["rkey"])
        assert attacker.request({"op": "export", "address": victim.address, "descriptor": lie}) == {}
        refused = _victim_writes_to(victim, attacker.info["device_id"], lie)
        changed = int((np.asarray(secret) != 0x11).sum())
        assert changed == 0, (
            f"the victim wrote {changed} bytes into its own unexported block through a key the attacker took "
            f"from a lookup and exported as its own"
        )
        assert refused is not None, "the write was neither refused nor did it land in the victim's pool"
        _good_peer_write(victim, "shm", seed=7)


def test_finding1_shm_peer_key_aliasing_third_party():
    """As above, but the key is a third party's: the attacker looked up a
    block the third party published, and exports that key with the address of
    the third party's unpublished neighbour block. A victim that never talked
    to the third party must not write into its memory."""
    with (
        _device("shm") as victim,
        start_server("shm", {"pub": 4096, "hidden": 4096}) as third,
        PeerProcess(_attack.forger, "shm") as attacker,
        _device("shm") as observer,
    ):
        och = observer.connect(third.address)
        hidden_address = och.lookup("hidden").address
        och.call("unpublish", b'{"name": "hidden"}', 10)
        zeros = crc(bytes(4096))
        assert remote_crc(och, "hidden", 0, 4096) == zeros
        attacker.request({"op": "connect", "address": third.address})
        attacker.request({"op": "connect", "address": victim.address})
        pub_desc = attacker.request({"op": "lookup", "address": third.address, "name": "pub"})["descriptor"]
        lie = make_descriptor(attacker.info["device_id"], hidden_address, 4096, parse_descriptor(pub_desc)["rkey"])
        assert attacker.request({"op": "export", "address": victim.address, "descriptor": lie}) == {}
        refused = _victim_writes_to(victim, attacker.info["device_id"], lie)
        assert remote_crc(och, "hidden", 0, 4096) == zeros, (
            "the victim wrote into a third party's unpublished block through a key the attacker exported"
        )
        assert refused is not None
        _good_peer_write(victim, "shm", seed=8)


# =============================================================================================
# finding 2: the identity of a slot's sender


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_finding2_third_peer_cannot_take_over_static_slot(transport):
    with _device(transport) as victim, start_slot_peer(transport) as sender, _device(transport) as third:
        slot = victim.static_slot("grad", (4,), "int64", depth=2)
        sender.request({"op": "connect", "address": victim.address})
        assert sender.request({"op": "sender", "kind": "static", "name": "grad"}) == {}
        assert sender.request({"op": "send", "name": "grad", "start": 10})["sent"] == 1
        tch = third.connect(victim.address)
        for _ in range(2):  # refused, and refused again
            with pytest.raises(tw.InvalidArgument, match="static slot 'grad' already has a sender"):
                tch.static_sender("grad")
        # the real sender's tensors keep arriving, intact and in order
        v = slot.recv(timeout=10)
        assert v.tolist() == [10] * 4
        slot.release(v)
        assert sender.request({"op": "send", "name": "grad", "start": 11, "count": 2})["sent"] == 2
        for k in (11, 12):
            v = slot.recv(timeout=10)
            assert v.tolist() == [k] * 4
            slot.release(v)
        # one more that the victim does not take, then the sender's process dies
        assert sender.request({"op": "send", "name": "grad", "start": 13})["sent"] == 1
        seq = slot.next_seq
        sender.kill()
        # a new sender attaches once the old one is seen gone; the slot goes on
        # from the next sequence (the dead sender's untaken tensor is dropped)
        new = _attach_when_free(lambda: tch.static_sender("grad"))
        for k in range(100, 105):  # more than depth: buffers wrap around
            new.send(np.full(4, k, dtype=np.int64)).wait(10)
            v = slot.recv(timeout=10)
            assert v.tolist() == [k] * 4
            slot.release(v)
            assert slot.next_seq == seq + 1
            seq += 1
        assert slot.poll() is None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_finding2_third_peer_cannot_take_over_dynamic_slot(transport):
    with _device(transport) as victim, start_slot_peer(transport) as sender, _device(transport) as third:
        slot = victim.dynamic_slot("acts")
        sender.request({"op": "connect", "address": victim.address})
        assert sender.request({"op": "sender", "kind": "dynamic", "name": "acts"}) == {}
        tch = third.connect(victim.address)
        with pytest.raises(tw.InvalidArgument, match="dynamic slot 'acts' already has a sender"):
            tch.dynamic_sender("acts")
        # the real sender's tensors keep arriving (a dynamic send completes on the receiver's ack)
        sender.send({"op": "send", "name": "acts", "start": 20, "count": 2, "shape": [3, 5]})
        for k in (20, 21):
            b = slot.recv(timeout=10)
            assert b.shape == [3, 5] and (b.numpy() == k).all()
            b.release()
        assert sender.recv(10)["sent"] == 2
        with pytest.raises(tw.InvalidArgument, match="already has a sender"):
            tch.dynamic_sender("acts")
        # a record the victim never takes, then the sender's process dies
        sender.send({"op": "send", "name": "acts", "start": 22, "timeout": 30})
        time.sleep(0.3)
        seq = slot.next_seq
        sender.kill()
        new = _attach_when_free(lambda: tch.dynamic_sender("acts"))
        for k in range(200, 203):
            src = third.empty((7,), "int32")
            np.asarray(src)[:] = k
            req = new.send(src)
            b = slot.recv(timeout=10)
            req.wait(10)
            assert b.shape == [7] and b.format == "i" and b.numpy().tolist() == [k] * 7
            assert slot.next_seq == seq + 1
            seq += 1
            b.release()


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_finding2_third_peer_cannot_reach_a_slot(transport, kind):
    """A slot's memory is exported only to the sender that attached (in its
    attach reply), never published: a third peer cannot look it up, and a
    descriptor leaked to it by the sender is refused by its own device (the
    victim exported nothing to it). The attached sender's tensors arrive."""
    with _device(transport) as victim, _device(transport) as sender, _device(transport) as third:
        if kind == "static":
            slot = victim.static_slot("grad", (8,), "int64", depth=2)
            s = sender.connect(victim.address).static_sender("grad")
        else:
            slot = victim.dynamic_slot("grad")
            s = sender.connect(victim.address).dynamic_sender("grad")
        xch = third.connect(victim.address)
        with pytest.raises(tw.NotFound):
            xch.lookup("grad")
        with pytest.raises(tw.InvalidArgument, match="not exported"):
            xch.remote_region(s.region.descriptor())
        for k in range(3):
            src = _filled(sender, 8, 10 + k)
            req = s.send(src)
            got = slot.recv(timeout=10)
            req.wait(10)
            if kind == "static":
                assert got.tolist() == [10 + k] * 8
                slot.release(got)
            else:
                assert got.numpy().tolist() == [10 + k] * 8


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_finding2_static_slot_ignores_writes_before_its_sender_attached(transport):
    """Whoever wrote into a static slot's buffers before its sender attached
    (here: a sender that attached, wrote, and is gone, replaced by a new one)
    is forgotten: the slot hands out only the attached sender's tensors."""
    with _device(transport) as victim, _device(transport) as sender:
        slot = victim.static_slot("grad", (8,), "int64", depth=2)
        with pytest.raises(tw.Timeout):
            slot.recv(timeout=0.2)  # nothing without a sender
        s = sender.connect(victim.address).static_sender("grad")
        s.send(np.arange(8, dtype=np.int64)).wait(10)
        v = slot.recv(timeout=10)
        assert v.tolist() == list(range(8))
        slot.release(v)


# =============================================================================================
# finding 3: a lying record from the attached sender


def _lie_then_good_tensor(
    receiver, attacker: tw.Device, ch: tw.Channel, s, good: tw.Block, body: bytes, match: str
) -> dict:
    """The attached sender `s` sends `good`, then overwrites its record (the
    slot's record, as the attach exported it: s.region) with `body` before the
    receiver process reads it. The receiver refuses it (InvalidArgument whose
    message holds `match`), the send fails with InvalidArgument, and the next
    good tensor arrives intact. Returns the receiver's last reply."""
    req = s.send(good)
    ch.flush().wait(10)
    stage = attacker.alloc(4096)
    np.asarray(stage)[: len(body)] = np.frombuffer(body, dtype=np.uint8)
    ch.write(stage, s.region, nbytes=len(body)).wait(10)
    ch.flush().wait(10)
    out = _receiver_reply(receiver, {"op": "recv", "name": "acts", "timeout": 10})
    assert out.get("raised") == "InvalidArgument", f"receiver: {out.get('raised')}: {out.get('message')}"
    assert match in out["message"], out["message"]
    with pytest.raises(tw.InvalidArgument, match="refused the tensor"):
        req.wait(10)
    # the slot goes on: the next good tensor arrives, contents intact
    np.asarray(good)[:] = 8
    receiver.send({"op": "recv", "name": "acts"})
    s.send(good).wait(10)
    out = receiver.recv(10)
    assert out["items"][0]["data"] == np.full(512, 8, np.int64).tobytes()
    return out


# Keys reach the receiver only on lanes that use them: a tcp lane is tensorwire's socket, always
# in the message form and keyless (its modified-peer attacks: tests/cpp/loopback/test_attack.cc).
KEYED_TRANSPORTS = ["shm"]
LIES = ["address_plus_1GiB", "address_0x10000", "unexported_own_block", "length_grown", "garbage_rkey"]


@pytest.mark.parametrize("lie", LIES)
@pytest.mark.parametrize("transport", KEYED_TRANSPORTS)
def test_finding3_lying_record_refused(transport, lie):
    """The attached sender (this process) sends a good tensor, then overwrites
    the record it just wrote with a lie before the receiver (another process)
    reads it. The receiver refuses it with InvalidArgument and lives on, the
    sender's request fails with InvalidArgument, and the next tensor arrives.
    A record in slot memory is the RMA form's (forced here); the
    message form's lies are tests/cpp/loopback (MessageFormRefusesLyingRecords)."""
    with lane_form("rma"), start_slot_peer(transport) as receiver, _device(transport, slab_size=MiB) as attacker:
        receiver.request({"op": "dynamic_slot", "name": "acts"})
        ch = attacker.connect(receiver.address)
        s = ch.dynamic_sender("acts")
        good = _filled(attacker, 512, 7)  # 4 KiB, exported by its first send
        unexported = _filled(attacker, 512, 9)
        receiver.send({"op": "recv", "name": "acts"})
        s.send(good).wait(10)
        assert receiver.recv(10)["items"][0]["data"] == np.full(512, 7, np.int64).tobytes()
        rkey = parse_descriptor(good.descriptor())["rkey"]
        address, nbytes, key = {
            "address_plus_1GiB": (good.ptr + GiB, 4096, rkey),
            "address_0x10000": (0x10000, 4096, rkey),
            "unexported_own_block": (unexported.ptr, 4096, rkey),
            "length_grown": (good.ptr, 8192, rkey),
            "garbage_rkey": (good.ptr, 4096, bytes((53 * i + 7) & 0xFF for i in range(len(rkey)))),
        }[lie]
        body = record_body(MAX_NDIM, [nbytes // 8], 0, 64, nbytes, address, attacker.id, key)
        out = _lie_then_good_tensor(receiver, attacker, ch, s, good, body, match="not one the sender exported")
        assert out["stats"]["rejected"] == 1 and out["stats"]["received"] == 2


GARBAGE_KEYS = {"0x44": 0x44, "0x01": 0x01}


@pytest.mark.parametrize("garbage", list(GARBAGE_KEYS))
@pytest.mark.parametrize("transport", KEYED_TRANSPORTS)
def test_finding3_exported_garbage_rkey_refused(transport, garbage):
    """The attached sender *exports* a range of its own with a garbage key
    (tw.export takes whatever the peer says about its own memory), then sends a
    record with that key. Unpacking it must fail with InvalidArgument in the
    receiver (another process), which lives on and takes the next tensor.
    Keys travel only in the RMA form (forced here)."""
    with lane_form("rma"), start_slot_peer(transport) as receiver, _device(transport, slab_size=MiB) as attacker:
        receiver.request({"op": "dynamic_slot", "name": "acts"})
        ch = attacker.connect(receiver.address)
        s = ch.dynamic_sender("acts")
        good = _filled(attacker, 512, 7)
        receiver.send({"op": "recv", "name": "acts"})
        s.send(good).wait(10)
        receiver.recv(10)
        key = bytes([GARBAGE_KEYS[garbage]]) * len(parse_descriptor(good.descriptor())["rkey"])
        ch.call(_attack.EXPORT_CALL, forge(good.descriptor(), rkey=key), 10)
        body = record_body(MAX_NDIM, [512], 0, 64, 4096, good.ptr, attacker.id, key)
        _lie_then_good_tensor(receiver, attacker, ch, s, good, body, match="")


@pytest.mark.parametrize("garbage", list(GARBAGE_KEYS))
@pytest.mark.parametrize("transport", KEYED_TRANSPORTS)
def test_finding3_garbage_ack_key_on_attach_refused(transport, garbage):
    """A peer attaches to a free dynamic slot by hand (the attach call) with an
    ack descriptor whose key is garbage. The receiver (another process) checks
    the key when it attaches: InvalidArgument, it lives on, and a good sender
    then attaches and its tensors arrive."""
    with start_slot_peer(transport) as receiver, _device(transport, slab_size=MiB) as good_dev:
        receiver.request({"op": "dynamic_slot", "name": "acts"})
        with _device(transport, slab_size=MiB) as attacker:
            ch = attacker.connect(receiver.address)
            ack = attacker.alloc(64)
            rkey = parse_descriptor(ack.descriptor())["rkey"]
            key = bytes([GARBAGE_KEYS[garbage]]) * len(rkey)
            with pytest.raises(tw.InvalidArgument, match="remote key"):
                ch.call("tw.dynamic/acts", attach_payload(forge(ack.descriptor(), rkey=key)), 10)
        s = _attach_when_free(lambda: good_dev.connect(receiver.address).dynamic_sender("acts"))
        src = _filled(good_dev, 16, 4)
        receiver.send({"op": "recv", "name": "acts"})
        s.send(src).wait(10)
        out = receiver.recv(10)
        assert out["items"][0]["data"] == np.full(16, 4, np.int64).tobytes()


# =============================================================================================
# finding 4: liveness (a SIGSTOPped peer)

LIVENESS_S = 1.0


def _stop(pid: int) -> None:
    """SIGSTOP pid and return once every thread of it has stopped: kill() returns before the
    target's threads reach their stop, and one still running could answer a call made after it."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                pass
        if states and all(s in "Tt" for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop within 10 s: {states}"
        time.sleep(0.001)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_finding4_stopped_receiver_fails_pending_send(transport):
    with start_slot_peer(transport, liveness=LIVENESS_S) as stopped, _device(transport, liveness=LIVENESS_S) as victim:
        stopped.request({"op": "static_slot", "name": "grad", "shape": [1024], "dtype": "int64", "depth": 1})
        ch = victim.connect(stopped.address)
        s = ch.static_sender("grad")
        s.send(np.arange(1024, dtype=np.int64)).wait(10)  # fills the one buffer; nobody releases it
        _stop(stopped.pid)
        try:
            t0 = time.monotonic()
            call_error: list = []

            def caller():  # a control call pending on the stopped peer fails too
                try:
                    ch.call("nothing", b"", timeout=30)
                except tw.Error as e:
                    call_error.append((e, time.monotonic() - t0))

            th = threading.Thread(target=caller, daemon=True)
            th.start()
            with pytest.raises(tw.PeerFailed, match="has not answered"):
                s.send(np.arange(1024, dtype=np.int64), timeout=LIVENESS_S + 10).wait(LIVENESS_S + 10)
            elapsed = time.monotonic() - t0
            assert elapsed < LIVENESS_S + 5, f"PeerFailed only after {elapsed:.1f} s"
            th.join(10)
            assert call_error and isinstance(call_error[0][0], tw.PeerFailed), call_error
            assert call_error[0][1] < LIVENESS_S + 5
            with pytest.raises(tw.PeerFailed):
                ch.lookup("grad", timeout=5)
            assert all(p["device_id"] != stopped.info["device_id"] for p in victim.peers())
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        stopped.kill()
        # the victim still serves a good peer: a new receiver gets its tensors
        with start_slot_peer(transport) as good:
            good.request({"op": "static_slot", "name": "grad", "shape": [1024], "dtype": "int64", "depth": 1})
            s2 = victim.connect(good.address).static_sender("grad")
            for k in range(3):
                s2.send(np.arange(1024, dtype=np.int64) * (k + 1)).wait(10)
                out = good.request({"op": "recv", "name": "grad"})
                assert out["items"][0]["data"] == (np.arange(1024, dtype=np.int64) * (k + 1)).tobytes()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_finding4_stopped_sender_fails_pending_recv(transport):
    with _device(transport, liveness=LIVENESS_S) as victim, start_slot_peer(transport, liveness=LIVENESS_S) as stopped:
        slot = victim.static_slot("grad", (4,), "int64", depth=2)
        stopped.request({"op": "connect", "address": victim.address})
        stopped.request({"op": "sender", "kind": "static", "name": "grad"})
        assert stopped.request({"op": "send", "name": "grad", "start": 1})["sent"] == 1
        v = slot.recv(timeout=10)
        assert v.tolist() == [1] * 4
        slot.release(v)
        _stop(stopped.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(tw.PeerFailed):
                slot.recv(timeout=LIVENESS_S + 10)
            elapsed = time.monotonic() - t0
            assert elapsed < LIVENESS_S + 5, f"PeerFailed only after {elapsed:.1f} s"
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        stopped.kill()
        # the slot is free again: a good sender attaches and its tensors arrive
        with _device(transport) as good:
            s = _attach_when_free(lambda: good.connect(victim.address).static_sender("grad"))
            for k in (5, 6, 7):
                s.send(np.full(4, k, dtype=np.int64)).wait(10)
                v = slot.recv(timeout=10)
                assert v.tolist() == [k] * 4
                slot.release(v)


# =============================================================================================
# finding 5: pool exhaustion


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_finding5_dynamic_tensor_larger_than_receiver_pool(transport):
    with tw.Device(transport=transport, slab_size=MiB, pool_limit=8 * MiB) as victim, _device(transport) as sender:
        slot = victim.dynamic_slot("acts")
        s = sender.connect(victim.address).dynamic_sender("acts")
        big = sender.empty((16 * MiB // 4,), "float32")  # twice the receiver's whole pool
        np.asarray(big)[:] = 1.5
        req = s.send(big)
        with pytest.raises(tw.PoolExhausted, match="acts") as info:
            slot.recv(timeout=10)
        assert isinstance(info.value, MemoryError)
        with pytest.raises(tw.PoolExhausted, match="the receiver's memory pool is exhausted"):
            req.wait(10)
        assert slot.stats()["rejected"] == 1
        # the next small tensors arrive on the same slot, contents intact
        for k in range(3):
            small = sender.empty((1000,), "int32")
            np.asarray(small)[:] = np.arange(1000) * (k + 1)
            req = s.send(small)
            b = slot.recv(timeout=10)
            req.wait(10)
            assert b.shape == [1000] and b.format == "i"
            assert np.array_equal(b.numpy(), np.arange(1000, dtype=np.int32) * (k + 1))
            b.release()
        # and one that needs most of the pool, once the big one is out of the way
        mid = sender.empty((6 * MiB // 4,), "float32")
        np.asarray(mid)[:] = 2.5
        req = s.send(mid)
        b = slot.recv(timeout=10)
        req.wait(10)
        assert b.shape == [6 * MiB // 4] and (b.numpy() == 2.5).all()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_finding5_fill_free_then_large_block(transport):
    limit = 4 * MiB
    with tw.Device(transport=transport, slab_size=MiB, pool_limit=limit) as victim:
        blocks = []
        with pytest.raises(tw.PoolExhausted):
            for _ in range(1000):
                blocks.append(victim.alloc(64 << 10))
        assert len(blocks) == limit // (64 << 10)
        assert victim.stats()["bytes_reserved"] <= limit
        for b in blocks:
            b.release()
        blocks.clear()
        gc.collect()
        assert victim.stats()["bytes_in_use"] == 0
        large = victim.alloc(limit)  # the whole limit in one block: the empty slabs went back
        assert large.nbytes == limit
        with pytest.raises(tw.PoolExhausted):
            victim.alloc(64 << 10)
        # the large block is good memory: a peer writes into it, then it goes out
        np.asarray(large)[:] = _pattern(limit, 9)
        with _device(transport) as peer:
            dst = peer.alloc(limit)
            peer.publish("dst", dst)
            ch = victim.connect(peer.address)
            ch.write(large, ch.lookup("dst")).wait(10)
            ch.flush().wait(10)
            assert zlib.crc32(np.asarray(dst)) == zlib.crc32(_pattern(limit, 9))
        large.release()
        gc.collect()
        again = [victim.alloc(64 << 10) for _ in range(limit // (64 << 10))]  # and small ones again
        assert len(again) == 64


# =============================================================================================
# exact keys (on by default only where hardware enforces keys: forced here over tcp)


def test_exact_keys_cover_the_export_and_carry_transfers(monkeypatch):
    """With exact export forced (TENSORWIRE_EXACT_EXPORT=1, as on an RDMA
    fabric), a peer gets keys of registrations of exactly what was exported:
    a looked-up region's key is not its slab's key, and writes, static and
    dynamic slot transfers all work with such keys."""
    monkeypatch.setenv("TENSORWIRE_EXACT_EXPORT", "1")
    monkeypatch.setenv("TENSORWIRE_LANE_FORM", "rma")  # keys are used only by one-sided RMA
    # Shared memory without the direct path: UCX's put then uses the exact keys, as verbs would
    # (a tcp lane uses no key at all).
    monkeypatch.setenv("TENSORWIRE_MAP_SHARED_MEMORY", "0")
    with _device("shm") as server, _device("shm") as client:
        dst = server.empty((1024,), "int64", alignment=4096)
        server.publish("dst", dst)
        ch = client.connect(server.address)
        remote = ch.lookup("dst")
        assert server.stats()["exact_exports"] == 1  # the key the client got covers `dst` alone
        src = _filled(client, 1024, 42)
        ch.write(src, remote).wait(10)
        ch.flush().wait(10)
        assert (np.asarray(dst) == 42).all()
        slot = server.static_slot("s", (16,), "int64", depth=2)
        dyn = server.dynamic_slot("d")
        sender, dsender = ch.static_sender("s"), ch.dynamic_sender("d")
        for k in range(3):
            sender.send(np.full(16, k, np.int64)).wait(10)
            v = slot.recv(timeout=10)
            assert v.tolist() == [k] * 16
            slot.release(v)
            req = dsender.send(np.full(5, k, np.int32))
            b = dyn.recv(timeout=10)
            req.wait(10)
            assert b.numpy().tolist() == [k] * 5
        # slot memory and the sender's ack blocks and sources were exported exactly too
        assert server.stats()["exact_exports"] >= 3 and client.stats()["exact_exports"] >= 3
        before = server.stats()["exact_exports"]
        server.unpublish("dst")
        del dst, remote
        gc.collect()
        assert server.stats()["exact_exports"] == before - 1  # freeing `dst` revoked its key; the slots' stay


def test_export_table_is_bounded():
    """A peer that exports range after range (over tcp every key is the same
    bytes) cannot grow the victim's table without bound: past 4096 ranges
    the oldest is forgotten, and a descriptor in it is refused again."""
    with _device("tcp") as victim, _device("tcp") as peer:
        ch = peer.connect(victim.address)
        blocks = [peer.alloc(64) for _ in range(4100)]
        exported = [ch.export_region(b) for b in blocks]
        vch = victim.channel_to(peer.id)
        with pytest.raises(tw.InvalidArgument, match="not exported"):
            vch.remote_region(exported[0])
        assert vch.remote_region(exported[-1]).nbytes == 64
