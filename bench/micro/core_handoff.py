"""Probe: how fast this machine hands 1 MiB from one CPU to another through
shared memory, with nothing of tensorwire in the way. Process A (pinned to
CPU a) writes the buffer, process B (pinned to CPU b) reads it (max) and hands
the turn back; prints the median microseconds of each side.

    python3 bench/micro/core_handoff.py          # CPUs 0 and 1
    python3 bench/micro/core_handoff.py 0,1 5    # five runs

On a VM whose two vCPUs the host sometimes runs on different dies (an AMD
EPYC's CCDs have an L3 each), both sides slow down several times over for as
long as that lasts; every same-host transfer in a benchmark does too. A probe,
not a benchmark of the suite; results: bench/results/core_handoff.txt.
"""
import multiprocessing as mp
import os
import sys
import time
from multiprocessing import shared_memory

import numpy as np

N = 1 << 20
ROUNDS = 2000


def side(role: int, name: str, cpu: int, out) -> None:
    os.sched_setaffinity(0, {cpu})
    shm = shared_memory.SharedMemory(name=name)
    buf = np.ndarray(N // 4, np.float32, shm.buf, 0)
    turn = np.ndarray(1, np.int64, shm.buf, N)
    src = np.ones(N // 4, np.float32)
    times = []
    deadline = time.monotonic() + 60
    for i in range(ROUNDS):
        while turn[0] != 2 * i + role:  # bounded: the other side gives the turn back within the deadline
            if time.monotonic() > deadline:
                raise SystemExit(f"side {role}: no turn within 60 s")
        t0 = time.perf_counter()
        if role == 0:
            buf[:] = src
        else:
            buf.max()
        times.append(time.perf_counter() - t0)
        turn[0] = 2 * i + role + 1
    times.sort()
    out.put((role, 1e6 * times[len(times) // 2]))
    del buf, turn
    shm.close()


def run(cpus: list[int]) -> tuple[float, float]:
    shm = shared_memory.SharedMemory(create=True, size=N + 64)
    try:
        np.ndarray(1, np.int64, shm.buf, N)[0] = 0
        out = mp.Queue()
        procs = [mp.Process(target=side, args=(r, shm.name, cpus[r], out)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(90)
        got = dict(out.get(timeout=5) for _ in procs)
        return got[0], got[1]
    finally:
        shm.close()
        shm.unlink()


if __name__ == "__main__":
    cpus = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "0,1").split(",")]
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):
        w, r = run(cpus)
        print(f"{time.strftime('%H:%M:%S')} 1 MiB from CPU {cpus[0]} to CPU {cpus[1]}: write {w:.1f} us, "
              f"read {r:.1f} us", flush=True)
