"""Probe: K senders into one receiver over tcp, N bytes each per round, one
tensor in flight per sender; tensorwire static slots vs plain sockets (one
receiving thread per flow). Prints the median round and the bytes/s.

    python3 bench/micro/incast.py --senders 2 --size 256M --mode socket
    python3 bench/micro/incast.py --senders 2 --size 256M --mode tw               # one UCX worker receives
    python3 bench/micro/incast.py --senders 2 --size 256M --mode tw --workers 2   # sender i on lane i

Why the parameter server's servers have a UCX worker per worker process
(tensorwire.torch.ps.common.server_lanes). A probe, not a benchmark of the
suite; results: bench/results/ps_lanes.txt.
"""
import argparse
import multiprocessing as mp
import socket
import statistics
import threading
import time

import numpy as np

from tensorwire.lab.fabric.common import parse_sizes
from tensorwire.lab.paper.floor import _recv_exact  # (the floor's plain-socket receive; no torch)

TIMEOUT_S = 60.0


def tw_recv(args, addresses, results) -> None:
    import tensorwire as tw
    dev = tw.Device(host="127.0.0.1", transport="tcp", workers=args.workers)
    slots = [dev.static_slot(f"incast/{i}", args.size // 4, "float32", depth=1) for i in range(args.senders)]
    for _ in range(args.senders):
        addresses.put(dev.address)
    times = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        views = [s.recv(TIMEOUT_S) for s in slots]
        times.append(time.perf_counter() - t0)
        for s, v in zip(slots, views):
            s.release(v)
    results.put(times)
    time.sleep(1)  # the senders' last acks land before the device goes
    dev.close()


def tw_send(args, i, addresses) -> None:
    import tensorwire as tw
    dev = tw.Device(host="127.0.0.1", transport="tcp")
    ch = dev.connect(addresses.get(timeout=TIMEOUT_S), lane=i if args.workers > 1 else 0)
    blk = dev.empty(args.size // 4, "float32")
    np.asarray(blk)[:] = 1
    sender = ch.static_sender(f"incast/{i}", path="copy", timeout=TIMEOUT_S)
    for _ in range(args.rounds):
        sender.send(blk, TIMEOUT_S).wait(TIMEOUT_S)
    sender.wait_consumed(sender.sent, TIMEOUT_S)
    dev.close()


def socket_recv(args, addresses, results) -> None:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(args.senders)
    lst.settimeout(TIMEOUT_S)
    for _ in range(args.senders):
        addresses.put(lst.getsockname()[1])
    conns = [lst.accept()[0] for _ in range(args.senders)]
    for c in conns:
        c.settimeout(TIMEOUT_S)
    bufs = [memoryview(bytearray(args.size)) for _ in conns]
    times = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        threads = [threading.Thread(target=_recv_exact, args=(c, b)) for c, b in zip(conns, bufs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times.append(time.perf_counter() - t0)
        for c in conns:
            c.sendall(b"k")  # the ack: one tensor in flight per sender, as the slots' depth 1
    results.put(times)


def socket_send(args, i, addresses) -> None:
    s = socket.create_connection(("127.0.0.1", addresses.get(timeout=TIMEOUT_S)), timeout=TIMEOUT_S)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(b"\x01" * args.size))
    for _ in range(args.rounds):
        s.sendall(buf)
        s.recv(1)
    s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--size", default="256M", help="bytes per sender and round (default 256M)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds; the first is not counted (default 12)")
    ap.add_argument("--mode", choices=("tw", "socket"), default="tw")
    ap.add_argument("--workers", type=int, default=1, help="the receiver's UCX workers (tw; > 1: sender i on lane i)")
    args = ap.parse_args()
    (args.size,) = parse_sizes(args.size)
    if args.senders < 1 or args.rounds < 2 or args.size < 4 or args.workers < 1:
        ap.error("needs --senders >= 1, --rounds >= 2, --size >= 4 and --workers >= 1")
    ctx = mp.get_context("spawn")
    addresses, results = ctx.Queue(), ctx.Queue()
    recv, send = (tw_recv, tw_send) if args.mode == "tw" else (socket_recv, socket_send)
    procs = [ctx.Process(target=recv, args=(args, addresses, results))]
    procs += [ctx.Process(target=send, args=(args, i, addresses)) for i in range(args.senders)]
    for p in procs:
        p.start()
    try:
        times = sorted(results.get(timeout=TIMEOUT_S * args.rounds)[1:])
    finally:
        for p in procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()
    med = statistics.median(times)
    print(f"{args.mode} senders={args.senders} size={args.size} workers={args.workers}: median round "
          f"{1e3 * med:.1f} ms, min {1e3 * times[0]:.1f} ms, {args.senders * args.size / med / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
