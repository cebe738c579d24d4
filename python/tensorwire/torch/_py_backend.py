"""The ``"tensorwire"`` torch.distributed backend: unchanged PyTorch programs
(DDP, FSDP, pipelining, checkpointing, send/recv) move their CPU tensors over
tensorwire after ``import tensorwire.torch`` and one changed word::

    import torch.distributed as dist
    import tensorwire.torch               # registers "tensorwire"
    dist.init_process_group("tensorwire")  # was "gloo"

Each process group is a tensorwire World (one Device) that meets its peers
through the c10d store torch hands it (no second rendezvous). Point to point
(``send``/``recv``/``isend``/``irecv``, ``batch_isend_irecv``) runs on the
tagged messages of tensorwire.ranks.messages: small tensors inline (eager), large
ones written straight into the receiver's own tensor (static placement, the
flag outside the payload) from the sender's own tensor, both registered in
place through one registration cache per group (tensorwire.registry); between
ranks on one host, a tensor moved again is shared in place (tensorwire.sharing)
and copied by plain loads and stores instead of the kernel's cross-memory copy.

Collectives: ``all_reduce``, ``broadcast``, ``barrier`` and the even
``all_to_all_single`` run on the World's one-sided collectives engine
(tensorwire.ranks.collectives, the same code as ``World.allreduce``), but an
all_reduce of 1 MiB or more: in the ranks' own tensors shared in place, through
the landing areas, or by messages (docs/torch.md); ``reduce``
is an all_reduce; ``all_gather*``, ``reduce_scatter*``, ``gather``,
``scatter``, ``all_to_all`` and uneven ``all_to_all_single`` are pairwise
exchanges of messages (zero copy into the output tensors for the large ones).
Every op runs when it is called, on the calling thread: its Work is complete
when the call returns, except ``isend``/``irecv``, whose Work completes when
waited for (a wait drives every pending message of the group). docs/torch.md
has the table of ops, dtypes, limits and how failures surface.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from .. import errors as tw_errors
from .. import sharing
from ..ranks.messages import Messenger
from ..registry import RegistrationCache
from ..ranks.world import Placement, World

BACKEND = "tensorwire"
COLL_TAG = -1                     # the tag of the messages collectives exchange (users' tags are >= 0)
# all_reduce from this size on: reduce-scatter then all-gather of messages, written straight into the
# ranks' own tensors (2.9x gloo at 16 MiB over shm, bench/results/torch_dist_shm.txt; through the engine's
# arena, which costs a copy in and out, it was 1.5x: torch_dist_quick.txt in git history, before ecf3ab5);
# below it the engine's recursive doubling (fewest trips)
LARGE_ALLREDUCE = 1 << 20
# all_reduce among ranks whose memory is mapped into each other (one host, shared memory): each round
# moves a piece of this many bytes per chunk through the peers' landing areas (n - 1 of them per rank)
SHARED_PIECE = 4 << 20
# all_reduce among ranks that map each other's tensors (shared in place, tensorwire.sharing): rank p
# reduces chunk p reading the peers' tensors and writes the result into them, this many bytes at a
# time (a piece stays in cache between its reduction and its copies out)
IN_PLACE_PIECE = 256 << 10
TICKET = 8  # int64s of an in-place all_reduce's ticket: Share.ticket's 5 (fd -1: none), nbytes, dtype, spare
SEEN_TICKETS = 4096  # tickets every rank remembers (identically) to skip the agreement round for known shares
ReduceOp = dist.ReduceOp
_REDUCE_NAMES = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "prod", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
                 ReduceOp.AVG: "avg"}
_TORCH_REDUCE = {"sum": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}


def progress_mode(transport: str, size: int, env: Any = None) -> str:
    """The Devices' progress mode (TENSORWIRE_PROGRESS, read by the core, overrides it).

    inline (the waiting rank drives its worker: no thread wake-up on the latency path) where
    every peer is reached through shared memory, whose writes land without the target's help;
    blocking (a progress thread) elsewhere: over tcp a write lands only when its target
    progresses, and a rank waiting on one group must not leave another group's messages
    unsent (inline, a wait drives only its own group's worker)."""
    env = os.environ if env is None else env
    if transport == "shm":
        return "inline"
    if transport != "auto":
        return "blocking"
    tls = env.get("UCX_TLS", "")
    if tls and not any(t in tls for t in ("all", "sm", "shm", "posix", "sysv", "cma", "xpmem", "knem")):
        return "blocking"  # the user's UCX_TLS leaves no shared-memory transport
    one_host = env.get("LOCAL_WORLD_SIZE") == str(size) or size == 1
    return "inline" if one_host else "blocking"


class TensorwireError(dist.DistBackendError, tw_errors.Error):
    """An op of the tensorwire backend failed: a peer failed or was silent (named), or the ranks disagree."""


def _op_name(op: Any) -> str:
    kind = getattr(op, "op", op)
    for k, name in _REDUCE_NAMES.items():
        if kind == k:
            return name
    raise ValueError(f"tensorwire backend: reduce op {kind} is not supported (SUM, AVG, PRODUCT, MIN, MAX)")


def _seconds(timeout: Any, default: float) -> float:
    """A Work/opts timeout (timedelta; zero or negative: the group's) in seconds."""
    if timeout is None:
        return default
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return default if s <= 0 else s


def _bytes_view(t: torch.Tensor, what: str) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor (no copy, any dtype)."""
    try:  # the common case first: numpy's own reshape and view cost a third of torch's
        if t.is_contiguous() and t.device.type == "cpu" and t.layout == torch.strided:
            return t.detach().numpy().reshape(-1).view(np.uint8)
    except (TypeError, RuntimeError, AttributeError):
        pass  # bfloat16 (numpy has none), quantized, or not a tensor: the checks below say which
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensorwire backend: {what} needs a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"tensorwire backend: {what} takes CPU tensors, got one on {t.device} "
                         f"(use 'cpu:tensorwire,cuda:nccl' to give CUDA tensors to another backend)")
    if not t.is_contiguous():
        raise ValueError(f"tensorwire backend: {what} needs a contiguous tensor (call .contiguous() first)")
    if t.is_sparse or t.is_quantized:
        raise ValueError(f"tensorwire backend: {what} takes dense tensors")
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def _buffer(t: torch.Tensor, what: str) -> tuple[int, int]:
    """(address, nbytes) of a contiguous CPU tensor, for the messages engine (which copies or
    places bytes; no numpy view: making one costs more than an eager send's post)."""
    if isinstance(t, torch.Tensor) and t.is_cpu and t.layout == torch.strided and not t.is_quantized \
            and t.is_contiguous():
        return t.data_ptr(), t.nbytes
    _bytes_view(t, what)  # raises the error that says what is wrong with it
    raise ValueError(f"tensorwire backend: {what} cannot move a {type(t).__name__} of {t.dtype}")


def _owner(t: torch.Tensor) -> Callable[[], tuple[int, int, Any]]:
    """For the registration cache: (address, nbytes, keepalive) of the allocation holding `t`,
    asked only where a message is placed."""
    def allocation() -> tuple[int, int, Any]:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes(), s
    return allocation


class Work(dist._Work):
    """A posted op: p2p completes when waited for (a wait drives every pending message of the
    group); a collective is complete when made, or, queued (an async_op), once the group's
    comm thread ran it (``ran``)."""

    # the defaults, as class attributes: a p2p Work is made per op, and each attribute set on a
    # torch Work costs (an eager send's path)
    fut: Future | None = None
    err: BaseException | None = None
    what = ""
    ran: threading.Event | None = None
    _settled = False

    def __init__(self, pg: "TensorwireProcessGroup | None", result: Any, ops: list | None = None,
                 queued: str = "") -> None:
        super().__init__()
        self.pg, self.result, self.ops = pg, result, ops or []
        if queued:
            self.what, self.ran = queued, threading.Event()

    _mu = threading.Lock()  # one for every Work: held for a field or two (p2p Works are made per op)

    def is_completed(self) -> bool:
        if self.ran is not None:
            return self.ran.is_set()
        if self.ops and self.err is None:
            try:
                with self.pg._lock:
                    return all(self.pg.msg.test(op) for op in self.ops)
            except Exception as e:  # noqa: BLE001 - surfaced by wait()
                self.err = e
        return True

    def is_success(self) -> bool:
        return self.is_completed() and self.err is None

    def exception(self) -> Any:
        return self.err

    def wait(self, timeout: Any = None) -> bool:
        if self.ran is not None:
            seconds = _seconds(timeout, self.pg.timeout)
            if not self.ran.wait(seconds):
                raise TensorwireError(f"tensorwire backend, rank {self.pg._rank}: {self.what} did not complete "
                                      f"within {seconds:g} s (it runs on in the background)")
        elif self.ops and self.err is None:
            try:
                self.pg._wait_ops(self.ops, _seconds(timeout, self.pg.timeout))
            except Exception as e:  # noqa: BLE001 - every failure is a backend error naming the peer
                self.err = self.pg._as_backend_error(e)
            self.ops = [] if self.err is None else self.ops
        if self.err is not None:
            raise self.err
        self._settle_future()
        return True

    def get_future(self) -> Future:
        with self._mu:
            if self.fut is None:
                self.fut = Future()
        if not self.ops and (self.ran is None or self.ran.is_set()):
            self._settle_future()
        return self.fut

    def _finish(self, err: BaseException | None) -> None:
        """The comm thread ran this collective (err: how it failed)."""
        self.err = err
        self.ran.set()
        self._settle_future()

    def _settle_future(self) -> None:
        if self.fut is None:  # no future asked for (get_future settles one made later itself)
            return
        with self._mu:
            if self.fut is None or self._settled:
                return
            self._settled = True
        if self.err is not None:  # (callbacks run here: on the comm thread for queued collectives, as gloo's)
            self.fut.set_exception(self.err)
        else:
            self.fut.set_result(self.result)


class TensorwireProcessGroup(dist.ProcessGroup):
    """One torch.distributed group on a tensorwire World (see the module docs)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size  # rank()/size() are calls into torch: the hot paths use these
        self._group_name = self._group_desc = ""
        self.timeout = _seconds(timeout, 1800.0)
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        placement = Placement(rank, size, f"{host}:{int(os.environ.get('MASTER_PORT', '0') or 0)}",
                              "torch.distributed", "c10d")
        transport = os.environ.get("TENSORWIRE_TRANSPORT") or "auto"
        options: dict[str, Any] = {"progress": progress_mode(transport, size), "transport": transport}
        # the c10d store is this group's own (a prefix store per group): the World meets under a fixed name
        self.world = World(placement, timeout=min(self.timeout, 300.0), store=store, name="pg", **options)
        self.world.timeout = self.timeout
        self.registry = RegistrationCache(self.world.device)
        self.msg: Messenger | None = None
        if size > 1:
            self.msg = Messenger(self.world, self.registry, timeout=self.timeout)
            self.world.beside = self.msg  # a send posted before a collective moves while we wait in it
        self._eager = self.msg.lay.eager if self.msg is not None else 0
        self._sent = Work(None, None)  # what every eager send that posted at once returns: complete (no ops, no group)
        self._scratch: torch.Tensor | None = None   # reduce_scatter's landing area (registered once)
        self._shared: Any = None  # all_reduce through mapped memory: (area, its bytes, the peers' areas), or False
        self._tokens = torch.zeros(size, dtype=torch.int64)  # that all_reduce's token rounds: ours, one per peer
        # all_reduce in the ranks' own tensors, shared in place (None: not tried yet; False: not here)
        self._in_place: bool | None = None
        self._seen: OrderedDict[tuple[int, ...], None] = OrderedDict()  # tickets all ranks have mapped
        self._closed = False
        # Every use of the World and the messages engine holds _lock (they are single-threaded).
        # Collectives asked as async_op (DDP's gradient buckets, FSDP's gathers) run in order on
        # the comm thread, so the caller computes meanwhile (gloo overlaps them so); a collective
        # whose caller waits at once runs on the caller when nothing is queued (no hand-off).
        self._lock = threading.RLock()
        self._jobs: queue.Queue = queue.Queue()
        self._queued = 0                # collectives queued or running on the comm thread
        self._queued_mu = threading.Lock()
        self._comm: threading.Thread | None = None

    # ---- identity -----------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    @property
    def backend_name(self) -> str:
        return BACKEND

    # torch names a group through these (its C++ default keeps the name in backends this Python group has none of)
    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    @property
    def group_name(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"TensorwireProcessGroup(rank={self.rank()}, size={self.size()})"

    # ---- plumbing -----------------------------------------------------------

    def _done(self, result: Any) -> Work:
        return Work(self, result)

    def _run(self, what: str, fn: Callable[[], Any], result: Any, opts: Any = None) -> Work:
        """Runs a collective: now, on this thread, when its caller waits for it at once (not an
        async_op) and nothing is queued, else queued for the comm thread (in call order). Any
        failure becomes a backend error naming the op."""
        self._check_open(what)
        on_comm = threading.current_thread() is self._comm
        if on_comm or (not getattr(opts, "asyncOp", True) and self._queued == 0):
            try:
                with self._lock:
                    fn()
            except (TypeError, ValueError):
                raise
            except Exception as e:  # noqa: BLE001
                raise self._as_backend_error(e, what) from None
            return self._done(result)
        work = Work(self, result, queued=what)
        with self._queued_mu:
            self._queued += 1
            if self._comm is None:
                self._comm = threading.Thread(target=self._comm_loop, name="tw-torch-comm", daemon=True)
                self._comm.start()
        self._jobs.put((what, fn, work))
        return work

    def _comm_loop(self) -> None:
        """The comm thread: runs queued collectives one after another until close() says stop."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            what, fn, work = job
            err: BaseException | None = None
            try:
                if self._closed:
                    raise TensorwireError(f"rank {self._rank}: {what} on a destroyed tensorwire process group")
                with self._lock:
                    fn()
            except (TypeError, ValueError, TensorwireError) as e:
                err = e
            except Exception as e:  # noqa: BLE001
                err = self._as_backend_error(e, what)
            with self._queued_mu:
                self._queued -= 1
            try:
                work._finish(err)
            except Exception:  # noqa: BLE001 - a future's callback failed: it is the caller's, logged by torch
                pass

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise TensorwireError(f"rank {self.rank()}: {what} on a destroyed tensorwire process group")

    def _as_backend_error(self, e: BaseException, what: str = "") -> BaseException:
        if isinstance(e, (TensorwireError, TypeError, ValueError)):
            return e
        if isinstance(e, tw_errors.InvalidArgument):
            return ValueError(f"tensorwire backend: {what + ': ' if what else ''}{e}")
        err = TensorwireError(f"tensorwire backend, rank {self.rank()}: {what + ' failed: ' if what else ''}{e}")
        err.__cause__ = e
        return err

    def _wait_ops(self, ops: list, timeout: float) -> None:
        """Waits for p2p ops in slices, letting the comm thread in between (a collective queued
        before may be what the peer needs first)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                left = deadline - time.monotonic()
                if self.msg.wait_some(ops, min(left, 0.05)):
                    return
                if left <= 0:
                    raise self.msg.timeout_error(ops, timeout)
            if self._queued:
                time.sleep(0.001)  # the comm thread takes the lock meanwhile

    def _exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
                  timeout: float | None = None) -> None:
        """Posts every receive, then every send (tag COLL_TAG), and waits for all."""
        if not sends and not recvs:
            return
        m = self.msg  # (under _lock: a collective runs holding it)
        ops = [m.irecv(*_buffer(t, "recv"), p, COLL_TAG, t, _owner(t)) for t, p in recvs]
        ops += [m.isend(*_buffer(t, "send"), p, COLL_TAG, t, _owner(t)) for t, p in sends]
        m.wait_all(ops, self.timeout if timeout is None else timeout)

    def _peers(self) -> list[int]:
        r, n = self.rank(), self.size()
        return [(r + k) % n for k in range(1, n)]

    # ---- point to point -----------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        op = self._p2p("send", self._one(tensors, "send"), dst, tag)
        if op.done and op.error is None:  # eager: complete once posted
            return self._sent
        return Work(self, None, [op])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        t = self._one(tensors, "recv")
        return Work(self, [t], [self._p2p("recv", t, src, tag)])

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        raise ValueError("tensorwire backend: recv from any source is not supported (name the source rank)")

    def _p2p(self, kind: str, t: torch.Tensor, peer: int, tag: int) -> Any:
        self._check_open(kind)
        if not 0 <= peer < self._size or peer == self._rank:
            raise ValueError(f"tensorwire backend: {kind} peer must be another rank of the group "
                             f"(0..{self._size - 1}, not {self._rank}), got {peer}")
        if tag < 0:
            raise ValueError(f"tensorwire backend: {kind} tag must be >= 0, got {tag}")
        ptr, nbytes = _buffer(t, kind)
        owner = _owner(t) if nbytes > self._eager else None  # (the placed path registers the allocation)
        try:
            with self._lock:
                if kind == "send":
                    return self.msg.isend(ptr, nbytes, peer, tag, t, owner)
                return self.msg.irecv(ptr, nbytes, peer, tag, t, owner)
        except Exception as e:  # noqa: BLE001
            raise self._as_backend_error(e, f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}") from None

    @staticmethod
    def _one(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise ValueError(f"tensorwire backend: {what} takes one tensor per call, got {len(tensors)}")
        return tensors[0]

    # ---- collectives on the World's engine ----------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        for t in tensors:
            _bytes_view(t, "all_reduce")
        return self._run("all_reduce", lambda: [self._allreduce(t, op) for t in tensors], tensors, opts=opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        for t in tensors:
            _bytes_view(t, "all_reduce_coalesced")

        def run() -> None:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for group in by_dtype.values():  # one call per dtype: the tensors flattened together
                flat = torch.cat([t.reshape(-1) for t in group]) if len(group) > 1 else group[0]
                self._allreduce(flat, op)
                if len(group) > 1:
                    off = 0
                    for t in group:
                        t.copy_(flat[off: off + t.numel()].view_as(t))
                        off += t.numel()
        return self._run("all_reduce_coalesced", run, tensors, opts=opts)

    def _allreduce(self, t: torch.Tensor, op: str) -> None:
        if t.dtype == torch.bool or t.is_complex() and op in ("min", "max"):
            raise ValueError(f"tensorwire backend: all_reduce {op} of {t.dtype} is not supported")
        if op == "avg" and not (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"tensorwire backend: ReduceOp.AVG needs a floating point tensor, got {t.dtype}")
        if self.size() == 1 or t.numel() == 0:
            return
        if t.numel() * t.element_size() >= LARGE_ALLREDUCE and t.numel() >= self.size():
            shared = self._shared_area()
            flat = t.detach().reshape(-1)
            if shared and self._allreduce_in_place(flat, op):
                return
            if shared:
                self._allreduce_shared(flat, op, shared)
            else:
                self._allreduce_by_messages(flat, op)
            return
        self._allreduce_engine(t, op)

    def _allreduce_engine(self, t: torch.Tensor, op: str) -> None:
        """all_reduce on the World's collectives engine (the small sizes)."""
        engine_op = "sum" if op == "avg" else op
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: reduce in float32, round once
            wide = t.float()
            self.world.allreduce(wide, engine_op)
            t.copy_(wide)
        else:
            self.world.allreduce(t.detach(), engine_op)
        if op == "avg":
            t.div_(self.size())

    def _allreduce_by_messages(self, flat: torch.Tensor, op: str) -> None:
        """Rank p reduces chunk p of every rank's tensor (each rank's chunk p lands in p's scratch),
        then hands the result to every rank, into its own tensor: every rank ends with the same bytes."""
        n, r = self.size(), self.rank()
        q = -(-flat.numel() // n)
        chunks = [flat[min(p * q, flat.numel()): min((p + 1) * q, flat.numel())] for p in range(n)]
        self._reduce_scatter(chunks[r], [c for c in chunks], op)
        peers = self._peers()
        self._exchange([(chunks[r], p) for p in peers if chunks[r].numel()],
                       [(chunks[p], p) for p in peers if chunks[p].numel()])

    def _shared_area(self) -> Any:
        """The landing area of all_reduce through mapped memory, made by the first large
        all_reduce (every rank makes it: a collective): 2 (n - 1) slots of SHARED_PIECE, for
        each sender a slot for its pieces and one for its results. False (all_reduce by
        messages) unless every rank maps every peer's (one host, shared memory)."""
        if self._shared is None:
            dev, name = self.world.device, "pg.landing"
            area = dev.alloc(2 * (self.size() - 1) * SHARED_PIECE, alignment=4096)
            dev.publish(name, area)
            self.world.allgather(None)  # every rank has published
            remotes = {p: self.msg.ch[p].lookup(name, self.timeout) for p in self._peers()}
            mapped = all(self.msg.ch[p].maps(remotes[p], area) for p in remotes)
            if all(self.world.allgather(mapped)):
                self._shared = (area, torch.from_numpy(np.frombuffer(area, dtype=np.uint8)), remotes)
            else:
                self._shared = False
                dev.unpublish(name)
        return self._shared

    def _allreduce_shared(self, flat: torch.Tensor, op: str, shared: Any) -> None:
        """All-reduce through the ranks' mapped landing areas, one copy per byte and hop: rank p
        reduces chunk p. Each round takes a piece of every chunk: every rank writes its piece of
        chunk p straight from its tensor into p's slot for it (a memcpy: the area is mapped
        here); p reduces the pieces in rank order into its own tensor and writes the result
        into every peer's result slot for it; each copies the others' results out. A token
        exchange after each of the two writes says they landed; it also says every rank is done
        with what the next writes overwrite (the pieces were reduced before the results went; the
        results were copied out before the next round's pieces went). The messages' reduce-
        scatter instead has the kernel copy across processes (cma) into a scratch the reduction
        then reads, and the same copy back (64 MiB over shm: 3.07x gloo this way, 2.58x that
        way at cd3b40b, bench/results/torch_dist_shm.txt and its history). The writes stream:
        plain stores into lines the peer's core holds ran at half the rate
        (bench/results/static_slot_streaming.txt has the same effect on the static slot)."""
        area, landed, remotes = shared
        n, r = self.size(), self.rank()
        peers, ch = self._peers(), self.msg.ch
        es, total = flat.element_size(), flat.numel()
        q = -(-total // n)                  # elements per chunk
        per = SHARED_PIECE // es            # elements per piece
        reg = self.registry.lookup(_owner(flat))
        at = flat.data_ptr() - reg.ptr      # our tensor in its registration

        def piece(p: int, j: int) -> tuple[int, int]:
            return min(p * q + j * per, total), min(p * q + min((j + 1) * per, q), total)

        def slot(owner: int, sender: int, result: bool = False) -> int:
            return ((n - 1 if result else 0) + (sender - owner) % n - 1) * SHARED_PIECE

        def write_to_peers(spans: dict[int, tuple[int, int]], result: bool) -> None:
            """Elements [a, b) of our tensor into peer p's slot for us, for each p: (a, b)."""
            reqs = [ch[p]._write_streaming(reg, remotes[p], at + a * es, slot(p, r, result), (b - a) * es)
                    for p, (a, b) in spans.items() if b > a]
            for req in reqs:
                req.wait(self.timeout)

        for j in range(-(-q // per)):
            write_to_peers({p: piece(p, j) for p in peers}, False)  # our piece of chunk p, to p
            self._token_round()
            a, b = piece(r, j)
            if b > a:
                parts = [flat[a:b] if p == r else landed[slot(r, p): slot(r, p) + (b - a) * es].view(flat.dtype)
                         for p in range(n)]
                _reduce_in_rank_order(parts, flat[a:b], op)
            write_to_peers({p: (a, b) for p in peers}, True)        # our result, to everybody
            self._token_round()
            for p in peers:                                          # everybody's results, into our tensor
                pa, pb = piece(p, j)
                if pb > pa:
                    at_p = slot(r, p, True)
                    flat[pa:pb].view(torch.uint8).copy_(landed[at_p: at_p + (pb - pa) * es])

    def _allreduce_in_place(self, flat: torch.Tensor, op: str) -> bool:
        """All-reduce in the ranks' own tensors, each shared in place with the others
        (tensorwire.sharing): rank p reduces chunk p reading every peer's tensor straight, in rank
        order, a piece at a time, and writes each piece of the result into every peer's tensor.
        Each byte is read from its owner once and written once per rank, against the landing
        areas' three copies of it; no copy into or out of a staging area. Rounds: a ticket round
        (each rank's share: the first message also says its input is ready), an agreement round
        only when a share is new (every rank mapped every peer's, or all fall back), and a token
        round at the end (every write into a peer's tensor has landed). The few elements outside
        every rank's whole pages (< a page at each end) go through the engine. False (nothing
        moved) when some rank's tensor cannot be shared: the caller takes the landing areas."""
        if self._in_place is False or not self.msg.sharing:
            return False
        n, r, peers = self._size, self._rank, self._peers()
        es, total = flat.element_size(), flat.numel()
        code = zlib.crc32(str(flat.dtype).encode()) & 0x7FFFFFFF
        share = self._share(flat)
        mine = torch.tensor([0, -1, 0, 0, 0, total * es, code, 0], dtype=torch.int64)
        if share is not None:
            mine[:5] = torch.tensor(share.ticket(flat.data_ptr()))
        got = torch.zeros(n, TICKET, dtype=torch.int64)
        got[r] = mine
        self._exchange([(mine, p) for p in peers], [(got[p], p) for p in peers])
        tickets = got.tolist()
        for p, t in enumerate(tickets):
            if t[5] != total * es or t[6] != code:
                what = f"{t[5]} B" if t[5] != total * es else "another dtype"
                raise ValueError(f"tensorwire backend: all_reduce of {total * es} B of {flat.dtype} here, "
                                 f"rank {p} passed {what}")
        if any(t[1] < 0 for t in tickets):
            return False
        keys = [tuple(t[:5]) for t in tickets]
        new = any(k not in self._seen for k in keys)
        addr: dict[int, int] = {}
        ok = True
        try:
            for p in peers:
                addr[p] = self.msg.peer_shares.address(*tickets[p][:4])
        except sharing.SharingError:
            if not new:  # mapped before by every rank (its owner keeps the fd while the ticket is current)
                raise
            ok = False
        if new:  # every rank agrees before anybody writes into a peer's tensor
            flags = torch.zeros(n, dtype=torch.int64)
            flags[r] = int(ok)
            self._exchange([(flags[r: r + 1], p) for p in peers], [(flags[p: p + 1], p) for p in peers])
            if not bool(flags.all()):
                self._in_place = False  # this host does not let ranks map each other: never again
                return False
            for k in keys:
                self._seen[k] = None
            while len(self._seen) > SEEN_TICKETS:
                self._seen.popitem(last=False)
        self._in_place = True
        off = [t[4] for t in tickets]               # rank p's share starts off[p] bytes into its tensor
        lo = max(0, max(-(-o // es) for o in off))  # elements [lo, hi) lie in every rank's share
        hi = min(min((o + t[3]) // es for o, t in zip(off, tickets)), total)
        if hi <= lo:
            return False
        q = -(-(hi - lo) // n)
        a, b = min(lo + r * q, hi), min(lo + (r + 1) * q, hi)  # our chunk

        def view(p: int) -> torch.Tensor:
            """Elements [a, b) of rank p's tensor, through its share mapped here."""
            at = addr[p] + a * es - off[p]
            raw = (ctypes.c_char * ((b - a) * es)).from_address(at)
            return torch.frombuffer(raw, dtype=torch.uint8).view(flat.dtype)
        if b > a:
            theirs = {p: view(p) for p in peers}
            step = max(1, IN_PLACE_PIECE // es)
            for i in range(0, b - a, step):
                j = min(i + step, b - a)
                ours = flat[a + i: a + j]
                _reduce_in_rank_order([ours if p == r else theirs[p][i:j] for p in range(n)], ours, op)
                for p in peers:
                    theirs[p][i:j].copy_(ours)
            del theirs
        self._token_round()
        if lo > 0 or hi < total:  # the ends outside some rank's whole pages
            ends = torch.cat([flat[:lo], flat[hi:]])
            self._allreduce_engine(ends, op)
            flat[:lo].copy_(ends[:lo])
            flat[hi:].copy_(ends[lo:])
        return True

    def _share(self, flat: torch.Tensor) -> sharing.Share | None:
        """The share of the allocation holding `flat` (Messenger.share: from its second move on), or None."""
        storage = flat.untyped_storage()
        return self.msg.share((storage.data_ptr(), storage.nbytes(), storage), flat.data_ptr(),
                              flat.numel() * flat.element_size())

    def _token_round(self) -> None:
        """Every rank tells every other that it is past this point, and waits to hear the same."""
        tok, peers = self._tokens, self._peers()
        self._exchange([(tok[self._rank: self._rank + 1], p) for p in peers], [(tok[p: p + 1], p) for p in peers])

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        self._check_root(opts.rootRank, "reduce")
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        root = opts.rootRank
        self._check_root(root, "broadcast")
        for t in tensors:
            _bytes_view(t, "broadcast")

        def run() -> None:
            for t in tensors:
                if t.numel():
                    self.world.broadcast(_bytes_view(t, "broadcast"), root)
        return self._run("broadcast", run, tensors, opts=opts)

    def barrier(self, opts: Any = None) -> Work:
        return self._run("barrier", lambda: self.world.barrier(self.timeout), None, opts=opts)

    def _check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.size():
            raise ValueError(f"tensorwire backend: {what} root must be a rank in 0..{self.size() - 1}, got {root}")

    # ---- collectives as exchanges of messages -------------------------------

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Work:
        n, r = self.size(), self.rank()
        _bytes_view(inp, "all_gather_into_tensor input")
        _bytes_view(out, "all_gather_into_tensor output")
        if out.numel() != n * inp.numel() or out.dtype != inp.dtype:
            raise ValueError(f"tensorwire backend: all_gather_into_tensor needs an output of {n} x the input "
                             f"({n} x {inp.numel()} {inp.dtype}), got {out.numel()} {out.dtype}")
        blocks = out.reshape(n, -1) if inp.numel() else [out] * n
        return self._run("all_gather_into_tensor", lambda: self._gather_all(inp, [blocks[p] for p in range(n)]),
                         out, opts=opts)

    _allgather_base = all_gather_single

    def allgather(self, outs: list[list[torch.Tensor]], inps: list[torch.Tensor], opts: Any = None) -> Work:
        n = self.size()
        if len(outs) != len(inps) or any(len(o) != n for o in outs):
            raise ValueError(f"tensorwire backend: all_gather needs {n} output tensors per input")
        for o, i in zip(outs, inps):
            for t in o:
                if t.numel() != i.numel() or t.dtype != i.dtype:
                    raise ValueError(f"tensorwire backend: all_gather outputs must match the input "
                                     f"({i.numel()} x {i.dtype}), got {t.numel()} x {t.dtype}")
        return self._run("all_gather", lambda: [self._gather_all(i, o) for o, i in zip(outs, inps)], outs, opts=opts)

    def allgather_coalesced(self, outs: list[list[torch.Tensor]], inps: list[torch.Tensor], opts: Any = None):
        return self.allgather(outs, inps, opts)

    def all_gather_single_coalesced(self, outs: list[torch.Tensor], inps: list[torch.Tensor], opts: Any = None):
        n = self.size()
        for o, i in zip(outs, inps):
            if o.numel() != n * i.numel():
                raise ValueError("tensorwire backend: all_gather_into_tensor needs an output of size x the input")
        return self._run("all_gather_into_tensor_coalesced",
                         lambda: [self._gather_all(i, list(o.reshape(n, -1)) if i.numel() else [o] * n)
                                  for o, i in zip(outs, inps)], outs, opts=opts)

    def _gather_all(self, inp: torch.Tensor, blocks: list[torch.Tensor]) -> None:
        r = self.rank()
        if inp.numel():
            blocks[r].reshape(-1).copy_(inp.reshape(-1))
        if self.size() > 1 and inp.numel():
            peers = self._peers()
            self._exchange([(inp, p) for p in peers], [(blocks[p], p) for p in peers])

    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Work:
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        n = self.size()
        _bytes_view(inp, "reduce_scatter_tensor input")
        _bytes_view(out, "reduce_scatter_tensor output")
        if inp.numel() != n * out.numel() or out.dtype != inp.dtype:
            raise ValueError(f"tensorwire backend: reduce_scatter_tensor needs an input of {n} x the output "
                             f"({n} x {out.numel()} {out.dtype}), got {inp.numel()} {inp.dtype}")
        blocks = list(inp.reshape(n, -1)) if out.numel() else []
        return self._run("reduce_scatter_tensor", lambda: self._reduce_scatter(out, blocks, op), out, opts=opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outs: list[torch.Tensor], inps: list[list[torch.Tensor]], opts: Any = None) -> Work:
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        n = self.size()
        if len(outs) != len(inps) or any(len(i) != n for i in inps):
            raise ValueError(f"tensorwire backend: reduce_scatter needs {n} input tensors per output")
        for o, ins in zip(outs, inps):
            for t in ins:
                if t.numel() != o.numel() or t.dtype != o.dtype:
                    raise ValueError("tensorwire backend: reduce_scatter inputs must match the output's size and dtype")
        return self._run("reduce_scatter",
                         lambda: [self._reduce_scatter(o, [t.contiguous() for t in i] if o.numel() else [], op)
                                  for o, i in zip(outs, inps)], outs, opts=opts)

    def reduce_scatter_single_coalesced(self, outs: list[torch.Tensor], inps: list[torch.Tensor], opts: Any = None):
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        n = self.size()
        return self._run("reduce_scatter_tensor_coalesced",
                         lambda: [self._reduce_scatter(o, list(i.reshape(n, -1)) if o.numel() else [], op)
                                  for o, i in zip(outs, inps)], outs, opts=opts)

    def _reduce_scatter(self, out: torch.Tensor, blocks: list[torch.Tensor], op: str) -> None:
        """Block p of every rank goes to rank p; each rank reduces what it got (in rank order,
        so every rank's sum is formed in the same order as gloo's ring would not promise)."""
        if op not in ("sum", "prod", "min", "max", "avg"):
            raise ValueError(f"tensorwire backend: reduce_scatter op {op} is not supported")
        if not blocks:
            return
        n, r = self.size(), self.rank()
        if n == 1:
            out.copy_(blocks[0].view_as(out))
            return
        peers = self._peers()
        nb = out.numel()
        scratch = self._landing(n * nb, out.dtype)
        got = {p: scratch[p * nb: (p + 1) * nb] for p in peers}
        self._exchange([(blocks[p], p) for p in peers], [(got[p], p) for p in peers])
        got[r] = blocks[r].reshape(-1)
        _reduce_in_rank_order([got[p] for p in range(n)], out.reshape(-1), op)  # a view: out is contiguous

    def _landing(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor of `numel` x dtype in one long-lived allocation (registered once)."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(max(nbytes, 4096), dtype=torch.uint8)
        return self._scratch[:nbytes].view(dtype)

    def alltoall_base(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                      opts: Any = None) -> Work:
        n = self.size()
        _bytes_view(inp, "all_to_all_single input")
        _bytes_view(out, "all_to_all_single output")
        if out.dtype != inp.dtype:
            raise ValueError(f"tensorwire backend: all_to_all_single needs one dtype, got {inp.dtype} and {out.dtype}")
        if not out_splits and not in_splits:
            if inp.numel() != out.numel() or (inp.dim() and inp.shape[0] % n):
                raise ValueError(f"tensorwire backend: all_to_all_single without splits needs input and output "
                                 f"of one size with dimension 0 divisible by {n}")
            if inp.numel() and inp.dim():
                return self._run("all_to_all_single", lambda: self.world.alltoall(
                    _bytes_view(out, "all_to_all_single"), _bytes_view(inp, "all_to_all_single")), out, opts=opts)
        row_in = inp[0].numel() if inp.dim() and inp.shape[0] else 0
        row_out = out[0].numel() if out.dim() and out.shape[0] else 0
        in_splits = list(in_splits) or [inp.shape[0] // n] * n
        out_splits = list(out_splits) or [out.shape[0] // n] * n
        if len(in_splits) != n or len(out_splits) != n or sum(in_splits) != (inp.shape[0] if inp.dim() else 1) \
                or sum(out_splits) != (out.shape[0] if out.dim() else 1):
            raise ValueError(f"tensorwire backend: all_to_all_single split sizes must be {n} numbers that add up to "
                             f"dimension 0 (input {in_splits} of {tuple(inp.shape)}, output {out_splits} of "
                             f"{tuple(out.shape)})")
        fi = inp.reshape(-1)
        fo = out.reshape(-1)
        ins = _split(fi, [s * row_in for s in in_splits])
        outs = _split(fo, [s * row_out for s in out_splits])
        return self._run("all_to_all_single", lambda: self._a2a(outs, ins), out, opts=opts)

    all_to_all_single = alltoall_base

    def alltoall(self, outs: list[torch.Tensor], inps: list[torch.Tensor], opts: Any = None) -> Work:
        n = self.size()
        if len(outs) != n or len(inps) != n:
            raise ValueError(f"tensorwire backend: all_to_all needs {n} input and {n} output tensors")
        return self._run("all_to_all", lambda: self._a2a(outs, [t.contiguous() for t in inps]), outs, opts=opts)

    def _a2a(self, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
        r = self.rank()
        if outs[r].numel() != ins[r].numel():
            raise ValueError(f"tensorwire backend: all_to_all: rank {r} sends itself {ins[r].numel()} elements "
                             f"but expects {outs[r].numel()}")
        outs[r].copy_(ins[r].view_as(outs[r]))
        peers = self._peers()
        self._exchange([(ins[p], p) for p in peers if ins[p].numel()],
                       [(outs[p], p) for p in peers if outs[p].numel()])

    def gather(self, outs: list[list[torch.Tensor]], inps: list[torch.Tensor], opts: Any) -> Work:
        root, r, n = opts.rootRank, self.rank(), self.size()
        self._check_root(root, "gather")
        inp = self._one(inps, "gather")
        if r == root:
            lst = self._one(outs, "gather") if outs else []
            if len(lst) != n:
                raise ValueError(f"tensorwire backend: gather on the root needs {n} output tensors, got {len(lst)}")

            def run() -> None:
                lst[r].copy_(inp)
                self._exchange([], [(lst[p], p) for p in self._peers()])
            return self._run("gather", run, outs, opts=opts)
        return self._run("gather", lambda: self._exchange([(inp, root)], []), outs, opts=opts)

    def scatter(self, outs: list[torch.Tensor], inps: list[list[torch.Tensor]], opts: Any) -> Work:
        root, r, n = opts.rootRank, self.rank(), self.size()
        self._check_root(root, "scatter")
        out = self._one(outs, "scatter")
        if r == root:
            lst = self._one(inps, "scatter") if inps else []
            if len(lst) != n:
                raise ValueError(f"tensorwire backend: scatter on the root needs {n} input tensors, got {len(lst)}")

            def run() -> None:
                out.copy_(lst[r])
                self._exchange([(lst[p].contiguous(), p) for p in self._peers()], [])
            return self._run("scatter", run, outs, opts=opts)
        return self._run("scatter", lambda: self._exchange([], [(out, root)]), outs, opts=opts)

    # ---- life ---------------------------------------------------------------

    def shutdown(self) -> None:
        self.close()

    def abort(self) -> None:
        self.close(sync=False)

    def close(self, sync: bool = True) -> None:
        """Releases every registration, the messages engine and the World's Device."""
        if self._closed:
            return
        comm = self._comm
        if comm is not None and comm is not threading.current_thread():
            self._jobs.put(None)  # after what is queued: those run first
            comm.join(self.timeout if sync else 1.0)
        self._closed = True
        with self._lock:
            if self.msg is not None:
                self.msg.close()
            self.registry.clear()
            self._scratch = None
            if self._shared:
                try:
                    self.world.device.unpublish("pg.landing")
                except tw_errors.Error:
                    pass
            self._shared = None
            self.world._close(sync=sync)

    def __del__(self) -> None:
        try:
            self.close(sync=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _reduce_in_rank_order(parts: list[torch.Tensor], out: torch.Tensor, op: str) -> None:
    """out = parts[0] op parts[1] op ..., in rank order (every rank forms the same bytes); AVG
    divides once by the count. Elementwise: out may be one of the parts."""
    fn = _TORCH_REDUCE["sum" if op == "avg" else op]
    if len(parts) == 2:
        fn(parts[0], parts[1], out=out)
    else:
        acc = fn(parts[0], parts[1])
        for part in parts[2:]:
            fn(acc, part, out=acc)
        out.copy_(acc)
    if op == "avg":
        if out.is_floating_point() or out.is_complex():
            out.div_(len(parts))
        else:
            out.div_(len(parts), rounding_mode="floor")


def _split(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, off = [], 0
    for s in sizes:
        out.append(flat[off: off + s])
        off += s
    return out


def create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> TensorwireProcessGroup:
    """torch.distributed's creator function for the "tensorwire" backend."""
    return TensorwireProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Registers the backend "tensorwire" for CPU tensors (idempotent)."""
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, create, devices=["cpu"])
