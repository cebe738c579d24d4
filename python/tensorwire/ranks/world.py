"""A world of N ranks: bootstrap, address table, collectives on tensors, barrier
and small-object exchange.

Every rank owns one Device. The ranks meet in one store (tensorwire.ranks.rendezvous):
each puts its device's address and host under ``tensorwire/world/...`` and
waits for everybody's. After that, ranks talk directly (`world.channel(peer)`);
the store only carries `allgather` and the object form of `broadcast`, which
are tiny (the paper's "RPC only for addresses").

Tensors: `allreduce`, `alltoall` and `broadcast` of a numpy array or CPU torch
tensor run on the one-sided collectives engine (tensorwire.ranks.collectives), made
on first use and grown when a call needs more; `barrier` runs on it once it
exists. Every rank must make the same collective calls, with the same shapes,
dtypes, ops and roots, in the same order (docs/collectives.md, "As a library").

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
from typing import Any, Mapping

import numpy as np

from ..errors import ConnectionError as TwConnectionError
from ..errors import Error, InvalidArgument, Timeout
from .rendezvous import (Aborted, ControlStore, Store, TorchStore, gather, publish, split_address,
                         torchrun_store)

DEFAULT_ROOT_PORT = 29600
CLOSE_LINGER_S = 5.0  # how long rank 0, the store's host, waits at close for the others to read the last round
# Worlds of more than one rank made in this process, by rank: the k-th World of every rank meets
# under the k-th prefix (a torchrun store outlives Worlds)
_worlds: dict[int, int] = {}


@dataclass(frozen=True)
class Placement:
    """Where this process stands: rank, size, where the ranks meet and who said so."""
    rank: int
    size: int
    root: str        # host:port of the store: rank 0's device, or torchrun's TCPStore
    launcher: str    # "tensorwire run", "mpirun", "pmi", "slurm", "torchrun" or "single"
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

    def __init__(self, placement: Placement | None = None, timeout: float = 30.0, store: Any = None,
                 name: str | None = None, **device_options: Any) -> None:
        from .. import Device
        self.placement = placement or detect()
        self.rank, self.size = self.placement.rank, self.placement.size
        self.timeout = timeout
        root_host, root_port = split_address(self.placement.root, "root address")
        device_options.setdefault("token", os.environ.get("TENSORWIRE_TOKEN", ""))
        self._round = 0
        self._channels: dict[tuple[int, int], Any] = {}
        self.store: Store | None = None
        self._serving = False        # this rank's device serves the store (rank 0, ControlStore)
        self._coll: Any = None       # the collectives engine (OneSidedCollectives), made on first use
        self._beside: Any = None     # another engine whose work our waits move (see beside)
        self._coll_gen = 0           # engines made so far (each publishes under its own names)
        self._coll_dims: tuple[int, ...] = (0, 0, 0)  # what it holds: alltoall block, allreduce vector, broadcast (bytes)
        # The engine's rule (tensorwire.ranks.collectives): control-plane calls sit between engine
        # barriers. _coll_data: a data-path call since the last engine barrier (a control-plane
        # call must barrier first); _coll_control: a control-plane call since then (the next
        # data-path call must barrier first). Every rank makes the same calls, so all agree.
        self._coll_data = self._coll_control = False
        self.store_prefix = ""       # where this World's keys live in the store (none for a single rank)
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
                raise TwConnectionError(f"rank 0 cannot listen on the root address {self.placement.root}: {e}") \
                    from None
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
        s, p, me = self.store, self.store_prefix, self.rank
        left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
        abort = f"{p}/error"
        mine = {"address": self.device.address, "host": _host_name(), "id": str(self.device.id)}
        try:
            if me == 0:
                s.set(f"{p}/size", str(self.size))
            else:
                s.wait([f"{p}/size"], left(), abort,
                       lambda _: f"rank 0 did not join within {self.timeout:g} s ({s})")
                theirs = int(s.get(f"{p}/size", left()))
                if theirs != self.size:
                    self._abort(f"rank {me} says the world has {self.size} ranks, rank 0 says {theirs}")
            if s.add(f"{p}/claim/{me}", 1) > 1:
                other = json.loads(s.get(f"{p}/addr/{me}", left()))["address"]
                self._abort(f"two processes claim rank {me} ({other} and {mine['address']})")
            publish(s, f"{p}/addr", me, json.dumps(mine))
            table = [json.loads(v) for v in gather(s, f"{p}/addr", self.size, left(),
                                                   f"join within {self.timeout:g} s", abort)]
        except Aborted as e:
            raise Error(f"rank {me}: bootstrap failed: {e}") from None
        except Timeout as e:
            self._abort(str(e), Timeout)
        self.addresses = [t["address"] for t in table]
        self.hosts = [t["host"] for t in table]
        self.device_ids = [int(t["id"]) for t in table]

    def _abort(self, why: str, kind: type[Error] = Error) -> None:
        """Tells every rank why the bootstrap failed here (as far as the store is reachable), and raises."""
        try:
            self.store.set(f"{self.store_prefix}/error", f"rank {self.rank}: {why}")
        except Error:
            pass
        raise kind(f"rank {self.rank}: bootstrap failed: {why}")

    # -- collectives on the store (small, JSON-serialisable values) --

    def allgather(self, value: Any, timeout: float | None = None) -> list[Any]:
        """Every rank's `value` (JSON-serialisable), in rank order, on every rank."""
        timeout = self.timeout if timeout is None else timeout
        if self._coll is not None and not self._coll.broken:
            if self._coll_data:
                self._coll.barrier()
                self._coll_data = False
            self._coll_control = True
        self._round += 1
        if self.size == 1:
            return [value]
        p = self._round_prefix(self._round)
        publish(self.store, p, self.rank, json.dumps(value))
        try:
            got = gather(self.store, p, self.size, timeout, f"reach collective round {self._round} "
                                                            f"within {timeout:g} s")
        except Timeout as e:
            raise Timeout(f"rank {self.rank}: {e}") from None
        try:
            if self.store.add(f"{p}/read", 1) == self.size:  # the last to read it: the round is over for all
                # rank 0's value goes last: once it is gone, rank 0 may close the store (_close)
                for key in [f"{p}/read"] + [f"{p}/{r}" for r in range(self.size - 1, -1, -1)]:
                    self.store.delete_key(key)
        except Error:
            # Housekeeping only: every value is read. A store its host took away as it left
            # (torch's, on rank 0, which read them all first) fails the next call that needs it.
            pass
        return [json.loads(v) for v in got]

    @property
    def beside(self) -> Any:
        """Another engine of this rank whose pending work only this rank's progress moves (none
        since the torch backend's engine is the C++ one, which progresses itself): every wait of this World (the
        collectives engine's, the store's) drives it too, so a send posted before a collective
        goes on while its sender waits in the collective (its receiver may wait for it first)."""
        return self._beside

    @beside.setter
    def beside(self, engine: Any) -> None:
        self._beside = engine
        if self.store is not None:
            self.store.nap = engine.nap if engine is not None else time.sleep

    def _round_prefix(self, rnd: int) -> str:
        return f"{self.store_prefix}/round/{rnd}"

    def barrier(self, timeout: float | None = None) -> None:
        """Returns once every rank has entered this barrier. One meaning, two paths: the
        collectives engine's dissemination barrier (flags only, microseconds) once the
        engine exists, an allgather in the store before (and after a collective failed)."""
        if self._coll is None or self._coll.broken:
            self.allgather(None, timeout)
            return
        self._coll.barrier(timeout)
        self._coll_data = self._coll_control = False

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
        eng = self._engine(bc=arr.nbytes)
        flat = arr.reshape(-1).view(np.uint8)
        if self.rank == root:
            eng.bc_view(flat.size)[:] = flat
        got = eng.broadcast(flat.size, root)
        if self.rank != root:
            flat[:] = got
        return value

    # -- collectives on tensors (the one-sided engine, tensorwire.ranks.collectives) --

    def allreduce(self, tensor: Any, op: str = "sum") -> Any:
        """Reduces `tensor` over all ranks in place and returns it: op "sum" (default),
        "prod", "min" or "max", on integer, float and complex dtypes (min/max: not
        complex). Every rank passes the same shape and dtype. The algorithm is chosen
        by size (recursive doubling below 512 KiB, then recursive halving or the ring):
        each rank ends with the same bytes."""
        from .collectives import OPS, choose_allreduce
        name = op.lower() if isinstance(op, str) else None
        if name not in OPS:
            raise InvalidArgument(f"allreduce op {op!r} is not supported; supported: {', '.join(OPS)}")
        arr = _array(tensor, "allreduce", writable=True)
        if arr.dtype.kind not in "iufc" or (arr.dtype.kind == "c" and name in ("min", "max")):
            raise InvalidArgument(f"allreduce {name} of {arr.dtype} is not supported: integer, float or complex "
                                  f"dtypes (min and max: not complex)")
        if self.size == 1 or arr.size == 0:
            return tensor
        eng = self._engine(ar=arr.nbytes)
        flat = arr.reshape(-1)
        eng.ar_view("src", flat.size, arr.dtype)[:] = flat
        flat[:] = eng.allreduce(flat.size, arr.dtype, choose_allreduce(arr.nbytes, self.size), name)
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
            raise InvalidArgument(f"alltoall needs out and inp of one dtype and size, got {o.dtype} x {o.size} "
                                  f"and {i.dtype} x {i.size}")
        for a, what in ((i, "inp"), (o, "out")):
            if a.ndim == 0 or a.shape[0] % n:
                raise InvalidArgument(f"alltoall {what} must hold {n} equal blocks (one per rank) along dimension "
                                      f"0, got shape {a.shape}")
        if n == 1 or i.nbytes == 0:
            np.copyto(o.reshape(-1), i.reshape(-1))
            return out
        b = i.nbytes // n
        eng = self._engine(a2a=b)
        eng.a2a_send_view(b)[:] = i.reshape(-1).view(np.uint8).reshape(n, b)
        o.reshape(-1).view(np.uint8).reshape(n, b)[:] = eng.alltoall(b)
        return out

    def _engine(self, a2a: int = 0, ar: int = 0, bc: int = 0) -> Any:
        """The engine for a data-path call needing these sizes: made on first use, grown
        (to the next power of two) when too small. Every rank makes the same calls, so all
        grow together; the old engine's barrier, the control plane, the new one's barrier."""
        self._coll_data = True  # the caller is about to use the data path
        need = (a2a, ar, bc)
        eng = self._coll
        if eng is not None and all(x <= have for x, have in zip(need, self._coll_dims)):
            if self._coll_control:
                eng.barrier()
                self._coll_control = False
            return eng
        from .collectives import RD_RING_THRESHOLD, OneSidedCollectives
        # the next power of two (at least 4 KiB): a growing series of calls grows the engine O(log) times
        dims = tuple(max(have, max(4096, 1 << (x - 1).bit_length()) if x else 0)
                     for x, have in zip(need, self._coll_dims))
        if eng is not None:
            eng.barrier()  # nobody fences while anybody is on the control plane
        self._coll = None
        every = self.allgather(list(need))  # a cheap check of the caller's contract
        if any(e != every[0] for e in every):
            raise InvalidArgument(f"rank {self.rank}: the ranks disagree about a collective call (buffer sizes "
                                  f"[alltoall block, allreduce, broadcast] by rank: {every})")
        new = OneSidedCollectives(self, dims[0], dims[1], timeout=self.timeout, bc_bytes=dims[2],
                                  rd_bytes=min(dims[1], RD_RING_THRESHOLD), name=f"coll.{self._coll_gen}")
        self._coll_gen += 1
        new.barrier()
        if eng is not None:
            eng.close()
        self._coll, self._coll_dims, self._coll_control = new, dims, False
        return new

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
                    raise Timeout(f"rank {self.rank}: rank {peer} did not connect within {self.timeout:g} s") \
                        from None
                try:
                    self.device.wait_for_peer(min(0.05, max(0.0, deadline - time.monotonic())))
                except Error:
                    pass

    def close(self) -> None:
        self._close(sync=True)

    def _close(self, sync: bool) -> None:
        eng, self._coll = self._coll, None
        if eng is not None and not self.device.closed:
            try:  # no peer may still write into our buffers when the device goes
                if sync and self._coll_data and not eng.broken:
                    eng.barrier(min(self.timeout, 10.0))
                eng.close()
            except Error:
                pass
        if (self.rank == 0 and self.size > 1 and self.store is not None and (self._serving or sync) and self._round
                and not self.device.closed):
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
            raise InvalidArgument(f"{what} needs a numpy array, a CPU torch tensor or a buffer, "
                                  f"got {type(x).__name__}") from None
    if not arr.flags.c_contiguous:
        raise InvalidArgument(f"{what} needs a C-contiguous array (np.ascontiguousarray makes one)")
    if writable and not arr.flags.writeable:
        raise InvalidArgument(f"{what} is written in place: it must be writable")
    if arr.dtype.hasobject:
        raise InvalidArgument(f"{what} cannot move Python objects (dtype=object)")
    return arr
