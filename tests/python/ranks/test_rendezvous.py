"""The rendezvous store (tensorwire.ranks.rendezvous) on both backends: torch's TCPStore
and the control-plane store served by a Device. Each test runs against the
serving side and a client: set/get/add/delete, a wait that ends when the key
comes, a missing key or rank named in the Timeout within its bound, an abort
key ending a wait early, values of hundreds of KiB."""

from __future__ import annotations

import threading
import time

import pytest

import tensorwire as tw
from tensorwire.ranks.rendezvous import Aborted, ControlStore, Store, TorchStore, gather, publish

BOUND_S = 0.5  # the bound of the waits that are meant to time out
SLACK_S = 2.0  # what such a wait may overrun it on a busy machine


@pytest.fixture(params=["control", "torch"])
def stores(request):
    """(the serving side, a client) of one store."""
    if request.param == "torch":
        pytest.importorskip("torch")
        host = TorchStore.host("127.0.0.1", 0, timeout=10)
        yield host, TorchStore.connect(host.address, timeout=10)
        return
    server, client = tw.Device(transport="tcp"), tw.Device(transport="tcp")
    try:
        host = ControlStore.serve(server)
        yield host, ControlStore.connect(client, server.address, timeout=10)
    finally:
        client.close()
        server.close()


def test_set_get_add_delete(stores):
    host, client = stores
    client.set("a", b"1")
    host.set("b", "two")  # str is stored as UTF-8
    assert host.get("a", 1) == b"1" and client.get("b", 1) == b"two"
    assert client.check(["a", "b"]) and not host.check(["a", "nope"])
    assert host.missing(["a", "x", "b", "y"]) == ["x", "y"]
    assert client.add("n", 2) == 2 and host.add("n", 3) == 5 and client.add("n", 0) == 5
    assert client.delete_key("a") and not host.check(["a"])
    assert not host.delete_key("a")
    client.set("empty", b"")
    assert host.get("empty", 1) == b""


def test_the_control_store_is_bounded():
    """Any peer with the token may call the served table: past its key limit a
    new key is refused with a clear error (existing keys still change)."""
    with tw.Device(transport="tcp") as server, tw.Device(transport="tcp") as client:
        host = ControlStore.serve(server, max_keys=3)
        remote = ControlStore.connect(client, server.address, timeout=10)
        for k in ("a", "b", "c"):
            remote.set(k, k)
        with pytest.raises(tw.Error, match="store is full"):
            remote.set("d", b"x")
        with pytest.raises(tw.Error, match="store is full"):
            remote.add("e", 1)
        remote.set("a", b"again")
        assert host.get("a", 1) == b"again" and host.missing(["d", "e"]) == ["d", "e"]


def test_large_values_cross(stores):
    host, client = stores
    big = bytes(range(256)) * 1024  # 256 KiB
    client.set("big", big)
    assert host.get("big", 5) == big
    host.set("big2", big[::-1])
    assert client.get("big2", 5) == big[::-1]


def test_a_get_waits_for_the_key(stores):
    host, client = stores
    later = threading.Timer(0.2, lambda: host.set("late", b"here"))
    later.start()
    try:
        t0 = time.monotonic()
        assert client.get("late", 10) == b"here"
        assert 0.15 < time.monotonic() - t0 < 5
    finally:
        later.cancel()


def test_a_missing_key_is_named_within_the_bound(stores):
    _, client = stores
    client.set("there", b"x")
    t0 = time.monotonic()
    with pytest.raises(tw.Timeout, match="'absent' not set in .* within 0.5 s"):
        client.wait(["there", "absent"], BOUND_S)
    assert BOUND_S <= time.monotonic() - t0 < BOUND_S + SLACK_S


def test_gather_names_the_ranks_that_did_not_arrive(stores):
    host, client = stores
    publish(host, "p", 0, b"zero")
    publish(client, "p", 2, b"two")
    t0 = time.monotonic()
    with pytest.raises(tw.Timeout, match=r"ranks 1, 3 did not publish within 0.5 s \("):
        gather(client, "p", 4, BOUND_S, f"publish within {BOUND_S:g} s")
    assert time.monotonic() - t0 < BOUND_S + SLACK_S
    publish(client, "p", 1, b"one")
    publish(host, "p", 3, b"three")
    assert gather(host, "p", 4, 1, "publish") == [b"zero", b"one", b"two", b"three"]


def test_an_abort_key_ends_the_wait_with_its_words(stores):
    host, client = stores
    later = threading.Timer(0.2, lambda: host.set("p/error", "rank 3: out of memory"))
    later.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(Aborted, match="rank 3: out of memory"):
            gather(client, "p", 2, 30, "publish", abort="p/error")
        assert time.monotonic() - t0 < 5  # not the 30 s bound
    finally:
        later.cancel()


def test_bad_keys_are_refused():
    dev = tw.Device(transport="tcp")
    try:
        store = ControlStore.serve(dev)
        for key in ("", "a\0b"):
            with pytest.raises(tw.InvalidArgument, match="store key"):
                store.set(key, b"x")
    finally:
        dev.close()


def test_connecting_to_nobody_times_out_naming_the_address():
    from conftest import free_port

    address = f"127.0.0.1:{free_port()}"
    dev = tw.Device(transport="tcp")
    try:
        t0 = time.monotonic()
        with pytest.raises(tw.Timeout, match=f"nobody served the tensorwire store at {address}"):
            ControlStore.connect(dev, address, BOUND_S)
        assert time.monotonic() - t0 < BOUND_S + SLACK_S
    finally:
        dev.close()


def test_a_c10d_store_passed_in_works():
    """Any torch.distributed store through its own API (here a HashStore)."""
    torch = pytest.importorskip("torch")
    store: Store = TorchStore(torch.distributed.HashStore())
    publish(store, "q", 0, b"a")
    publish(store, "q", 1, b"b")
    assert gather(store, "q", 2, 1, "publish") == [b"a", b"b"]
    assert store.add("n", 4) == 4
