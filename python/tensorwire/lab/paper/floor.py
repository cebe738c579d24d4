"""The transport floor of one parameter-server step: the bytes a training step
moves, in the same pattern, with no compute, no torch and nothing but the least
any implementation must do to move them on this machine:

  tcp  plain sockets: one TCP connection per process pair, one thread per flow
       (sendall / recv_into release the GIL), 4 MiB socket buffers (the
       kernel's made its VGG-16 step ~3% faster for ~15% more CPU,
       bench/results/tcp_tuning.md; tensorwire's Device leaves UCX's to the
       kernel);
  shm  one memcpy per byte: the sender copies each flow from its own memory
       into a shared-memory segment the receiver maps (what tensorwire's
       direct path does over shared memory), then wakes the receiver with a
       one-byte message; one thread per flow.

Every worker sends each server the bytes of the variables placed on it (the
push); once a server has all of them it sends each worker those bytes back
(the pull). The placement is tensorwire.torch.ps.place(), as in training;
--colocate drops the flows between a worker and the server in its own
process, as `tensorwire train --colocate` does. Prints the median step time, the
CPU time all processes spent per step, and one worker's forward and backward
at --batch measured alone (the fastest of 10), and each server's aggregation
measured alone (the mean of W gradients and an SGD step over its variables, as
tensorwire.torch.ps does it), then two upper bounds on samples/s for any
implementation that moves these bytes over that transport on this machine:
  sequential  compute, the floor step and the slowest server's aggregation, one
              after the other (a synchronous PS pushes after its backward, and a
              server updates once the gradients are in). The floor step moves
              every push before any pull; a PS whose servers each send their
              parameters as soon as their own gradients are in overlaps one
              server's pull with another's push and can pass this one (over
              tcp tensorwire's zerocopy does for fcn5 and VGG-16 since
              2026-11-27, bench/results/net_tcp_train_b1.txt)
  overlapped  everything hidden behind everything else, limited only by the CPU
              all of it needs: (floor CPU + W x compute + every server's
              aggregation) / CPUs, or the longest single part

    python3 -m tensorwire.lab.paper.floor --model fcn5 [--transport shm] [--batch 1] [--colocate] [--steps 20]
    (also bench/micro/ps_floor.py; results: bench/results/net_tcp_train_b1.txt, ps_shm_floor.txt)

`tensorwire bench train` measures it beside Figure 8 (bound()) over tcp and shm.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import threading
import time
from multiprocessing import shared_memory
from typing import Any

from ..fabric.common import BenchError
from ...ranks.roles import RoleError, Roles

SOCK_BUF = 4 << 20
TRANSPORTS = ("tcp", "shm")


def _mapped(m: shared_memory.SharedMemory) -> memoryview:
    """The segment's memory (None only once it is closed)."""
    assert m.buf is not None
    return m.buf


def flows(push_bytes: list[int], pull_bytes: list[int], workers: int, colocate: bool) -> tuple[int, list, list]:
    """(processes, push flows, pull flows); a flow is (src, dst, nbytes).
    push_bytes[s]/pull_bytes[s]: what one worker sends server s / gets back
    (they differ by the sparse gradients, whose pushes are not counted).
    Separate layout: servers are processes 0..S-1, workers S..S+W-1.
    Colocated: process r is worker r and server r."""
    S = len(push_bytes)
    if colocate:
        pairs = [(w, s) for w in range(workers) for s in range(S) if s != w]
        return (
            workers,
            [(w, s, push_bytes[s]) for w, s in pairs if push_bytes[s]],
            [(s, w, pull_bytes[s]) for w, s in pairs if pull_bytes[s]],
        )
    pairs = [(w, s) for w in range(workers) for s in range(S)]
    return (
        S + workers,
        [(S + w, s, push_bytes[s]) for w, s in pairs if push_bytes[s]],
        [(s, S + w, pull_bytes[s]) for w, s in pairs if pull_bytes[s]],
    )


def pair_sizes(phases: list) -> dict:
    """The largest flow between each ordered pair of processes: what its buffer
    (or shm segment) holds. Colocated, a pair carries a push one way and a pull
    of another size the same way (worker a to server b, server a to worker b)."""
    sizes: dict = {}
    for a, b, n in phases:
        sizes[(a, b)] = max(n, sizes.get((a, b), 0))
    return sizes


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def _copy_and_wake(dst, src, sock: socket.socket) -> None:
    """dst[:] = src (numpy arrays: the copy releases the GIL), then the wake-up."""
    dst[:] = src
    sock.sendall(b"\x01")


