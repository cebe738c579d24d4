"""Plain TCP socket streaming between two processes: the floor any user has
without tensorwire (sendall from a buffer, recv_into a preallocated buffer).

  python -m tensorwire.lab.fabric.tcp_stream --sizes 1M,16M [--iters N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import socket
import time

from ...ranks.roles import Roles
from .common import BenchError, iterations_for, parse_sizes


def _receiver(pipe, sizes_iters) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    pipe.send(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(max(s for s, _ in sizes_iters))
    view = memoryview(buf)
    for size, iters in sizes_iters:
        for _ in range(iters):
            got = 0
            while got < size:
                n = conn.recv_into(view[got:size])
                if n == 0:
                    return
                got += n
        conn.sendall(b"k")  # one ack per size: the sender's clock stops on it
    conn.close()


def measure(sizes: list[int], iters: int = 1000, budget: int = 1 << 30) -> list[dict]:
    plan = [(s, iterations_for(s, iters, budget)) for s in sizes]
    with Roles() as roles:
        rx = roles.spawn("the tcp_stream receiver", _receiver, plan)
        port = rx.recv(30, "start")
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = memoryview(bytearray(max(sizes)))
        rows = []
        for size, n in plan:
            t0 = time.perf_counter()
            for _ in range(n):
                sock.sendall(payload[:size])
            if sock.recv(1) != b"k":
                raise BenchError("tcp_stream receiver went away")
            dt = time.perf_counter() - t0
            rows.append({"size": size, "iters": n, "seconds": dt, "bw_MBps": size * n / dt / 1e6})
        sock.close()
        roles.stop(wait=30)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,16M")
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = measure(parse_sizes(a.sizes), a.iters)
    for r in rows:
        print(f"{r['size']:>10d} {r['iters']:>6d} {r['bw_MBps']:12.1f} MB/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"test": "tcp_stream", "config": {"sizes": a.sizes}, "rows": rows, "verdict": "PASS"}, f)


if __name__ == "__main__":
    main()
