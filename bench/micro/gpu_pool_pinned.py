"""Is host pool memory page-locked for CUDA copies? D2H bandwidth of 256 MiB into a pool block vs a pinned vs a pageable torch tensor (needs a GPU). Run: python3 bench/micro/gpu_pool_pinned.py"""
import time

import numpy as np
import torch

import tensorwire as tw

n = 256 << 20
for transport in ("shm", "tcp"):
    with tw.Device(transport=transport) as d:
        g = torch.empty(n, dtype=torch.uint8, device="cuda")
        d.alloc(4096, memory="cuda")  # CUDA in use by tensorwire before the host block
        b = d.alloc(n)
        targets = {"pool block": torch.from_numpy(np.asarray(b)), "pinned": torch.empty(n, dtype=torch.uint8).pin_memory(),
                   "pageable": torch.empty(n, dtype=torch.uint8)}
        for name, dst in targets.items():
            dst.copy_(g)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5):
                dst.copy_(g)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) / 5
            print(f"{transport}: D2H 256 MiB into {name}: {n / dt / 1e9:.1f} GB/s", flush=True)
