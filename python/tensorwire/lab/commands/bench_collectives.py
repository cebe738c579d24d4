"""`tensorwire bench alltoall` and `tensorwire bench allreduce`: the World's
collectives (the C++ collectives layer over the tagged-message engine, the torch
backend's too), measured the way the OSU micro-benchmarks measure MPI
collectives, optionally beside MPI or torch.distributed gloo in the same run.

Method (osu_alltoall / osu_allreduce): per size, `warm-up` untimed calls, then
`iterations` timed calls; each call is timed alone on every rank and followed
by a barrier outside the timer (the layer's dissemination barrier here,
MPI_Barrier for MPI). A rank's latency is its average over the timed calls;
the table gives the average over ranks (Avg) and the smallest and largest rank
(Min, Max), in microseconds. Sizes are bytes per peer (alltoall) or bytes of
the reduced vector (allreduce, float32 or int32 SUM).

--validate fills the inputs with a pattern that depends on rank, peer,
element and iteration before every call and checks every output after it
(both outside the timer); any mismatch is a FAIL.

--api times the library path, world.allreduce(array) / world.alltoall(out,
inp) with its checks, instead of the layer called directly (both work in the
arrays themselves: no copies).

Importing this module is cheap (no UCX, no MPI): the work is imported inside
the command functions.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from ... import TRANSPORTS
from ..fabric._coll_osu import OSU_ITERS, OSU_LARGE, OSU_SKIP, PROFILE_1MI_INT32, mpi_unavailable
from .args import PLOT_NEEDS, add_progress_switch, arg_nonneg, arg_positive as _positive, arg_sizes as _sizes
from .args import deprecated_alias

OPS = ("alltoall", "allreduce")
DEFAULT_SIZES = {"alltoall": "1:1M", "allreduce": "4:1M"}
# allreduce --algorithm auto: recursive doubling up to this many bytes. The C++ layer's
# default (kSmallAllreduceBytes; Collectives.small_allreduce_limit, which a test compares).
SMALL_ALLREDUCE_BYTES = 64 << 10
ALGORITHMS = ("auto", "ring", "rd")
RANK_ENV = ("TENSORWIRE_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")

EXAMPLES = {
    "alltoall": """\
examples:
  tensorwire bench alltoall --ranks 4 --transport shm --validate
  tensorwire bench alltoall --ranks 4 --sizes 4K,64K,1M --compare mpi --json a2a.json --plot a2a.png
  tensorwire bench alltoall --ranks 4 --sizes 64K --api --compare gloo   (world.alltoall vs torch.distributed)
  tensorwire bench alltoall --ranks 4 --profile 1mi-int32 --iters 20     (1 Mi int32 per peer, repeated)
  tensorwire run -n 4 -- tensorwire bench alltoall --format osu        (ranks started by you)
  mpirun -n 4 tensorwire bench alltoall --compare mpi                  (root: $TENSORWIRE_ROOT or 127.0.0.1:29600)
""",
    "allreduce": """\
examples:
  tensorwire bench allreduce --ranks 4 --validate --type int
  tensorwire bench allreduce --ranks 3 --algorithm rd --sizes 4:1M      (non-power-of-two recursive doubling)
  tensorwire bench allreduce --ranks 4 --sizes 1M --compare mpi --json ar.json
  tensorwire bench allreduce --ranks 4 --transport shm --sizes 1M --api --compare gloo --validate
  tensorwire bench allreduce --ranks 4 --profile 1mi-int32               (1 Mi int32, repeated)
