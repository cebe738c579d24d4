"""The point-to-point family `bench write_bw|read_bw|write_lat|read_lat`, its
aliases `bench bw|latency` (one command per kind, the operation chosen with
--op) and `bench serve` (the passive side a spawned peer runs); fullmesh, in
../fullmesh.py, shares their option types. Their options and help, and the
functions they run. Importing this module is cheap (the CLI imports it to
register the commands); the work is imported inside the commands."""

from __future__ import annotations

import argparse
from typing import Callable

from ... import TRANSPORTS
from ..fabric.common import parse_sizes
from ..fabric.perftest.measure import measure_bw, measure_lat
from ..fabric.perftest.peer import serve_main, with_client
from .args import PLOT_NEEDS, add_progress_switch, arg_rate, arg_seconds
from .args import arg_positive as _positive, arg_sizes as _sizes

FORMATS = ("perftest", "osu", "imb")
ALL_SIZES = "2:8M"  # perftest -a: 2^1..2^23
BW_SIZES, LAT_SIZES = "65536", "2"  # perftest's -s defaults
BW_ITERS = {"write": 5000, "read": 1000}  # perftest's -n defaults (per lane)
LAT_ITERS = 1000


BW_HELP = """\
Streams one-sided {ops} of each size on --lanes channels (perftest -q), at most
--tx-depth in flight per lane, and reports perftest's columns: BW peak, BW
average (MiB/sec = 2^20 B/s, or Gb/sec = 10^9 bit/s with --report-gbits) and
MsgRate[Mpps]. --iters is per lane (perftest -n), so the table shows
iters x lanes. BW average = bytes / (first post .. last completion incl. the
final flush); BW peak = the best run of consecutive operations
(completion[j] - post[i]), never below the average by construction.
--duration D (perftest -D) streams for D seconds and counts only the
completions inside [margin, D - margin] (margin = D/4 unless --margin); peak
is disabled (0.00) as in perftest. --bidirectional (-b): both sides stream at
once, each measures what it initiates, the table shows the sum.
--validate (-c): the source holds an iteration-dependent pattern during the
timed run and the sink is checked after it; then a few untimed transfers,
one pattern per round, lanes in turn, each checked by the receiver (OSU -c).
--format osu prints osu_bw/osu_bibw's columns (MB/s = 10^6 B/s), imb prints
IMB Uniband/Biband's (Mbytes/sec = 10^6 B/s, Msg/sec).

Peers: spawned on 127.0.0.1 by default; --server / --connect HOST:PORT like
perftest's two sides; under `tensorwire run -n 2` rank 0 measures against rank 1.

examples:
  tensorwire bench {name} --transport tcp -s 64K,1M -q 2
  tensorwire bench {name} --transport shm -a --report-gbits --format osu
  tensorwire bench {name} --transport tcp -s 1M -D 4 -b --json bw.json --plot bw.png
  tensorwire run -n 2 --testbed tw --hosts h1,h2 -- tensorwire bench {name} --transport tcp
"""

LAT_HELP = """\
{what} Reported in perftest's columns: t_min, t_max (2nd largest raw sample:
the 2 largest are dropped), t_typical (median), t_avg, t_stdev (true stdev,
not perftest's integer-truncated one), 99% and 99.9% percentiles, in usec.
{rtt}
--validate (-c): after the timed loop, a few untimed transfers with an
iteration-dependent pattern, each checked by the receiver. --format osu prints
osu_latency's `Avg Latency(us)`, imb prints IMB PingPong's t[usec] and
Mbytes/sec (10^6 B/s).

examples:
  tensorwire bench {name} --transport shm -s 8,4K
  tensorwire bench {name} --transport tcp -a --format imb --json lat.json --plot lat.png
"""

LAT_WHAT = {
    "write": (
        "Ping-pong of one-sided writes: each side polls the last byte of its receive buffer and "
        "answers (ib_write_lat / ucp_put_lat).",
        "Latency is one-way: half the round trip (RTT/2).",
    ),
    "read": (
        "One read at a time, timed from post to completion (ib_read_lat).",
        "Latency is the FULL ROUND TRIP (labelled rtt), as perftest reports reads.",
    ),
}

