"""Rank side of test_torch_testbed.py: DDP on a small model for a few SGD steps on one backend
(argv[1]); each rank saves its trained parameters, and for tensorwire what its group runs on,
to OUT/<backend>_rank<r>.pt (argv[2])."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tensorwire.torch  # noqa: F401 - registers "tensorwire"

backend, out_dir = sys.argv[1], sys.argv[2]
STEPS = 5
dist.init_process_group(backend, timeout=timedelta(seconds=40))
r = dist.get_rank()
torch.manual_seed(0)  # every rank starts from the same model (DDP broadcasts rank 0's anyway)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
gen = torch.Generator().manual_seed(100 + r)  # each rank its own batches
for _ in range(STEPS):
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
where = ""
if backend == "tensorwire":
    where = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).describe()
dist.barrier()
torch.save(
    {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "initial": initial,
        "world": dist.get_world_size(),
        "where": where,
        "backend_of_group": str(dist.get_backend()),
    },
    os.path.join(out_dir, f"{backend}_rank{r}.pt"),
)
dist.destroy_process_group()
