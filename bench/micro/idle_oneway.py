"""One-way time of a static-slot send to a receiver that has been idle for a
while (its wait spun out and naps): sender t0 -> receiver's recv() returned,
one clock (time.perf_counter) in both processes. Device() defaults.

  python3 bench/micro/idle_oneway.py [TRANSPORT=shm] [GAP_S=300e-6] [MEMORY=host|cuda] [KIND=static|dynamic]
                                     [WAIT=recv|wait_any]

The sender busy-waits GAP_S, sends one 4 KiB tensor, waits until the receiver
released (static) or took (dynamic) it, 400 times; the first 50 are dropped
(bench/results/gpu_latency_h100.txt, idle_receiver.txt). WAIT=wait_any: the
receiver waits in tw.wait_any([slot]) before each recv()."""
import sys, time, statistics
import tensorwire as tw
from tensorwire.ranks.roles import Roles

def _rx(conn, transport, n, memory, kind, wait):
    with tw.Device(transport=transport) as dev:
        if kind == "static":
            slot = dev.static_slot("x", (1024,), "float32", depth=2, memory=memory)
        else:
            slot = dev.dynamic_slot("x", memory=memory)
        conn.send(dev.address)
        arr = []
        for _ in range(n):
            if wait == "wait_any":
                tw.wait_any([slot], 30)
            v = slot.recv(30)
            arr.append(time.perf_counter())
            if kind == "static":
                slot.release(v)
            del v
        conn.send(arr)

def main():
    transport = sys.argv[1] if len(sys.argv) > 1 else "shm"
    gap = float(sys.argv[2]) if len(sys.argv) > 2 else 300e-6
    memory = sys.argv[3] if len(sys.argv) > 3 else "host"
    kind = sys.argv[4] if len(sys.argv) > 4 else "static"
    wait = sys.argv[5] if len(sys.argv) > 5 else "recv"
    n = 400
    with Roles() as roles:
        p = roles.spawn("rx", _rx, transport, n, memory, kind, wait)
        addr = p.recv(60, "start")
        with tw.Device(transport=transport) as dev:
            ch = dev.connect(addr)
            s = ch.static_sender("x", timeout=30) if kind == "static" else ch.dynamic_sender("x", timeout=30)
            src = dev.empty((1024,), "float32", memory=memory)
            t0s = []
            for k in range(n):
                end = time.perf_counter() + gap
                while time.perf_counter() < end:
                    pass
                t0s.append(time.perf_counter())
                r = s.send(src, 30)
                if kind == "static":
                    s.wait_consumed(k + 1, 30)
                else:
                    r.wait(30)  # completes on the receiver's ack
            arr = p.recv(60, "arrivals")
        roles.stop(wait=30)
    d = [(a - t) * 1e6 for a, t in zip(arr[50:], t0s[50:])]
    d.sort()
    print(f"{kind} {transport} {memory} gap {gap*1e6:.0f}us, {wait}: one-way p50 {statistics.median(d):.1f} us, p10 {d[len(d)//10]:.1f}, p90 {d[9*len(d)//10]:.1f}")

if __name__ == "__main__":
    main()
