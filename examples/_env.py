"""Lets the examples run under `tensorwire run` as under torchrun: torch.distributed's env://
reads RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, which `tensorwire run` spells TENSORWIRE_*."""

import os


def torch_env() -> None:
    if "RANK" in os.environ or "TENSORWIRE_RANK" not in os.environ:
        return  # torchrun, mpirun with env already set, or a single process
    host, port = os.environ["TENSORWIRE_ROOT"].rsplit(":", 1)
    os.environ.update(RANK=os.environ["TENSORWIRE_RANK"], WORLD_SIZE=os.environ["TENSORWIRE_SIZE"],
                      LOCAL_RANK=os.environ.get("TENSORWIRE_LOCAL_RANK", "0"),
                      MASTER_ADDR=host, MASTER_PORT=port)  # a free port the launcher picked for rank 0
