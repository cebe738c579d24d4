"""DDP training of a small MLP on CPU: a plain PyTorch program; only the backend name differs.

    torchrun --nproc-per-node 2 examples/ddp.py [--backend gloo]
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tensorwire.torch  # noqa: F401 - registers the "tensorwire" backend

p = argparse.ArgumentParser()
p.add_argument("--backend", default="tensorwire")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--save", help="rank 0 writes the final parameters here (torch.save)")
args = p.parse_args()
dist.init_process_group(args.backend)
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 10))
ddp = DDP(model, bucket_cap_mb=0.25)  # several buckets: allreduces overlap the backward pass
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(1 + rank)
for step in range(args.steps):
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    loss.backward()
    opt.step()
flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
if args.save and rank == 0:
    torch.save(flat, args.save)
print(f"rank {rank}/{world} {args.backend}: loss {loss.item():.6f} params {flat.sum().item():.8f} "
      f"{flat.abs().sum().item():.8f}", flush=True)
dist.destroy_process_group()