""",
}

DESCRIPTION = {
    "alltoall": "Alltoall of the World's C++ collectives layer: every receive posted first, then the sends "
    "to ranks r+1, r+2, ... (tagged messages: eager through the peer's inbox ring, larger ones "
    "placed straight into the receiver's buffer). Sizes are bytes per peer (OSU).",
    "allreduce": "Allreduce (SUM) of the World's C++ collectives layer: ring (reduce-scatter + all-gather, "
    "2(N-1) steps of 1/N of the vector) or recursive doubling (ceil(log2 N) full-vector exchanges; "
    "ranks beyond the largest power of two fold in first and get the result back). --algorithm "
    "auto takes recursive doubling up to %d KiB (TENSORWIRE_COLL_SMALL_BYTES, or --threshold) "
    "or below one element per rank, then the ring." % (SMALL_ALLREDUCE_BYTES >> 10),
}


# ---------------------------------------------------------------- command line


def _add_parser(bench_sub, op: str) -> argparse.ArgumentParser:
    p = bench_sub.add_parser(
        op,
        help=(
            "alltoall on one-sided writes (osu_alltoall), optionally vs MPI"
            if op == "alltoall"
            else "allreduce: ring / recursive doubling (osu_allreduce), optionally vs MPI"
        ),
        description=textwrap.fill(DESCRIPTION[op], 79)
        + "\n\n"
        + __doc__.split("\n\n")[1]
        + "\n\n"
        + __doc__.split("\n\n")[2],
        epilog=EXAMPLES[op],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--ranks",
        "-np",
        type=_positive,
        default=None,
        help="when not started as a rank: start this many ranks here (mpirun -np; default 2; 4 with "
        "--profile 1mi-int32)",
    )
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="data transport between ranks: tcp, shm, rdma, or auto (UCX_TLS as set; shm on one host)",
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help=f"sizes in bytes ({'per peer' if op == 'alltoall' else 'of the vector'}): a list like "
        f"4K,1M or a power-of-two range (default {DEFAULT_SIZES[op]})",
    )
    p.add_argument(
        "--iters",
        "-i",
        type=_positive,
        default=None,
        help=f"timed iterations per size (default OSU's: {OSU_ITERS[0]} up to {OSU_LARGE} B, {OSU_ITERS[1]} above)",
    )
    p.add_argument(
        "--warmup",
        "-x",
        type=arg_nonneg,
        default=None,
        help=f"untimed iterations first (default OSU's: {OSU_SKIP[0]} / {OSU_SKIP[1]})",
    )
    if op == "allreduce":
        p.add_argument(
            "--type",
            choices=("float", "int"),
            default="float",
            help="element type: float (float32, default) or int (int32); the operation is SUM",
        )
        p.add_argument(
            "--algorithm",
            type=_algorithm,
            choices=ALGORITHMS,
            default="auto",
            help="ring, rd (recursive doubling) or auto: rd up to --threshold, then the ring",
        )
        p.add_argument(
            "--threshold",
            type=_sizes,
            default=None,
            metavar="BYTES",
            help=f"auto's switch from rd to ring (default {SMALL_ALLREDUCE_BYTES >> 10}K; sets "
            f"TENSORWIRE_COLL_SMALL_BYTES in the ranks)",
        )
    p.add_argument(
        "--validate",
        "-c",
        action="store_true",
        help="iteration-dependent pattern in, every output checked (adds a Validation column)",
    )
    p.add_argument(
        "--compare",
        choices=("mpi", "gloo"),
        default=None,
        help="also measure the same operation in the same run through mpi4py (ranks are started "
        "by mpirun; needs mpirun and mpi4py) or torch.distributed's gloo backend (needs torch)",
    )
    p.add_argument(
        "--api",
        action="store_true",
        help="time the library path, world.%s on numpy arrays (its checks included), "
        "instead of the collectives layer called directly"
        % ("alltoall(out, inp)" if op == "alltoall" else "allreduce(array)"),
    )
    p.add_argument(
        "--profile",
        choices=("1mi-int32",),
        default=None,
        help="1mi-int32: the RoCE study's MPI_Alltoall experiment, 1 Mi int32 per peer (or an int32 "
        "vector of 1 Mi for allreduce), called back to back; adds algbw/busbw",
    )
    p.add_argument(
        "--rounds",
        type=_positive,
        default=None,
        help="split each size's timed iterations into this many blocks, the series taking turns "
        "block by block (default 5 with --compare, else 1)",
    )
    p.add_argument(
        "--format",
        choices=("table", "osu"),
        default="table",
        help="table (default: both series side by side) or osu (OSU's header lines and columns, one table per series)",
    )
    p.add_argument(
        "--progress-mode",
        choices=("inline", "blocking"),
        default="inline",
        help="who drives each rank's worker: inline (the waiting rank itself, default) or blocking (a progress thread)",
    )
    add_progress_switch(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds any one wait for a peer may take before the run fails naming it (default 30)",
    )
    p.add_argument("--json", metavar="FILE", help="rank 0 writes the report, with every rank's raw samples")
    p.add_argument("--plot", metavar="FILE.png", help="latency vs size, one line per series (needs matplotlib)")
    p.add_argument("--kill-rank", type=int, default=None, help=argparse.SUPPRESS)  # tests: SIGKILL this rank
    # bench/results/coll_wait_before_after.txt was made with -n; -n is perftest's iterations in the other commands.
    deprecated_alias(p, "-n", replacement="--ranks", why="-n is perftest's iteration count in bench write_bw etc.")
    p.set_defaults(func=run_command, coll_op=op, needs=(PLOT_NEEDS,))
    return p


def _algorithm(name: str) -> str:
    if name == "rh":
        raise argparse.ArgumentTypeError(
            "rh (recursive halving) went with the Python collectives engine; the C++ "
            "layer has ring and rd (recursive doubling)"
        )
    return name


def register(commands) -> None:
    """Adds `bench alltoall` and `bench allreduce` (tensorwire.lab.commands's COMMAND_MODULES)."""
    for op in OPS:
        _add_parser(commands.bench, op)


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The command-line arguments that reproduce `args` (for the ranks we start)."""
    out = [
        args.coll_op,
        "--transport",
        args.transport,
        "--format",
        args.format,
        "--progress-mode",
        args.progress_mode,
        "--timeout",
        repr(args.timeout),
    ]
    if args.sizes is not None:
        out += ["--sizes", ",".join(map(str, args.sizes))]
    for flag, value in (
        ("--iters", args.iters),
        ("--warmup", args.warmup),
        ("--compare", args.compare),
        ("--profile", args.profile),
        ("--rounds", args.rounds),
        ("--json", args.json and os.path.abspath(args.json)),
        ("--plot", args.plot and os.path.abspath(args.plot)),
        ("--kill-rank", args.kill_rank),
    ):
        if value is not None:
            out += [flag, str(value)]
    if args.coll_op == "allreduce":
        out += ["--type", args.type, "--algorithm", args.algorithm]
        if args.threshold:
            out += ["--threshold", str(args.threshold[0])]
    if args.validate:
        out.append("--validate")
    if args.api:
        out.append("--api")
    return out


# ---------------------------------------------------------------- launching


def _as_rank() -> bool:
    return any(k in os.environ for k in RANK_ENV)


def _launch(args: argparse.Namespace) -> int:
    n = args.ranks or (4 if args.profile else 2)
    rank_cmd = [sys.executable, "-m", "tensorwire", "bench", *_argv_of(args)]  # the same command, as a rank
    env_path = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if args.compare == "mpi":
        from ...config import PROGRESS_BAR
        from ...ranks.launch import free_port

        why = mpi_unavailable()
        if why:
            print(f"tensorwire bench {args.coll_op}: --compare mpi is not possible here: {why}", file=sys.stderr)
            return 2
        cmd = ["mpirun", "-n", str(n)]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if n > (os.cpu_count() or 1):
            cmd.append("--oversubscribe")
        root = f"127.0.0.1:{free_port()}"
        cmd += [
            "-x",
            f"TENSORWIRE_ROOT={root}",
            "-x",
            "PYTHONUNBUFFERED=1",
            "-x",
            PROGRESS_BAR,
            "-x",
            "PYTHONPATH=" + os.pathsep.join(p for p in (env_path, os.environ.get("PYTHONPATH")) if p),
        ]
        cmd += rank_cmd
        print(f"# launching: {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            os.killpg(proc.pid, 15)
            proc.wait()
            return 130
    if args.compare == "gloo":
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            print(
                f"tensorwire bench {args.coll_op}: --compare gloo needs torch: pip install tensorwire[torch]",
                file=sys.stderr,
            )
            return 2
    from ...ranks import launch

    return launch.run(rank_cmd, launch.plan(n))


def run_command(args: argparse.Namespace) -> int:
    if args.profile == "1mi-int32" and args.sizes is None:
        args.sizes = [PROFILE_1MI_INT32["bytes"]]
    if args.sizes is None:
        args.sizes = _sizes(DEFAULT_SIZES[args.coll_op])
    if args.coll_op == "allreduce":
        bad = [s for s in args.sizes if s % 4]
        if bad:
            print(
                f"tensorwire bench allreduce: sizes must be multiples of 4 B (32-bit elements), not {bad}",
                file=sys.stderr,
            )
            return 2
    if args.ranks == 1:
        print(
            f"tensorwire bench {args.coll_op}: needs 2 or more ranks (one rank has no collectives layer: "
            f"nothing moves)",
            file=sys.stderr,
        )
        return 2
    if args.api and args.coll_op == "allreduce" and (args.algorithm != "auto" or args.threshold):
        print(
            "tensorwire bench allreduce: --api times world.allreduce, which chooses its algorithm itself "
            "(auto); leave out --algorithm/--threshold",
            file=sys.stderr,
        )
        return 2
    from ...config import export_progress_bar

    export_progress_bar(args.progress)  # the ranks started below inherit the choice
    if not _as_rank():
        return _launch(args)
    from ..fabric._coll_bench import run_rank

    return run_rank(args)