def _phase(rank: int, phase: list, socks: dict, bufs: dict, segs: dict | None) -> None:
    """This process's sends and receives of one phase, concurrently. Over
    shm (segs: this process's outgoing flows' shared segments, None over tcp)
    a send is a copy into the receiver's segment and a one-byte wake-up, a
    receive that byte."""
    ts = []
    for src, dst, n in phase:
        if src == rank:
            if segs is not None:
                ts.append(
                    threading.Thread(
                        target=_copy_and_wake, args=(segs[(src, dst)][:n], bufs[(src, dst)][:n], socks[dst])
                    )
                )
            else:
                ts.append(threading.Thread(target=socks[dst].sendall, args=(bufs[(src, dst)][:n],)))
        elif dst == rank:
            view = memoryview(bytearray(1)) if segs is not None else bufs[(src, dst)][:n]
            ts.append(threading.Thread(target=_recv_exact, args=(socks[src], view)))
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _proc(conn, rank: int, nprocs: int, push: list, pull: list, steps: int, shm_names: dict) -> None:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(nprocs)
    conn.send(("port", lst.getsockname()[1]))
    # every process's port (tensorwire.ranks.roles: gather, then broadcast). Not through tensorwire.ranks.rendezvous:
    # its stores need torch or a Device in each floor process, which has neither (torch's import made
    # test_floor's measurements take 13 s instead of 1 s here)
    tag, ports = conn.recv()
    peers = {p for f in push + pull for p in f[:2] if rank in f[:2]} - {rank}
    socks = {}
    for p in sorted(peers):  # the lower rank connects
        if p > rank:
            s = socket.create_connection(("127.0.0.1", ports[p]))
            s.sendall(rank.to_bytes(4, "little"))
            socks[p] = s
    while len(socks) < len(peers):
        c, _ = lst.accept()
        socks[int.from_bytes(c.recv(4), "little")] = c
    for s in socks.values():
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
    # shm: a send's source is this process's own memory, written once (no page faults in the timed steps)
    bufs: dict[tuple[int, int], Any] = {
        (a, b): memoryview(bytearray(b"\x01" * n))  # (then numpy views, for shm)
        for (a, b), n in pair_sizes(push + pull).items()
        if rank == a or (rank == b and not shm_names)
    }
    maps = {f: shared_memory.SharedMemory(name) for f, name in shm_names.items() if f[0] == rank}
    segs: dict | None = None  # over tcp
    if shm_names:  # numpy views, made before the timed steps (so is numpy's import)
        import numpy as np

        segs = {f: np.frombuffer(_mapped(m), np.uint8) for f, m in maps.items()}
        bufs = {f: np.frombuffer(b, np.uint8) for f, b in bufs.items()}
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), os.times()
        _phase(rank, push, socks, bufs, segs)
        _phase(rank, pull, socks, bufs, segs)
        c1 = os.times()
        times.append(time.perf_counter() - t0)
        cpu.append(c1.user - c0.user + c1.system - c0.system)
    conn.send(("result", (times, cpu)))
    for s in socks.values():
        s.close()
    segs = None  # (its arrays hold the segments' buffers)
    for m in maps.values():
        m.close()


def measure(
    push_bytes: list[int], pull_bytes: list[int], workers: int, colocate: bool, steps: int, transport: str = "tcp"
) -> dict:
    if transport not in TRANSPORTS:
        raise ValueError(f"the floor is measured over {' or '.join(TRANSPORTS)}, not {transport!r}")
    nprocs, push, pull = flows(push_bytes, pull_bytes, workers, colocate)
    # shm: a segment per flow, written by its sender; created (and unlinked) here, so none outlives the run
    sizes = pair_sizes(push + pull) if transport == "shm" else {}
    segments = {f: shared_memory.SharedMemory(create=True, size=max(1, n)) for f, n in sizes.items()}
    try:
        names = {f: m.name for f, m in segments.items()}
        # a process that dies fails the measurement at once, not at the deadline
        with Roles() as roles:
            for r in range(nprocs):
                roles.spawn(f"{transport} floor process {r}", _proc, r, nprocs, push, pull, steps, names)
            try:
                ports = [m[1] for m in roles.gather("port", 60)]
                roles.broadcast(("ports", ports))
                roles.supervise(600)
            except RoleError as e:
                raise BenchError(f"{transport} floor: {e}") from None
            res = {r: role.result for r, role in enumerate(roles)}
        for (a, b), m in segments.items():  # every flow's bytes arrived (the senders write ones)
            n = sizes[(a, b)]
            if n and _mapped(m)[:n].tobytes().count(1) != n:
                raise BenchError(f"shm floor: the flow from process {a} to {b} did not arrive whole")
    finally:
        for m in segments.values():
            m.close()
            m.unlink()
    # a worker's step: from its push until its last parameter byte arrived
    worker_ranks = range(nprocs) if colocate else range(len(push_bytes), nprocs)
    per_step = [max(res[r][0][i] for r in worker_ranks) for i in range(steps)]
    cpu_step = [sum(res[r][1][i] for r in res) for i in range(steps)]
    skip = 2 if steps > 4 else 0
    return {
        "median_s": statistics.median(per_step[skip:]),
        "min_s": min(per_step[skip:]),
        # the mean: os.times() counts clock ticks, and per-step deltas add up to the exact total
        "cpu_s": statistics.mean(cpu_step[skip:]),
        "bytes_per_step": sum(n for *_, n in push + pull),
    }


