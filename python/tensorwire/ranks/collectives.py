"""The collectives engine: alltoall (pairwise exchange), allreduce (ring,
recursive doubling, recursive halving), broadcast and a dissemination barrier on
one-sided writes between the ranks of a tensorwire World. The World's
``allreduce``/``alltoall``/``broadcast``/``barrier`` (world.py) and
``tensorwire bench alltoall|allreduce`` both run on it (docs/collectives.md).

Memory. Every rank allocates one registered *arena* (published as
``<name>.arena``) and one *flag block* (``<name>.flags``) whose layouts depend
only on (world size, largest alltoall block, allreduce vector, broadcast), so
every rank knows every other rank's offsets::

    flags     N senders x M slots of 8 B: slot k % M of sender s holds
              sig << 40 | k once s's message k to us has landed (M:
              Layout.slots, >= 64; sig: the call's signature, below)
    flagsrc   N x FLAG_SLOTS words: the local sources of our flag writes
    a2a.send  N blocks of A bytes (A = align64(largest block per peer))
    a2a.recv  2 parities x N blocks of A bytes: rank s writes into block s
    ar.src    V bytes (V = align64(largest vector))
    ar.acc    V bytes (local scratch)
    ar.dst    2 parities x V bytes (the result; peers write into it too)
    ar.land   2 parities x the largest of the algorithms' landing slots:
              rd (log2 p + 1) x R (R: largest vector rd may take), ring
              (N-1) x chunk, rh halves V/2 + V/4 + ...
    bc.recv   2 parities x B bytes (B: largest broadcast); the root writes
              from its own and into everybody else's

Messages. A message from rank s to rank r is: the payload (a one-sided write
into r's arena, if any), ``fence()``, then an 8-byte write of the message's
number k into r's flag slot (s, k % M) (docs/contracts.md section 1: data,
fence, flag, all on one channel). Both sides follow the same schedule, so r
knows which k it waits for. The flag also carries a 24-bit signature of the
call (operation, size, dtype, algorithm, root): ranks that disagree about the
call (the caller's contract) fail with InvalidArgument instead of mixing
buffers. Numbers only grow, so nothing is ever reset; every message has its
own slot, so flags need no order among themselves and flag-only messages (the
barrier) need no fence. A sender is at most about two
calls ahead of any receiver, far less than M messages. Nothing but one-sided
writes crosses the wire in a timed loop.

Reuse. Call i uses parity i % 2 of every buffer a peer writes into. A rank
writes into a peer's parity-p buffers in call i+2 only after finishing call
i+1, which needs a contribution of every rank to call i+1 (alltoall and
broadcast: a message from every rank; the allreduces: the reduced vector
contains every rank's input), so the peer has left call i, whose results it
was reading. Within a call every
step lands in its own slot. Local sources are not touched again before their
writes completed locally (all requests are waited for at the end of a call).

Progress and the control plane. With inline progress a rank's worker moves
only while that rank waits (tcp and short shm puts need the target to
progress). ``fence()`` may block until earlier writes are complete at their
targets and holds the GIL meanwhile; a rank busy in a control-plane call
(``world.barrier``/``allgather``, answered by rank 0's Python handlers under
rank 0's GIL) does not progress its data worker. So control-plane calls must
sit between two engine barriers (``barrier()`` sends flags only, never
fences): then nobody fences while somebody is on the control plane. The
World keeps this rule for its users (world.py: _coll_data, _coll_control).
"""

from __future__ import annotations

import os
import time
import zlib
from typing import Any, Callable

import numpy as np

from .. import _core
from ..errors import Error, InvalidArgument, Timeout

FLAG_SLOTS = 32           # source words per peer for flag writes, reused round-robin
ALIGN = 64
SEQ_BITS = 40             # a flag is sig << SEQ_BITS | message number
SEQ_MASK = (1 << SEQ_BITS) - 1
MISMATCH_CHECK_S = 0.2    # how often a long wait looks for a flag of another call
BESIDE_SLICE_S = 0.05     # a wait that drives the engine beside (World.beside) re-reads its words this often
# allreduce auto: recursive doubling below this many bytes, then rh (4, 8, ... ranks) or the
# ring. Measured with `tensorwire bench allreduce --algorithm ring|rd` on 2, 3 and 4 ranks
# (bench/results/collectives_threshold.txt, docs/collectives.md).
RD_RING_THRESHOLD = 512 << 10
# allreduce ops: numpy's ufuncs work on views of registered memory, in place
OPS: dict[str, Callable] = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def rd_geometry(n: int) -> tuple[int, int, int]:
    """(p, rem, steps): largest power of two <= n, the extra ranks, log2 p."""
    p = 1 << (n.bit_length() - 1)
    return p, n - p, p.bit_length() - 1


