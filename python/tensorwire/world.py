"""A world of N ranks: bootstrap, address table, barrier and small-object exchange.

Every rank owns one Device. Rank 0's device listens on the *root address*
that all ranks know; the others connect to it, say who they are (JOIN), and
poll until rank 0 has heard from everybody, then get the table of all device
addresses. After that, ranks talk directly (`world.channel(peer)`); rank 0
only serves `allgather`/`barrier`, which are tiny control calls (the paper's
"RPC only for addresses").

Who am I? ``World.from_env()`` reads, in this order:

========================  ================================  ===============================
launcher                  rank / size                       root address
========================  ================================  ===============================
``tensorwire run``        TENSORWIRE_RANK / TENSORWIRE_SIZE TENSORWIRE_ROOT (host:port)
mpirun (Open MPI)         OMPI_COMM_WORLD_RANK/SIZE         TENSORWIRE_ROOT, else 127.0.0.1:29600
MPICH / Intel MPI (PMI)   PMI_RANK / PMI_SIZE               TENSORWIRE_ROOT, else 127.0.0.1:29600
srun (Slurm)              SLURM_PROCID / SLURM_NTASKS       TENSORWIRE_ROOT, else 127.0.0.1:29600
torchrun                  RANK / WORLD_SIZE                 MASTER_ADDR : MASTER_PORT+1
========================  ================================  ===============================

torchrun's own store already listens on MASTER_PORT, hence the +1. A rank
listens on TENSORWIRE_HOST if set, else on 127.0.0.1 when the root is
loopback, else on the local address that routes to the root. Every variable:
docs/configuration.md.

Every wait is bounded: a rank that does not arrive in ``timeout`` seconds
ends the bootstrap (on every rank) with an error that names it.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ConnectionError as TwConnectionError
from .errors import Error, InvalidArgument, PeerFailed, Timeout

DEFAULT_ROOT_PORT = 29600
_JOIN, _TABLE, _PUT, _GET = "tw.world.join", "tw.world.table", "tw.world.put", "tw.world.get"


@dataclass(frozen=True)
class Placement:
    """Where this process stands: rank, size, the root's address and who said so."""
    rank: int
    size: int
    root: str        # host:port of rank 0's device
    launcher: str    # "tensorwire run", "mpirun", "pmi", "slurm", "torchrun" or "single"


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise InvalidArgument(f"{key}={env[key]!r} is not an integer") from None


# The launcher's names before every variable became TENSORWIRE_* (docs/configuration.md):
# no longer read, but a process that still sets one is told so once.
_RETIRED = {f"TW_{n}": f"TENSORWIRE_{n}" for n in ("RANK", "SIZE", "ROOT", "HOST", "TOKEN", "LOCAL_RANK")}
_warned_retired = False


def _warn_retired(env: Mapping[str, str]) -> None:
    global _warned_retired
    old = [k for k in _RETIRED if k in env and _RETIRED[k] not in env]
    if old and not _warned_retired:
        _warned_retired = True
        warnings.warn(", ".join(old) + " no longer read: tensorwire reads "
                      + ", ".join(_RETIRED[k] for k in old) + " (docs/configuration.md)", stacklevel=3)


def detect(env: Mapping[str, str] | None = None) -> Placement:
    """This process's placement from its environment (see the module docs)."""
    env = os.environ if env is None else env
    _warn_retired(env)
    default_root = env.get("TENSORWIRE_ROOT", f"127.0.0.1:{DEFAULT_ROOT_PORT}")
    for rank_key, size_key, launcher in (("TENSORWIRE_RANK", "TENSORWIRE_SIZE", "tensorwire run"),
                                         ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun"),
                                         ("PMI_RANK", "PMI_SIZE", "pmi"),
                                         ("SLURM_PROCID", "SLURM_NTASKS", "slurm"),
                                         ("RANK", "WORLD_SIZE", "torchrun")):
        if rank_key in env and size_key in env:
            rank, size = _int(env, rank_key), _int(env, size_key)
            root = default_root
            if launcher == "torchrun" and "TENSORWIRE_ROOT" not in env:
                if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
                    raise InvalidArgument("RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not")
                root = f"{env['MASTER_ADDR']}:{_int(env, 'MASTER_PORT') + 1}"
            break
    else:
        rank, size, root, launcher = 0, 1, default_root, "single"
    if size < 1 or not 0 <= rank < size:
        raise InvalidArgument(f"rank {rank} of size {size} is not a valid placement ({launcher})")
    _split(root)
    return Placement(rank, size, root, launcher)


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"root address must be host:port, got {address!r}")
    return host, int(port)


