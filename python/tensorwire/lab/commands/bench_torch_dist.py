"""`tensorwire bench torch-dist` (tensorwire.lab.torch_dist): its options
and help; the rounds are the bench module's."""

from __future__ import annotations

import argparse

from .. import torch_dist
from .args import PLOT_NEEDS, add_progress_switch, arg_positive, arg_sizes


def register(commands) -> None:
    p = commands.bench.add_parser(
        "torch-dist",
        help="the torch.distributed backend vs gloo: send/recv, collectives, DDP, pipelining",
        description=torch_dist.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--transport",
        choices=("auto", "tcp", "shm"),
        default="shm",
        help="tensorwire's transport (gloo: always tcp loopback); default shm",
    )
    p.add_argument("--ranks", type=arg_positive, default=2, help="ranks (processes) per round, default 2")
    p.add_argument(
        "--suite",
        default=",".join(torch_dist.SUITES),
        help=f"comma list of {', '.join(torch_dist.SUITES)} (default all)",
    )
    p.add_argument(
        "--lat-sizes",
        type=arg_sizes,
        default=arg_sizes("8,1K,64K"),
        metavar="SIZES",
        help="send/recv latency sizes (default 8,1K,64K)",
    )
    p.add_argument(
        "--sizes",
        type=arg_sizes,
        default=arg_sizes("64K,1M,16M"),
        help="send/recv bandwidth sizes (default 64K,1M,16M)",
    )
    p.add_argument(
        "--coll-sizes",
        type=arg_sizes,
        default=arg_sizes("1M,16M,64M"),
        metavar="SIZES",
        help="collective sizes in bytes (default 1M,16M,64M)",
    )
    p.add_argument(
        "--iters",
        type=arg_positive,
        default=1000,
        help="iterations per latency size (fewer for large sizes), default 1000",
    )
    p.add_argument(
        "--steps",
        type=arg_positive,
        default=8,
        help=f"timed DDP/pipelining steps, default 8 (after {torch_dist.WARMUP} untimed ones, as "
        f"collectives and bandwidth windows are timed after {torch_dist.WARMUP}: DDP rebuilds its "
        "buckets after its first step, and a tensor moved again is shared in place)",
    )
    p.add_argument("--repeat", type=arg_positive, default=3, help="rounds per backend, alternating (default 3)")
    # Not --timeout: in the other commands that bounds one wait or step, not a whole round.
    p.add_argument(
        "--round-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds one round (a world of --ranks running the suite) may take (default 600)",
    )
    p.add_argument("--json", metavar="FILE", help="write every round's numbers and the best as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot bandwidth and collective time by size (matplotlib)")
    add_progress_switch(p)
    p.set_defaults(func=torch_dist.run, needs=(("torch", "torch"), PLOT_NEEDS))