def ring_chunks(count: int, n: int) -> list[tuple[int, int]]:
    """(first element, element count) of each of n ring chunks (trailing ones may be empty)."""
    q = -(-count // n) if count else 0
    return [(min(c * q, count), max(0, min((c + 1) * q, count) - min(c * q, count))) for c in range(n)]


class CollectiveError(Error, RuntimeError):
    """A collective did not complete: a silent peer (named), or an earlier failure
    left the engine's message numbering unknown."""


class CollectiveTimeout(CollectiveError, Timeout):
    """A peer did not deliver a message of the call in time (also a tw.Timeout, as the
    control plane's barrier raises)."""


def signature(*parts: Any) -> int:
    """24 bits naming a call: every rank computes the same for the same call."""
    return zlib.crc32(" ".join(map(str, parts)).encode()) & 0xFFFFFF


class Layout:
    """Offsets of the data arena and the flag block (identical on every rank)."""

    def __init__(self, n: int, a2a_bytes: int, ar_bytes: int, bc_bytes: int = 0,
                 rd_bytes: int | None = None) -> None:
        self.n = n
        self.block = align(max(a2a_bytes, 1))
        self.vec = align(max(ar_bytes, 4))
        self.bc = align(max(bc_bytes, 1))
        # recursive doubling lands a whole vector per step: only up to rd_bytes (default all)
        self.rd_vec = align(max(min(ar_bytes if rd_bytes is None else rd_bytes, ar_bytes), 4))
        _p, _rem, steps = rd_geometry(n)
        self.chunk_stride = align(-(-max(ar_bytes, 4) // n) + ALIGN)
        self.rd_slots = steps + 1
        # rh's step k lands at most ceil(count / 2^(k+1)) elements: V/2^(k+1) plus an element
        self.rh_offsets = [0]
        for k in range(steps):
            self.rh_offsets.append(self.rh_offsets[-1] + align((self.vec >> (k + 1)) + 2 * ALIGN))
        self.land = max(self.rd_slots * self.rd_vec, (n - 1) * self.chunk_stride, self.rh_offsets[-1], ALIGN)
        # flag slots per sender: more than the messages a sender can be ahead
        # by (it is at most one call plus one barrier ahead: <= 2(N-1) + log2 N + 1)
        need = 2 * (2 * (n - 1) + steps + 2)
        self.slots = max(64, 1 << (need - 1).bit_length())
        self.flags = 0                                   # in the flag block
        self.flagsrc = align(n * self.slots * 8, 4096)   # in the flag block (local only)
        self.flag_total = self.flagsrc + n * FLAG_SLOTS * 8
        off = 0

        def take(nbytes: int) -> int:
            nonlocal off
            start = off
            off = align(off + nbytes, 4096)
            return start
        self.a2a_send = take(n * self.block) if a2a_bytes else 0
        self.a2a_recv = take(2 * n * self.block) if a2a_bytes else 0
        self.ar_src = take(self.vec) if ar_bytes else 0
        self.ar_acc = take(self.vec) if ar_bytes else 0
        self.ar_dst = take(2 * self.vec) if ar_bytes else 0
        self.ar_land = take(2 * self.land) if ar_bytes else 0
        self.bc_recv = take(2 * self.bc) if bc_bytes else 0
        self.total = max(off, 4096)


class OneSidedCollectives:
    """Alltoall / allreduce / broadcast / barrier over one-sided writes between the ranks of `world`.

    Args:
        world: a tensorwire.ranks.world.World.
        a2a_bytes: largest alltoall block per peer (0: no alltoall buffers).
        ar_bytes: largest allreduce vector in bytes (0: no allreduce buffers).
        bc_bytes: largest broadcast in bytes (0: no broadcast buffers).
        rd_bytes: largest vector recursive doubling may take (default ar_bytes; it
            lands a whole vector per step, so the World caps it at RD_RING_THRESHOLD).
        timeout: seconds any one wait may take before CollectiveError names the silent peer.
        order: "fence" or "flush" (how a payload is ordered before its flag); default:
            flush when a channel to a peer runs over tcp, else fence.
        name: prefix of the two published regions (engines of one device need their own).
    """

    def __init__(self, world: Any, a2a_bytes: int, ar_bytes: int, timeout: float = 30.0,
                 drive: bool = True, order: str | None = None, bc_bytes: int = 0,
                 rd_bytes: int | None = None, name: str = "coll") -> None:
        self.drive = drive  # progress the worker while waiting (needed with inline progress)
        self.world = world
        self.rank, self.n = world.rank, world.size
        self.timeout = timeout
        self.lay = Layout(self.n, a2a_bytes, ar_bytes, bc_bytes, rd_bytes)
        # Every wait is wait_any (the C++ waiter: spin for the device's spin_us driving the
        # worker where the peer's writes need it, yield the CPU while spinning, then nap).
        local = sum(1 for h in world.hosts if h == world.hosts[world.rank]) if world.hosts else world.size
        self.oversubscribed = local > (os.cpu_count() or 1)  # reported with the results
        dev = world.device
        self.arena = dev.alloc(self.lay.total, alignment=4096)
        self.flagblk = dev.alloc(self.lay.flag_total, alignment=4096)
        self.mem = np.frombuffer(self.arena, dtype=np.uint8)
        self.fmem = np.frombuffer(self.flagblk, dtype=np.uint64)
        self.fmem[:] = 0
        self.sent = [0] * self.n        # messages sent to each peer
        self.expect = [0] * self.n      # messages received from each peer
        self.reqs: list[Any] = []       # data writes of the current call
        self.flag_reqs: list[list[Any]] = [[None] * FLAG_SLOTS for _ in range(self.n)]
        self.a2a_calls = self.ar_calls = self.bc_calls = self.barriers = 0
        self.sig, self.what = 0, ""     # signature and name of the call in progress
        self.broken: str | None = None  # why an earlier call failed (the numbering is lost)
        self.names = (f"{name}.arena", f"{name}.flags")
        dev.publish(self.names[0], self.arena)
        dev.publish(self.names[1], self.flagblk)
        world.allgather(None)  # a control-plane barrier: every rank has published
        self.ch: list[Any] = [None] * self.n
        self.remote: list[Any] = [None] * self.n
        self.rflags: list[Any] = [None] * self.n
        for peer in range(self.n):
            if peer != self.rank:
                self.ch[peer] = world.channel(peer)
                self.remote[peer] = self.ch[peer].lookup(self.names[0], timeout)
                self.rflags[peer] = self.ch[peer].lookup(self.names[1], timeout)
        # How a payload is ordered before its flag. fence() is a blocking flush inside UCX on
        # transports without a native fence (tcp): it spins without yielding and holds the
        # GIL, which on an oversubscribed host costs whole time slices (measured ~16 ms per
        # alltoall on 4 ranks / 2 cores). There we flush the channel instead and wait for
        # it in our own yielding loop (a flush is the stronger guarantee: data visible).
        if order is None:
            tcp = any(_core.transport_family(t.split("/")[0]) == "tcp" for c in self.ch if c is not None
                      for t in c.transports())
            order = "flush" if tcp else "fence"
        self.order = os.environ.get("TENSORWIRE_COLL_ORDER") or order
        if self.order not in ("fence", "flush"):
            raise InvalidArgument(f"order must be 'fence' or 'flush', got {self.order!r}")
        world.allgather(None)

    def close(self) -> None:
        """Waits for this rank's writes to complete locally and unpublishes the buffers
        (call after an engine barrier: no peer writes into them any more)."""
        for r in self.reqs + [r for per in self.flag_reqs for r in per if r is not None]:
            if not r.done():
                try:
                    self._wait([r], lambda: "a write did not complete")
                except Error:
                    pass  # the peer is gone; its memory no longer matters
        self.reqs.clear()
        self.flag_reqs = [[None] * FLAG_SLOTS for _ in range(self.n)]
        for name in self.names:
            try:
                self.world.device.unpublish(name)
            except Error:
                pass

    # ---- views ------------------------------------------------------------

    def a2a_send_view(self, nbytes: int) -> np.ndarray:
        """(N, nbytes) uint8: row p is the block for rank p."""
        b, o = self.lay.block, self.lay.a2a_send
        return np.lib.stride_tricks.as_strided(self.mem[o:], shape=(self.n, nbytes), strides=(b, 1))

    def a2a_recv_view(self, nbytes: int, parity: int) -> np.ndarray:
        """(N, nbytes) uint8: row s is the block rank s sent us in a call of this parity."""
        b = self.lay.block
        o = self.lay.a2a_recv + parity * self.n * b
        return np.lib.stride_tricks.as_strided(self.mem[o:], shape=(self.n, nbytes), strides=(b, 1))

    def ar_view(self, which: str, count: int, dtype: Any, parity: int = 0) -> np.ndarray:
        dt = np.dtype(dtype)
        off = {"src": self.lay.ar_src, "acc": self.lay.ar_acc,
               "dst": self.lay.ar_dst + parity * self.lay.vec}[which]
        return self.mem[off: off + count * dt.itemsize].view(dt)

    def bc_view(self, nbytes: int) -> np.ndarray:
        """uint8 view the next broadcast's root stages its bytes in (its own receive buffer)."""
        o = self.lay.bc_recv + (self.bc_calls & 1) * self.lay.bc
        return self.mem[o: o + nbytes]

    # ---- messages -----------------------------------------------------------

    def _send(self, peer: int, local_off: int = 0, remote_off: int = 0, nbytes: int = 0) -> None:
        """Message to `peer`: payload (arena[local_off:+nbytes] -> peer's arena[remote_off:]),
        fence, then the message's number into the peer's flag slot for us."""
        if nbytes:
            self._put(peer, local_off, remote_off, nbytes)
            # Only a payload needs ordering: every message has its own flag slot.
            self._order([peer])
        self._flag(peer)

    def _order(self, peers: list[int]) -> None:
        """Payloads posted so far to `peers` land before anything posted later."""
        if self.order == "fence":
            self.ch[peers[0]].fence()   # worker-wide: orders the writes to every peer
            return
        reqs = [self.ch[p].flush() for p in peers]
        pending = [r for r in reqs if not r.done()]
        while pending:
            pending.pop(self._wait(pending, lambda: f"a flush towards ranks {peers} did not complete within "
                                                    f"{self.timeout:g} s"))
        for r in reqs:
            if r.failed:
                r.wait(0)  # raises its error

    def _put(self, peer: int, local_off: int, remote_off: int, nbytes: int) -> None:
        if nbytes:
            self.reqs.append(self.ch[peer].write(self.arena, self.remote[peer], local_off, remote_off, nbytes))

    def _flag(self, peer: int) -> None:
        ch = self.ch[peer]
        seq = self.sent[peer] = self.sent[peer] + 1
        slot = seq % FLAG_SLOTS
        prev = self.flag_reqs[peer][slot]
        if prev is not None and not prev.done():
            prev.wait(self.timeout)
        src = (self.lay.flagsrc >> 3) + peer * FLAG_SLOTS + slot
        self.fmem[src] = self.sig << SEQ_BITS | seq
        dst = (self.rank * self.lay.slots + seq % self.lay.slots) * 8
        self.flag_reqs[peer][slot] = ch.write(self.flagblk, self.rflags[peer], src * 8, dst, 8)

    def _recv(self, peer: int) -> None:
        """Waits until the next message from `peer` has landed (its flag slot holds this call's
        signature and its number): wait_any on the flag word, driving the worker (the target
        of a tcp put must progress) and failing at once when `peer`'s channel fails. A flag
        with the right number and another signature: `peer` is in another call."""
        want = self.expect[peer] = self.expect[peer] + 1
        value = self.sig << SEQ_BITS | want
        idx = peer * self.lay.slots + want % self.lay.slots
        f = self.fmem
        if f[idx] == value:
            return
        word = _core.Word(self.flagblk, idx * 8, value, self.ch[peer] if self.drive else None)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._wait_any([word], max(0.0, min(MISMATCH_CHECK_S, deadline - time.monotonic())))
                return
            except Timeout:
                got = int(f[idx])
                if got & SEQ_MASK == want:
                    raise InvalidArgument(
                        f"rank {self.rank}: rank {peer} is in another collective call (signature "
                        f"{got >> SEQ_BITS:06x}, ours {self.sig:06x}: {self.what}); every rank must make the "
                        f"same calls with the same sizes, dtypes, ops and roots, in the same order") from None
                if time.monotonic() >= deadline:
                    raise CollectiveTimeout(
                        f"rank {self.rank}: rank {peer} did not deliver its message {want} ({self.what}) within "
                        f"{self.timeout:g} s (its slot holds {got & SEQ_MASK}"
                        f"{'; it is more than a call ahead' if got & SEQ_MASK > want else ''})") from None

    def _wait(self, items: list, why: Any) -> int:
        """wait_any(items) within the timeout; CollectiveError with why() after it."""
        try:
            return self._wait_any(items, self.timeout)
        except Timeout:
            raise CollectiveTimeout(f"rank {self.rank}: {why()}") from None

    def _wait_any(self, items: list, timeout: float) -> int:
        """wait_any(items), which raises Timeout after `timeout` s. While the World's engine
        beside (World.beside) has work that waits for our progress, its words are watched too,
        in slices (some of them, credits, an equality wait can miss), and it is driven at every
        wake-up."""
        beside = self.world.beside
        deadline = time.monotonic() + timeout
        while beside is not None and beside.busy():
            left = deadline - time.monotonic()
            try:
                i = _core.wait_any(items + beside.wait_items(), timeout=max(0.0, min(BESIDE_SLICE_S, left)))
            except Timeout:
                i = len(items)
                if left <= BESIDE_SLICE_S:
                    raise
            beside.progress()
            if i < len(items):  # wait_any names the first ready item: ours come first
                return i
        return _core.wait_any(items, timeout=max(0.0, deadline - time.monotonic()))

    def _complete(self) -> None:
        """Local completion of the call's data writes (their sources may be reused)."""
        for r in self.reqs:
            if not r.done():
                r.wait(self.timeout)
        self.reqs.clear()

    def _call(self, what: str, fn: Callable, *args: Any) -> Any:
        """Runs one collective under its signature; a failure breaks the engine for good
        (the peers' message numbers are unknown from then on)."""
        if self.broken:
            raise CollectiveError(f"rank {self.rank}: an earlier collective failed ({self.broken}); the "
                                  f"collectives of this World cannot be used any more")
        self.what, self.sig = what, signature(what)
        try:
            return fn(*args)
        except BaseException as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise

    # ---- barrier ------------------------------------------------------------

    def barrier(self, timeout: float | None = None) -> None:
        """Dissemination barrier: round k signals rank r+2^k and waits for r-2^k (flags only)."""
        self.barriers += 1
        saved, self.timeout = self.timeout, self.timeout if timeout is None else timeout
        try:
            self._call("barrier", self._barrier)
        finally:
            self.timeout = saved

    def _barrier(self) -> None:
        k = 1
        while k < self.n:
            self._send((self.rank + k) % self.n)
            self._recv((self.rank - k) % self.n)
            k <<= 1

    # ---- alltoall and broadcast ------------------------------------------------

    def alltoall(self, nbytes: int) -> np.ndarray:
        """Pairwise exchange of `nbytes` per peer: block p of a2a_send_view goes to rank p.
        Returns the (N, nbytes) view of the blocks received (valid until the call after next)."""
        if nbytes > self.lay.block:
            raise ValueError(f"alltoall block {nbytes} B exceeds the {self.lay.block} B the buffers were sized for")
        parity = self.a2a_calls & 1
        self.a2a_calls += 1
        b = self.lay.block
        recv = self.lay.a2a_recv + parity * self.n * b
        self._call(f"alltoall {nbytes} B per rank", self._exchange,
                   [(self.lay.a2a_send + p * b, recv + self.rank * b, nbytes) for p in range(self.n)])
        return self.a2a_recv_view(nbytes, parity)

    def broadcast(self, nbytes: int, root: int) -> np.ndarray:
        """The `nbytes` the root staged in bc_view() on every rank; returns the uint8 view
        (valid until the call after next). An alltoall in which only the root's messages
        carry bytes: every rank still sends every other rank a (flag-only) message, so a
        call ends only once every rank has entered it and the alltoall's parity argument
        for reusing the receive buffers holds unchanged; the root writes from its own
        receive buffer, which nobody else writes into in this call."""
        if nbytes > self.lay.bc:
            raise ValueError(f"broadcast of {nbytes} B exceeds the {self.lay.bc} B the buffers were sized for")
        own = self.lay.bc_recv + (self.bc_calls & 1) * self.lay.bc
        self.bc_calls += 1
        plan = [(own, own, nbytes if self.rank == root else 0)] * self.n
        self._call(f"broadcast {nbytes} B from rank {root}", self._exchange, plan)
        return self.mem[own: own + nbytes]

    def _exchange(self, plan: list[tuple[int, int, int]]) -> None:
        """plan[p] = (local offset, offset at rank p, bytes) of the message to each rank p:
        every payload first (to r+1, r+2, ...), one fence, then every flag, then wait for
        ranks r-1, r-2, ... (pairwise exchange: all payloads in flight at once)."""
        n, r = self.n, self.rank
        peers = [(r + k) % n for k in range(1, n)]
        for peer in peers:
            self._put(peer, *plan[peer])
        if any(plan[p][2] for p in peers):
            self._order(peers)          # every payload lands before any flag
        for peer in peers:
            self._flag(peer)
        src, dst, nb = plan[r]
        if nb and src != dst:
            self.mem[dst: dst + nb] = self.mem[src: src + nb]
        for k in range(1, n):
            self._recv((r - k) % n)
        self._complete()

    # ---- allreduce ----------------------------------------------------------

    def allreduce(self, count: int, dtype: Any, algorithm: str, op: str = "sum") -> np.ndarray:
        """`op` over every rank's ar_view('src') (count elements of dtype), on every rank.
        Returns the view of the result (valid until the call after next)."""
        dt = np.dtype(dtype)
        nb = count * dt.itemsize
        if nb > self.lay.vec:
            raise ValueError(f"allreduce of {nb} B exceeds the {self.lay.vec} B the buffers were sized for")
        if algorithm == "rh" and not is_pow2(self.n):
            raise ValueError(f"rh (recursive halving) needs a power-of-two rank count, not {self.n}")
        if algorithm == "rd" and nb > self.lay.rd_vec:
            raise ValueError(f"rd of {nb} B exceeds the {self.lay.rd_vec} B its landing slots were sized for")
        run = {"ring": self._ring, "rd": self._recursive_doubling, "rh": self._recursive_halving}.get(algorithm)
        if run is None:
            raise ValueError(f"unknown allreduce algorithm {algorithm!r}")
        parity = self.ar_calls & 1
        self.ar_calls += 1
        if self.n == 1:
            out = self.ar_view("dst", count, dt, parity)
            out[:] = self.ar_view("src", count, dt)
            return out
        with np.errstate(over="ignore", invalid="ignore"):  # IEEE results, as torch's own ops give, no warning
            self._call(f"allreduce {op} {count} x {dt.str} {algorithm}", run, count, dt, parity, OPS[op])
        self._complete()
        return self.ar_view("dst", count, dt, parity)

    def _ring(self, count: int, dt: np.dtype, parity: int, ufunc: Callable) -> None:
        n, r, lay, it = self.n, self.rank, self.lay, dt.itemsize
        right, left = (r + 1) % n, (r - 1) % n
        chunks = ring_chunks(count, n)
        src = self.ar_view("src", count, dt)
        acc = self.ar_view("acc", count, dt)
        dst = self.ar_view("dst", count, dt, parity)
        land_base = lay.ar_land + parity * lay.land
        dst_base = lay.ar_dst + parity * lay.vec
        # reduce-scatter: step s sends chunk r-s, receives chunk r-s-1 and adds its own part
        for s in range(n - 1):
            c = (r - s) % n
            first, cnt = chunks[c]
            base = lay.ar_src if s == 0 else lay.ar_acc
            self._send(right, base + first * it, land_base + s * lay.chunk_stride, cnt * it)
            self._recv(left)
            c = (r - s - 1) % n
            first, cnt = chunks[c]
            if cnt:
                o = land_base + s * lay.chunk_stride
                got = self.mem[o: o + cnt * it].view(dt)
                out = dst if s == n - 2 else acc
                ufunc(src[first: first + cnt], got, out=out[first: first + cnt])
        # allgather: step t forwards chunk r+1-t straight into the right neighbour's result
        for t in range(n - 1):
            c = (r + 1 - t) % n
            first, cnt = chunks[c]
            self._send(right, dst_base + first * it, dst_base + first * it, cnt * it)
            self._recv(left)

    def _recursive_doubling(self, count: int, dt: np.dtype, parity: int, ufunc: Callable) -> None:
        n, r, lay, it = self.n, self.rank, self.lay, dt.itemsize
        nb, rv = count * it, lay.rd_vec
        p, rem, steps = rd_geometry(n)
        land_base = lay.ar_land + parity * lay.land
        dst_off = lay.ar_dst + parity * lay.vec
        land = lambda k: self.mem[land_base + k * rv: land_base + k * rv + nb].view(dt)  # noqa: E731
        src = self.ar_view("src", count, dt)
        bufs = {lay.ar_acc: self.ar_view("acc", count, dt), dst_off: self.ar_view("dst", count, dt, parity)}
        # the buffer a step reduces into alternates so that the last step ends in dst
        out_of = lambda k: dst_off if (steps - 1 - k) % 2 == 0 else lay.ar_acc  # noqa: E731
        if r < 2 * rem and r % 2 == 0:
            # extra rank: hand the input to r+1, get the result back into dst
            self._send(r + 1, lay.ar_src, land_base + steps * rv, nb)
            self._recv(r + 1)
            return
        if r < 2 * rem:
            self._recv(r - 1)
            cur = lay.ar_acc if out_of(0) == dst_off else dst_off
            ufunc(src, land(steps), out=bufs[cur])
            newrank = r // 2
        else:
            cur = lay.ar_src
            newrank = r - rem
        for k in range(steps):
            pnew = newrank ^ (1 << k)
            partner = pnew * 2 + 1 if pnew < rem else pnew + rem
            self._send(partner, cur, land_base + k * rv, nb)
            self._recv(partner)
            out = out_of(k)
            # the previous write from `out` must be done before it is overwritten
            self._complete()
            a = src if cur == lay.ar_src else bufs[cur]
            ufunc(a, land(k), out=bufs[out])
            cur = out
        if r < 2 * rem:
            self._send(r - 1, dst_off, dst_off, nb)

    def _recursive_halving(self, count: int, dt: np.dtype, parity: int, ufunc: Callable) -> None:
        """Rabenseifner's allreduce for power-of-two N: reduce-scatter by recursive
        halving, then allgather by recursive doubling. 2 log2 N steps (4 on 4 ranks,
        against the ring's 6) moving the ring's bytes: fewer synchronisations, which
        is what counts when ranks share cores."""
        n, r, lay, it = self.n, self.rank, self.lay, dt.itemsize
        land_base = lay.ar_land + parity * lay.land
        dst_base = lay.ar_dst + parity * lay.vec
        src = self.ar_view("src", count, dt)
        dst = self.ar_view("dst", count, dt, parity)
        lo, hi = 0, count
        ranges = []  # (lo, hi, partner) of each halving step, replayed backwards by the allgather
        d, k = n >> 1, 0
        while d:
            partner = r ^ d
            mid = lo + (hi - lo) // 2
            keep, give = ((lo, mid), (mid, hi)) if r & d == 0 else ((mid, hi), (lo, mid))
            base = lay.ar_src if k == 0 else dst_base  # what we hold of `give` so far
            slot = land_base + lay.rh_offsets[k]
            self._send(partner, base + give[0] * it, slot, (give[1] - give[0]) * it)
            self._recv(partner)
            got = self.mem[slot: slot + (keep[1] - keep[0]) * it].view(dt)
            a = src if k == 0 else dst
            ufunc(a[keep[0]: keep[1]], got, out=dst[keep[0]: keep[1]])
            ranges.append((lo, hi, partner))
            lo, hi = keep
            d >>= 1
            k += 1
        self._complete()  # our halves have left before partners write results over them
        # allgather: hand what we own to the partner of each step, in reverse order
        for plo, phi, partner in reversed(ranges):
            self._send(partner, dst_base + lo * it, dst_base + lo * it, (hi - lo) * it)
            self._recv(partner)
            lo, hi = plo, phi


def choose_allreduce(nbytes: int, n: int, threshold: int = RD_RING_THRESHOLD) -> str:
    """auto: recursive doubling below `threshold` bytes (latency-bound); from there on
    recursive halving (Rabenseifner) on power-of-two rank counts, else the ring."""
    if nbytes < threshold:
        return "rd"
    return "rh" if is_pow2(n) and n > 2 else "ring"