ALIAS_HELP = """\
`bench {name}` is an alias of `bench {family}` (--op picks the member: {members});
it takes the same options and prints the same table, JSON rows and units.
Its older spellings still work: --sizes (= -s), --iters (= -n), --window
(= -t), --raw (a no-op: the JSON always has the raw samples).

"""


def _peer_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="data transport: tcp, shm (shared memory), rdma, or auto (UCX_TLS as set)",
    )
    # Not --workers: in `bench train` that counts worker processes (docs/benchmarks.md, "Flags").
    p.add_argument(
        "--ucp-workers",
        dest="workers",
        type=_positive,
        default=1,
        metavar="N",
        help="UCP workers (progress contexts) per device: Device(workers=N) (default 1)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "-p", "--port", type=int, default=0, help="port to listen on with --server (perftest -p; default: pick one)"
    )
    p.add_argument(
        "-d",
        "--ib-dev",
        "--net-devices",
        dest="net_devices",
        default="auto",
        metavar="DEV",
        help="the network device(s) UCX may use for data, e.g. mlx5_0:1 or eth0 (perftest -d; sets "
        "UCX_NET_DEVICES for this device and a spawned peer; default: lo on loopback, else UCX's choice)",
    )


def _common_options(p: argparse.ArgumentParser, sizes: str) -> None:
    _peer_options(p)
    p.add_argument(
        "-s",
        "--size",
        "--sizes",
        dest="sizes",
        type=_sizes,
        default=None,
        help=f"message sizes: 8,4K,1M or a power-of-two range 2:8M (default {sizes})",
    )
    p.add_argument("-a", "--all", action="store_true", help=f"all sizes 2 B..8 MiB (perftest -a: {ALL_SIZES})")
    p.add_argument(
        "--budget",
        type=_sizes,
        default=None,
        metavar="BYTES",
        help="cap on bytes moved per size (lowers --iters for big sizes; default: no cap, as perftest)",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="perftest",  # not -F: perftest's CPU-frequency switch
        help="table columns and units of which anchor (default perftest)",
    )
    p.add_argument(
        "-c",
        "--validate",
        action="store_true",
        help="check received contents against an iteration-dependent pattern (FAIL on mismatch)",
    )
    p.add_argument(
        "--link-rate",
        type=arg_rate,
        default=None,
        metavar="RATE",
        help="the link's rate (e.g. 1gbit, 25G): results above it FAIL",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--server",
        action="store_true",
        help="run only the passive side and wait for a client (perftest without a host)",
    )
    mode.add_argument("--connect", metavar="HOST:PORT", help="run the active side against a --server elsewhere")
    p.add_argument("--json", metavar="FILE", help="write the report (with raw samples) as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot the results (needs matplotlib)")
    add_progress_switch(p)


def _bw_options(p: argparse.ArgumentParser, iters: str) -> None:
    _common_options(p, BW_SIZES)
    p.add_argument(
        "-n", "--iters", type=_positive, default=None, help=f"iterations per lane (perftest -n; default {iters})"
    )
    p.add_argument("-q", "--lanes", type=_positive, default=1, help="channels to the peer (perftest -q)")
    p.add_argument(
        "-t",
        "--tx-depth",
        "--window",
        dest="window",
        type=_positive,
        default=None,
        help="operations in flight per lane (default: ~8 MiB in flight, 2..32)",
    )
    p.add_argument(
        "-D",
        "--duration",
        type=arg_seconds,
        default=None,
        metavar="S",
        help="run S seconds instead of --iters; sample the middle (perftest -D)",
    )
    p.add_argument(
        "-f",
        "--margin",
        type=float,
        default=None,
        metavar="S",
        help="warm-up and cool-down margin of --duration (default D/4)",
    )
    p.add_argument("-b", "--bidirectional", action="store_true", help="both directions at once (sum)")
    p.add_argument(
        "--report-gbits",
        "--report_gbits",
        dest="report_gbits",
        action="store_true",
        help="report Gb/sec (10^9 bit/s) instead of MiB/sec",
    )
    p.add_argument("-N", "--no-peak", action="store_true", help="do not compute BW peak (prints 0.00)")


def _lat_options(p: argparse.ArgumentParser) -> None:
    _common_options(p, LAT_SIZES)
    p.add_argument(
        "-n", "--iters", type=_positive, default=LAT_ITERS, help=f"iterations per size (default {LAT_ITERS})"
    )


