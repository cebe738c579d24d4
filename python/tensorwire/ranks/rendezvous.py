"""One rendezvous: processes meet by putting small values (device addresses,
host names) under keys of one store and waiting for each other's keys.

:class:`Store` is the subset of torch's c10d ``Store`` API tensorwire needs:
``set``, ``get`` (waits for the key), ``add``, ``check``, ``delete_key`` and
``wait``; :func:`publish` and :func:`gather` build the usual exchange on it
(every rank puts its value under ``prefix/rank``, every rank reads them all).
Two backends, one rule:

* :class:`TorchStore`, torch's ``TCPStore`` (or any c10d store) used through
  its own API, where one already exists or the launcher is a torch program:
  under torchrun, the store at MASTER_ADDR:MASTER_PORT (:func:`torchrun_store`:
  torchrun's agent hosts it when TORCHELASTIC_USE_AGENT_STORE=True, else rank 0
  does, as torch's own env:// rendezvous, with which it shares the port);
  ``tensorwire train`` under torchrun or mpirun likewise; ps ``train()`` and
  partition's ``run()`` host one on port 0 in the launching process and hand
  host:port to their children; and a c10d store the user passes in.
* :class:`ControlStore`, the same protocol over tensorwire's control plane:
  one process's Device serves the table by control calls. ``World`` uses it
  wherever no torch store exists (``tensorwire run``, mpirun, srun): rank 0's
  device at the root address. A numpy program then never imports torch (a
  second of start-up), and runs where torch is absent.

This module imports torch only inside :class:`TorchStore`'s constructors.
Every wait is bounded and its Timeout names what is missing; a wait may watch
an *abort* key, which a failing process sets to say why, so that the others
fail with its words instead of waiting out the deadline. Waiting polls with a
back-off from 50 us to 20 ms (the control store's server runs its handlers on
the device's dispatcher thread, which must never block): setup only, never a
data path. The keys in use are listed in docs/architecture.md ("Rendezvous").
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Any, Callable, Iterable

from ..errors import ConnectionError as TwConnectionError
from ..errors import Error, InvalidArgument, NotFound, Timeout

FIRST_NAP_S, LAST_NAP_S = 50e-6, 0.02  # the back-off of every wait
CONNECT_NAP_S = 0.05  # between tries to reach a control store that does not answer yet
_CALLS = {op: f"tw.store.{op}" for op in ("set", "get", "add", "missing", "delete")}


def ranks(rs: Iterable[int], who: str = "rank") -> str:
    """'rank 2' or 'ranks 2, 3' (`who`: another noun)."""
    rs = list(rs)
    return f"{who}{'' if len(rs) == 1 else 's'} " + ", ".join(map(str, rs))


def split_address(address: str, what: str = "address") -> tuple[str, int]:
    """(host, port) of 'host:port' (InvalidArgument otherwise)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{what} must be host:port, got {address!r}")
    return host, int(port)


class Aborted(Error):
    """A wait ended early: another process set the abort key (its words are the message)."""


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Store:
    """A key -> bytes table shared by processes. Backends implement ``_set``,
    ``_get`` (of a key that is set: no wait), ``add``, ``missing`` and
    ``delete_key``."""

    address = ""  # host:port where it is served ("" for a store passed in)

    def set(self, key: str, value: bytes | str) -> None:
        self._set(key, _bytes(value))

    def get(self, key: str, timeout: float) -> bytes:
        """The value of `key`, waiting up to `timeout` s for it to be set."""
        self.wait([key], timeout)
        return self._get(key)

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set (no wait)."""
        return not self.missing(keys)

    def wait(
        self,
        keys: list[str],
        timeout: float,
        abort: str | None = None,
        describe: Callable[[list[str]], str] | None = None,
    ) -> None:
        """Returns once every key is set. Raises Timeout after `timeout` s
        (``describe(missing keys)`` says why, else the keys are named), or
        Aborted with the value of `abort` as soon as that key is set."""
        deadline = time.monotonic() + timeout
        watch = list(keys) + ([abort] if abort is not None else [])
        delay = FIRST_NAP_S
        while True:
            missing = self.missing(watch)
            if abort is not None and abort not in missing:
                raise Aborted(self._get(abort).decode(errors="replace"))
            missing = [k for k in missing if k != abort]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(
                    describe(missing)
                    if describe
                    else f"{', '.join(map(repr, missing))} not set in {self} within {timeout:g} s"
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, LAST_NAP_S)

    # -- the backend's part --

    def _set(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def _get(self, key: str) -> bytes:
        raise NotImplementedError

    def add(self, key: str, n: int) -> int:
        """Adds n to the integer under `key` (0 when unset) and returns the sum."""
        raise NotImplementedError

    def missing(self, keys: list[str]) -> list[str]:
        """Those of `keys` that are not set (no wait)."""
        raise NotImplementedError

    def delete_key(self, key: str) -> bool:
        """Removes `key`; whether it was set."""
        raise NotImplementedError


def publish(store: Store, prefix: str, rank: int, value: bytes | str) -> None:
    """Puts rank `rank`'s value where :func:`gather` finds it."""
    store.set(f"{prefix}/{rank}", value)


