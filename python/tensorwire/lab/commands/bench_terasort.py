"""`tensorwire bench terasort`: TeraGen -> sample/partition -> shuffle -> sort -> TeraValidate
over N ranks, with the shuffle moving every partition straight into its
receiver's registered memory (tensorwire dynamic slots), and optionally the
same shuffle over plain TCP sockets for comparison (docs/terasort.md)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from ... import TRANSPORTS
from .args import PLOT_NEEDS, add_progress_switch, arg_positive as _positive, arg_size as _size

HELP = """\
TeraSort on tensorwire (Hadoop's TeraGen / TeraSort / TeraValidate, one process per rank):

  teragen    every rank generates its share of the rows (gensort/TeraGen binary
             records, 100 B, 10-byte key) and the CRC-32 sum of its records
  partition  each rank samples keys (--samples in total, from 10 places of its
             input); rank 0 sorts them and picks R-1 split points; every rank
             assigns each record to the first range whose split point is above
             its key and gathers the records per destination into registered memory
  shuffle    rank i sends partition j to rank j through a dynamic slot: the receiver
             allocates from its pool and RDMA-reads the sender's memory (pieces of at
             most --chunk bytes); every rank knows what it will receive from the
             partition-size matrix exchanged after partitioning (an empty partition
             is announced there as 0 rows); one thread per rank drives all pairs
  sort       each rank sorts what it received by key
  validate   TeraValidate: keys in order within and across ranks, row count and the
             128-bit CRC-32 sum equal to the generator's

