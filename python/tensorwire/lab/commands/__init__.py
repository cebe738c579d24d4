"""The lab's subcommands of `tensorwire`: `bench ...`, `demo`, `testbed`,
`train`, `bench train`, `partition` and `conformance`.

tensorwire.cli (the product's command line) looks this module up by name and
calls register(commands) after registering its own commands (`info`, `run`):
the arrow points from the lab to the product, which names the lab nowhere
else. Each module of COMMAND_MODULES has register(commands), as the product's
command modules do (tensorwire.cli's docstring: func, needs, cheap imports);
``args.py`` holds what their parsers share.
"""

from __future__ import annotations

import importlib

# In this order in --help, after the product's commands. Each has register(commands).
COMMAND_MODULES = (
    "tensorwire.lab.commands.bench_p2p",  # bench latency/bw/serve
    "tensorwire.lab.commands.bench_tensor",  # bench tensor
    "tensorwire.lab.commands.demo",  # tensorwire demo
    "tensorwire.lab.commands.bench_fabric",  # bench write_bw/read_bw/write_lat/read_lat
    "tensorwire.lab.commands.bench_fullmesh",  # bench fullmesh
    "tensorwire.lab.commands.bench_collectives",  # bench alltoall/allreduce
    "tensorwire.lab.commands.bench_terasort",  # bench terasort
    "tensorwire.lab.commands.bench_torch_dist",  # bench torch-dist
    "tensorwire.lab.commands.bench_report",  # bench report
    "tensorwire.lab.testbed.cli",  # tensorwire testbed
    "tensorwire.lab.commands.train",  # tensorwire train, bench train, partition
    "tensorwire.lab.commands.conformance",  # tensorwire conformance
)


def _load_testbed(name: str):
    """`tensorwire run --testbed NAME`'s hosts (tensorwire.ranks.launch.Hosts)."""
    from ..testbed import Testbed

    return Testbed.load(name)


def register(commands) -> None:
    """Adds the lab's commands to tensorwire.cli's `commands`, and lets `tensorwire
    run --testbed NAME` (a product command) place its ranks in a testbed's hosts."""
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands)
    run = commands.top.choices.get("run")
    if run is not None:
        run.set_defaults(load_testbed=_load_testbed)
