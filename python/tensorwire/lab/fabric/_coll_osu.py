"""The conventions `tensorwire bench alltoall|allreduce` follows (OSU's
iterations, skips and titles; the 1 Mi int32 profile) and whether its MPI
comparison can run: shared by the command (collectives.py) and its ranks
(_coll_bench.py). Cheap to import."""

from __future__ import annotations

import shutil
from typing import Any

# OSU defaults: LARGE_MESSAGE_SIZE 8192; 1000/100 iterations/skip up to it, 100/10 above.
OSU_LARGE = 8192
OSU_ITERS = (1000, 100)
OSU_SKIP = (100, 10)
OSU_TITLES = {
    "alltoall": "# OSU MPI All-to-All Personalized Exchange Latency Test v7.4",
    "allreduce": "# OSU MPI Allreduce Latency Test v7.4",
}
PROFILE_1MI_INT32: dict[str, Any] = {"bytes": 4 << 20, "count": 1 << 20, "dtype": "int32", "iters": 50, "warmup": 10}


def mpi_unavailable() -> str | None:
    """Why --compare mpi cannot run here (None when it can)."""
    if shutil.which("mpirun") is None:
        return "mpirun not found (apt-get install -y openmpi-bin libopenmpi-dev; then pip install mpi4py)"
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install mpi4py; it must link the Open MPI that mpirun belongs to)"
    return None