def _host_name() -> str:
    """This rank's host: the testbed host it runs in, else the machine's name."""
    return os.environ.get("TENSORWIRE_TESTBED_HOST") or socket.gethostname()


def _local_host_towards(root_host: str) -> str:
    """The local address a connection to root_host leaves from (no packet is sent)."""
    if root_host.startswith("127.") or root_host == "localhost":
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((root_host, 9))
        return s.getsockname()[0]


class _Root:
    """Rank 0's side of the bootstrap: the JOIN table and the allgather rounds.
    Handlers run on the device's dispatcher thread and never block."""

    def __init__(self, size: int, own_address: str) -> None:
        self.size = size
        self.addresses: list[str | None] = [None] * size
        self.addresses[0] = own_address
        self.hosts: list[str | None] = [None] * size
        self.hosts[0] = _host_name()
        self.rounds: dict[int, dict[int, Any]] = {}
        self.fetched: dict[int, int] = {}
        self.error: str | None = None

    def missing(self) -> list[int]:
        return [r for r, a in enumerate(self.addresses) if a is None]

    def join(self, payload: bytes) -> bytes:
        msg = json.loads(payload)
        rank, size = int(msg["rank"]), int(msg["size"])
        if size != self.size:
            self.error = f"rank {rank} says the world has {size} ranks, rank 0 says {self.size}"
            raise ValueError(self.error)
        if not 0 < rank < self.size:
            raise ValueError(f"rank {rank} is out of range for a world of {self.size}")
        old = self.addresses[rank]
        if old is not None and old != msg["address"]:
            self.error = f"two processes claim rank {rank} ({old} and {msg['address']})"
            raise ValueError(self.error)
        self.addresses[rank] = msg["address"]
        self.hosts[rank] = msg.get("host")
        return b"ok"

    def table(self, _payload: bytes) -> bytes:
        missing = self.missing()
        return json.dumps({"missing": missing, "error": self.error,
                           "addresses": self.addresses if not missing else None,
                           "hosts": self.hosts if not missing else None}).encode()

    def put(self, payload: bytes) -> bytes:
        msg = json.loads(payload)
        self._put(int(msg["round"]), int(msg["rank"]), msg["value"])
        return b"ok"

    def _put(self, rnd: int, rank: int, value: Any) -> None:
        self.rounds.setdefault(rnd, {})[rank] = value

    def get(self, payload: bytes) -> bytes:
        rnd = int(json.loads(payload)["round"])
        return json.dumps(self._get(rnd)).encode()

    def _get(self, rnd: int) -> dict:
        got = self.rounds.get(rnd, {})
        if len(got) < self.size:
            return {"missing": [r for r in range(self.size) if r not in got]}
        values = [got[r] for r in range(self.size)]
        self.fetched[rnd] = self.fetched.get(rnd, 0) + 1
        if self.fetched[rnd] == self.size:  # everybody has it: forget the round
            del self.rounds[rnd], self.fetched[rnd]
        return {"values": values}


