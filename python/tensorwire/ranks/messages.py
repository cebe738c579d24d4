"""Tagged point-to-point messages between the ranks of a World: ``send``/``recv``
of contiguous arrays with MPI's matching rule (per source and tag, in order),
on one-sided writes. The torch.distributed backend's send/recv and the
collectives it builds from them (tensorwire.torch.backend) run on it.

Two paths, chosen by the message's size (both sides know it from their own
tensor; a size that differs between the two sides is an error on both):

* **eager** (<= ``eager_bytes``, default 128 KiB): the sender copies a 64-byte
  header and the payload into its staging slot and writes them into its slot
  of the receiver's inbox ring, orders, then writes the slot's sequence word
  (data, fence, flag: docs/contracts.md section 1). The receiver copies the
  payload into the destination. One trip; no registration of the tensors.
* **placed** (larger): the paper's static placement into the receiver's own
  tensor. The receiver registers the destination (a cache keyed by the
  allocation that holds it, tensorwire.registry), exports it to the sender
  once per allocation and sends a RTR record (its descriptor, offset, size);
  the sender writes the tensor straight into it from its own memory
  (registered in place through the same cache), orders, then sends a DONE
  record: the flag outside the payload. The sender also sends an RTS header
  at once, so a receiver that posted a smaller tensor fails at once instead
  of waiting. When the receiver posts first (a pipeline stage, a ping-pong),
  the RTR is already there when the sender arrives: one trip.
* **placed, split** (larger than ``split_bytes``, default 256 KiB, to a peer on
  this host that the kernel copies to, e.g. UCX's cma): the sender's RTS
  also carries its own tensor's descriptor (exported to the receiver once per
  allocation); the sender writes the first half into the receiver's tensor
  while the receiver reads the second half out of the sender's, each on its
  own core (one copy of each byte, on two cores: 16 MiB at 11.7 GB/s in
  bench/results/torch_dist_shm.txt, 83% of the cross-process copy limit measured beside it). The receiver's TAKEN
  record tells the sender its tensor may change again. Who copies the first
  half is claimed, not assumed: the RTR names a claim word in the receiver's
  arena (the ``aux`` field: word index and message id); the sender swaps it
  when it has the RTR, the receiver when its own half is done, and the first
  swap wins. A sender busy computing (a pipeline stage that posted isend and
  went on) thus never stalls its receiver: the receiver copies it all.
* **placed, split, shared** (larger than ``pull_bytes`` on the receiver's side;
  an allocation moved before on the sender's): the RTS and the RTR also carry
  a ticket of the tensor's allocation shared in place (tensorwire.sharing,
  ``SHARED`` in ``aux``); the peer maps it and copies its half with plain loads
  and stores instead of the kernel's copy (16 MiB: bench/results/torch_dist_shm.txt),
  the few bytes outside the allocation's whole pages (``EDGE`` at least) by UCX.

Records travel in per-peer rings of ``SLOTS`` slots; the receiver hands
credits back (an 8-byte word written into the sender's arena every SLOTS/2
records), so a sender never overwrites a record that was not read. Records
that arrive before their receive is posted are copied out of the ring (the
unexpected queue), so a full ring never blocks a message behind it.

Progress: nothing moves in the background. Every ``wait`` (and ``test``)
drives the whole engine: it reads the rings of every peer, answers RTRs,
posts what waited for credit and completes writes; a rank's pending sends
move whenever it waits for anything: the World's other waits (its collectives
engine's, its store's) drive this engine too while it is ``busy()`` (World.beside). Waits block in the C++ waiter on the
words the peers write (``tensorwire.wait_any``), watching the peers'
channels: a dead peer fails the wait within the Device's liveness bound.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from .. import _core, sharing
from ..errors import Error, InvalidArgument, Timeout
from ..registry import RegistrationCache

SLOTS = 64                # records in flight per direction and peer (a power of two)
DEFAULT_PULL_BYTES = 4 << 20    # up to here a tensor not registered yet is copied out for the receiver to pull
DEFAULT_SPLIT_BYTES = 256 << 10  # from here a same-host placed message is copied by both sides
# transports whose copies a process makes into another's memory itself (the kernel's cross-memory
# attach, xpmem, knem): a second process can copy part of a message at the same time
SPLIT_TRANSPORTS = ("cma/", "xpmem/", "knem/")
HEADER = 64               # bytes: kind, tag, k, nbytes, offset, payload length, aux (int64 each), 1 spare
OUTBOX_BYTES = 32 << 20   # our staging for pulled messages (in the arena: every peer has it mapped or exported)
PULL = 1                  # an RTS's aux: the data waits in the sender's outbox at `offset`; the receiver reads it
CLAIM_AFTER_S = 200e-6    # a split receive claims the first half once its sender was silent this long
CLAIMS = 1023             # split receives in flight per sender whose first half either side may claim
DEFAULT_EAGER_BYTES = 128 << 10  # a pipeline stage's activations (FCN-5, batch 8: 128 KiB) complete on posting
CLOSE_FLUSH_S = 5.0       # how long close() waits for records posted to live peers to land
WAIT_SLICE_S = 0.05       # a wait re-reads what a word-equality wait can miss (credits) this often
# Records a peer may have waiting for receives and sends not posted yet (a peer that sends more is
# refused: its memory is not ours to fill); 16384 eager payloads are at most 2 GiB.
MAX_UNMATCHED = 16384
PULLED_KEPT = 1024        # allocations sent from once (pulled) remembered, to register one sent again
REMOTES_KEPT = 1024       # unpacked descriptors of peers' tensors kept for the next placed send
SHARES_MAX_BYTES = 2 << 30  # allocations kept shared in place (and alive) at most
MET_KEPT = 4096           # allocations remembered as moved once (shared in place when moved again)

SHARED = 1 << 62          # a split RTS's or an RTR's aux: the payload starts with the tensor's share ticket
TICKET_BYTES = 40         # a share ticket: pid, fd, inode, length, where the share starts in the registration
EDGE = 64                 # bytes of a split half that go through UCX when the rest is a mapped copy

EAGER, RTS, RTR, DONE, ERR, TAKEN = 1, 2, 3, 4, 5, 6
ERR_ON_RECV = 1  # an ERR record's offset: about the receive it names (else: about the send)
KIND_NAMES = {EAGER: "eager", RTS: "rts", RTR: "rtr", DONE: "done", ERR: "error", TAKEN: "taken"}


class MessageError(Error, RuntimeError):
    """A send or receive failed: the two sides disagree (size), or a peer failed or was silent."""


class Op:
    """One posted send or receive; completed by the engine's progress."""

    __slots__ = ("kind", "peer", "tag", "k", "ptr", "nbytes", "keep", "done", "error", "req", "reg", "queued",
                 "split", "parts", "done_due", "claim", "src", "head", "tail_done", "landed", "share")

    def __init__(self, kind: str, peer: int, tag: int, k: int, ptr: int, nbytes: int, keep: Any) -> None:
        self.kind, self.peer, self.tag, self.k = kind, peer, tag, k
        self.ptr, self.nbytes, self.keep = ptr, nbytes, keep  # keep: what holds the memory at ptr
        self.done = False
        self.error: BaseException | None = None
        self.req: Any = None      # the placed data write (send) or split read (receive) in flight
        self.reg: Any = None      # the registration the op holds while in flight
        self.queued = False       # its last record waits for credit (the op is not complete before it goes)
        self.split = 0            # placed, split: the sender writes [0, split), the receiver reads the rest
        self.parts = 1            # what the op still waits for: DONE or the write; + TAKEN or the read if split
        self.done_due = False     # a placed send's DONE record goes once its write completed
        self.claim: tuple[int, int] | None = None  # a split receive's claim word (index, message id)
        self.src: Any = None      # a split receive: (the sender's region, offset) it reads from
        self.head = False         # a split receive reads the first half too (it won the claim)
        self.tail_done = False    # a split receive has read the second half
        self.landed = False       # a receive's DONE arrived
        self.share: Any = None    # our share whose ticket the op sent (kept until the op completes)

    def what(self) -> str:
        way = "to" if self.kind == "send" else "from"
        return f"{self.kind} of {self.nbytes} B {way} rank {self.peer} (tag {self.tag}, message {self.k})"


