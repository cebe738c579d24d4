"""One rank of `tensorwire bench terasort` (see terasort.py for the phases)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

import tensorwire as tw

from . import teragen
from ._terasort_core import partition_of, pick_splitters, sample_keys, sort_records, summarize, validate
from .common import BenchError, Progress, Report, check_lane_transports, print_table
from .teragen import KEY, RECORD

SLOT_DATA = "terasort/data/{src}"
SLOT_SAMPLE = "terasort/sample/{src}"
HEADER = np.dtype("<i8")
_DEBUG = bool(os.environ.get("TENSORWIRE_TERASORT_DEBUG"))


class _Threads:
    """Runs callables on threads; join() re-raises the first error (with its thread's name)."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: list[tuple[str, BaseException]] = []

    def start(self, name: str, fn: Callable[[], None]) -> None:
        def body() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to join()
                self.errors.append((name, e))

        t = threading.Thread(target=body, name=name, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise TimeoutError(f"{t.name} did not finish within {timeout:g} s")
        if self.errors:
            name, e = self.errors[0]
            raise type(e)(f"{name}: {e}") from e


class _Phase:
    """Per-rank duration, rows and bytes of each phase."""

    def __init__(self) -> None:
        self.stats: dict[str, dict[str, float]] = {}

    def record(self, name: str, seconds: float, rows: int, nbytes: int, **extra: Any) -> None:
        self.stats[name] = {"seconds": seconds, "rows": rows, "bytes": nbytes, **extra}


def _slot_exchange(
    rank: int,
    senders: dict,
    slots: dict,
    outgoing: dict[int, list],
    incoming: dict[int, int],
    chunk_rows: int,
    schedule: str,
    timeout: float,
    t0: float,
) -> dict[int, list]:
    """Every pair's pieces through the dynamic slots, driven by one thread: start
    the next send to a peer once its previous piece was acked (a slot holds one
    record at a time), take whatever piece has arrived (poll(): the receiver
    allocates a block and RDMA-reads the sender's memory), and wait (tw.wait_any)
    when nothing moved. One thread per rank rather than one per pair and direction:
    on few cores, many waiting threads each spinning on the worker starve the
    transport (see docs/terasort.md)."""
    received: dict[int, list] = {}
    for group in _schedule(schedule, rank, len(senders) + 1):
        todo = {dst: list(outgoing[dst]) for dst, _ in group if outgoing[dst]}  # an empty partition sends nothing
        inflight: dict[int, Any] = {}
        expect = {src: -(-incoming[src] // chunk_rows) for _, src in group}
        got: dict[int, list] = {src: [] for _, src in group}
        deadline = time.monotonic() + timeout
        while todo or inflight or any(len(got[src]) < n for src, n in expect.items()):
            moved = False
            for dst in list(inflight):
                req = inflight[dst]
                if req.test():  # test(), not done(): a slot send completes when polled (it reads the ack word)
                    req.wait(0)  # raises the send's error, if any
                    del inflight[dst]
                    moved = True
            for dst in list(todo):
                if dst not in inflight:
                    inflight[dst] = senders[dst].send(todo[dst].pop(0), timeout)
                    if not todo[dst]:
                        del todo[dst]
                    moved = True
            for src, n in expect.items():
                if len(got[src]) < n:
                    blk = slots[src].poll()
                    if blk is not None:
                        got[src].append(blk)
                        moved = True
                        if _DEBUG:
                            print(
                                f"rank {rank} <- {src}: {blk.nbytes} B (at {time.perf_counter() - t0:.4f})",
                                file=sys.stderr,
                                flush=True,
                            )
            if moved:
                deadline = time.monotonic() + timeout
            else:
                if time.monotonic() > deadline:
                    waiting = [f"sending to rank {d}" for d in list(todo) + list(inflight)] + [
                        f"receiving from rank {s}" for s, n in expect.items() if len(got[s]) < n
                    ]
                    raise TimeoutError(f"shuffle stalled for {timeout:g} s: {', '.join(waiting)}")
                # Until a piece arrives or a send is acked (the C++ wait: spin, then nap on the workers)
                try:
                    tw.wait_any(
                        [slots[s] for s, n in expect.items() if len(got[s]) < n] + list(inflight.values()),
                        timeout=max(0.0, deadline - time.monotonic()),
                    )
                except tw.Timeout:
                    pass  # the next round names what stalled
        for src in got:
            have = sum(b.shape[0] for b in got[src])
            if have != incoming[src]:
                raise BenchError(f"rank {src} was to send {incoming[src]} rows, {have} arrived")
            received[src] = got[src]
    return received


def _schedule(kind: str, rank: int, size: int) -> list[list[tuple[int, int]]]:
    """Groups of (destination, source) pairs run one group after the other:
    "all" = every pair at once; "pairwise" = step k sends to rank+k and receives
    from rank-k (one flow in and one out per rank at a time, MPI's pairwise alltoall)."""
    steps = [((rank + k) % size, (rank - k) % size) for k in range(1, size)]
    return [steps] if kind == "all" else [[s] for s in steps]


def _warm_pool(dev, pieces_rows: list[int]) -> None:
    blocks = [dev.empty((rows, RECORD), "uint8") for rows in pieces_rows if rows]
    for b in blocks:
        np.asarray(b).fill(0)
    for b in blocks:
        b.release()


def _host_of(address: str) -> str:
    return address.rpartition(":")[0]


def _maybe_die(args: argparse.Namespace, rank: int, phase: str, state: dict | None = None) -> None:
    if state is not None:
        state["phase"] = phase
    if args.kill_rank == rank and args.kill_phase == phase:
        print(
            f"terasort: rank {rank} kills itself at the start of {phase} (t={time.time():.3f})",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGKILL)


def run_rank(args: argparse.Namespace) -> int:
    from ...ranks.world import World

    world = World(transport=args.transport, timeout=args.timeout)
    state = {"phase": "setup"}
    try:
        return _job(world, args, state)
    except Exception as e:
        from ...errors import PeerFailed

        if isinstance(e, PeerFailed):
            # the peer that died is the run's cause: give the launcher a moment to see its
            # exit first, so that it names that rank rather than this one
            time.sleep(1.0)
        # name the peer by its rank where the error names it by address
        msg = str(e)
        for r, addr in enumerate(world.addresses):
            if r != world.rank and addr in msg:
                msg = msg.replace(addr, f"{addr} (rank {r})")
        raise type(e)(f"rank {world.rank} failed in phase {state['phase']}: {msg}") from e
    finally:
        world.close()


def _job(world, args: argparse.Namespace, state: dict) -> int:
    rank, size, dev = world.rank, world.size, world.device
    timeout = args.timeout
    chunk_rows = max(1, args.chunk // RECORD)
    ph = _Phase()
    # rank 0 draws the bar, one step per phase, the TCP baseline's rounds within the
    # shuffle's (the command's --progress, passed to the ranks as TENSORWIRE_PROGRESS_BAR)
    step = Progress(len(PHASES_RUN(args)) - (args.baseline == "tcp"), "terasort", None if rank == 0 else False).step

    # receiving ends first: every slot exists before anybody attaches (barrier below)
    data_slots = {
        src: dev.dynamic_slot(
            SLOT_DATA.format(src=src), max_ndim=2, max_nbytes=max(chunk_rows * RECORD, HEADER.itemsize * 2)
        )
        for src in range(size)
        if src != rank
    }
    sample_slots = (
        {
            src: dev.dynamic_slot(SLOT_SAMPLE.format(src=src), max_ndim=2, max_nbytes=max(KEY, args.samples * KEY))
            for src in range(size)
            if src != rank
        }
        if rank == 0
        else {}
    )
    teragen.warm_up()  # the generator's and the CRC's constant tables, computed once per process
    world.barrier()

    # -- teragen --
    _maybe_die(args, rank, "teragen", state)
    first, count = teragen.split_rows(args.rows, size, rank)
    t0 = time.perf_counter()
    gen_block = dev.empty((count, RECORD), "uint8") if count else None
    records = np.asarray(gen_block) if count else np.zeros((0, RECORD), np.uint8)
    teragen.generate(first, count, out=records)
    gen_sum = teragen.checksum(records)
    ph.record("teragen", time.perf_counter() - t0, count, count * RECORD)
    world.barrier()
    step("teragen")

    # -- sample + partition --
    _maybe_die(args, rank, "partition", state)
    t0 = time.perf_counter()
    share = -(-args.samples // size)
    mine = sample_keys(records, share)
    if rank == 0:
        got = [mine]
        for src, slot in sample_slots.items():
            hdr = np.frombuffer(slot.recv(timeout), dtype=HEADER)
            if hdr[0]:
                got.append(np.asarray(slot.recv(timeout)).reshape(-1, KEY).copy())
        samples = np.concatenate(got) if got else np.zeros((0, KEY), np.uint8)
        splitters = pick_splitters(samples, size)
        split_hex = [bytes(s).hex() for s in splitters]
        sampled = int(samples.shape[0])
    else:
        s = world.channel(0).dynamic_sender(SLOT_SAMPLE.format(src=rank), timeout=timeout)
        s.send(np.array([mine.shape[0]], dtype=HEADER), timeout).wait(timeout)
        if mine.shape[0]:
            s.send(np.ascontiguousarray(mine), timeout).wait(timeout)
        split_hex, sampled = None, 0
    split_hex = world.broadcast(split_hex, root=0)
    splitters = np.array([np.frombuffer(bytes.fromhex(h), np.uint8) for h in split_hex], dtype=np.uint8).reshape(
        -1, KEY
    )
    dest = partition_of(records, splitters)
    order = np.argsort(dest, kind="stable")
    counts = np.bincount(dest, minlength=size)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    # map output: each remote partition gathered into registered blocks (the pieces sent zero-copy)
    outgoing: dict[int, list] = {}
    for j in range(size):
        idx = order[bounds[j] : bounds[j + 1]]
        if j == rank:
            local = teragen.gather(records, idx)
            continue
        pieces = []
        for a in range(0, idx.size, chunk_rows):
            part = idx[a : a + chunk_rows]
            blk = dev.empty((part.size, RECORD), "uint8")
            teragen.gather(records, part, out=np.asarray(blk))
            pieces.append(blk)
        outgoing[j] = pieces
    del records, order, dest
    if gen_block is not None:
        gen_block.release()
    ph.record(
        "partition",
        time.perf_counter() - t0,
        count,
        count * RECORD,
        sampled=sampled,
        partition_rows=[int(c) for c in counts],
    )
    # every rank learns how much it will receive from whom (Hadoop's fetchers know the
    # map output sizes from the index files before they fetch)
    matrix = world.allgather([int(c) for c in counts])
    incoming = {src: int(matrix[src][rank]) for src in range(size) if src != rank}
    step("partition")

    # -- shuffle over tensorwire --
    _maybe_die(args, rank, "shuffle", state)
    t_setup = time.perf_counter()
    senders = {
        j: world.channel(j).dynamic_sender(SLOT_DATA.format(src=rank), timeout=timeout)
        for j in range(size)
        if j != rank
    }
    # registered receive memory is set up ahead, as an RDMA shuffle's buffer pool is:
    # lease, touch and return blocks of the sizes about to arrive, so the slots'
    # allocations find mapped, registered pages (docs/terasort.md)
    _warm_pool(dev, [min(chunk_rows, rows - a) for rows in incoming.values() for a in range(0, rows, chunk_rows)])
    setup_s = time.perf_counter() - t_setup
    received: dict[int, list] = {}
    sent_bytes = sum(b.nbytes for pieces in outgoing.values() for b in pieces)

    # The TCP baseline's connections and buffers are set up before the first
    # round, and its rounds alternate with the slots' (slots, sockets, slots,
    # ...): on a machine whose speed drifts, both see the same phases.
    tcp = _TcpShuffle(world, outgoing, incoming, timeout, args.schedule) if args.baseline == "tcp" else None
    rounds, tcp_rounds = [], []
    for rnd in range(args.repeat):
        if rnd:  # a repeat: the previous round's blocks go back to the pool first
            for pieces in received.values():
                for b in pieces:
                    b.release()
            received.clear()
        world.barrier()
        t0 = time.perf_counter()
        received = _slot_exchange(rank, senders, data_slots, outgoing, incoming, chunk_rows, args.schedule, timeout, t0)
        rounds.append(time.perf_counter() - t0)
        if tcp is not None:
            state["phase"] = "shuffle over tcp sockets"
            tcp_rounds.append(tcp.round())
            state["phase"] = "shuffle"
    recv_bytes = sum(b.nbytes for pieces in received.values() for b in pieces)
    ph.record(
        "shuffle",
        float(np.median(rounds)),
        sent_bytes // RECORD,
        sent_bytes,
        received_bytes=recv_bytes,
        setup_s=setup_s,
        local_rows=int(local.shape[0]),
        rounds=rounds,
    )
    if tcp is not None:
        tcp.close()
        same = all(
            np.array_equal(
                np.concatenate(
                    [np.asarray(b) for b in received.get(src, [])] or [np.zeros((0, RECORD), np.uint8)]
                ).reshape(-1),
                tcp.got.get(src, np.zeros(0, np.uint8)),
            )
            for src in range(size)
            if src != rank
        )
        ph.record(
            "shuffle_tcp",
            float(np.median(tcp_rounds)),
            sent_bytes // RECORD,
            sent_bytes,
            same_bytes=bool(same),
            rounds=tcp_rounds,
        )
        del tcp
    world.barrier()
    step("shuffle")
    for pieces in outgoing.values():
        for b in pieces:
            b.release()
    outgoing.clear()

    # -- local sort --
    _maybe_die(args, rank, "sort", state)
    t0 = time.perf_counter()
    parts = [local] + [np.asarray(b) for src in sorted(received) for b in received[src]]
    mine_all = np.concatenate(parts) if len(parts) > 1 else local
    for pieces in received.values():
        for b in pieces:
            b.release()
    received.clear()
    del parts
    output = sort_records(mine_all)
    del mine_all
    if args.inject and rank == size - 1 and output.shape[0] >= 2:  # tests: validation must catch these
        output = output[[1, 0, *range(2, output.shape[0])]] if args.inject == "swap" else output[:-1]
    ph.record("sort", time.perf_counter() - t0, int(output.shape[0]), int(output.nbytes))
    world.barrier()
    step("sort")

    # -- validate --
    _maybe_die(args, rank, "validate", state)
    t0 = time.perf_counter()
    summary = summarize(output, rank)
    ph.record("validate", time.perf_counter() - t0, int(output.shape[0]), int(output.nbytes))
    if args.output:  # TeraSort's output files: part-r-<rank>, concatenated in rank order = the sorted whole
        os.makedirs(args.output, exist_ok=True)
        output.tofile(os.path.join(args.output, f"part-r-{rank:05d}"))
    lanes = sorted({t for j in range(size) if j != rank for t in world.channel(j).transports()})
    everything = world.allgather(
        {
            "summary": summary,
            "gen_checksum": hex(gen_sum),
            "phases": ph.stats,
            "host": socket.gethostname(),
            "lane_transports": lanes,
        }
    )
    step("validate")
    if rank != 0:
        return 0
    return _report(args, world, everything)


def PHASES_RUN(args: argparse.Namespace) -> list[str]:  # noqa: N802 - phases of this run, in order
    out = ["teragen", "partition", "shuffle"]
    if args.baseline == "tcp":
        out.append("shuffle_tcp")
    return out + ["sort", "validate"]


class _TcpShuffle:
    """The same exchange over kernel TCP: one connection per ordered pair, an
    8-byte header (the byte count), then the bytes (sendall / recv_into).
    Connections and receive buffers (allocated and touched) are set up here,
    before any clock starts, as the slots' are; round() times one exchange."""

    def __init__(
        self, world, outgoing: dict[int, list], incoming: dict[int, int], timeout: float, schedule: str = "all"
    ) -> None:
        self.world, self.outgoing, self.timeout, self.schedule = world, outgoing, timeout, schedule
        rank, size = world.rank, world.size
        host = _host_of(world.addresses[rank])
        lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind((host, 0))
        lst.listen(size)
        lst.settimeout(timeout)
        ports = world.allgather(lst.getsockname()[1])
        self.outs: dict[int, socket.socket] = {}
        for j in range(size):
            if j != rank:
                c = socket.create_connection((_host_of(world.addresses[j]), ports[j]), timeout=timeout)
                c.sendall(struct.pack("<q", rank))
                self.outs[j] = c
        self.ins: dict[int, socket.socket] = {}
        while len(self.ins) < size - 1:
            c, _ = lst.accept()
            c.settimeout(timeout)
            src = struct.unpack("<q", _recv_exact(c, 8))[0]
            self.ins[src] = c
        lst.close()
        self.got: dict[int, np.ndarray] = {}
        for src, rows in incoming.items():
            self.got[src] = np.empty(rows * RECORD, dtype=np.uint8)
            self.got[src].fill(0)

    def _send(self, j: int) -> Callable[[], None]:
        def run() -> None:
            pieces = self.outgoing[j]
            self.outs[j].sendall(struct.pack("<q", sum(b.nbytes for b in pieces)))
            for b in pieces:
                self.outs[j].sendall(np.asarray(b).data.cast("B"))

        return run

    def _recv(self, src: int) -> Callable[[], None]:
        def run() -> None:
            c = self.ins[src]
            n = struct.unpack("<q", _recv_exact(c, 8))[0]
            buf = self.got[src]
            if n != buf.nbytes:
                raise BenchError(f"rank {src} announced {n} B over TCP, {buf.nbytes} B expected")
            view = buf.data
            done = 0
            while done < n:
                k = c.recv_into(view[done:], n - done)
                if k == 0:
                    raise ConnectionError(f"rank {src} closed its TCP connection after {done} of {n} B")
                done += k

        return run

    def round(self) -> float:
        """One exchange, started together on every rank; its seconds on this rank."""
        rank, size = self.world.rank, self.world.size
        self.world.barrier()
        t0 = time.perf_counter()
        for group in _schedule(self.schedule, rank, size):
            th = _Threads()
            for dst, src in group:
                th.start(f"rank {rank} TCP-receiving from rank {src}", self._recv(src))
                th.start(f"rank {rank} TCP-sending to rank {dst}", self._send(dst))
            th.join(self.timeout * 4)
        return time.perf_counter() - t0

    def close(self) -> None:
        for c in list(self.outs.values()) + list(self.ins.values()):
            c.close()


def _recv_exact(c: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        k = c.recv(n - len(buf))
        if not k:
            raise ConnectionError("connection closed during the header")
        buf += k
    return bytes(buf)


# -- rank 0's report --


def _report(args: argparse.Namespace, world, everything: list[dict]) -> int:
    size = world.size
    summaries = [e["summary"] for e in everything]
    gen_checksum = sum(int(e["gen_checksum"], 16) for e in everything)
    v = validate(summaries, args.rows, gen_checksum)
    per_rank = [e["phases"] for e in everything]
    transport = args.transport
    report = Report(
        "terasort",
        {
            "rows": args.rows,
            "bytes": args.rows * RECORD,
            "ranks": size,
            "transport": transport,
            "baseline": args.baseline,
            "chunk": args.chunk,
            "samples": args.samples,
            "repeat": args.repeat,
            "schedule": args.schedule,
            "hosts": sorted({e["host"] for e in everything}),
            "command": "tensorwire bench terasort " + " ".join(sys.argv[1:]),
        },
    )
    check_lane_transports(report, transport, [t for e in everything for t in e.get("lane_transports", [])])
    rows_out = []
    for name in PHASES_RUN(args):
        secs = [p[name]["seconds"] for p in per_rank]
        rows = sum(int(p[name]["rows"]) for p in per_rank)
        nbytes = sum(int(p[name]["bytes"]) for p in per_rank)
        t = max(secs)
        extra: dict = {}
        if "rounds" in per_rank[0][name]:  # a round lasts as long as its slowest rank; report the median round
            by_round = [max(p[name]["rounds"][i] for p in per_rank) for i in range(len(per_rank[0][name]["rounds"]))]
            t = float(np.median(by_round))
            extra = {"rounds_seconds": by_round, "best_seconds": min(by_round)}
        row = {
            "phase": name,
            "rows": rows,
            "bytes": nbytes,
            "seconds": t,
            "MBps": nbytes / t / 1e6 if t > 0 else float("nan"),
            "rank_seconds": secs,
            **extra,
        }
        if name.startswith("shuffle"):
            row["rank_bytes"] = [int(p[name]["bytes"]) for p in per_rank]
        if name == "shuffle":
            row["setup_seconds"] = max(p[name]["setup_s"] for p in per_rank)
            row["local_rows"] = sum(int(p[name]["local_rows"]) for p in per_rank)
        rows_out.append(row)
    report.rows = rows_out
    partition_rows = [s["rows"] for s in sorted(summaries, key=lambda s: s["part"])]
    report.config["partition_rows"] = partition_rows
    report.config["checksum"] = f"{v.checksum:x}"
    report.config["gen_checksum"] = f"{gen_checksum:x}"
    for e in v.errors:
        report.fail(f"validation: {e}")
    mean = args.rows / size
    if mean >= 1 and max(partition_rows) > 1.5 * mean:
        report.warn(f"partition skew: largest {max(partition_rows)} rows > 1.5 x mean {mean:.0f}")
    by = {r["phase"]: r for r in rows_out}
    if args.rows and size > 1 and by["shuffle"]["bytes"] == 0:
        report.fail("the shuffle moved no bytes")
    if "shuffle_tcp" in by:
        same = all(p["shuffle_tcp"]["same_bytes"] for p in per_rank)
        if not same:
            report.fail("the TCP baseline delivered other bytes than the tensorwire shuffle")
        by["shuffle"]["speedup_vs_tcp"] = (
            by["shuffle_tcp"]["seconds"] / by["shuffle"]["seconds"] if by["shuffle"]["seconds"] > 0 else float("nan")
        )

    print(
        f"# tensorwire terasort: {args.rows} rows ({args.rows * RECORD / 1e6:.1f} MB), {size} ranks, "
        f"transport {transport}, chunk {args.chunk} B, {args.samples} samples"
    )
    print(f"# partitions (rows per rank): {' '.join(map(str, partition_rows))}")
    lines = []
    for r in rows_out:
        label = {"shuffle": f"shuffle[{transport}]", "shuffle_tcp": "shuffle[tcp-sockets]"}.get(r["phase"], r["phase"])
        lines.append(f" {label:<22} {r['rows']:>12} {r['bytes']:>14} {r['seconds']:>10.3f} {r['MBps']:>18.1f}")
    print_table(f" {'phase':<22} {'rows':>12} {'bytes':>14} {'time[s]':>10} {'throughput[MB/s]':>18}", lines)
    total = sum(r["seconds"] for r in rows_out if r["phase"] != "shuffle_tcp")
    print(
        f"# total {total:.3f} s; validation: {'OK' if v.ok else '; '.join(v.errors)}; "
        f"checksum {v.checksum:x} (generator {gen_checksum:x}), {v.rows} rows"
    )
    sh = by["shuffle"]
    key = f"{args.rows} rows sorted in {total:.2f} s; shuffle {sh['MBps']:.0f} MB/s"
    if "shuffle_tcp" in by:
        key += f" vs tcp sockets {by['shuffle_tcp']['MBps']:.0f} MB/s (x{sh['speedup_vs_tcp']:.2f})"
    print(report.verdict_line(key), flush=True)
    report.write_json(args.json)
    if args.plot:
        _plot(args.plot, rows_out, transport, args.rows, size)
    return 0 if report.verdict != "FAIL" else 2


def _plot(path: str, rows: list[dict], transport: str, n: int, size: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("terasort: --plot needs matplotlib", file=sys.stderr)
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    names = {"shuffle": f"shuffle\n({transport})", "shuffle_tcp": "shuffle\n(tcp sockets)"}
    labels = [names.get(r["phase"], r["phase"]) for r in rows]
    a1.bar(labels, [r["seconds"] for r in rows], color="tab:blue")
    a1.set_ylabel("time [s] (slowest rank)")
    a2.bar(labels, [r["MBps"] for r in rows], color="tab:orange")
    a2.set_ylabel("throughput [MB/s]")
    for a in (a1, a2):
        a.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"tensorwire terasort: {n} rows, {size} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