def compute_s(model_name: str, batch: int, reps: int = 12) -> float:
    """The fastest forward + backward of one worker's batch, alone in this
    process, one torch thread, as a zerocopy worker computes it: the dense
    layers' gradients written in place into buffers allocated once
    (tensorwire.torch.alloc_sites), so no step page-faults fresh gradients."""
    import torch
    from tensorwire.lab.paper import data, models
    from tensorwire.torch import alloc_sites

    torch.set_num_threads(1)
    model = models.get(model_name).factory()
    bufs = {id(p): torch.empty(p.numel(), dtype=p.dtype) for p in model.parameters()}
    alloc_sites.install(model, lambda p: bufs.get(id(p)))
    x, y = data.Synthetic(model_name, batch, 0)(0, 0)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for p in model.parameters():
            p.grad = None
        torch.nn.functional.cross_entropy(model(x), y).backward()
        ts.append(time.perf_counter() - t0)
    return min(ts[2:])


def aggregate_s(shapes: list[tuple[int, ...]], workers: int, reps: int = 6) -> float:
    """The fastest aggregation of one server's dense variables, alone in this
    process, one torch thread, as tensorwire.torch.ps's servers do it: the mean
    of `workers` gradients in place (the first becomes the accumulator) and a
    torch.optim.SGD step."""
    import torch
    from ...torch import ps
    from ...torch.ps.common import mean_into

    torch.set_num_threads(1)
    if not shapes:
        return 0.0
    master = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    grads = [[torch.full(s, float(w + 1)) for s in shapes] for w in range(workers)]
    opt = ps.make_optimizer("sgd", master)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i, m in enumerate(master):
            m.grad = grads[0][i]
            for w in range(1, workers):
                mean_into(m.grad, grads[w][i], w)
        opt.step()
        ts.append(time.perf_counter() - t0)
    return min(ts[1:])


def bounds(
    model: str, batches: list[int], workers: int, servers: int, colocate: bool, steps: int = 12, transport: str = "tcp"
) -> list[dict]:
    """The floor and the two samples/s bounds of each batch size (see the
    module's doc): the floor and the aggregation measured once, the compute per batch."""
    from ...torch import ps
    from . import models

    specs = [v for v, _ in ps.variables(models.get(model).factory())]
    owner = ps.place([v.nbytes for v in specs], servers, "balanced")
    push = [sum(v.nbytes for v, o in zip(specs, owner) if o == s and not v.sparse) for s in range(servers)]
    pull = [sum(v.nbytes for v, o in zip(specs, owner) if o == s) for s in range(servers)]
    r = measure(push, pull, workers, colocate, steps, transport)
    agg = [
        aggregate_s([v.shape for v, o in zip(specs, owner) if o == s and not v.sparse], workers) for s in range(servers)
    ]
    ncpu = os.cpu_count() or 1
    floor, cpu = r["min_s"], r["cpu_s"]
    out = []
    for batch in batches:
        c = compute_s(model, batch)
        out.append(
            {
                "model": model,
                "batch": batch,
                "workers": workers,
                "servers": servers,
                "colocate": colocate,
                "transport": transport,
                "mib_per_step": r["bytes_per_step"] / 2**20,
                "floor_ms": floor * 1e3,
                "floor_median_ms": r["median_s"] * 1e3,
                "cpu_ms": cpu * 1e3,
                "compute_ms": c * 1e3,
                "aggregate_ms": max(agg) * 1e3,
                "aggregate_cpu_ms": sum(agg) * 1e3,
                "cpus": ncpu,
                # a synchronous step: compute, push, the slowest server's aggregation, pull
                "sequential": workers * batch / (c + floor + max(agg)),
                "overlapped": workers * batch / max(floor, c, max(agg), (cpu + workers * c + sum(agg)) / ncpu),
            }
        )
    return out


def bound(
    model: str, batch: int, workers: int, servers: int, colocate: bool, steps: int = 12, transport: str = "tcp"
) -> dict:
    """The floor and the two samples/s bounds of one configuration."""
    return bounds(model, [batch], workers, servers, colocate, steps, transport)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="fcn5")
    ap.add_argument("--transport", choices=TRANSPORTS, default="tcp")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--colocate", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=1, help="batch per worker of the compute measurement")
    a = ap.parse_args()
    if a.colocate and a.servers != a.workers:
        ap.error("--colocate needs --servers equal to --workers")
    b = bound(a.model, a.batch, a.workers, a.servers, a.colocate, a.steps, a.transport)
    layout = "colocated" if a.colocate else "separate"
    print(
        f"{a.model} batch {a.batch}, {a.workers}w x {a.servers}s {layout}: {b['mib_per_step']:.1f} MiB "
        f"over {a.transport} per step; floor step median {b['floor_median_ms']:.1f} ms (min {b['floor_ms']:.1f}), "
        f"CPU {b['cpu_ms']:.0f} ms per step; compute {b['compute_ms']:.1f} ms per worker step; "
        f"aggregation {b['aggregate_ms']:.1f} ms on the slowest server ({b['aggregate_cpu_ms']:.1f} ms all); "
        f"at most {b['sequential']:.2f} samples/s sequential, {b['overlapped']:.2f} overlapped on {b['cpus']} CPUs"
    )


if __name__ == "__main__":
    main()
