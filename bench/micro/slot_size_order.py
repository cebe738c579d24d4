"""Probe: a static slot's transfer time at one size depends on what ran before
it on the same devices (issue 17, tcp 2-4 MiB). Two blocking-mode Devices in one
process over tcp, one slot and sender per size, one tensor in flight; prints the
median transfer + consume per size.

    python3 bench/micro/slot_size_order.py 4194304            # 4 MiB alone
    python3 bench/micro/slot_size_order.py 65536,4194304      # 64 KiB first
    PRE=1 python3 bench/micro/slot_size_order.py 65536,4194304  # every slot and block made up front

A probe, not a benchmark of the suite; results: bench/results/tcp_size_order.txt.
"""
import os
import statistics
import sys
import threading
import time

import numpy as np

import tensorwire as tw

sizes = [int(s) for s in sys.argv[1].split(",")]
N = 64
rx = tw.Device(host="127.0.0.1", transport="tcp"); tx = tw.Device(host="127.0.0.1", transport="tcp")
ch = tx.connect(rx.address)
pre = {}
if os.environ.get("PRE"):
    for size in sizes:
        pre[size] = (rx.static_slot(f"s{size}", size // 4, "float32", depth=1), ch.static_sender(f"s{size}", path="copy"), tx.empty(size // 4, "float32"))
        np.asarray(pre[size][2])[:] = 1
for size in sizes:
    if pre:
        slot, snd, blk = pre[size]
    else:
        slot = rx.static_slot(f"s{size}", size // 4, "float32", depth=1)
        snd = ch.static_sender(f"s{size}", path="copy")
        blk = tx.empty(size // 4, "float32"); np.asarray(blk)[:] = 1
    def serve():
        for _ in range(N + 8):
            v = slot.recv(30); np.asarray(v).max(); slot.release(v)
    t = threading.Thread(target=serve); t.start()
    ts = []
    for i in range(N + 8):
        t0 = time.perf_counter(); snd.send(blk).wait(30); snd.wait_consumed(snd.sent, 30); ts.append(time.perf_counter() - t0)
    t.join()
    print(size, f"{1e6*statistics.median(ts[8:]):.0f} us")
    del slot, snd, blk
    pre.pop(size, None)
rx.close(); tx.close()
