"""FSDP2 (fully_shard) training on CPU: a plain PyTorch program; only the backend name differs.

    torchrun --nproc-per-node 2 examples/fsdp.py [--backend gloo]
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import tensorwire.torch  # noqa: F401 - registers the "tensorwire" backend

p = argparse.ArgumentParser()
p.add_argument("--backend", default="tensorwire")
p.add_argument("--steps", type=int, default=10)
p.add_argument("--save", help="rank 0 writes the final parameters here (torch.save)")
args = p.parse_args()
dist.init_process_group(args.backend)
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                            torch.nn.Linear(128, 4))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)   # each layer's parameters sharded over the ranks (all_gather / reduce_scatter)
fully_shard(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1 + rank)
for step in range(args.steps):
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
full = torch.cat([q.full_tensor().reshape(-1) for q in model.parameters()])
if args.save and rank == 0:
    torch.save(full, args.save)
print(f"rank {rank}/{world} {args.backend}: loss {loss.item():.6f} params {full.sum().item():.8f} "
      f"{full.abs().sum().item():.8f}", flush=True)
dist.destroy_process_group()