def _alias_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--op",
        choices=("write", "read"),
        default="write",
        help="one-sided operation: the family member to run (default write)",
    )
    p.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)  # old flag: the JSON always has them


def register(commands) -> None:
    bench_sub = commands.bench
    fmt = argparse.RawDescriptionHelpFormatter
    for op in ("write", "read"):
        name = f"{op}_bw"
        p = bench_sub.add_parser(
            name,
            formatter_class=fmt,
            help=f"one-sided {op} bandwidth, perftest ib_{op}_bw semantics (-q, -D, -b)",
            description=BW_HELP.format(ops=op + "s", name=name),
        )
        _bw_options(p, str(BW_ITERS[op]))
        p.set_defaults(func=_bw_main, op=op, test=name, needs=(PLOT_NEEDS,))
    for op, (what, rtt) in LAT_WHAT.items():
        name = f"{op}_lat"
        p = bench_sub.add_parser(
            name,
            formatter_class=fmt,
            help=f"one-sided {op} latency, perftest ib_{op}_lat semantics"
            + (" (full RTT)" if op == "read" else " (RTT/2)"),
            description=LAT_HELP.format(what=what, rtt=rtt, name=name),
        )
        _lat_options(p)
        p.set_defaults(func=_lat_main, op=op, test=name, lanes=1, needs=(PLOT_NEEDS,))


def register_aliases(commands) -> None:
    """`bench latency` (write_lat, --op read: read_lat), `bench bw` (write_bw / read_bw) and `bench serve`."""
    bench_sub = commands.bench
    fmt = argparse.RawDescriptionHelpFormatter
    p = bench_sub.add_parser(
        "latency",
        formatter_class=fmt,
        help="alias of write_lat (--op read: read_lat)",
        description=ALIAS_HELP.format(name="latency", family="write_lat", members="write_lat, read_lat")
        + LAT_HELP.format(
            what=" ".join(w for w, _ in LAT_WHAT.values()),
            rtt=" ".join(r for _, r in LAT_WHAT.values()),
            name="latency",
        ),
    )
    _lat_options(p)
    _alias_options(p)
    p.set_defaults(func=_lat_main, test=None, lanes=1, needs=(PLOT_NEEDS,))
    p = bench_sub.add_parser(
        "bw",
        formatter_class=fmt,
        help="alias of write_bw (--op read: read_bw)",
        description=ALIAS_HELP.format(name="bw", family="write_bw", members="write_bw, read_bw")
        + BW_HELP.format(ops="writes (reads with --op read)", name="bw"),
    )
    _bw_options(p, "5000 write, 1000 read")
    _alias_options(p)
    p.set_defaults(func=_bw_main, test=None, needs=(PLOT_NEEDS,))
    p = bench_sub.add_parser("serve", help="the passive side of the point-to-point benches (what --server runs)")
    _peer_options(p)
    p.set_defaults(func=serve_main, test="serve")


def _sizes_of(args, default: str) -> list[int]:
    if args.all:
        return parse_sizes(ALL_SIZES)
    return args.sizes or parse_sizes(default)


def _run(args, kind: str, measure: Callable) -> int:
    """Runs the family member `args.op`_`kind` (an alias names it by --op) and reports."""
    args.test = args.test or f"{args.op}_{kind}"
    from ...config import export_progress_bar

    export_progress_bar(args.progress)
    if args.server:
        return serve_main(args)
    sizes = _sizes_of(args, BW_SIZES if kind == "bw" else LAT_SIZES)
    out = with_client(args, max(sizes), lambda client: measure(args, client, sizes))
    if out is None:
        return 0
    report, plotter, key = out  # the table is out: its rows were printed as they were measured
    if args.plot:
        plotter(args.plot)
        print(f"plot written to {args.plot}")
    print(report.verdict_line(key))
    report.write_json(args.json)
    return 0 if report.verdict != "FAIL" else 2


def _bw_main(args) -> int:
    if args.iters is None:
        args.iters = BW_ITERS[args.op]
    if args.duration is not None:
        margin = args.duration / 4 if args.margin is None else args.margin
        if margin < 0 or 2 * margin >= args.duration:
            raise SystemExit(f"--margin {margin:g} leaves no sample window in --duration {args.duration:g}")
        args.margin = margin
    return _run(args, "bw", measure_bw)


def _lat_main(args) -> int:
    return _run(args, "lat", measure_lat)
