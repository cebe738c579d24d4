"""How long a dynamic sender waiting on its send's request takes to see the
receiver's ack, when the receiver takes the tensor GAP after it was sent (the
sender's wait spun out and naps): receiver's recv() returned (the ack is
written by then) -> sender's wait() returned, one clock in both processes.
Device() defaults.

  python3 bench/micro/idle_ack.py [TRANSPORT=shm] [GAP_S=3e-3]

200 sends of 4 KiB, the first 20 dropped (bench/results/idle_receiver.txt)."""
import statistics
import sys
import time

import tensorwire as tw
from tensorwire.ranks.roles import Roles


def _rx(conn, transport, n, gap):
    with tw.Device(transport=transport) as dev:
        slot = dev.dynamic_slot("x")
        conn.send(dev.address)
        took = []
        for _ in range(n):
            conn.recv()  # the sender sent
            end = time.perf_counter() + gap
            while time.perf_counter() < end:
                pass
            b = slot.recv(30)
            took.append(time.perf_counter())
            del b
        conn.send(took)


def main():
    transport = sys.argv[1] if len(sys.argv) > 1 else "shm"
    gap = float(sys.argv[2]) if len(sys.argv) > 2 else 3e-3
    n = 200
    with Roles() as roles:
        p = roles.spawn("rx", _rx, transport, n, gap)
        addr = p.recv(60, "start")
        with tw.Device(transport=transport) as dev:
            s = dev.connect(addr).dynamic_sender("x", timeout=30)
            src = dev.empty((1024,), "float32")
            done = []
            for _ in range(n):
                r = s.send(src, 30)
                p.send("sent")
                r.wait(30)
                done.append(time.perf_counter())
            took = p.recv(60, "times")
        roles.stop(wait=30)
    d = sorted((a - b) * 1e6 for a, b in zip(done[20:], took[20:]))
    print(f"dynamic ack {transport} gap {gap * 1e6:.0f}us: ack -> sender's wait returned p50 {statistics.median(d):.1f} us, "
          f"p90 {d[9 * len(d) // 10]:.1f}")


if __name__ == "__main__":
    main()
