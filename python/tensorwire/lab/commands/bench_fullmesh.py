"""`tensorwire bench fullmesh` (tensorwire.lab.fabric.fullmesh): its options and
help; the run and the sweep are the bench module's."""

from __future__ import annotations

import argparse

from ... import TRANSPORTS
from ..fabric import fullmesh
from ..fabric.perftest.peer import in_world
from .args import PLOT_NEEDS, add_progress_switch, arg_counts, arg_positive as _positive, arg_rate, arg_seconds
from .args import arg_sizes as _sizes, deprecated_alias

HELP = (
    fullmesh.__doc__.split("\n\n", 1)[1]
    + """
examples:
  tensorwire run -n 3 -- tensorwire bench fullmesh --transport tcp --duration 4 --lanes 2
  tensorwire bench fullmesh --transport tcp --sweep-ranks 2,3,4 --duration 4 --json fm.json --plot fm.png
  tensorwire bench fullmesh --testbed tw --sweep-ranks 2,4,8 --isl-rate 4gbit --link-rate 1gbit --plot fig7.png
"""
)


def register(commands) -> None:
    p = commands.bench.add_parser(
        "fullmesh",
        help="all-pairs one-sided write bandwidth and fairness (N(N-1) flows)",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="tcp",
        help="data transport (default tcp; across testbed hosts always tcp)",
    )
    p.add_argument(
        "-s",
        "--size",
        dest="sizes",
        type=_sizes,
        default=[65536],
        help="message size (perftest -s; one size here; default 65536, perftest's)",
    )
    p.add_argument("-q", "--lanes", type=_positive, default=1, help="channels per ordered pair (perftest -q)")
    p.add_argument(
        "-t",
        "--tx-depth",
        dest="window",
        type=_positive,
        default=None,
        help="writes in flight per channel (default: ~8 MiB in flight, 2..32)",
    )
    p.add_argument("-D", "--duration", type=arg_seconds, default=4.0, help="seconds of streaming (default 4)")
    p.add_argument(
        "-f", "--margin", type=float, default=None, help="warm-up and cool-down margin (default D/4, perftest's)"
    )
    p.add_argument(
        "--sweep-ranks",
        type=arg_counts,
        default=None,
        metavar="N,N,...",
        help="sweep these world sizes (each a `tensorwire run -n N`); default 2,3,4, "
        "or every size up to the testbed's host count",
    )
    p.add_argument("--testbed", default=None, metavar="NAME", help="run the sweep inside this testbed's hosts")
    p.add_argument("--hosts", default=None, help="testbed hosts to use in order (default: all of the testbed)")
    p.add_argument(
        "--link-rate",
        type=arg_rate,
        default=None,
        metavar="RATE",
        help="per-host link rate (e.g. 1gbit): a rank's TX or RX above it FAILs",
    )
    p.add_argument(
        "--isl-rate",
        type=arg_rate,
        default=None,
        metavar="RATE",
        help="inter-group capacity drawn on the scaling plot (e.g. 4gbit)",
    )
    p.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        metavar="S",
        help="a sweep's run (one world size) that takes longer FAILs (default: duration + 90 s)",
    )
    p.add_argument("--json", metavar="FILE", help="rank 0 (or the sweep) writes the report here, with raw bins")
    p.add_argument("--plot", metavar="FILE.png", help="per-flow bars (one run) or the scaling plot (sweep)")
    add_progress_switch(p)  # the sweep's bar: one step per world size
    # bench/results/fullmesh_loopback.txt was made with --ranks 2,3,4.
    deprecated_alias(
        p,
        "--ranks",
        replacement="--sweep-ranks",
        why="a sweep has its own flag; --ranks is a count of ranks in every other command",
    )
    p.set_defaults(func=_main, test="fullmesh", needs=(PLOT_NEEDS,))


def _main(args) -> int:
    if len(args.sizes) != 1:
        raise SystemExit(f"-s/--size: a fullmesh run streams one size, got {len(args.sizes)}")
    args.size = args.sizes[0]
    margin = args.duration / 4 if args.margin is None else args.margin
    if margin < 0 or 2 * margin >= args.duration:
        raise SystemExit(f"--margin {margin:g} leaves no sample window in --duration {args.duration:g}")
    args.margin = margin
    from ...config import export_progress_bar

    export_progress_bar(args.progress)
    if in_world():
        return fullmesh.run_rank(args)
    return fullmesh.sweep(args)