def _poll(fn, timeout: float, what: str):
    """Calls fn() until it returns something other than None; backs off from
    50 us to 20 ms; raises Timeout with `what(last)` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    delay, last = 50e-6, None
    while True:
        out, last = fn()
        if out is not None:
            return out
        if time.monotonic() > deadline:
            raise Timeout(what(last))
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class World:
    """N processes, one Device each, all addresses known to all.

    Args:
        placement: rank/size/root (default: ``detect()`` from the environment).
        timeout: seconds the bootstrap and each barrier/allgather may take.
        device_options: passed to ``tensorwire.Device`` (transport, progress, workers, ...).
    """

    def __init__(self, placement: Placement | None = None, timeout: float = 30.0,
                 **device_options: Any) -> None:
        from . import Device
        self.placement = placement or detect()
        self.rank, self.size = self.placement.rank, self.placement.size
        self.timeout = timeout
        root_host, root_port = _split(self.placement.root)
        device_options.setdefault("token", os.environ.get("TENSORWIRE_TOKEN", ""))
        self._round = 0
        self._channels: dict[tuple[int, int], Any] = {}
        self._root: _Root | None = None
        self._root_channel = None
        if self.size == 1:
            self.device = Device(host=os.environ.get("TENSORWIRE_HOST", root_host), port=0, **device_options)
            self.addresses = [self.device.address]
            self.hosts = [_host_name()]
            return
        if self.rank == 0:
            try:
                self.device = Device(host=root_host, port=root_port, **device_options)
            except Error as e:
                raise TwConnectionError(f"rank 0 cannot listen on the root address {self.placement.root}: {e}") \
                    from None
            self._root = _Root(self.size, self.device.address)
            for name, fn in ((_JOIN, self._root.join), (_TABLE, self._root.table),
                             (_PUT, self._root.put), (_GET, self._root.get)):
                self.device.on_call(name, fn)
            def joined():
                if self._root.error:
                    raise Error(f"bootstrap failed: {self._root.error}")
                missing = self._root.missing()
                return (None if missing else True), missing
            try:
                _poll(joined, timeout, lambda m: f"{_ranks(m)} did not join rank 0 at {self.placement.root} "
                                                 f"within {timeout:g} s")
            except BaseException:
                self.device.close()
                raise
            self.addresses = list(self._root.addresses)
            self.hosts = list(self._root.hosts)
            return
        host = os.environ.get("TENSORWIRE_HOST") or _local_host_towards(root_host)
        self.device = Device(host=host, port=0, **device_options)
        try:
            self._bootstrap(timeout)
        except PeerFailed as e:
            self.device.close()
            raise PeerFailed(f"rank {self.rank}: rank 0 ended the bootstrap ({e}); its error says why") from None
        except BaseException:
            self.device.close()
            raise

    def _bootstrap(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last_error = None
        while self._root_channel is None:  # rank 0 may not listen yet
            try:
                self._root_channel = self.device.connect(self.placement.root)
            except TwConnectionError as e:
                last_error = e
                if time.monotonic() > deadline:
                    raise Timeout(f"rank {self.rank}: rank 0 at {self.placement.root} did not answer within "
                                  f"{timeout:g} s ({last_error})") from None
                time.sleep(0.05)
        me = {"rank": self.rank, "size": self.size, "address": self.device.address,
              "host": _host_name()}
        self._call(_JOIN, me)

        def table():
            t = json.loads(self._call(_TABLE, {}))
            if t["error"]:
                raise Error(f"bootstrap failed at rank 0: {t['error']}")
            return t if t["addresses"] else None, t["missing"]
        t = _poll(table, max(0.0, deadline - time.monotonic()),
                  lambda m: f"rank {self.rank}: {_ranks(m or [])} did not join within {timeout:g} s")
        self.addresses, self.hosts = t["addresses"], t["hosts"]

    def _call(self, name: str, msg: Any) -> bytes:
        return self._root_channel.call(name, json.dumps(msg).encode(), self.timeout)

    # -- collectives on the control plane (small, JSON-serialisable values) --

    def allgather(self, value: Any, timeout: float | None = None) -> list[Any]:
        """Every rank's `value` (JSON-serialisable), in rank order, on every rank."""
        timeout = self.timeout if timeout is None else timeout
        self._round += 1
        rnd = self._round
        if self.size == 1:
            return [value]
        if self._root is not None:
            self._root._put(rnd, 0, value)
            get = lambda: (lambda r: (r.get("values"), r.get("missing")))(self._root._get(rnd))  # noqa: E731
        else:
            self._call(_PUT, {"round": rnd, "rank": self.rank, "value": value})
            get = lambda: (lambda r: (r.get("values"), r.get("missing")))(  # noqa: E731
                json.loads(self._call(_GET, {"round": rnd})))
        return _poll(get, timeout, lambda m: f"rank {self.rank}: {_ranks(m or [])} did not reach "
                                             f"collective round {rnd} within {timeout:g} s")

    def barrier(self, timeout: float | None = None) -> None:
        """Returns once every rank has entered this barrier."""
        self.allgather(None, timeout)

    def broadcast(self, value: Any = None, root: int = 0, timeout: float | None = None) -> Any:
        """`value` of rank `root`, on every rank."""
        if not 0 <= root < self.size:
            raise InvalidArgument(f"root must be a rank in 0..{self.size - 1}, got {root}")
        return self.allgather(value if self.rank == root else None, timeout)[root]

    # -- data paths --

    def channel(self, peer: int, lane: int = 0):
        """A channel from this rank to `peer` on `lane` (connected on first use, then cached)."""
        if not 0 <= peer < self.size or peer == self.rank:
            raise InvalidArgument(f"peer must be another rank in 0..{self.size - 1}, got {peer}")
        key = (peer, lane)
        ch = self._channels.get(key)
        if ch is None:
            ch = self._channels[key] = self.device.connect(self.addresses[peer], lane)
        return ch

    def close(self) -> None:
        if self._root is not None and not self.device.closed:
            # the others may still fetch the last round from us: give them a moment
            deadline = time.monotonic() + min(self.timeout, 5.0)
            while self._root.rounds and time.monotonic() < deadline:
                time.sleep(0.001)
        self._channels.clear()
        self._root_channel = None
        self.device.close()

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"World(rank={self.rank}, size={self.size}, launcher={self.placement.launcher!r})"
