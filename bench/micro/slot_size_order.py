"""Probe: a static slot's transfer time at one size depends on what ran before
it on the same devices (issue 17, tcp 2-4 MiB). Two blocking-mode Devices in one
process over tcp, one slot and sender per size, one tensor in flight; prints the
median transfer + consume per size.

    python3 bench/micro/slot_size_order.py 4194304            # 4 MiB alone
    python3 bench/micro/slot_size_order.py 65536,4194304      # 64 KiB first
    PRE=1 python3 bench/micro/slot_size_order.py 65536,4194304  # every slot and block made up front
    KEEP=slot,snd,blk ...   # what of the previous size stays alive (default: nothing)
    SHIFT=1 ...             # take 128 KiB of each pool before a later size's slot and block
    N=300 ...               # transfers per size (default 64, 8 more untimed)

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
N = int(os.environ.get("N", "64"))
rx = tw.Device(host="127.0.0.1", transport="tcp"); tx = tw.Device(host="127.0.0.1", transport="tcp")
ch = tx.connect(rx.address)
pre = {}
kept = []
if os.environ.get("PRE"):
    for size in sizes:
        pre[size] = (rx.static_slot(f"s{size}", size // 4, "float32", depth=1), ch.static_sender(f"s{size}", path="copy"), tx.empty(size // 4, "float32"))
        np.asarray(pre[size][2])[:] = 1
for size in sizes:
    if pre:
        slot, snd, blk = pre[size]
    else:
        if os.environ.get("SHIFT") and size > sizes[0]:  # take the freed start of the slabs first
            kept.append((rx.empty(1 << 17, "uint8"), tx.empty(1 << 17, "uint8")))
        slot = rx.static_slot(f"s{size}", size // 4, "float32", depth=1)
        snd = ch.static_sender(f"s{size}", path="copy")
        blk = tx.empty(size // 4, "float32"); np.asarray(blk)[:] = 1
    def serve():
        for _ in range(N + 8):
            v = slot.recv(30); np.asarray(v).max(); slot.release(v)
    t = threading.Thread(target=serve); t.start()
    ts = []
    c0, w0 = time.process_time(), time.perf_counter()
    for i in range(N + 8):
        t0 = time.perf_counter(); snd.send(blk).wait(30); snd.wait_consumed(snd.sent, 30); ts.append(time.perf_counter() - t0)
    t.join()
    cpu = (time.process_time() - c0) / (time.perf_counter() - w0)
    print(size, f"{1e6*statistics.median(ts[8:]):.0f} us", f"cpu {100 * cpu:.0f}%")
    if os.environ.get("KEEP"):  # a comma list of what stays alive: slot, snd, blk
        keep = os.environ["KEEP"].split(",")
        kept.append([o for n, o in (("slot", slot), ("snd", snd), ("blk", blk)) if n in keep])
    del slot, snd, blk
    pre.pop(size, None)
rx.close(); tx.close()
