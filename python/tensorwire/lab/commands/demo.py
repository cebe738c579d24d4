"""`tensorwire demo`: a two-process tensor write on loopback (tensorwire.lab.demo)."""

from __future__ import annotations

import argparse

from ... import TRANSPORTS
from .args import arg_positive as _positive


def register(commands) -> None:
    p = commands.top.add_parser("demo", help="a two-process tensor write on loopback, with bandwidth and latency")
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="data transport: tcp, shm (shared memory), rdma, or auto (UCX_TLS as set)",
    )
    p.add_argument("--mib", type=_positive, default=64, help="tensor size in MiB (default 64)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    return run_demo(args.transport, args.mib)