--baseline tcp repeats the shuffle over plain TCP sockets (one connection per
ordered pair, sendall/recv_into) on the same data and addresses, its rounds
alternating with the slots' (5 each unless --repeat says), and checks that it
delivered the same bytes. Times are the slowest rank's; MB/s = 10^6 B/s;
shuffle bytes count what left each rank (the rank's own partition stays local).

Without TENSORWIRE_RANK in the environment the command starts --ranks ranks of
itself through `tensorwire run`; under `tensorwire run` (or mpirun/srun) it runs as a
rank. Rank 0 draws the progress bar, one step per phase (--progress/--no-progress).

examples:
  tensorwire bench terasort --rows 1m --ranks 4 --transport shm
  tensorwire bench terasort --rows 2000000 --ranks 4 --transport tcp --baseline tcp --json ts.json --plot ts.png
  tensorwire run -n 3 -- tensorwire bench terasort --rows 300k --transport tcp
  tensorwire bench terasort --gen-only part0 --rows 1000     # = gensort 1000 part0 (prints the checksum)
"""

PHASES = ("teragen", "partition", "shuffle", "sort", "validate")
_SUFFIX = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_rows(text: str) -> int:
    """'1000', '10k', '2m', '1b' (TeraGen's decimal suffixes)."""
    t = text.strip().lower().replace("_", "")
    scale = _SUFFIX.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        value = int(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad row count {text!r}: use e.g. 1000, 10k, 2m") from None
    if value < 0:
        raise argparse.ArgumentTypeError("row count must be >= 0")
    return value


def register(commands) -> None:
    """Adds `bench terasort` (tensorwire.lab.commands's COMMAND_MODULES)."""
    _add_parser(commands.bench)


def _add_parser(bench_sub) -> None:
    p = bench_sub.add_parser(
        "terasort",
        help="TeraGen/TeraSort/TeraValidate with the shuffle on tensorwire",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--rows",
        type=parse_rows,
        default=parse_rows("1m"),
        help="rows in total (100 B each; suffixes k, m, b as in teragen; default 1m)",
    )
    p.add_argument("--ranks", type=_positive, default=4, help="ranks to start when not under a launcher (default 4)")
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="tensorwire transport of the shuffle: tcp, shm, rdma or auto (UCX_TLS as set)",
    )
    p.add_argument(
        "--baseline",
        choices=("none", "tcp"),
        default="none",
        help="also run the shuffle over plain TCP sockets and compare (default none)",
    )
    p.add_argument(
        "--chunk", type=_size, default=_size("64M"), help="largest piece of a partition sent at once (default 64M)"
    )
    p.add_argument(
        "--samples",
        type=_positive,
        default=100_000,
        help="keys sampled in total for the split points (default 100000, as TeraSort)",
    )
    p.add_argument(
        "--schedule",
        choices=("all", "pairwise"),
        default="all",
        help="all: every pair exchanges at once (default); pairwise: step k sends to rank+k and "
        "receives from rank-k, one flow each way per rank at a time",
    )
    p.add_argument(
        "--repeat",
        type=_positive,
        default=None,
        help="run each shuffle this many times on the same data and report the median round "
        "(default 1, the job as it is; 5 with --baseline tcp, whose rounds alternate with "
        "the slots': one round is one sample of a noisy machine)",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any one wait may take (default 60)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON (rank 0)")
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of the phases (needs matplotlib)")
    p.add_argument(
        "--output",
        metavar="DIR",
        help="write each rank's sorted partition to DIR/part-r-<rank> (untimed; cat them in rank "
        "order for the sorted file, e.g. for gensort's valsort)",
    )
    p.add_argument(
        "--gen-only",
        metavar="FILE",
        help="only write --rows records from --start to FILE (gensort's binary format) and "
        "print the checksum; no ranks",
    )
    p.add_argument("--start", type=parse_rows, default=0, help="first row id with --gen-only (gensort -b)")
    add_progress_switch(p)
    p.add_argument("--kill-rank", type=int, default=None, help=argparse.SUPPRESS)  # failure tests
    p.add_argument("--kill-phase", choices=PHASES, default="shuffle", help=argparse.SUPPRESS)
    p.add_argument("--inject", choices=("swap", "drop"), default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_main, needs=(PLOT_NEEDS,))


def _main(args: argparse.Namespace) -> int:
    if args.repeat is None:
        args.repeat = 5 if args.baseline == "tcp" else 1
    if args.gen_only:
        from ..fabric import teragen

        t0 = time.perf_counter()
        total = teragen.write_file(args.gen_only, args.rows, args.start)
        dt = time.perf_counter() - t0
        print(
            f"wrote {args.rows} records ({args.rows * teragen.RECORD} B) from row {args.start} to "
            f"{args.gen_only} in {dt:.2f} s",
            file=sys.stderr,
        )
        print(f"{total:x}")
        return 0
    from ...config import export_progress_bar
    from ...ranks.world import detect

    export_progress_bar(args.progress)  # the ranks started below inherit the choice
    placement = detect()
    if placement.launcher == "single" and args.ranks > 1:
        return _launch(args)
    from ..fabric._terasort_job import run_rank

    return run_rank(args)


def _launch(args: argparse.Namespace) -> int:
    from ...ranks.launch import plan, run

    cmd = [
        sys.executable,
        "-m",
        "tensorwire",
        "bench",
        "terasort",
        "--rows",
        str(args.rows),  # the same, as a rank
        "--ranks",
        str(args.ranks),
        "--transport",
        args.transport,
        "--baseline",
        args.baseline,
        "--chunk",
        str(args.chunk),
        "--samples",
        str(args.samples),
        "--repeat",
        str(args.repeat),
        "--schedule",
        args.schedule,
        "--timeout",
        str(args.timeout),
    ]
    if args.json:
        cmd += ["--json", os.path.abspath(args.json)]
    if args.plot:
        cmd += ["--plot", os.path.abspath(args.plot)]
    if args.output:
        cmd += ["--output", os.path.abspath(args.output)]
    if args.inject:
        cmd += ["--inject", args.inject]
    if args.kill_rank is not None:
        cmd += ["--kill-rank", str(args.kill_rank), "--kill-phase", args.kill_phase]
    sys.stdout.flush()
    return run(cmd, plan(args.ranks))
