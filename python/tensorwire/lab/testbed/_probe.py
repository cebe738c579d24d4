"""TCP stream endpoints for `tensorwire testbed check`, run inside testbed hosts.

Standard library only, run as a script (python -S _probe.py ...), so a probe starts in tens of
milliseconds without importing tensorwire (and UCX).

  sink   --bind ADDR --port P --flows N [--timeout S]
         prints READY once listening; accepts N connections; reads until all close; prints JSON
         {"samples": [[t, bytes_so_far], ...]} with t from time.monotonic() (one clock for the
         whole machine, so the caller can add up sinks in different namespaces).
  source --to ADDR:PORT [--to ...] --seconds S
         one TCP flow per --to; all start together and send for S seconds; prints {"sent": B}.
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import sys
import threading
import time
from typing import cast

CHUNK = 256 * 1024
SAMPLE_EVERY_S = 0.005


def sink(bind: str, port: int, flows: int, timeout: float) -> int:
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((bind, port))
    ls.listen(max(flows, 8))
    print("READY", flush=True)
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    ls.setblocking(False)
    sel.register(ls, selectors.EVENT_READ, None)
    accepted = open_conns = 0
    total = 0
    samples: list[list[float]] = []
    last_sample = last_rx = 0.0
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    while (accepted < flows or open_conns > 0) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.2):
            if key.data is None:
                try:
                    c, _addr = ls.accept()
                except BlockingIOError:
                    continue
                c.setblocking(False)
                sel.register(c, selectors.EVENT_READ, "conn")
                accepted += 1
                open_conns += 1
                if accepted == flows:
                    sel.unregister(ls)
                continue
            try:
                n = cast(socket.socket, key.fileobj).recv_into(view)  # the connections registered above
            except BlockingIOError:
                continue
            except OSError:
                n = 0
            if n == 0:
                sel.unregister(key.fileobj)
                cast(socket.socket, key.fileobj).close()
                open_conns -= 1
                continue
            now = time.monotonic()
            if not samples:
                samples.append([now, 0])  # first byte: the start of the stream
            total += n
            last_rx = now
            if now - last_sample >= SAMPLE_EVERY_S:
                samples.append([now, total])
                last_sample = now
    if samples:
        samples.append([last_rx, total])  # the last byte: the end of the stream
    ls.close()
    print(
        json.dumps(
            {
                "samples": samples,
                "accepted": accepted,
                "bytes": total,
                "complete": accepted == flows and open_conns == 0,
            }
        ),
        flush=True,
    )
    return 0 if accepted == flows else 1


def source(targets: list[str], seconds: float) -> int:
    socks = []
    for t in targets:
        host, _, port = t.rpartition(":")
        s = socket.create_connection((host, int(port)), timeout=10)
        s.settimeout(max(10.0, seconds * 4))
        socks.append(s)
    sent = [0] * len(socks)
    start = threading.Barrier(len(socks) + 1)
    deadline = [0.0]
    errors: list[str] = []

    def flow(i: int) -> None:
        data = memoryview(bytes(CHUNK))
        start.wait()
        try:
            while time.monotonic() < deadline[0]:
                socks[i].sendall(data)
                sent[i] += CHUNK
        except OSError as e:
            errors.append(str(e))
        finally:
            socks[i].close()

    threads = [threading.Thread(target=flow, args=(i,), daemon=True) for i in range(len(socks))]
    for th in threads:
        th.start()
    deadline[0] = time.monotonic() + seconds
    start.wait()
    for th in threads:
        th.join(seconds * 4 + 10)
    print(json.dumps({"sent": sum(sent), "errors": errors}), flush=True)
    return 1 if errors else 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="_probe")
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("sink")
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--flows", type=int, required=True)
    s.add_argument("--timeout", type=float, default=30.0)
    c = sub.add_parser("source")
    c.add_argument("--to", action="append", required=True)
    c.add_argument("--seconds", type=float, required=True)
    a = p.parse_args(argv)
    if a.role == "sink":
        return sink(a.bind, a.port, a.flows, a.timeout)
    return source(a.to, a.seconds)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
