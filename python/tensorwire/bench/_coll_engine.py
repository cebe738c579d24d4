"""Collectives on one-sided writes: alltoall (pairwise exchange), allreduce
(ring, recursive doubling) and a dissemination barrier, between the ranks of a
tensorwire World.

Memory. Every rank allocates one registered *arena* (published as
``coll.arena``) and one *flag block* (``coll.flags``) whose layouts depend only
on (world size, largest alltoall block, largest allreduce vector), so every
rank knows every other rank's offsets::

    flags     N senders x M slots of 8 B: slot k % M of sender s holds k once
              s's message k to us has landed (M: Layout.slots, >= 64)
    flagsrc   N x FLAG_SLOTS words: the local sources of our flag writes
    a2a.send  N blocks of A bytes (A = align64(largest block per peer))
    a2a.recv  2 parities x N blocks of A bytes: rank s writes into block s
    ar.src    V bytes (V = align64(largest vector))
    ar.acc    V bytes (local scratch)
    ar.dst    2 parities x V bytes (the result; peers write into it too)
    ar.land   2 parities x max((log2 p + 1) x V, (N-1) x chunk) landing slots

Messages. A message from rank s to rank r is: the payload (a one-sided write
into r's arena, if any), ``fence()``, then an 8-byte write of the message's
number k into r's flag slot (s, k % M) (docs/contracts.md section 1: data,
fence, flag, all on one channel). Both sides follow the same schedule, so r
knows which k it waits for. Numbers only grow, so nothing is ever reset;
every message has its own slot, so flags need no order among themselves and
flag-only messages (the barrier) need no fence. A sender is at most about two
calls ahead of any receiver, far less than M messages. Nothing but one-sided
writes crosses the wire in a timed loop.

Reuse. Call i uses parity i % 2 of every buffer a peer writes into. A rank
writes into a peer's parity-p buffers in call i+2 only after finishing call
i+1, which needs a contribution of every rank to call i+1 (alltoall: directly;
ring and recursive doubling: the reduced vector contains every rank's input),
so the peer has left call i, whose results it was reading. Within a call every
step lands in its own slot. Local sources are not touched again before their
writes completed locally (all requests are waited for at the end of a call).

Progress and the control plane. With inline progress a rank's worker moves
only while that rank waits (tcp and short shm puts need the target to
progress). ``fence()`` may block until earlier writes are complete at their
targets and holds the GIL meanwhile; a rank busy in a control-plane call
(``world.barrier``/``allgather``, answered by rank 0's Python handlers under
rank 0's GIL) does not progress its data worker. So control-plane calls must
sit between two engine barriers (``barrier()`` sends flags only, never
fences): then nobody fences while somebody is on the control plane.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import tensorwire as tw

FLAG_SLOTS = 32           # source words per peer for flag writes, reused round-robin
ALIGN = 64
ARENA_NAME = "coll.arena"
FLAGS_NAME = "coll.flags"


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


class CollectiveError(RuntimeError):
    pass


class Layout:
    """Offsets of the data arena and the flag block (identical on every rank)."""

    def __init__(self, n: int, a2a_bytes: int, ar_bytes: int) -> None:
        self.n = n
        self.block = align(max(a2a_bytes, 1))
        self.vec = align(max(ar_bytes, 4))
        _p, _rem, steps = rd_geometry(n)
        self.chunk_stride = align(-(-max(ar_bytes, 4) // n) + ALIGN)
        self.rd_slots = steps + 1
        self.land = max(self.rd_slots * self.vec, (n - 1) * self.chunk_stride, ALIGN)
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
        self.total = max(off, 4096)


class OneSidedCollectives:
    """Alltoall / allreduce / barrier over one-sided writes between the ranks of `world`.

    Args:
        world: a tensorwire.world.World.
        a2a_bytes: largest alltoall block per peer (0: no alltoall buffers).
        ar_bytes: largest allreduce vector in bytes (0: no allreduce buffers).
        timeout: seconds any one wait may take before CollectiveError names the silent peer.
    """

    def __init__(self, world: Any, a2a_bytes: int, ar_bytes: int, timeout: float = 30.0,
                 drive: bool = True, order: str | None = None) -> None:
        self.drive = drive  # progress the worker while waiting (needed with inline progress)
        # How a payload is ordered before its flag. fence() is a blocking flush inside UCX on
        # transports without a native fence (tcp): it spins without yielding and holds the
        # GIL, which on an oversubscribed host costs whole time slices (measured ~16 ms per
        # alltoall on 4 ranks / 2 cores). There we flush the channel instead and wait for
        # it in our own yielding loop (a flush is the stronger guarantee: data visible).
        self.order = os.environ.get("TENSORWIRE_COLL_ORDER") or order or "fence"
        if self.order not in ("fence", "flush"):
            raise ValueError(f"order must be 'fence' or 'flush', got {order!r}")
        # Every wait is tw.wait_any (the C++ waiter: spin for the device's spin_us driving the
        # worker where the peer's writes need it, yield the CPU while spinning, then nap).
        local = sum(1 for h in world.hosts if h == world.hosts[world.rank]) if world.hosts else world.size
        self.oversubscribed = local > (os.cpu_count() or 1)  # reported with the results
        self.world = world
        self.rank, self.n = world.rank, world.size
        self.timeout = timeout
        self.lay = Layout(self.n, a2a_bytes, ar_bytes)
        dev = world.device
        self.arena = dev.alloc(self.lay.total, alignment=4096)
        self.flagblk = dev.alloc(self.lay.flag_total, alignment=4096)
        self.mem = np.frombuffer(self.arena, dtype=np.uint8)
        self.fmem = np.frombuffer(self.flagblk, dtype=np.uint64)
        self.fmem[:] = 0
        self.fptr = self.flagblk.ptr
        self.sent = [0] * self.n        # messages sent to each peer
        self.expect = [0] * self.n      # messages received from each peer
        self.reqs: list[Any] = []       # data writes of the current call
        self.flag_reqs: list[list[Any]] = [[None] * FLAG_SLOTS for _ in range(self.n)]
        self.a2a_calls = 0
        self.ar_calls = 0
        self.barriers = 0
        dev.publish(ARENA_NAME, self.arena)
        dev.publish(FLAGS_NAME, self.flagblk)
        world.barrier()
        self.ch: list[Any] = [None] * self.n
        self.remote: list[Any] = [None] * self.n
        self.rflags: list[Any] = [None] * self.n
        for peer in range(self.n):
            if peer != self.rank:
                self.ch[peer] = world.channel(peer)
                self.remote[peer] = self.ch[peer].lookup(ARENA_NAME, timeout)
                self.rflags[peer] = self.ch[peer].lookup(FLAGS_NAME, timeout)
        world.barrier()

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
        self.fmem[src] = seq
        dst = (self.rank * self.lay.slots + seq % self.lay.slots) * 8
        self.flag_reqs[peer][slot] = ch.write(self.flagblk, self.rflags[peer], src * 8, dst, 8)

    def _recv(self, peer: int) -> None:
        """Waits until the next message from `peer` has landed (its flag slot holds its number):
        tw.wait_any on the flag word, driving the worker (the target of a tcp put must
        progress) and failing at once when `peer`'s channel fails."""
        want = self.expect[peer] = self.expect[peer] + 1
        idx = peer * self.lay.slots + want % self.lay.slots
        f = self.fmem
        if f[idx] == want:
            return

        def why() -> str:
            got = int(f[idx])
            return (f"rank {peer} did not deliver its message {want} within {self.timeout:g} s "
                    f"(its slot holds {got}{'; it is more than a call ahead' if got > want else ''})")
        self._wait([tw.Word(self.flagblk, idx * 8, want, self.ch[peer] if self.drive else None)], why)

    def _wait(self, items: list, why: Any) -> int:
        """tw.wait_any(items) within the timeout; CollectiveError with why() after it."""
        try:
            return tw.wait_any(items, timeout=self.timeout)
        except tw.Timeout:
            raise CollectiveError(f"rank {self.rank}: {why()}") from None

    def _complete(self) -> None:
        """Local completion of the call's data writes (their sources may be reused)."""
        for r in self.reqs:
            if not r.done():
                r.wait(self.timeout)
        self.reqs.clear()

    # ---- barrier ------------------------------------------------------------

    def barrier(self) -> None:
        """Dissemination barrier: round k signals rank r+2^k and waits for r-2^k."""
        self.barriers += 1
        k = 1
        while k < self.n:
            self._send((self.rank + k) % self.n)
            self._recv((self.rank - k) % self.n)
            k <<= 1

    # ---- alltoall -----------------------------------------------------------

    def alltoall(self, nbytes: int) -> np.ndarray:
        """Pairwise exchange of `nbytes` per peer: block p of a2a_send_view goes to rank p.
        Returns the (N, nbytes) view of the blocks received (valid until the call after next)."""
        if nbytes > self.lay.block:
            raise ValueError(f"alltoall block {nbytes} B exceeds the {self.lay.block} B the buffers were sized for")
        parity = self.a2a_calls & 1
        self.a2a_calls += 1
        n, r, b = self.n, self.rank, self.lay.block
        recv_base = self.lay.a2a_recv + parity * n * b
        # pairwise order: every payload first (to r+1, r+2, ...), one fence, then every flag
        peers = [(r + k) % n for k in range(1, n)]
        for peer in peers:
            self._put(peer, self.lay.a2a_send + peer * b, recv_base + r * b, nbytes)
        if nbytes and peers:
            self._order(peers)          # every payload lands before any flag
        for peer in peers:
            self._flag(peer)
        own = self.lay.a2a_send + r * b
        self.mem[recv_base + r * b: recv_base + r * b + nbytes] = self.mem[own: own + nbytes]
        for k in range(1, n):
            self._recv((r - k) % n)
        self._complete()
        return self.a2a_recv_view(nbytes, parity)

    # ---- allreduce ----------------------------------------------------------

    def allreduce(self, count: int, dtype: Any, algorithm: str) -> np.ndarray:
        """Sum of every rank's ar_view('src') (count elements of dtype), on every rank.
        Returns the view of the result (valid until the call after next)."""
        dt = np.dtype(dtype)
        if count * dt.itemsize > self.lay.vec:
            raise ValueError(f"allreduce of {count * dt.itemsize} B exceeds the {self.lay.vec} B the buffers "
                             f"were sized for")
        parity = self.ar_calls & 1
        self.ar_calls += 1
        if self.n == 1:
            out = self.ar_view("dst", count, dt, parity)
            out[:] = self.ar_view("src", count, dt)
            return out
        if algorithm == "ring":
            self._ring(count, dt, parity)
        elif algorithm == "rd":
            self._recursive_doubling(count, dt, parity)
        elif algorithm == "rh":
            if not is_pow2(self.n):
                raise ValueError(f"rh (recursive halving) needs a power-of-two rank count, not {self.n}")
            self._recursive_halving(count, dt, parity)
        else:
            raise ValueError(f"unknown allreduce algorithm {algorithm!r}")
        self._complete()
        return self.ar_view("dst", count, dt, parity)

    def _ring(self, count: int, dt: np.dtype, parity: int) -> None:
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
                np.add(src[first: first + cnt], got, out=out[first: first + cnt])
        # allgather: step t forwards chunk r+1-t straight into the right neighbour's result
        for t in range(n - 1):
            c = (r + 1 - t) % n
            first, cnt = chunks[c]
            self._send(right, dst_base + first * it, dst_base + first * it, cnt * it)
            self._recv(left)

    def _recursive_doubling(self, count: int, dt: np.dtype, parity: int) -> None:
        n, r, lay, it = self.n, self.rank, self.lay, dt.itemsize
        nb = count * it
        p, rem, steps = rd_geometry(n)
        land_base = lay.ar_land + parity * lay.land
        dst_off = lay.ar_dst + parity * lay.vec
        land = lambda k: self.mem[land_base + k * lay.vec: land_base + k * lay.vec + nb].view(dt)  # noqa: E731
        src = self.ar_view("src", count, dt)
        bufs = {lay.ar_acc: self.ar_view("acc", count, dt), dst_off: self.ar_view("dst", count, dt, parity)}
        # the buffer a step reduces into alternates so that the last step ends in dst
        out_of = lambda k: dst_off if (steps - 1 - k) % 2 == 0 else lay.ar_acc  # noqa: E731
        if r < 2 * rem and r % 2 == 0:
            # extra rank: hand the input to r+1, get the result back into dst
            self._send(r + 1, lay.ar_src, land_base + steps * lay.vec, nb)
            self._recv(r + 1)
            return
        if r < 2 * rem:
            self._recv(r - 1)
            cur = lay.ar_acc if out_of(0) == dst_off else dst_off
            np.add(src, land(steps), out=bufs[cur])
            newrank = r // 2
        else:
            cur = lay.ar_src
            newrank = r - rem
        for k in range(steps):
            pnew = newrank ^ (1 << k)
            partner = pnew * 2 + 1 if pnew < rem else pnew + rem
            self._send(partner, cur, land_base + k * lay.vec, nb)
            self._recv(partner)
            out = out_of(k)
            # the previous write from `out` must be done before it is overwritten
            self._complete_writes_from(out)
            a = src if cur == lay.ar_src else bufs[cur]
            np.add(a, land(k), out=bufs[out])
            cur = out
        if r < 2 * rem:
            self._send(r - 1, dst_off, dst_off, nb)

    def _recursive_halving(self, count: int, dt: np.dtype, parity: int) -> None:
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
            self._send(partner, base + give[0] * it, land_base + k * lay.vec, (give[1] - give[0]) * it)
            self._recv(partner)
            got = self.mem[land_base + k * lay.vec: land_base + k * lay.vec + (keep[1] - keep[0]) * it].view(dt)
            a = src if k == 0 else dst
            np.add(a[keep[0]: keep[1]], got, out=dst[keep[0]: keep[1]])
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

    def _complete_writes_from(self, _off: int) -> None:
        # Requests do not record their source; completing all earlier writes is
        # cheap here (the partner already holds their data: we got its reply).
        self._complete()


def choose_allreduce(nbytes: int, n: int, threshold: int) -> str:
    """auto: recursive doubling below `threshold` bytes (latency-bound); from there on
    recursive halving (Rabenseifner) on power-of-two rank counts, else the ring."""
    if nbytes < threshold:
        return "rd"
    return "rh" if is_pow2(n) and n > 2 else "ring"

