"""A depth-2 static-slot stream across two processes, and where its time goes.

Usage: python3 bench/micro/slot_stream.py SIZE COUNT [CONSUME]

The sender posts COUNT float32 tensors of SIZE bytes back to back
(send().wait() each; depth 2 lets it write tensor k+1 while the receiver holds
tensor k); the receiver recv()s, consumes and releases. CONSUME: 0 nothing,
1 numpy's max over the tensor (the bench's consumer, default), N > 1 a busy
loop of N us. Default Device() settings over tcp: blocking progress, whose
slots do not ask for placed tensors; TENSORWIRE_PROGRESS=inline shows the
placed form, TENSORWIRE_PLACE=off the rendezvous (docs/configuration.md).
Prints MB/s and, as medians over the last three quarters: the time per tensor,
the consume time, the sender's send().wait(), and the receiver's gap from a
release to the next recv() returning. Whether the transfer overlaps the
consumer shows as time per tensor ~ max(transfer, consume), not their sum.
A probe: it compares settings on one machine, alternating.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np


def _receiver(q, rq, size: int, count: int, consume: int) -> None:
    import tensorwire as tw
    with tw.Device(transport="tcp") as dev:
        slot = dev.static_slot("stream", (size // 4,), "float32", depth=2)
        q.put(dev.address)
        marks = []
        for _ in range(count):
            view = slot.recv(30.0)
            t = time.perf_counter()
            if consume == 1:
                np.asarray(view).max()
            elif consume > 1:
                end = t + consume * 1e-6
                while time.perf_counter() < end:
                    pass
            marks.append((t, time.perf_counter()))
            slot.release(view)
        rq.put(marks)
        rq.get()  # the sender is done: the device may close


def main() -> None:
    size, count = int(sys.argv[1]), int(sys.argv[2])
    consume = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    import tensorwire as tw
    q, rq = mp.Queue(), mp.Queue()
    rx = mp.Process(target=_receiver, args=(q, rq, size, count, consume))
    rx.start()
    with tw.Device(transport="tcp") as dev:
        sender = dev.connect(q.get(timeout=60)).static_sender("stream")
        tensor = dev.empty((size // 4,), "float32")
        np.asarray(tensor)[:] = 1
        posts = []
        for _ in range(count):
            t = time.perf_counter()
            sender.send(tensor).wait(30.0)
            posts.append((t, time.perf_counter()))
        marks = rq.get(timeout=120)
        rq.put(None)
        stats = sender.stats()
    rx.join(60)
    w = count // 4
    elapsed = marks[-1][0] - marks[w][0]
    med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    print(f"{size >> 10} KiB consume={consume} place={os.environ.get('TENSORWIRE_PLACE', 'default')}: "
          f"{(count - 1 - w) * size / elapsed / 1e6:.0f} MB/s; per tensor {elapsed / (count - 1 - w) * 1e6:.0f} us; "
          f"consume {med([b - a for a, b in marks[w:]]):.0f} us; send.wait {med([b - a for a, b in posts[w:]]):.0f} us; "
          f"release -> next recv {med([marks[i + 1][0] - marks[i][1] for i in range(w, count - 1)]):.0f} us; "
          f"placed {stats['placed']} of {stats['sent']}")


if __name__ == "__main__":
    main()
