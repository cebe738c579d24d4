"""`tensorwire conformance` (tensorwire.lab.conformance): PyTorch's own
distributed test suite against a torch.distributed backend."""

from __future__ import annotations

import argparse


def _run(args: argparse.Namespace) -> int:
    import shlex
    import sys
    from .. import conformance

    return conformance.run(args, command=shlex.join(["tensorwire"] + sys.argv[1:]))


def register(commands) -> None:
    from .. import conformance  # cheap while the commands load: tensorwire.torch skips torch then

    p = commands.top.add_parser(
        "conformance",
        help="PyTorch's distributed test suite against a backend (tensorwire, gloo)",
        description=conformance.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    conformance.add_arguments(p)
    p.set_defaults(func=_run, needs=(("torch", "torch"), ("expecttest", "test")))
