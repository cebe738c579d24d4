"""torch.distributed.pipelining on CPU: a Sequential split into one stage per rank, run with
GPipe and with 1F1B; the last stage checks the loss against the unsplit model's.

    torchrun --nproc-per-node 2 examples/pipeline.py [--backend gloo]
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import tensorwire.torch  # noqa: F401 - registers the "tensorwire" backend

p = argparse.ArgumentParser()
p.add_argument("--backend", default="tensorwire")
p.add_argument("--microbatches", type=int, default=4)
args = p.parse_args()
dist.init_process_group(args.backend)
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)
width = 256
layers = [m for _ in range(2 * world) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())]
full = torch.nn.Sequential(*layers)
per = len(layers) // world
g = torch.Generator().manual_seed(7)
x, y = torch.randn(32, width, generator=g), torch.randn(32, width, generator=g)


def loss_fn(out, target):
    return torch.nn.functional.mse_loss(out, target)


with torch.no_grad():
    want = loss_fn(full(x), y).item()
for schedule_cls in (ScheduleGPipe, Schedule1F1B):
    part = torch.nn.Sequential(*layers[rank * per:(rank + 1) * per])
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    schedule = schedule_cls(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    losses: list = []
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y, losses=losses)
        got = torch.stack(losses).mean().item()
        ok = abs(got - want) <= 1e-5 * max(1.0, abs(want))
        print(f"{schedule_cls.__name__} {args.backend}: loss {got:.8f} unsplit {want:.8f} "
              f"{'OK' if ok else 'DIFFERENT'}", flush=True)
    else:
        schedule.step()
    for q in part.parameters():
        q.grad = None
dist.destroy_process_group()
