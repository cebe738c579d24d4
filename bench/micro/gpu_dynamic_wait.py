"""A dynamic slot in GPU memory over shm: does a tensor arrive when the receiver
waits in recv() before it is sent (the bench order), after it was sent, or
before the sender attached, under each progress mode? The device run of
bench/results/gpu_tensor_h100_shm_20261127.txt. MEM=host runs it without a GPU.

  python3 bench/micro/gpu_dynamic_wait.py blocking|polling|inline recv-first|send-first|recv-before-attach [SIZES]
"""
import os, sys, time
import tensorwire as tw
from tensorwire.ranks.roles import Roles
MEM = os.environ.get("MEM", "cuda")

def _rx(conn, progress, sizes, order):
    with tw.Device(transport="shm", progress=progress) as dev:
        slot = dev.dynamic_slot("d", memory=MEM)
        conn.send(dev.address)
        if order != "recv-before-attach":
            conn.recv()  # the sender attached
        out = []
        for s in sizes:
            if order == "send-first":
                conn.recv()
            t0 = time.perf_counter()
            try:
                b = slot.recv(6)
                out.append((s, "ok", round((time.perf_counter() - t0) * 1e3, 2)))
                del b
            except Exception as e:
                out.append((s, f"{type(e).__name__}: {str(e)[:160]}"))
                break
        conn.send(out)

def main():
    progress, order = sys.argv[1], sys.argv[2]
    sizes = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "256,4096,1048576").split(",")]
    with Roles() as roles:
        p = roles.spawn("rx", _rx, progress, sizes, order)
        addr = p.recv(60, "start")
        res = []
        with tw.Device(transport="shm", progress=progress) as dev:
            ch = dev.connect(addr)
            if order == "recv-before-attach":
                time.sleep(0.3)
            snd = ch.dynamic_sender("d")
            if order != "recv-before-attach":
                p.send("attached")
            for s in sizes:
                b = dev.empty((s // 4,), "float32", memory=MEM)
                if order != "send-first":
                    time.sleep(0.2)
                t0 = time.perf_counter()
                req = snd.send(b)
                if order == "send-first":
                    p.send("go")
                try:
                    req.wait(6)
                    res.append((s, "ok", round((time.perf_counter() - t0) * 1e3, 2)))
                except Exception as e:
                    res.append((s, f"{type(e).__name__}: {str(e)[:120]}"))
                    break
            print(f"{progress} {order} sender: {res}; stats {snd.stats()}", flush=True)
            print(f"{progress} {order} receiver: {p.recv(30, 'result')}", flush=True)
        roles.stop(wait=10)

if __name__ == "__main__":
    main()
