"""A world of N ranks: bootstrap, address table, collectives on tensors, barrier
and small-object exchange.

Every rank owns one Device. The ranks meet in one store (tensorwire.ranks.rendezvous):
each puts its device's address and host under ``tensorwire/world/...`` and
waits for everybody's. After that, ranks talk directly (`world.channel(peer)`);
the store only carries `allgather` and the object form of `broadcast`, which
are tiny (the paper's "RPC only for addresses").

Tensors: `allreduce`, `alltoall` and `broadcast` of a numpy array or CPU torch
tensor run on the C++ collectives layer (``_core.Collectives``, the torch backend's
too) over a tagged-message engine (``_core.Messenger``) made on first use, in the
caller's memory; `barrier` runs on it once it exists. Every rank must make the same
collective calls, with the same shapes, dtypes, ops and roots, in the same order
(docs/collectives.md, "As a library").

Who am I, and where do we meet? ``detect()`` reads, in this order:

========================  ================================  =========================================
launcher                  rank / size                       store (the root address)
========================  ================================  =========================================
``tensorwire run``        TENSORWIRE_RANK / TENSORWIRE_SIZE rank 0's device at TENSORWIRE_ROOT
mpirun (Open MPI)         OMPI_COMM_WORLD_RANK/SIZE         rank 0's device at TENSORWIRE_ROOT,
                                                            else 127.0.0.1:29600
MPICH / Intel MPI (PMI)   PMI_RANK / PMI_SIZE               as mpirun
srun (Slurm)              SLURM_PROCID / SLURM_NTASKS       as mpirun
torchrun                  RANK / WORLD_SIZE                 torch's TCPStore at MASTER_ADDR:MASTER_PORT
                                                            (rank 0's device at TENSORWIRE_ROOT if set)
========================  ================================  =========================================

Rank 0's device serves the store by control calls (rendezvous.ControlStore);
under torchrun the ranks use torchrun's own store (rendezvous.torchrun_store),
and ``World(store=...)`` takes any other (a c10d store included). A rank
listens on TENSORWIRE_HOST if set, else on 127.0.0.1 when the root is
loopback, else on the local address that routes to the root. Every variable:
docs/configuration.md.

Every wait is bounded: a rank that does not arrive in ``timeout`` seconds
ends the bootstrap (on every rank) with an error that names it; a rank that
finds the world inconsistent (two processes claim a rank, the sizes differ)
says so in the store, and every rank fails with its words.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NoReturn

import numpy as np

from ..errors import ConnectionError as TwConnectionError
from ..errors import Error, InvalidArgument, Timeout
from .rendezvous import Aborted, ControlStore, Store, TorchStore, gather, publish, split_address, torchrun_store

DEFAULT_ROOT_PORT = 29600
CLOSE_LINGER_S = 5.0  # how long rank 0, the store's host, waits at close for the others to read the last round
# allreduce's ops: World's names -> the C++ layer's
_OPS = {"sum": "sum", "prod": "product", "min": "min", "max": "max"}
# the dtypes it reduces (numpy's names, the core's too); not float128 or numpy's bool
_REDUCIBLE = frozenset(
    f"{k}{b}"
    for k, bits in (
        ("int", (8, 16, 32, 64)),
        ("uint", (8, 16, 32, 64)),
        ("float", (16, 32, 64)),
        ("complex", (64, 128)),
    )
    for b in bits
)
# Worlds of more than one rank made in this process, by rank: the k-th World of every rank meets
# under the k-th prefix (a torchrun store outlives Worlds)
_worlds: dict[int, int] = {}


@dataclass(frozen=True)
class Placement:
    """Where this process stands: rank, size, where the ranks meet and who said so."""

    rank: int
    size: int
    root: str  # host:port of the store: rank 0's device, or torchrun's TCPStore
    launcher: str  # "tensorwire run", "mpirun", "pmi", "slurm", "torchrun" or "single"
    store: str = "tensorwire"  # "tensorwire" (rank 0's device serves it) or "torch" (torchrun's TCPStore)


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
        warnings.warn(
            ", ".join(old)
            + " no longer read: tensorwire reads "
            + ", ".join(_RETIRED[k] for k in old)
            + " (docs/configuration.md)",
            stacklevel=3,
        )


def detect(env: Mapping[str, str] | None = None) -> Placement:
    """This process's placement from its environment (see the module docs)."""
    env = os.environ if env is None else env
    _warn_retired(env)
    default_root = env.get("TENSORWIRE_ROOT", f"127.0.0.1:{DEFAULT_ROOT_PORT}")
    for rank_key, size_key, launcher in (
        ("TENSORWIRE_RANK", "TENSORWIRE_SIZE", "tensorwire run"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun"),
        ("PMI_RANK", "PMI_SIZE", "pmi"),
        ("SLURM_PROCID", "SLURM_NTASKS", "slurm"),
        ("RANK", "WORLD_SIZE", "torchrun"),
    ):
        if rank_key in env and size_key in env:
            rank, size = _int(env, rank_key), _int(env, size_key)
            root, store = default_root, "tensorwire"
            if launcher == "torchrun" and "TENSORWIRE_ROOT" not in env:
                if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
                    raise InvalidArgument("RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not")
                root, store = f"{env['MASTER_ADDR']}:{_int(env, 'MASTER_PORT')}", "torch"
            break
    else:
        rank, size, root, launcher, store = 0, 1, default_root, "single", "tensorwire"
    if size < 1 or not 0 <= rank < size:
        raise InvalidArgument(f"rank {rank} of size {size} is not a valid placement ({launcher})")
    split_address(root, "root address")
    return Placement(rank, size, root, launcher, store)


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


class World:
    """N processes, one Device each, all addresses known to all.

    Args:
        placement: rank/size/root (default: ``detect()`` from the environment).
        timeout: seconds the bootstrap and each barrier/allgather may take.
        store: where the ranks meet (default: see the module docs): a
            ``tensorwire.ranks.rendezvous.Store`` or a c10d store (torch.distributed),
            the same on every rank.
        name: where this World's keys live in the store (default: the k-th World of
            this rank in this process meets under the k-th name); give one when the
            store is already the World's own (a torch.distributed group's prefix store).
        device_options: passed to ``tensorwire.Device`` (transport, progress, workers, ...).
    """

    def __init__(
        self,
        placement: Placement | None = None,
        timeout: float = 30.0,
        store: Any = None,
        name: str | None = None,
        **device_options: Any,
    ) -> None:
        from .. import Device

        self.placement = placement or detect()
        self.rank, self.size = self.placement.rank, self.placement.size
        self.timeout = timeout
        root_host, root_port = split_address(self.placement.root, "root address")
        device_options.setdefault("token", os.environ.get("TENSORWIRE_TOKEN", ""))
        self._round = 0
        self._channels: dict[tuple[int, int], Any] = {}
        self.store: Store | None = None
        self._serving = False  # this rank's device serves the store (rank 0, ControlStore)
        self._messenger: Any = None  # _core.Messenger and _core.Collectives on it, made on first use
        self._coll: Any = None
        self._coll_failed = ""  # why a collective failed: the ranks' calls are no longer aligned
        self.store_prefix = ""  # where this World's keys live in the store (none for a single rank)
        if self.size == 1:
            self.device = Device(host=os.environ.get("TENSORWIRE_HOST", root_host), port=0, **device_options)
            self.addresses = [self.device.address]
            self.hosts = [_host_name()]
            self.device_ids = [self.device.id]
            return
        self._serving = store is None and self.placement.store == "tensorwire" and self.rank == 0
        if self._serving:
            try:
                self.device = Device(host=root_host, port=root_port, **device_options)
            except Error as e:
                raise TwConnectionError(
                    f"rank 0 cannot listen on the root address {self.placement.root}: {e}"
                ) from None
        else:
            host = os.environ.get("TENSORWIRE_HOST") or _local_host_towards(root_host)
            self.device = Device(host=host, port=0, **device_options)
        if name is None:
            k = _worlds[self.rank] = _worlds.get(self.rank, -1) + 1
            name = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{k}"
        self.store_prefix = f"tensorwire/world/{name}"
        deadline = time.monotonic() + timeout
        try:
            self.store = self._open_store(store, deadline)
            self._meet(deadline)
        except TwConnectionError as e:
            self.device.close()
            if isinstance(self.store, ControlStore) and not self._serving:
                raise type(e)(f"rank {self.rank}: rank 0 ended the bootstrap ({e}); its error says why") from None
            raise
        except BaseException:
            self.device.close()
            raise

    def _open_store(self, store: Any, deadline: float) -> Store:
        if store is not None:
            return store if isinstance(store, Store) else TorchStore(store)
        left = max(0.0, deadline - time.monotonic())
        if self.placement.store == "torch":
            return torchrun_store(self.rank, left, self.placement.root)
        if self._serving:
            return ControlStore.serve(self.device)
        try:
            return ControlStore.connect(self.device, self.placement.root, left, call_timeout=self.timeout)
        except Timeout as e:
            raise Timeout(f"rank {self.rank}: rank 0 did not answer: {e}") from None

    def _meet(self, deadline: float) -> None:
        """Puts this rank's address and host in the store and takes everybody's;
        checks first that the ranks agree on the size and that no rank is claimed twice."""
        s, p, me = self._shared_store(), self.store_prefix, self.rank
        left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
        abort = f"{p}/error"
        mine = {"address": self.device.address, "host": _host_name(), "id": str(self.device.id)}
        try:
            if me == 0:
                s.set(f"{p}/size", str(self.size))
            else:
                s.wait([f"{p}/size"], left(), abort, lambda _: f"rank 0 did not join within {self.timeout:g} s ({s})")
                theirs = int(s.get(f"{p}/size", left()))
                if theirs != self.size:
                    self._abort(f"rank {me} says the world has {self.size} ranks, rank 0 says {theirs}")
            if s.add(f"{p}/claim/{me}", 1) > 1:
                other = json.loads(s.get(f"{p}/addr/{me}", left()))["address"]
                self._abort(f"two processes claim rank {me} ({other} and {mine['address']})")
            publish(s, f"{p}/addr", me, json.dumps(mine))
            table = [
                json.loads(v)
                for v in gather(s, f"{p}/addr", self.size, left(), f"join within {self.timeout:g} s", abort)
            ]
        except Aborted as e:
            raise Error(f"rank {me}: bootstrap failed: {e}") from None
        except Timeout as e:
            self._abort(str(e), Timeout)
        self.addresses = [t["address"] for t in table]
        self.hosts = [t["host"] for t in table]
        self.device_ids = [int(t["id"]) for t in table]

    def _shared_store(self) -> Store:
        """The store the ranks meet in (every World of more than one rank has one)."""
        assert self.store is not None, "a World of one rank has no store"
        return self.store

    def _abort(self, why: str, kind: type[Error] = Error) -> NoReturn:
        """Tells every rank why the bootstrap failed here (as far as the store is reachable), and raises."""
        try:
            self._shared_store().set(f"{self.store_prefix}/error", f"rank {self.rank}: {why}")
        except Error:
            pass
        raise kind(f"rank {self.rank}: bootstrap failed: {why}")

    # -- collectives on the store (small, JSON-serialisable values) --

    def allgather(self, value: Any, timeout: float | None = None) -> list[Any]:
        """Every rank's `value` (JSON-serialisable), in rank order, on every rank."""
        timeout = self.timeout if timeout is None else timeout
        self._round += 1
        if self.size == 1:
            return [value]
        p = self._round_prefix(self._round)
        store = self._shared_store()
        publish(store, p, self.rank, json.dumps(value))
        try:
            got = gather(store, p, self.size, timeout, f"reach collective round {self._round} within {timeout:g} s")
        except Timeout as e:
            raise Timeout(f"rank {self.rank}: {e}") from None
        try:
            if store.add(f"{p}/read", 1) == self.size:  # the last to read it: the round is over for all
                # rank 0's value goes last: once it is gone, rank 0 may close the store (_close)
                for key in [f"{p}/read"] + [f"{p}/{r}" for r in range(self.size - 1, -1, -1)]:
                    store.delete_key(key)
        except Error:
            # Housekeeping only: every value is read. A store its host took away as it left
            # (torch's, on rank 0, which read them all first) fails the next call that needs it.
            pass
        return [json.loads(v) for v in got]

    def _round_prefix(self, rnd: int) -> str:
        return f"{self.store_prefix}/round/{rnd}"

    def barrier(self, timeout: float | None = None) -> None:
        """Returns once every rank has entered this barrier. One meaning, two paths: the
        collectives layer's dissemination barrier (one-byte messages, microseconds) once it
        exists, an allgather in the store before (and after a collective failed). On the
        layer a wait is also bounded by its engine's own bound, twice the World's timeout."""
        if self._coll is None or self._coll_failed:
            self.allgather(None, timeout)
            return
        self._call("barrier", lambda c: c.barrier(self.timeout if timeout is None else timeout))

    def broadcast(self, value: Any = None, root: int = 0, timeout: float | None = None) -> Any:
        """Rank `root`'s `value` on every rank.

        A tensor (numpy array, CPU torch tensor, writable buffer) is broadcast in place
        on the data path: every rank passes one of the same shape and dtype, the root's
        bytes land in the others' (exactly), and it is returned. Any other value must
        be JSON-serialisable and goes through the store, as allgather (small values;
        the other ranks' `value` is ignored)."""
        if not 0 <= root < self.size:
            raise InvalidArgument(f"root must be a rank in 0..{self.size - 1}, got {root}")
        if not _is_tensor(value):
            return self.allgather(value if self.rank == root else None, timeout)[root]
        arr = _array(value, "broadcast", writable=self.rank != root, any_dtype=True)
        if self.size == 1 or arr.nbytes == 0:
            return value
        self._call(
            "broadcast", lambda c: c.broadcast(arr.ctypes.data, arr.nbytes, root, keep=arr, timeout=self.timeout)
        )
        return value

    # -- collectives on tensors (the C++ layer, _core.Collectives) --

    def allreduce(self, tensor: Any, op: str = "sum") -> Any:
        """Reduces `tensor` over all ranks in place and returns it: op "sum" (default),
        "prod", "min" or "max", on integer, float and complex dtypes (min/max: not
        complex). Every rank passes the same shape and dtype. The algorithm is chosen
        by size (recursive doubling up to 64 KiB, then the ring): each rank ends with
        the same bytes."""
        name = op.lower() if isinstance(op, str) else None
        if name not in _OPS:
            raise InvalidArgument(f"allreduce op {op!r} is not supported; supported: {', '.join(_OPS)}")
        arr = _array(tensor, "allreduce", writable=True)
        if arr.dtype.name not in _REDUCIBLE or (arr.dtype.kind == "c" and name in ("min", "max")):
            raise InvalidArgument(
                f"allreduce {name} of {arr.dtype} is not supported: integer, float or complex "
                f"dtypes (min and max: not complex)"
            )
        if not arr.dtype.isnative:
            raise InvalidArgument(
                f"allreduce needs the machine's byte order, got {arr.dtype.str} "
                f"(arr.astype(arr.dtype.newbyteorder('=')) makes a copy in it)"
            )
        if self.size == 1 or arr.size == 0:
            return tensor
        self._call(
            "allreduce",
            lambda c: c.allreduce(
                arr.ctypes.data, arr.size, arr.dtype.name, _OPS[name], keep=arr, timeout=self.timeout
            ),
        )
        return tensor

    def alltoall(self, out: Any, inp: Any) -> Any:
        """All-to-all of N equal blocks (N = world size) along dimension 0: block r of `inp`
        goes to rank r, block s of `out` comes from rank s (torch.distributed's
        all_to_all_single without split sizes). `out` and `inp` have the same dtype and
        size (every rank the same); exact bytes of any dtype. Returns `out`."""
        o = _array(out, "alltoall out", writable=True, any_dtype=True)
        i = _array(inp, "alltoall inp", any_dtype=True)
        n = self.size
        if i.dtype != o.dtype or i.nbytes != o.nbytes:
            raise InvalidArgument(
                f"alltoall needs out and inp of one dtype and size, got {o.dtype} x {o.size} and {i.dtype} x {i.size}"
            )
        for a, what in ((i, "inp"), (o, "out")):
            if a.ndim == 0 or a.shape[0] % n:
                raise InvalidArgument(
                    f"alltoall {what} must hold {n} equal blocks (one per rank) along dimension 0, got shape {a.shape}"
                )
        if n == 1 or i.nbytes == 0:
            np.copyto(o.reshape(-1), i.reshape(-1))
            return out
        if np.may_share_memory(o, i):  # the layer writes out while it still reads inp
            i = i.copy()
        self._call(
            "alltoall",
            lambda c: c.alltoall(
                i.ctypes.data, o.ctypes.data, i.nbytes // n, in_keep=i, out_keep=o, timeout=self.timeout
            ),
        )
        return out

    @property
    def collectives(self) -> Any:
        """The C++ collectives layer (``_core.Collectives``) this World's tensor collectives run
        on, made on first use (every rank at the same call: it meets the others through the
        World's store). A bench uses it to force an allreduce algorithm; a second one on the
        same ranks would take its messages, so there is only this one."""
        if self._coll is None:
            if self.size == 1:
                raise InvalidArgument("a World of one rank has no collectives layer (its collectives copy locally)")
            if self._coll_failed:
                raise Error(f"rank {self.rank}: this World's collectives cannot be used any more: {self._coll_failed}")
            from .. import _core

            try:  # a collective set-up: every rank meets the others in the World's store
                # each call's deadline is the World's timeout (its Timeout names the call and the
                # ranks it waits for); the engine's own, longer, only ends what a failed call left
                store = self._shared_store()
                self._messenger = _core.Messenger(
                    self.device,
                    self.rank,
                    self.size,
                    store.set,
                    store.get,
                    name=f"{self.store_prefix}/msg",
                    timeout=2 * self.timeout,
                )
            except Error as e:
                self._coll_failed = f"setting up the collectives failed: {e}"
                raise
            self._coll = _core.Collectives(self._messenger)
        return self._coll

    def _call(self, what: str, fn: Callable[[Any], None]) -> None:
        """Runs one collective on the layer. After a failure inside a call the ranks' calls
        are no longer aligned (a message of this call may still arrive): later tensor
        collectives are refused, and barrier/allgather use the store."""
        if self._coll_failed:
            raise Error(
                f"rank {self.rank}: {what}: this World's collectives cannot be used any more: an earlier "
                f"collective failed ({self._coll_failed})"
            )
        coll = self.collectives
        try:
            fn(coll)
        except Error as e:
            self._coll_failed = str(e)
            raise

    # -- data paths --

    def channel(self, peer: int, lane: int = 0):
        """A channel from this rank to `peer` on `lane` (made on first use, then cached).

        One connection per pair of ranks: the lower rank connects, the higher one takes
        the channel back on that connection (waiting up to the World's timeout for it).
        Identity is per connection (contracts section 11): a range one rank exports over
        a connection is accepted only on that connection, so both directions of a pair
        must share it."""
        if not 0 <= peer < self.size or peer == self.rank:
            raise InvalidArgument(f"peer must be another rank in 0..{self.size - 1}, got {peer}")
        key = (peer, lane)
        ch = self._channels.get(key)
        if ch is None:
            if peer > self.rank:
                ch = self.device.connect(self.addresses[peer], lane)
            else:
                ch = self._channel_back(peer, lane)
            self._channels[key] = ch
        return ch

    def _channel_back(self, peer: int, lane: int):
        """The channel on the connection `peer` (a lower rank) makes to us."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self.device.channel_to(self.device_ids[peer], lane)
            except Error:
                if time.monotonic() >= deadline:
                    raise Timeout(f"rank {self.rank}: rank {peer} did not connect within {self.timeout:g} s") from None
                try:
                    self.device.wait_for_peer(min(0.05, max(0.0, deadline - time.monotonic())))
                except Error:
                    pass

    def close(self) -> None:
        self._close(sync=True)

    def _close(self, sync: bool) -> None:
        coll, messenger, self._coll, self._messenger = self._coll, self._messenger, None, None
        if messenger is not None and not self.device.closed:
            try:  # every rank is past its last collective (no message still on its way to us) before we go
                if sync and not self._coll_failed:
                    coll.barrier(min(self.timeout, 10.0))
            except Error:
                pass
            del coll
            messenger.close()
        if (
            self.rank == 0
            and self.size > 1
            and self.store is not None
            and (self._serving or sync)
            and self._round
            and not self.device.closed
        ):
            # the others may still read the last round from the store, which rank 0 hosts (ours,
            # or torch's TCPStore under env:// without an agent, gone when this process ends):
            # give them a moment (its last reader deletes it)
            last = f"{self._round_prefix(self._round)}/0"
            deadline = time.monotonic() + min(self.timeout, CLOSE_LINGER_S)
            try:
                while self.store.check([last]) and time.monotonic() < deadline:
                    time.sleep(0.001)
            except Error:
                pass  # a store whose host (an agent) is gone: nobody can read it any more
        self._channels.clear()
        self.device.close()

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc: object) -> None:
        self._close(sync=exc[0] is None)  # after an error the others may never arrive

    def __repr__(self) -> str:
        return f"World(rank={self.rank}, size={self.size}, launcher={self.placement.launcher!r})"


# -- tensors as numpy views (zero-copy) --

_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr") and hasattr(x, "is_contiguous")


def _is_tensor(x: Any) -> bool:
    """A tensor for the data path: an array, a torch tensor or a buffer (not a JSON value)."""
    if isinstance(x, np.ndarray) or _is_torch(x):
        return True
    try:
        memoryview(x)
        return True
    except TypeError:
        return False


def _array(x: Any, what: str, writable: bool = False, any_dtype: bool = False) -> np.ndarray:
    """A C-contiguous numpy view of `x` (numpy array, CPU torch tensor, buffer), never a
    copy: results are written into the caller's memory. any_dtype: only bytes move, so a
    dtype numpy lacks (bfloat16) is viewed as an integer of its size."""
    if isinstance(x, np.ndarray):
        arr = x
    elif _is_torch(x):
        if x.device.type != "cpu":
            raise InvalidArgument(f"{what} takes CPU tensors, got one on {x.device} (copy it with .cpu())")
        if not x.is_contiguous():
            raise InvalidArgument(f"{what} needs a contiguous tensor (call .contiguous() first)")
        t = x.detach()
        try:
            arr = t.numpy()
        except (TypeError, RuntimeError) as e:
            if not any_dtype or t.element_size() not in _INT_OF_SIZE:
                raise InvalidArgument(f"{what} of a {x.dtype} tensor is not supported ({e})") from None
            import torch

            arr = t.view(getattr(torch, _INT_OF_SIZE[t.element_size()])).numpy()
    else:
        try:
            arr = np.asarray(memoryview(x))
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"{what} needs a numpy array, a CPU torch tensor or a buffer, got {type(x).__name__}"
            ) from None
    if not arr.flags.c_contiguous:
        raise InvalidArgument(f"{what} needs a C-contiguous array (np.ascontiguousarray makes one)")
    if writable and not arr.flags.writeable:
        raise InvalidArgument(f"{what} is written in place: it must be writable")
    if arr.dtype.hasobject:
        raise InvalidArgument(f"{what} cannot move Python objects (dtype=object)")
    return arr
