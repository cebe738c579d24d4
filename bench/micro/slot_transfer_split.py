"""Where the time of one slot transfer goes, across two processes.

Usage: python3 bench/micro/slot_transfer_split.py SIZE ITERS [--progress blocking|inline] [--transport tcp|shm]
                                                 [--kind static|dynamic|both] [--no-consume] [--depth N]

A sender process and a receiver process (one Device each, the given progress
mode, default settings otherwise) move a float32 tensor of SIZE bytes through
a static slot (depth 1, or --depth N buffers used in turn) ITERS times: send().wait(), then wait_consumed(); the
receiver recv()s, takes the max and releases. Both record time.perf_counter()
(CLOCK_MONOTONIC, comparable across processes on one host) at each step, and
the medians of the segments are printed (the first quarter of the iterations,
at most 200, are warm-up), with the context switches of both threads per
transfer. Used to find the blocking-mode costs of docs/architecture.md §6
(progress-thread spin, parked-thread looks).
--kind dynamic: a dynamic slot instead; the sender's send().wait() ends at
the slot's ack (when recv() takes the tensor), so "consumed seen" is that too,
and the receiver drops the block after the max. --kind both: a static and a
dynamic transfer alternate in the same pair of processes, so that the two see
the same machine (this VM's speed moves between runs by up to 1.5x).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np


def _switches() -> tuple[int, int]:
    """This thread's voluntary and involuntary context switches so far."""
    import resource
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_nvcsw, r.ru_nivcsw


def _receiver(q, rq, size: int, iters: int, progress: str, transport: str, kinds: list[str],
              consume: bool, depth: int) -> None:
    import tensorwire as tw
    with tw.Device(transport=transport, progress=progress) as dev:
        slots = {k: dev.static_slot("split-static", (size // 4,), "float32", depth=depth) if k == "static"
                 else dev.dynamic_slot("split-dynamic") for k in kinds}
        q.put(dev.address)
        marks: dict[str, list] = {k: [] for k in kinds}
        switches = []
        for i in range(iters):
            if i == min(200, iters // 4):
                switches.append(_switches())
            for k, slot in slots.items():
                a = time.perf_counter()
                view = slot.recv(30)
                b = time.perf_counter()
                if consume:
                    np.asarray(view).max()
                if k == "static":
                    slot.release(view)
                del view  # a dynamic slot's block is freed with its last reference
                marks[k].append((a, b, time.perf_counter()))
        switches.append(_switches())
        rq.put((marks, {k: s.stats() for k, s in slots.items()}, switches))
        time.sleep(0.5)  # the last release reaches the sender before the device closes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("size", type=int)
    ap.add_argument("iters", type=int)
    ap.add_argument("--progress", default="blocking", choices=("blocking", "inline", "polling"))
    ap.add_argument("--transport", default="tcp", choices=("tcp", "shm"))
    ap.add_argument("--kind", default="static", choices=("static", "dynamic", "both"))
    ap.add_argument("--no-consume", dest="consume", action="store_false", help="release without reading the tensor")
    ap.add_argument("--depth", type=int, default=1, help="the static slot's buffers, used in turn (default 1)")
    args = ap.parse_args()
    kinds = ["static", "dynamic"] if args.kind == "both" else [args.kind]
    import tensorwire as tw
    ctx = mp.get_context("spawn")
    q, rq = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(q, rq, args.size, args.iters, args.progress, args.transport, kinds,
                                               args.consume, args.depth))
    proc.start()
    with tw.Device(transport=args.transport, progress=args.progress) as dev:
        ch = dev.connect(q.get(timeout=60))
        senders = {k: ch.static_sender("split-static") if k == "static" else ch.dynamic_sender("split-dynamic")
                   for k in kinds}
        tensor = dev.empty((args.size // 4,), "float32")
        marks: dict[str, list] = {k: [] for k in kinds}
        switches = []
        for i in range(args.iters):
            if i == min(200, args.iters // 4):
                switches.append(_switches())
            for k, sender in senders.items():
                t0 = time.perf_counter()
                request = sender.send(tensor)
                t_post = time.perf_counter()
                request.wait(30)
                t1 = time.perf_counter()
                if k == "static":
                    sender.wait_consumed(sender.sent, 30)
                marks[k].append((t0, t_post, t1, time.perf_counter()))
        switches.append(_switches())
        rx, rstats, rswitches = rq.get(timeout=60)
    proc.join(30)
    skip = min(200, args.iters // 4)
    timed = args.iters - skip
    for k in kinds:
        s, r = np.array(marks[k][skip:]), np.array(rx[k][skip:])
        print(f"# {k} slot, {args.size} B, {timed} timed of {args.iters}, {args.transport}, {args.progress} "
              f"progress{', alternating with the other slot' if len(kinds) > 1 else ''}; medians in us (p10, p90)")
        for name, x in (("send posted -> recv returns", r[:, 1] - s[:, 0]),
                        ("recv returns -> released", r[:, 2] - r[:, 1]),
                        ("recv called -> recv returns", r[:, 1] - r[:, 0]),
                        ("send() call", s[:, 1] - s[:, 0]),
                        ("send posted -> send done", s[:, 2] - s[:, 0]),
                        ("total (send posted -> consumed seen)", s[:, 3] - s[:, 0])):
            p10, p50, p90 = np.percentile(x * 1e6, [10, 50, 90])
            print(f"  {name:<38} {p50:10.1f}  ({p10:.1f}, {p90:.1f})")
        print(f"  receiver's slot: {rstats[k]}")
    per = timed * len(kinds)
    for who, sw in (("sender", switches), ("receiver", rswitches)):
        print(f"# {who}'s thread: {(sw[1][0] - sw[0][0]) / per:.2f} voluntary and "
              f"{(sw[1][1] - sw[0][1]) / per:.2f} involuntary context switches per transfer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
