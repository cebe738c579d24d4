"""Slow episodes of the shared-memory push, per slot and per process pair.

A fresh receiver process with S static slots (2 MiB, depth 1); the sender
pushes N tensors into each slot in turn (two source blocks alternating), the
receiver max-reduces each. Prints, per pair, the median send (the copy into
the receiver's mapped slot) and the receiver's reduction for every slot, so a
slow spell shows whether it follows a buffer, a process pair or time.

    python3 bench/micro/push_episodes.py PAIRS        (results: bench/results/push_episodes.txt)
"""
import multiprocessing as mp
import statistics
import sys
import time

import numpy as np

SIZE = 2 << 20  # bytes per tensor
N = 200  # transfers per slot
S = 4  # slots per pair


def receiver(conn):
    import tensorwire as tw
    dev = tw.Device(host="127.0.0.1", transport="shm", progress="inline", spin_us=100)
    slots = [dev.static_slot(f"probe{i}", (SIZE // 4,), "float32", depth=1) for i in range(S)]
    conn.send(dev.address)
    reduce_s = [[] for _ in range(S)]
    for i in range(S):
        for _ in range(N):
            view = slots[i].recv(30)
            t0 = time.perf_counter()
            np.asarray(view).max()
            reduce_s[i].append(time.perf_counter() - t0)
            slots[i].release(view)
    conn.send(reduce_s)
    conn.recv()
    dev.close()


def median_us(samples):
    return statistics.median(samples[N // 4:]) * 1e6  # the first quarter is warm-up


def main(pairs):
    import tensorwire as tw
    for pair in range(pairs):
        here, there = mp.Pipe()
        proc = mp.get_context("spawn").Process(target=receiver, args=(there,))
        proc.start()
        address = here.recv()
        dev = tw.Device(host="127.0.0.1", transport="shm", progress="inline", spin_us=100)
        ch = dev.connect(address)
        senders = [ch.static_sender(f"probe{i}") for i in range(S)]
        sources = [dev.empty((SIZE // 4,), "float32") for _ in range(2)]
        for block in sources:
            np.asarray(block)[:] = 0.5
        send_us = []
        for i in range(S):
            block = sources[i % 2]
            arr = np.asarray(block)
            samples = []
            for k in range(N):
                arr[0] = 1 + k
                t0 = time.perf_counter()
                senders[i].send(block).wait(30)
                samples.append(time.perf_counter() - t0)
                senders[i].wait_consumed(senders[i].sent, 30)
            send_us.append(median_us(samples))
        reduce_s = here.recv()
        here.send(None)
        proc.join()
        print(f"pair {pair}: send per slot " + " ".join(f"{x:6.1f}" for x in send_us) + " | reduce per slot "
              + " ".join(f"{median_us(r):5.1f}" for r in reduce_s) + "  (us)", flush=True)
        del senders, ch, sources, arr, block
        dev.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