def gather(
    store: Store, prefix: str, n: int, timeout: float, what: str, abort: str | None = None, who: str = "rank"
) -> list[bytes]:
    """The values ranks 0..n-1 published under `prefix`, in rank order, once all
    are there. After `timeout` s, Timeout "ranks 2, 3 did not <what> (<store>)"
    (`what` says the bound: the caller knows the whole of it; `who` may name
    the ranks otherwise); Aborted with the value of `abort` once that key is set."""
    keys = [f"{prefix}/{r}" for r in range(n)]
    store.wait(
        keys, timeout, abort, lambda m: f"{ranks((int(k.rsplit('/', 1)[1]) for k in m), who)} did not {what} ({store})"
    )
    return [store._get(k) for k in keys]


# -- torch's store --


class TorchStore(Store):
    """A c10d store (torch's TCPStore, or any ``torch.distributed.Store``) through its own API."""

    def __init__(self, store: Any, address: str = "") -> None:
        self.store, self.address = store, address

    @classmethod
    def host(
        cls, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0, multi_tenant: bool = False
    ) -> "TorchStore":
        """A TCPStore served by this process on host:port (port 0: a free one)."""
        from torch.distributed import TCPStore

        s = cls._make(
            f"{host}:{port}",
            lambda: TCPStore(
                host,
                port,
                None,
                True,
                datetime.timedelta(seconds=timeout),
                wait_for_workers=False,
                multi_tenant=multi_tenant,
            ),
        )
        return cls(s, f"{host}:{s.port}")

    @classmethod
    def connect(cls, address: str, timeout: float = 60.0) -> "TorchStore":
        """A client of the TCPStore at host:port (waits up to `timeout` s for it to listen)."""
        from torch.distributed import TCPStore

        host, port = split_address(address, "a store's address")
        return cls(
            cls._make(address, lambda: TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))), address
        )

    @staticmethod
    def _make(address: str, make: Callable[[], Any]) -> Any:
        try:
            return make()
        except RuntimeError as e:  # torch's DistNetworkError, DistStoreError
            raise TwConnectionError(f"torch's TCPStore at {address}: {e}") from None

    def _do(self, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as e:
            raise TwConnectionError(f"{self}: {e}") from None

    def _set(self, key: str, value: bytes) -> None:
        self._do(self.store.set, key, value)

    def _get(self, key: str) -> bytes:
        return bytes(self._do(self.store.get, key))

    def add(self, key: str, n: int) -> int:
        return int(self._do(self.store.add, key, n))

    def missing(self, keys: list[str]) -> list[str]:
        if not keys or self._do(self.store.check, keys):
            return []
        return [k for k in keys if not self._do(self.store.check, [k])]

    def delete_key(self, key: str) -> bool:
        return bool(self._do(self.store.delete_key, key))

    def __repr__(self) -> str:
        return f"torch's TCPStore at {self.address}" if self.address else "the torch store"


def torchrun_store(rank: int, timeout: float, address: str | None = None) -> TorchStore:
    """The store of a torchrun job at `address` (default MASTER_ADDR:MASTER_PORT,
    127.0.0.1:29500 where unset). torchrun's agent hosts it when
    TORCHELASTIC_USE_AGENT_STORE is True; otherwise rank 0 hosts it,
    multi-tenant as torch's env:// rendezvous does, so that an
    init_process_group in the same process shares its port."""
    if address is None:
        address = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"
    host, port = split_address(address, "MASTER_ADDR:MASTER_PORT")
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return TorchStore.host(host, port, timeout, multi_tenant=True)
    return TorchStore.connect(address, timeout)


# -- the control-plane store --


def _split(payload: bytes) -> tuple[str, bytes]:
    key, _, rest = payload.partition(b"\0")
    return key.decode(), rest


class _Table:
    """The served table. Its handlers run on the device's dispatcher thread:
    they take a lock for a dictionary operation and never wait. Any peer with
    the device's token may call them, so the table is bounded: at most
    `max_keys` keys (a value is bounded by one control message)."""

    MAX_KEYS = 1 << 16  # a rendezvous uses a few keys per rank

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.max_keys = max_keys

    def _room_for(self, key: str) -> None:  # under the lock
        if key not in self.data and len(self.data) >= self.max_keys:
            raise InvalidArgument(f"the tensorwire store is full ({self.max_keys} keys): {key!r} not added")

    def set(self, payload: bytes) -> bytes:
        key, value = _split(payload)
        with self.lock:
            self._room_for(key)
            self.data[key] = value
        return b""

    def get(self, payload: bytes) -> bytes:
        with self.lock:
            value = self.data.get(payload.decode())
        return b"\0" if value is None else b"\1" + value

    def add(self, payload: bytes) -> bytes:
        key, n = _split(payload)
        with self.lock:
            self._room_for(key)
            total = int(self.data.get(key, b"0")) + int(n)
            self.data[key] = str(total).encode()
        return str(total).encode()

    def missing(self, payload: bytes) -> bytes:
        keys = payload.decode().split("\0") if payload else []
        with self.lock:
            return ",".join(str(i) for i, k in enumerate(keys) if k not in self.data).encode()

    def delete(self, payload: bytes) -> bytes:
        with self.lock:
            return b"1" if self.data.pop(payload.decode(), None) is not None else b"0"


class ControlStore(Store):
    """The store protocol served by one Device's control calls (``tw.store.*``).

    ``ControlStore.serve(device)`` serves the table on `device` (this process's
    own calls go to it directly); ``ControlStore.connect(device, address)`` is a
    client of the table served at `address`, through a channel of `device`.
    A value may be up to about 1 MiB (one control message)."""

    def __init__(self, call: Callable[[str, bytes], bytes], address: str) -> None:
        self._call, self.address = call, address

    @classmethod
    def serve(cls, device: Any, max_keys: int = _Table.MAX_KEYS) -> "ControlStore":
        table = _Table(max_keys)
        fns = {name: getattr(table, op) for op, name in _CALLS.items()}
        for name, fn in fns.items():
            device.on_call(name, fn)
        return cls(lambda name, payload: fns[name](payload), device.address)

    @classmethod
    def connect(cls, device: Any, address: str, timeout: float, call_timeout: float = 10.0) -> "ControlStore":
        """A client of the store served at `address`; its host may not listen,
        or serve, yet: tried every 50 ms for up to `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ch = device.connect(address)
                ch.call(_CALLS["missing"], b"", call_timeout)  # served yet?
                return cls(lambda name, payload: ch.call(name, payload, call_timeout), address)
            except (TwConnectionError, NotFound) as e:
                if time.monotonic() > deadline:
                    raise Timeout(
                        f"nobody served the tensorwire store at {address} within {timeout:.3g} s ({e})"
                    ) from None
                time.sleep(CONNECT_NAP_S)

    @staticmethod
    def _key(key: str) -> bytes:
        if not key or "\0" in key:
            raise InvalidArgument(f"a store key must be a non-empty string without NUL, got {key!r}")
        return key.encode()

    def _set(self, key: str, value: bytes) -> None:
        self._call(_CALLS["set"], self._key(key) + b"\0" + value)

    def _get(self, key: str) -> bytes:
        out = self._call(_CALLS["get"], self._key(key))
        if out[:1] != b"\1":
            raise NotFound(f"{key!r} is not set in {self}")
        return out[1:]

    def add(self, key: str, n: int) -> int:
        return int(self._call(_CALLS["add"], self._key(key) + b"\0" + str(int(n)).encode()))

    def missing(self, keys: list[str]) -> list[str]:
        out = self._call(_CALLS["missing"], b"\0".join(self._key(k) for k in keys))
        return [keys[int(i)] for i in out.split(b",")] if out else []

    def delete_key(self, key: str) -> bool:
        return self._call(_CALLS["delete"], self._key(key)) == b"1"

    def __repr__(self) -> str:
        return f"the tensorwire store at {self.address}"
