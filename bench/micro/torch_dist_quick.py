import os, sys, time, torch, torch.distributed as dist
import tensorwire.torch
be = sys.argv[1]
dist.init_process_group(be)
r = dist.get_rank()
res = []
def pingpong(nb, N):
    t = torch.zeros(max(nb // 4, 1))
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(N):
        if r == 0: dist.send(t, 1); dist.recv(t, 1)
        else: dist.recv(t, 0); dist.send(t, 0)
    return (time.perf_counter() - t0) / N / 2 * 1e6
def bw(nb, N):
    t = torch.zeros(nb // 4); a = torch.zeros(1)
    dist.barrier(); t0 = time.perf_counter()
    for i in range(N):
        if r == 0: dist.send(t, 1)
        else: dist.recv(t, 0)
    if r == 0: dist.recv(a, 1)
    else: dist.send(a, 0)
    return N * nb / (time.perf_counter() - t0) / 1e6
def ar(nb, N):
    t = torch.ones(nb // 4); dist.all_reduce(t)
    dist.barrier(); t0 = time.perf_counter()
    for i in range(N): dist.all_reduce(t)
    return (time.perf_counter() - t0) / N * 1e6
out = {"lat8": min(pingpong(8, 2000) for _ in range(2)),
       "bw64K": max(bw(64 << 10, 200) for _ in range(2)), "bw1M": max(bw(1 << 20, 100) for _ in range(2)),
       "bw16M": max(bw(16 << 20, 20) for _ in range(2)),
       "ar1M": min(ar(1 << 20, 30) for _ in range(2)), "ar16M": min(ar(16 << 20, 8) for _ in range(2))}
if r == 0: print(be, os.environ.get("TENSORWIRE_TRANSPORT", "auto"), " ".join(f"{k}={v:.1f}" for k, v in out.items()), flush=True)
dist.destroy_process_group()