class Layout:
    """Offsets in the messages arena (identical on every rank for a world of n)."""

    def __init__(self, n: int, eager_bytes: int) -> None:
        self.n = n
        self.eager = eager_bytes
        self.slot = HEADER + (eager_bytes + 63) // 64 * 64
        ring = SLOTS * self.slot
        off = 0

        def take(nbytes: int) -> int:
            nonlocal off
            start = off
            off = (off + nbytes + 4095) // 4096 * 4096
            return start
        self.inbox = take(n * ring)          # sender s writes into inbox + s * ring
        self.flags = take(n * SLOTS * 8)     # sender s's sequence words
        self.acks = take(n * 8)              # receiver r writes how many of our records it consumed
        self.staging = take(n * ring)        # local: our records to peer p, slot by slot
        self.flagsrc = take(n * SLOTS * 8)   # local: sources of our sequence words
        self.acksrc = take(n * 8)            # local: sources of our credit words
        self.claims = take(n * CLAIMS * 8)   # receiver: who copies a split message's first half (peers swap)
        self.outbox = take(OUTBOX_BYTES)     # sender: pulled messages wait here until their TAKEN
        self.total = off
        self.ring = ring


class Messenger:
    """Tagged send/recv between the ranks of `world` (see the module docs).

    Args:
        world: a tensorwire.ranks.world.World (its device, channels and store).
        registry: a tensorwire.registry.RegistrationCache for the placed path.
        timeout: seconds a wait may take when the caller gives none.
        eager_bytes: the largest message that travels inline in the ring.
        split_bytes: the smallest placed message both sides copy (same-host peers; 0: never).
        name: prefix of the published arena (several engines on one device need their own).
    """

    def __init__(self, world: Any, registry: Any, timeout: float = 30.0,
                 eager_bytes: int = DEFAULT_EAGER_BYTES, split_bytes: int = DEFAULT_SPLIT_BYTES,
                 pull_bytes: int = DEFAULT_PULL_BYTES, name: str = "msg") -> None:
        if eager_bytes < 0 or eager_bytes > 1 << 24:
            raise InvalidArgument(f"eager_bytes must be in 0..16 MiB, got {eager_bytes}")
        if split_bytes < 0:
            raise InvalidArgument(f"split_bytes must be >= 0 (0: never split), got {split_bytes}")
        self.world, self.registry = world, registry
        self.rank, self.n = world.rank, world.size
        self.timeout = timeout
        self.lay = lay = Layout(self.n, eager_bytes)
        # where record j to (or from) each peer lives: the hot paths add j * slot (or j * 8)
        self._staging_at = [lay.staging + p * SLOTS * lay.slot for p in range(self.n)]
        self._flagsrc_at = [lay.flagsrc + p * SLOTS * 8 for p in range(self.n)]
        self._inbox_at = lay.inbox + self.rank * SLOTS * lay.slot   # ours in each peer's inbox
        self._flags_at = lay.flags + self.rank * SLOTS * 8          # our sequence words there
        self._flag_words = lay.flags >> 3                           # (word index) the peers' sequence words here
        self._ack_words = lay.acks >> 3                             # (word index) the credits peers hand us
        dev = world.device
        self.arena = dev.alloc(self.lay.total, alignment=4096)
        self.base = self.arena.ptr
        self.mem = np.frombuffer(self.arena, dtype=np.uint8)
        self.words = self.mem.view(np.int64)
        # the same words through a memoryview: its scalar reads cost less than numpy's (every record)
        self.wv = memoryview(self.words).cast("B").cast("q")
        self.mem[self.lay.flags: self.lay.acks + self.n * 8] = 0
        self.name = f"{name}.arena"
        dev.publish(self.name, self.arena)
        world.allgather(None)  # every rank has published
        self.ch: list[Any] = [None] * self.n
        self.remote: list[Any] = [None] * self.n
        for p in range(self.n):  # one connection per pair (World.channel): exports hold on it
            if p != self.rank:
                self.ch[p] = world.channel(p)
                self.remote[p] = self.ch[p].lookup(self.name, timeout)
        world.allgather(None)  # every rank has looked up (nothing is written before)
        n = self.n
        # per peer: the smallest placed message both sides copy (0: never; the sender decides, its RTS says)
        # per peer: whether a completed write has landed at the target (the message form: it completes
        # on the target's reply), so a placed send's DONE follows its completion instead of a fence
        # (over tcp a fence after a rendezvous write is a round trip that stalls the sender)
        self.landed_on_completion = [ch is not None and ch.form == "messages" for ch in self.ch]
        self.split_sends = 0  # placed sends both sides copied (split), for tests and benchmarks
        self.pulled_sends = 0  # placed sends copied to the outbox for the receiver to read
        self.mapped_copies = 0  # halves of split messages copied through a peer's share (tensorwire.sharing)
        self.split_from = [split_bytes if ch is not None and split_bytes and ch.form == "rma" and
                           ch.peer.get("same_host") and any(t.startswith(SPLIT_TRANSPORTS) for t in ch.transports())
                           else 0 for ch in self.ch]
        self.claims_free: list[list[int]] = [list(range(CLAIMS)) if f else [] for f in self.split_from]
        self.claim_ids = 0    # message ids of claim words (never reused: a stale swap fails)
        self.claimable: list[Op] = []               # split receives whose first half is open
        self.pull_max = pull_bytes
        self.outbox_free: list[tuple[int, int]] = [(0, OUTBOX_BYTES)]   # (offset in the outbox, bytes)
        self.outbox_held: dict[tuple[int, int, int], tuple[int, int]] = {}  # pulled sends until TAKEN
        self.pulled_allocs: OrderedDict[tuple[int, int], bool] = OrderedDict()  # allocations pulled once
        self.last_heard = [0.0] * n                 # when a record of each peer was last consumed
        self.sent = [0] * n            # records posted to p (the last one's number)
        self.got = [0] * n             # records consumed from p
        self.acked = [0] * n           # credits we handed back to p (records)
        self.post_req: list[list[Any]] = [[None] * SLOTS for _ in range(n)]  # a staging slot's writes in flight
        self.outq: list[list[tuple]] = [[] for _ in range(n)]     # records waiting for credit
        self.send_k: dict[tuple[int, int], int] = {}
        self.recv_k: dict[tuple[int, int], int] = {}
        self.recvs: dict[tuple[int, int, int], Op] = {}       # posted receives
        self.sends: dict[tuple[int, int, int], Op] = {}       # placed sends waiting for their RTR
        self.unexpected: dict[tuple[int, int, int], tuple[int, Any]] = {}
        self.rtrs: dict[tuple[int, int, int], tuple[int, int, bytes]] = {}
        self.writing: list[Op] = []                            # placed sends whose data write is in flight
        self.reading: list[Op] = []                            # split receives whose read is in flight
        self.taking: dict[tuple[int, int, int], Op] = {}       # split sends waiting for the receiver's TAKEN
        self.exported: dict[tuple[int, int], np.ndarray] = {}  # (peer, registration id) -> descriptor
        self.remotes: dict[tuple[int, bytes], Any] = {}        # (peer, descriptor) -> RemoteRegion
        self.failed: dict[int, BaseException] = {}             # peers whose channel failed
        self.next_word: list[Any] = [None] * n                 # (number, Word) of the next record per peer
        # allocations shared in place with same-host peers, and the peers' shares mapped here
        # (tensorwire.sharing): the backend's all_reduce reads and writes the ranks' own tensors
        self.sharing = os.environ.get("TENSORWIRE_SHARE_IN_PLACE", "1") != "0"
        self.shares = RegistrationCache(world.device, max_bytes=SHARES_MAX_BYTES,
                                        register=sharing.share_in_place, release=self._release_share)
        self.share_users: dict[int, int] = {}          # id(share) -> ops in flight whose peer may use it
        self.release_due: dict[int, sharing.Share] = {}  # shares dropped from the cache while in use
        self.peer_shares = sharing.PeerShares()
        # allocations moved once (True: shared when moved again) or refused (False: not looked at again)
        self.met: OrderedDict[tuple[int, int], bool] = OrderedDict()
        self.closed = False

    # ---- public API --------------------------------------------------------

    def isend(self, ptr: int, nbytes: int, peer: int, tag: int = 0, keep: Any = None, owner: Any = None) -> Op:
        """Posts a send of the `nbytes` bytes at address `ptr` (held by `keep`, which must not
        change them before the op completes) to `peer`; `owner` (see RegistrationCache.lookup)
        names the allocation that holds them, for the placed path. Returns the Op."""
        if self.closed or peer in self.failed or not 0 <= peer < self.n or peer == self.rank:
            self._check_peer(peer)  # raises what is wrong
        key = (peer, tag)
        k = self.send_k[key] = self.send_k.get(key, 0) + 1
        op = Op("send", peer, tag, k, ptr, nbytes, keep)
        if nbytes <= self.lay.eager:
            if self.rtrs:
                self.rtrs.pop((peer, tag, k), None)  # a receiver expecting another size fails on our record
            if self._record(peer, EAGER, tag, k, nbytes, 0, ptr, nbytes, op):
                op.done = True
            return op
        alloc = owner() if callable(owner) else owner if owner is not None else (ptr, nbytes, keep)
        if nbytes <= self.pull_max and self.registry.cached(alloc) is None and (
                not self.landed_on_completion[peer] or self._first_send_of(alloc)):
            off = self._outbox_take(nbytes)
            if off is not None:  # copied out now; the op completes on the receiver's TAKEN (or ERR)
                ctypes.memmove(self.base + self.lay.outbox + off, ptr, nbytes)
                self.outbox_held[(peer, tag, k)] = (off, nbytes)
                self.taking[(peer, tag, k)] = op
                self.rtrs.pop((peer, tag, k), None)  # not written by us: the receiver reads it
                self.pulled_sends += 1
                self._record(peer, RTS, tag, k, nbytes, self.lay.outbox + off, aux=PULL)
                return op
        hits = self.registry.hits
        op.reg = self.registry.lookup(alloc)
        # split only a tensor sent before (its allocation registered already): exporting a fresh
        # one to the receiver is a control call, a round trip, which costs more than the copy it
        # shares (a pipeline stage sends new activations every microbatch)
        reused = self.registry.hits != hits or (peer, id(op.reg)) in self.exported
        if self.split_from[peer] and nbytes >= self.split_from[peer] and reused:
            op.split, op.parts = _split_at(nbytes), 2
            self.taking[(peer, tag, k)] = op
            self.split_sends += 1
            desc, aux = self._export(peer, op.reg), 0
            share = self.share(alloc, ptr, nbytes)
            if share is not None:  # the receiver may copy its half out of our share
                desc, aux = _with_ticket(share, op.reg.ptr, desc), SHARED
                self._use_share(op, share)
            self._record(peer, RTS, tag, k, nbytes, ptr - op.reg.ptr, *_payload(desc), aux=aux)
        else:
            self._record(peer, RTS, tag, k, nbytes)
        rtr = self.rtrs.pop((peer, tag, k), None)
        if rtr is None:
            self.sends[(peer, tag, k)] = op
        else:
            self._place(op, *rtr)
        return op

    def irecv(self, ptr: int, nbytes: int, peer: int, tag: int = 0, keep: Any = None, owner: Any = None) -> Op:
        """Posts a receive into the `nbytes` writable bytes at `ptr` (held by `keep`) from `peer`."""
        if self.closed or peer in self.failed or not 0 <= peer < self.n or peer == self.rank:
            self._check_peer(peer)  # raises what is wrong
        key = (peer, tag)
        k = self.recv_k[key] = self.recv_k.get(key, 0) + 1
        op = Op("recv", peer, tag, k, ptr, nbytes, keep)
        mkey = (peer, tag, k)
        got = self.unexpected.pop(mkey, None)
        if op.nbytes > self.lay.eager:
            if got is not None and got[2] != nbytes:
                self._arrived(op, got)  # fails it, saying both sizes
                return op
            alloc = owner() if callable(owner) else owner if owner is not None else (ptr, nbytes, keep)
            op.reg = self.registry.lookup(alloc)
            if got is not None and got[1] is PULL:  # it waits in the sender's outbox: no RTR needed
                self.recvs[mkey] = op
                self._pull(op, got[3])
                return op
            desc = self._export(peer, op.reg)
            self.recvs[mkey] = op
            aux = 0
            if nbytes >= self.split_from[peer] > 0 and self.claims_free[peer]:
                c = self.claims_free[peer].pop()
                self.claim_ids += 1
                op.claim = (c, self.claim_ids)
                self.words[(self.lay.claims >> 3) + peer * CLAIMS + c] = self.claim_ids * 4  # open
                aux = (self.claim_ids << 10) | (c + 1)
                # (up to pull_max a sender pulls from an allocation it has not registered: nobody
                # would use a share then)
                share = self.share(alloc, ptr, nbytes) if nbytes > self.pull_max else None
                if share is not None:  # the sender may copy its half into our share
                    desc, aux = _with_ticket(share, op.reg.ptr, desc), aux | SHARED
                    self._use_share(op, share)
            self._record(peer, RTR, tag, k, nbytes, ptr - op.reg.ptr, *_payload(desc), aux=aux)
            if got is not None:
                self._arrived(op, got)  # the sender's RTS: a split one starts our read
            return op
        if got is not None:
            self._arrived(op, got)
            if op.done:
                return op
        self.recvs[mkey] = op
        return op

    def share(self, alloc: tuple[int, int, Any], ptr: int, nbytes: int) -> sharing.Share | None:
        """The share of the allocation (address, nbytes, keepalive) an op moves [ptr, ptr + nbytes)
        of, made when the allocation is moved the second time (sharing copies it once and each peer
        maps it: a temporary moved once does not pay that back), or None: not yet, sharing is off,
        the op does not cover the allocation's whole pages (its other bytes might change while they
        are copied into the share), or they are not malloc's private memory."""
        key = (int(alloc[0]), int(alloc[1]))
        lo, hi = sharing.interior(*key)
        if not self.sharing or hi <= lo or ptr > lo or ptr + nbytes < hi:
            return None
        if self.shares.cached(key) is None:
            seen = self.met.get(key)
            if not seen:  # the first move, or one refused before (each try reads /proc/self/maps)
                if seen is None:
                    self.met[key] = True
                    while len(self.met) > MET_KEPT:
                        self.met.popitem(last=False)
                return None
        try:
            return self.shares.lookup(alloc)
        except sharing.SharingError:
            self.met[key] = False
            return None

    def _use_share(self, op: Op, share: sharing.Share) -> None:
        """`op` sent `share`'s ticket: the share stays until the op completes, even if the cache drops it."""
        op.share = share
        self.share_users[id(share)] = self.share_users.get(id(share), 0) + 1

    def _release_share(self, share: sharing.Share) -> None:
        """The cache dropped `share`: private pages go back now, or once no op in flight names it."""
        if self.share_users.get(id(share)):
            self.release_due[id(share)] = share
        else:
            share.release()

    def test(self, op: Op) -> bool:
        if not op.done:
            self.progress()
        if op.done and op.error is not None:
            raise op.error
        return op.done

    def wait(self, op: Op, timeout: float | None = None) -> None:
        """Drives the engine until `op` completes; raises its error, or MessageError after
        `timeout` seconds (default: the engine's) naming the silent peer."""
        self.wait_all([op], timeout)

    def wait_all(self, ops: list[Op], timeout: float | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not self.wait_some(ops, deadline - time.monotonic()):
            if time.monotonic() >= deadline:
                raise self.timeout_error(ops, timeout)

    def timeout_error(self, ops: list[Op], timeout: float) -> MessageError:
        """The error of a wait for `ops` that took `timeout` seconds: the first op left, and its peer."""
        op = next(op for op in ops if not op.done)
        p = op.peer
        return MessageError(f"rank {self.rank}: {op.what()} did not complete within {timeout:g} s "
                            f"(rank {p} did not take part; records with it: {self.sent[p]} sent, "
                            f"{self._credit(p)} acknowledged, {len(self.outq[p])} waiting for credit, "
                            f"{self.got[p]} received)")

    def wait_some(self, ops: list[Op], seconds: float) -> bool:
        """Drives the engine for at most `seconds` (one look at least): True once every op in
        `ops` completed; raises the first one's error."""
        deadline = time.monotonic() + max(0.0, seconds)
        while True:
            self.progress()
            left = None
            for op in ops:
                if not op.done:
                    left = op if left is None else left
                elif op.error is not None:
                    raise op.error
            if left is None:
                return True
            due = self._claim_idle() if self.claimable else None
            now = time.monotonic()
            if now >= deadline:
                return False
            self._block(min(WAIT_SLICE_S, deadline - now, due or WAIT_SLICE_S),
                        {op.peer for op in ops if not op.done})

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for op in self.writing + self.reading:
            try:
                op.req.wait(1.0)
            except Error:
                pass
        # Records posted but not landed yet: over tcp they may still sit in our socket or the
        # peer's (a record's write is not answered there), and a Device that closes under them
        # loses them (a rank that sent its last messages and left at once: its receiver got none
        # of them). One answered write after them, our credit word again, lands behind them on
        # the same connection: its completion says they landed. A peer that is gone fails it at
        # once; one alive answers in a round trip.
        deadline = time.monotonic() + CLOSE_FLUSH_S
        for p in range(self.n):
            if p == self.rank or p in self.failed or not self.sent[p]:
                continue
            src = self.lay.acksrc + p * 8
            try:
                self.ch[p].write(self.arena, self.remote[p], src, self.lay.acks + self.rank * 8, 8).wait(
                    max(0.0, deadline - time.monotonic()))
            except Error:
                pass
        try:
            self.world.device.unpublish(self.name)
        except Error:
            pass
        self.shares.clear()  # private pages back under every allocation shared in place
        for share in self.release_due.values():  # (ops still in flight fail with the closed engine)
            share.release()
        self.release_due.clear()
        self.peer_shares.close()

    # ---- progress ----------------------------------------------------------

    def progress(self) -> None:
        """Reads every ring, answers what arrived, posts what waited for credit,
        completes placed sends whose data write completed."""
        w, got = self.wv, self.got
        for p in range(self.n):
            if p == self.rank or p in self.failed:
                continue
            base = self._flag_words + p * SLOTS
            while p not in self.failed and w[base + (got[p] + 1) % SLOTS] == got[p] + 1:
                self._consume(p, got[p] + 1)
            if self.outq[p]:
                self._drain(p)
        if self.writing:
            still = []
            for op in self.writing:
                if op.done_due and op.req.done():
                    op.done_due = False
                    if not op.req.failed:
                        self._record(op.peer, DONE, op.tag, op.k, op.nbytes, op=op)
                if op.req.done() and not op.queued and not op.done_due:
                    self._finish_send(op)
                else:
                    still.append(op)
            self.writing = still
        if self.reading:
            still = []
            for op in self.reading:
                if op.req.done():
                    self._finish_read(op)
                else:
                    still.append(op)
            self.reading = still

    def busy(self) -> bool:
        """Whether something waits for this rank's own progress: a record for credit, a placed
        send for its RTR or its write, a read, a posted receive, a TAKEN."""
        return bool(self.sends or self.writing or self.reading or self.recvs or self.taking or
                    any(self.outq))

    def nap(self, seconds: float) -> None:
        """Spends up to `seconds` moving what waits for us (a wait elsewhere, e.g. in the store,
        lets a send posted before it go on), or sleeps when nothing does."""
        if not self.busy():
            time.sleep(seconds)
            return
        self.progress()
        self._block(seconds, {p for p in range(self.n) if p != self.rank and p not in self.failed})

    def wait_items(self) -> list[Any]:
        """What a wait for this engine watches: each peer's next record word, the credit word
        where records wait for it, and the reads and writes in flight."""
        lay = self.lay
        items: list[Any] = []
        for p in range(self.n):
            if p == self.rank or p in self.failed:
                continue  # a failed peer writes nothing more; what waited for it failed with it
            m = self.got[p] + 1
            nw = self.next_word[p]
            if nw is None or nw[0] != m:
                nw = self.next_word[p] = (m, _core.Word(self.arena, lay.flags + (p * SLOTS + m % SLOTS) * 8, m,
                                                        self.ch[p]))
            items.append(nw[1])
            if self.outq[p]:  # credits: the receiver writes a multiple of SLOTS/2
                need = self.sent[p] + 1 - SLOTS
                want = -(-need // (SLOTS // 2)) * (SLOTS // 2)
                items.append(_core.Word(self.arena, lay.acks + p * 8, want, self.ch[p]))
        # Every read, and every write but one whose last record waits for credit: a done request
        # is ready at once, which is right when progress has something to do for it (a read or
        # write that completed since progress() looked: leaving it out slept a whole slice, 50
        # ms of a 64 MiB all_reduce's 13), and wrong for a queued one (a wait that returns at
        # once never drives the worker: over tcp the peer's writes to us would not land, both
        # ranks spun, neither progressed); the credit word wakes that one.
        items += [op.req for op in self.reading]
        items += [op.req for op in self.writing if not (op.queued and op.req.done())]
        return items

    def _block(self, seconds: float, peers: set[int]) -> None:
        """Sleeps in the C++ waiter until a peer writes something we may be waiting for."""
        items = self.wait_items()
        if not items:
            time.sleep(min(seconds, 0.001))
            return
        try:
            _core.wait_any(items, timeout=max(0.0, seconds))
        except Timeout:
            pass
        except Error as e:  # a watched peer failed
            self._peer_failed(e, peers)

    def _peer_failed(self, e: Error, peers: set[int]) -> None:
        """A watched peer's channel failed. What it wrote before it went is read first (a peer
        that sent its last message and left has not failed the receive of it); then every op
        still waiting for it fails, naming it. Ops with other peers go on."""
        bad = self._peer_of(e)
        try:
            self.progress()
        except Error:
            pass
        suspects = [bad] if bad is not None else sorted(peers)
        who = f"rank {bad}" if bad is not None else f"one of ranks {suspects}"
        err = MessageError(f"rank {self.rank}: {who} failed ({type(e).__name__}: {e})")
        err.__cause__ = e
        for p in suspects:
            self._fail_peer(p, err)

    def _refuse(self, p: int, what: str) -> None:
        """Rank `p` sent something no tensorwire peer sends: nothing more of it is read, and every
        op with it fails, saying what it sent. Ops with other ranks go on."""
        self._fail_peer(p, MessageError(f"rank {self.rank}: rank {p} sent {what}; its messages are refused "
                                        f"from now on"))

    def _fail_peer(self, p: int, err: MessageError) -> None:
        self.failed[p] = err
        for op in list(self.recvs.values()) + list(self.sends.values()) + list(self.taking.values()) + self.writing:
            if op.peer == p and not op.done:
                op.error, op.done = err, True
        for table in (self.recvs, self.sends, self.unexpected, self.rtrs, self.taking):
            for key in [k for k in table if k[0] == p]:
                del table[key]
        self.writing = [op for op in self.writing if op.peer != p]
        self.reading = [op for op in self.reading if op.peer != p]
        self.claimable = [op for op in self.claimable if op.peer != p]
        for key in [k for k in self.outbox_held if k[0] == p]:
            self._outbox_release(key)

    def _peer_of(self, e: Error) -> int | None:
        """The rank whose failure `e` reports ("peer HOST:PORT (pid N) ..."), if it says."""
        import re
        m = re.search(r"peer (\S+) \(pid (\d+)\)", str(e))
        if m is None:
            return None
        found = [p for p, ch in enumerate(self.ch) if ch is not None and ch.peer.get("pid") == int(m.group(2))]
        exact = [p for p in found if self.ch[p].peer.get("address") == m.group(1)]
        hits = exact or found
        return hits[0] if len(hits) == 1 else None

    # ---- records -----------------------------------------------------------

    def _record(self, peer: int, kind: int, tag: int, k: int, nbytes: int, offset: int = 0,
                pptr: int = 0, plen: int = 0, op: Op | None = None, aux: int = 0) -> bool:
        """Posts a record to `peer` (its payload: the `plen` bytes at `pptr`), or queues it until
        `peer` hands back credit (then `op`, whose last record it is, completes only once it
        went: a rank whose ops are all complete has nothing left that only its own progress
        could post). True if posted."""
        if self.outq[peer] or self.sent[peer] + 1 - self._credit(peer) > SLOTS:
            # no credit: keep a copy (the caller's memory may change once the op returns)
            if op is not None:
                op.queued = True
            copy = np.empty(plen, dtype=np.uint8)
            if plen:
                ctypes.memmove(copy.ctypes.data, pptr, plen)
            self.outq[peer].append((kind, tag, k, nbytes, offset, copy, op, aux))
            return False
        self._post(peer, kind, tag, k, nbytes, offset, pptr, plen, aux)
        return True

    def _credit(self, peer: int) -> int:
        return self.wv[self._ack_words + peer]

    def _drain(self, peer: int) -> None:
        q = self.outq[peer]
        while q and self.sent[peer] + 1 - self._credit(peer) <= SLOTS:
            kind, tag, k, nbytes, offset, copy, op, aux = q.pop(0)
            self._post(peer, kind, tag, k, nbytes, offset, copy.ctypes.data if copy.size else 0, copy.size, aux)
            if op is not None:
                op.queued = False
                if op.kind == "send" and op.req is None:  # an eager send: complete once posted
                    self._complete(op)
                elif op.kind == "recv" and not op.done:  # its TAKEN went
                    self._part_done(op)
                    if op.done:
                        self.recvs.pop((op.peer, op.tag, op.k), None)

    def _post(self, peer: int, kind: int, tag: int, k: int, nbytes: int, offset: int,
              pptr: int, plen: int, aux: int = 0) -> None:
        """Header and payload into the staging slot, written into our slot of the peer's ring;
        fence; the slot's sequence word (one C++ call: this is every send's path)."""
        m = self.sent[peer] = self.sent[peer] + 1
        j = m % SLOTS
        reqs = self.post_req[peer]
        prev = reqs[j]
        if prev is not None and not prev.done():
            prev.wait(self.timeout)  # long done in practice: the record was consumed
        slot = self.lay.slot
        reqs[j] = self.ch[peer]._post_record(
            self.arena, self.remote[peer], self._staging_at[peer] + j * slot, self._inbox_at + j * slot,
            self._flagsrc_at[peer] + j * 8, self._flags_at + j * 8, m, (kind, tag, k, nbytes, offset, plen, aux),
            pptr, plen)

    def _consume(self, p: int, m: int) -> None:
        lay = self.lay
        off = lay.inbox + (p * SLOTS + m % SLOTS) * lay.slot
        kind, tag, k, nbytes, offset, plen, aux = self.wv[off >> 3: (off >> 3) + 7].tolist()
        self.got[p] = m  # before anything below posts records of its own
        self.last_heard[p] = time.monotonic()
        if kind == EAGER and plen == nbytes and 0 <= nbytes <= lay.slot - HEADER:
            # the common case first: eager data for a receive posted with its size
            key = (p, tag, k)
            op = self.recvs.get(key)
            if op is not None and op.nbytes == nbytes:
                del self.recvs[key]
                if nbytes:
                    ctypes.memmove(op.ptr, self.base + off + HEADER, nbytes)
                self._complete(op)
                if m % (SLOTS // 2) == 0:
                    self._ack(p, m)
                return
        # The peer wrote every field: check them against what a record may say before any is used
        # (a modified peer may send anything; docs/contracts.md section 11).
        if (kind not in KIND_NAMES or nbytes < 0 or not 0 <= plen <= lay.slot - HEADER
                or (kind == EAGER and plen != nbytes) or (kind in (DONE, TAKEN) and plen)):
            self._refuse(p, f"a malformed record (kind {kind}, {nbytes} B, payload {plen} B)")
            return
        if kind in (EAGER, RTS, RTR) and len(self.unexpected) + len(self.rtrs) >= MAX_UNMATCHED:
            self._refuse(p, f"more than {MAX_UNMATCHED} messages that no receive or send here matches yet")
            return
        body = self.mem[off + HEADER: off + HEADER + plen] if kind != EAGER else None
        key = (p, tag, k)
        ticket = None
        if kind in (RTS, RTR) and aux & SHARED:
            if plen < TICKET_BYTES:
                self._refuse(p, f"a share ticket of {plen} B")
                return
            ticket = tuple(body[:TICKET_BYTES].view(np.int64).tolist())
            body, aux = body[TICKET_BYTES:], aux & ~SHARED
        if kind == RTR:
            if aux and not 1 <= (aux & 1023) <= CLAIMS:
                self._refuse(p, f"a ready-to-receive record naming claim word {(aux & 1023) - 1}")
                return
            self._on_rtr(key, nbytes, offset, bytes(body), aux, ticket)
        elif kind == EAGER:
            # (kind, data, nbytes, data's address): copied out of the ring by _deliver or _arrived
            self._deliver(key, (kind, None, nbytes, self.base + off + HEADER))
        elif kind == ERR and offset == ERR_ON_RECV:  # the sender's write for our receive `key` failed
            rop = self.recvs.pop(key, None)
            if rop is not None and not rop.done:
                self._fail(rop, bytes(body).decode(errors="replace"))
        elif kind == ERR:  # the receiver refused our send `key`
            self._outbox_release(key)
            sop = self.sends.pop(key, None) or self.taking.get(key)
            if sop is not None and not sop.done:
                self._fail(sop, bytes(body).decode(errors="replace"))
        elif kind == TAKEN:  # the receiver read its part of our split send `key`, or all of a pulled one
            sop = self.taking.pop(key, None)
            released = self._outbox_release(key)
            if sop is not None:
                self._part_done(sop)
            elif not released and not self._sent_already(key):
                self._refuse(p, f"a taken record for send {key[1:]} that was never posted")
                return
        elif kind == RTS and aux == PULL:  # the data waits in the sender's outbox at `offset`
            if not (self.lay.outbox <= offset and offset + nbytes <= self.lay.outbox + OUTBOX_BYTES):
                self._refuse(p, f"a message to pull from outside its outbox ({nbytes} B at {offset})")
                return
            self._deliver(key, (kind, PULL, nbytes, offset))
        elif kind == RTS:  # a split one carries the sender's descriptor (and share): kept past the ring slot
            desc = bytes(body) if plen else None
            self._deliver(key, (kind, desc if ticket is None else (desc, ticket), nbytes, offset))
        else:  # DONE
            self._deliver(key, (kind, None, nbytes, 0))
        if m % (SLOTS // 2) == 0:
            self._ack(p, m)

    def _ack(self, p: int, m: int) -> None:
        src = self.lay.acksrc + p * 8
        self.words[src >> 3] = m
        self.acked[p] = m
        try:
            self.ch[p].write(self.arena, self.remote[p], src, self.lay.acks + self.rank * 8, 8)
        except Error:
            pass  # the peer is gone: a credit nobody will use (what it sent before is still read)

    def _deliver(self, key: tuple[int, int, int], got: tuple) -> None:
        op = self.recvs.get(key)
        if op is None:  # the ring slot is reused once consumed: keep a copy of its payload
            if got[0] == EAGER:
                at = got[3] - self.base
                data = self.mem[at: at + got[2]].copy()
                got = (EAGER, data, got[2], data.ctypes.data)
            self.unexpected[key] = got
            return
        self._arrived(op, got)
        if op.done:
            self.recvs.pop(key, None)

    def _arrived(self, op: Op, got: tuple) -> None:
        """A record for the posted receive `op`: eager data, the sender's RTS or DONE
        (kind, payload, nbytes, and the payload's address (eager) or the sender's offset (RTS))."""
        kind, data, nbytes, offset = got
        if nbytes != op.nbytes:
            why = (f"rank {op.peer} sends {nbytes} B (tag {op.tag}, message {op.k}) but rank {self.rank} "
                   f"receives into {op.nbytes} B: send and receive tensors must have the same size")
            self._fail(op, why)
            text = np.frombuffer(why.encode(), dtype=np.uint8)  # held here while the record is posted
            self._record(op.peer, ERR, op.tag, op.k, 0, 0, *_payload(text))
            return
        if kind == EAGER:
            if nbytes:
                ctypes.memmove(op.ptr, offset, nbytes)
            self._complete(op)
        elif kind == DONE:
            op.landed = True
            if op in self.claimable:  # the sender wrote the first half: we are done with its tensor
                self.claimable.remove(op)
                self._taken(op)
            self._part_done(op)
        elif data is PULL:  # read it all out of the sender's outbox
            self._pull(op, offset)
        elif data is not None:  # a split RTS: read the second half out of the sender's tensor
            self._take(op, data, offset)
        # RTS with the right size: our RTR went (or goes) out; the DONE follows

    def _on_rtr(self, key: tuple[int, int, int], nbytes: int, offset: int, desc: bytes, aux: int,
                ticket: tuple | None) -> None:
        op = self.sends.pop(key, None)
        if op is None:
            if not self._sent_already(key):  # (else our send went eager: the receiver fails on it)
                self.rtrs[key] = (nbytes, offset, desc, aux, ticket)
        else:
            self._place(op, nbytes, offset, desc, aux, ticket)

    def _sent_already(self, key: tuple[int, int, int]) -> bool:
        """Whether our send `key` was posted already (a record for it that finds no op is stale)."""
        p, tag, k = key
        return k <= self.send_k.get((p, tag), 0)

    def _place(self, op: Op, nbytes: int, offset: int, desc: bytes, aux: int = 0, ticket: tuple | None = None) -> None:
        """The receiver's RTR for the placed send `op`: write the data into its tensor (a split
        one: its first half, if we claim it before the receiver does; through the receiver's
        share, when it sent one, but the first bytes outside its whole pages)."""
        if nbytes != op.nbytes:
            why = (f"rank {self.rank} sends {op.nbytes} B (tag {op.tag}, message {op.k}) but rank {op.peer} "
                   f"receives into {nbytes} B: send and receive tensors must have the same size")
            self._fail(op, why)
            return  # the receiver fails on our RTS
        p = op.peer
        ch = self.ch[p]
        if op.split and aux:
            word = self.lay.claims + (self.rank * CLAIMS + (aux & 1023) - 1) * 8
            mine = aux >> 10 << 2
            try:
                won = ch._compare_swap(self.arena, self.remote[p], word, mine, mine + 1) == mine
            except Error as e:
                self._refuse(p, f"a claim word this device cannot reach ({e})")
                return
            if not won:  # the receiver copies it all (it was done with its half before we came)
                self._part_done(op)
                return
        mapped = self._mapped(p, ticket, offset, 0, op.split, head=True) if op.split and ticket else None
        try:  # the descriptor and offset are the peer's: the core checks them against its exports
            op.req = ch.write(op.reg, self._remote(p, desc), op.ptr - op.reg.ptr, offset,
                              mapped[0] if mapped else op.split or op.nbytes)
        except Error as e:
            self._refuse(p, f"a ready-to-receive record this device cannot write to ({e})")
            return
        if mapped:  # the rest of our half: a copy into the receiver's tensor, mapped here
            _core.copy(mapped[2], op.ptr + mapped[0], mapped[1] - mapped[0])  # the direct path's copy
            self.mapped_copies += 1
        if self.landed_on_completion[p]:
            op.done_due = True  # posted by progress() once the write completed (it landed then)
        else:
            ch.fence()
            self._record(p, DONE, op.tag, op.k, op.nbytes, op=op)
        self.writing.append(op)

    def _remote(self, p: int, desc: bytes) -> Any:
        remote = self.remotes.get((p, desc))
        if remote is None:
            if len(self.remotes) >= REMOTES_KEPT:
                self.remotes.clear()
            remote = self.remotes[(p, desc)] = self.ch[p].remote_region(desc)
        return remote

    def _finish_send(self, op: Op) -> None:
        if op.req.failed:
            why = f"the write into rank {op.peer}'s tensor failed: {op.req.error}"
            if self.landed_on_completion[op.peer]:  # no DONE went: the receiver learns it from us
                text = np.frombuffer(why.encode(), dtype=np.uint8)  # held here while the record is posted
                self._record(op.peer, ERR, op.tag, op.k, 0, ERR_ON_RECV, *_payload(text))
            self._fail(op, why)
        else:
            self._part_done(op)

    def _take(self, op: Op, data: Any, offset: int) -> None:
        """Reads the second half of the split send `op` receives out of the sender's tensor
        (through the sender's share, when it sent one, but the last bytes outside its whole pages)."""
        p = op.peer
        desc, ticket = data if isinstance(data, tuple) else (data, None)
        op.split, op.parts = _split_at(op.nbytes), op.parts + 1
        mapped = self._mapped(p, ticket, offset, op.split, op.nbytes, head=False) if ticket else None
        at = mapped[1] if mapped else op.split  # UCX reads [at, nbytes)
        try:  # the descriptor and offset are the peer's: the core checks them against its exports
            op.src = (self._remote(p, desc), offset)
            op.req = self.ch[p].read(op.reg, op.src[0], op.ptr - op.reg.ptr + at, offset + at, op.nbytes - at)
        except Error as e:
            self._refuse(p, f"a split send this device cannot read from ({e})")
            return
        if mapped:
            _core.copy(op.ptr + mapped[0], mapped[2], mapped[1] - mapped[0])
            self.mapped_copies += 1
        self.reading.append(op)

    def _mapped(self, p: int, ticket: tuple, offset: int, i: int, j: int, head: bool) -> tuple[int, int, int] | None:
        """The part [a, b) of bytes [i, j) of a message that peer p's share (its `ticket`) holds,
        p's tensor at `offset` of its registration, and where byte a lies in that share mapped
        here; the rest, [i, a) (head: ours to write) or [b, j) (else: ours to read), at least EDGE
        bytes, goes through UCX. None when the share does not hold the rest or cannot be mapped."""
        pid, fd, ino, length, at = ticket
        lo, hi = at - offset, at - offset + length  # the share, in message bytes
        if head:
            a, b = max(i + EDGE, lo), j
        else:
            a, b = i, min(j - EDGE, hi)
        if a < lo or b > hi or b - a < EDGE:
            return None
        try:
            base = self.peer_shares.address(pid, fd, ino, length)
        except sharing.SharingError:
            return None  # (e.g. another pid namespace): UCX moves it all
        return a, b, base + a - lo

    def _pull(self, op: Op, offset: int) -> None:
        """Reads the whole message `op` receives out of the sender's outbox (no DONE comes)."""
        p = op.peer
        op.head = True  # its read covers it all: TAKEN once it completed
        try:
            op.req = self.ch[p].read(op.reg, self.remote[p], op.ptr - op.reg.ptr, offset, op.nbytes)
        except Error as e:
            self._refuse(p, f"a message to pull that this device cannot read ({e})")
            return
        self.reading.append(op)

    def _first_send_of(self, alloc: tuple) -> bool:
        """Whether the allocation (address, nbytes, keepalive) was not sent from lately. Over a
        socket (a peer whose writes complete on its reply) a tensor sent once (a pipeline stage's
        activations) is copied out for the receiver to pull, which costs less than registering
        it; one sent again (a buffer a loop reuses) is registered and written from in place from
        then on (1 MiB send/recv over tcp 1.21x gloo in bench/results/torch_dist_tcp.txt, 0.98x
        when every send was pulled). Over shared memory the pull stays: the receiver's read of
        the copy runs beside the sender, which was faster there in an alternating probe."""
        key = (int(alloc[0]), int(alloc[1]))
        if self.pulled_allocs.pop(key, None) is not None:
            return False
        self.pulled_allocs[key] = True
        if len(self.pulled_allocs) > PULLED_KEPT:
            self.pulled_allocs.popitem(last=False)
        return True

    def _outbox_take(self, nbytes: int) -> int | None:
        """An offset in our outbox for `nbytes` (first fit, 64-byte aligned), or None when full."""
        size = (nbytes + 63) // 64 * 64
        for i, (off, free) in enumerate(self.outbox_free):
            if free >= size:
                if free == size:
                    del self.outbox_free[i]
                else:
                    self.outbox_free[i] = (off + size, free - size)
                return off
        return None

    def _outbox_release(self, key: tuple[int, int, int]) -> bool:
        """Returns the outbox space of the pulled send `key` (its TAKEN or ERR came). False if none."""
        held = self.outbox_held.pop(key, None)
        if held is None:
            return False
        off, size = held[0], (held[1] + 63) // 64 * 64
        free = sorted(self.outbox_free + [(off, size)])
        merged: list[tuple[int, int]] = []
        for o, n in free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self.outbox_free = merged
        return True

    def _finish_read(self, op: Op) -> None:
        """A split receive's read completed: its second half, or (claimed) its first."""
        if op.req.failed:
            why = f"reading out of rank {op.peer}'s tensor failed: {op.req.error}"
            text = np.frombuffer(why.encode(), dtype=np.uint8)  # held here while the record is posted
            self._record(op.peer, ERR, op.tag, op.k, 0, 0, *_payload(text))
            self._fail(op, why)
        elif op.head:  # we copied it all: the sender may change its tensor again
            self._taken(op)
        else:
            op.tail_done = True
            if op.landed or op.claim is None or self._claim_word(op) != op.claim[1] * 4:
                self._taken(op)  # the sender wrote the first half, or claimed it: DONE comes (or came)
            else:
                self.claimable.append(op)  # the first half is open: claimed by us if the sender stays away
        if op.done:
            self.recvs.pop((op.peer, op.tag, op.k), None)

    def _taken(self, op: Op) -> None:
        """Tells the sender we are done reading its tensor; the part we read counts done once the
        record went (a receive that completed with its TAKEN still queued for credit would leave
        its sender waiting for good: nothing but this rank's next wait posts it)."""
        if self._record(op.peer, TAKEN, op.tag, op.k, op.nbytes, op=op):
            self._part_done(op)

    def _claim_word(self, op: Op) -> int:
        return int(self.words[(self.lay.claims >> 3) + op.peer * CLAIMS + op.claim[0]])

    def _claim_idle(self) -> float | None:
        """Claims the open first halves of split receives whose sender was silent for CLAIM_AFTER_S
        (busy computing, not in a wait that would write them): we read them ourselves. Returns how
        long until the next one is due, or None."""
        now = time.monotonic()
        due: float | None = None
        still = []
        for op in self.claimable:
            if op.done or op.landed:
                continue
            quiet = now - self.last_heard[op.peer]
            if quiet < CLAIM_AFTER_S:
                still.append(op)
                due = min(due or CLAIM_AFTER_S, CLAIM_AFTER_S - quiet)
                continue
            c, mid = op.claim
            if _core._compare_swap(self.arena, self.lay.claims + (op.peer * CLAIMS + c) * 8, mid * 4,
                                   mid * 4 + 2) != mid * 4:
                self._taken(op)  # the sender claimed it meanwhile: its DONE follows
                continue
            op.head, op.parts = True, op.parts - 1  # no DONE will come: we read the first half
            try:
                op.req = self.ch[op.peer].read(op.reg, op.src[0], op.ptr - op.reg.ptr, op.src[1], op.split)
            except Error as e:
                self._fail(op, f"reading the first half out of rank {op.peer}'s tensor failed: {e}")
                self.recvs.pop((op.peer, op.tag, op.k), None)
                continue
            self.reading.append(op)
        self.claimable = still
        return due

    def _part_done(self, op: Op) -> None:
        op.parts -= 1
        if op.parts <= 0:
            self._complete(op)

    def _export(self, peer: int, reg: Any) -> np.ndarray:
        key = (peer, id(reg))
        d = self.exported.get(key)
        if d is None:
            d = self.exported[key] = np.frombuffer(self.ch[peer].export_region(reg, self.timeout), dtype=np.uint8)
            self.registry.on_drop(reg, lambda: self.exported.pop(key, None))
        return d

    # ---- completion --------------------------------------------------------

    def _complete(self, op: Op) -> None:
        op.done = True
        if op.share is not None:  # (before op.keep goes: a share is released while its memory lives)
            key = id(op.share)
            left = self.share_users[key] = self.share_users[key] - 1
            if not left:
                del self.share_users[key]
                due = self.release_due.pop(key, None)
                if due is not None:
                    due.release()
            op.share = None
        op.reg = op.keep = op.src = None
        if op.claim is not None:  # its word stays: a late swap finds another message's id there
            self.claims_free[op.peer].append(op.claim[0])
            op.claim = None

    def _fail(self, op: Op, why: str) -> None:
        op.error = MessageError(f"rank {self.rank}: {op.what()} failed: {why}")
        if op.kind == "send":
            self.taking.pop((op.peer, op.tag, op.k), None)
        self._complete(op)

    def _check_peer(self, peer: int) -> None:
        if self.closed:
            raise MessageError(f"rank {self.rank}: the messenger is closed")
        if not 0 <= peer < self.n or peer == self.rank:
            raise InvalidArgument(f"peer must be another rank in 0..{self.n - 1}, got {peer}")
        if peer in self.failed:
            raise self.failed[peer]


def _split_at(nbytes: int) -> int:
    """Where a split message's halves meet (both sides compute it from the size)."""
    return nbytes // 2 & ~63


def _with_ticket(share: sharing.Share, base: int, desc: np.ndarray) -> np.ndarray:
    """A record payload: the share's ticket (where it starts relative to the registration at
    `base`), then the registration's descriptor."""
    ticket = np.array(share.ticket(base), dtype=np.int64)
    return np.concatenate([ticket.view(np.uint8), desc])


def _payload(arr: np.ndarray) -> tuple[int, int]:
    """(address, length) of a record payload; the caller holds `arr` until the record is posted."""
    return (arr.ctypes.data if arr.size else 0), arr.size
