"""torch.distributed.checkpoint: each rank saves its state, loads it back into fresh tensors,
and the ranks agree that every value came back (an all_reduce of the mismatches).

    torchrun --nproc-per-node 2 examples/checkpoint.py --dir /tmp/ckpt [--backend gloo]
"""

import argparse

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tensorwire.torch  # noqa: F401 - registers the "tensorwire" backend

p = argparse.ArgumentParser()
p.add_argument("--backend", default="tensorwire")
p.add_argument("--dir", required=True)
args = p.parse_args()
dist.init_process_group(args.backend)
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)  # replicated state: DCP saves one copy of what every rank holds alike
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
saved = {"model": model.state_dict(), "step": torch.tensor(42)}
dcp.save(saved, checkpoint_id=args.dir)

fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
loaded = {"model": fresh.state_dict(), "step": torch.tensor(0)}
dcp.load(loaded, checkpoint_id=args.dir)
bad = torch.tensor(sum(int(not torch.equal(a, loaded["model"][k])) for k, a in saved["model"].items())
                   + int(loaded["step"].item() != 42))
dist.all_reduce(bad)
print(f"rank {rank}/{world} {args.backend}: checkpoint {'OK' if bad.item() == 0 else f'{bad.item()} values differ'}",
      flush=True)
dist.destroy_process_group()
