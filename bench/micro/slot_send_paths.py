"""Per-send cost of a static-slot sender's two paths for tensors outside the pool
(path="copy": into the sender's staging block; path="register": in place), one
process, two Devices over shm: send + wait + recv + release per iteration.

    python3 bench/micro/slot_send_paths.py register 4096 2000
    python3 bench/micro/slot_send_paths.py copy 4194304 200

Prints the best and median of 5 passes (us per iteration) and the sender's stats.
A probe, not a benchmark of the suite: the numbers compare two builds on one machine.
"""
import sys
import time

import torch

import tensorwire as tw

path, n, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with tw.Device(transport="shm") as a, tw.Device(transport="shm") as b:
    slot = a.static_slot("s", (n // 4,), "float32", depth=2)
    sender = b.connect(a.address).static_sender("s", path=path)
    t = torch.ones(n // 4)
    passes = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            sender.send(t).wait(5)
            slot.release(slot.recv(5))
        passes.append((time.perf_counter() - t0) / iters * 1e6)
    passes.sort()
    print(f"{path} {n} B: best {passes[0]:.2f} us/iter, median {passes[2]:.2f}", sender.stats())
