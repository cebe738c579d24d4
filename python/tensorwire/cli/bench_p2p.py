"""`tensorwire bench latency|bw|serve`: the one-sided point-to-point benchmarks
of tensorwire.bench.p2p (their passive side spawned on loopback, or --server /
--connect across hosts)."""

from __future__ import annotations

import argparse

from ..bench.common import arg_positive as _positive
from ..bench.common import arg_sizes as _sizes
from . import PLOT_NEEDS, TRANSPORTS


def _p2p_options(p: argparse.ArgumentParser, sizes: str, iters: int) -> None:
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="data transport: tcp, shm (shared memory), rdma, or auto (UCX_TLS as set)")
    p.add_argument("--sizes", type=_sizes, default=_sizes(sizes),
                   help=f"message sizes: a list like 8,4K,1M or a power-of-two range like 1:64M (default {sizes})")
    p.add_argument("--iters", type=_positive, default=iters, help=f"iterations per size (default {iters})")
    p.add_argument("--budget", type=_sizes, default=[1 << 30], metavar="BYTES",
                   help="cap on bytes moved per size; lowers --iters for big sizes (default 1G)")
    p.add_argument("--op", choices=("write", "read"), default="write", help="one-sided operation (default write)")
    p.add_argument("--workers", type=_positive, default=1, help="UCP workers per device (default 1)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--server", action="store_true",
                      help="run only the passive side and wait for a client (like perftest without a host)")
    mode.add_argument("--connect", metavar="HOST:PORT", help="run the active side against a --server elsewhere")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to listen on with --server (default: pick one)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--raw", action="store_true", help="include raw samples in the JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot the results (needs matplotlib)")


def register(commands) -> None:
    bsub = commands.bench
    lat = bsub.add_parser("latency", help="one-sided latency: write ping-pong (RTT/2) or read (full RTT)",
                          description="Ping-pong of one-sided writes, each side polling the last byte of its "
                                      "buffer (ib_write_lat / ucp_put_lat); with --op read, each read is timed as "
                                      "a full round trip (ib_read_lat). Spawns the peer on loopback unless "
                                      "--server/--connect is given.")
    _p2p_options(lat, "8,64,4K,64K,1M", 10000)
    lat.set_defaults(func=_latency, needs=(PLOT_NEEDS,))
    bw = bsub.add_parser("bw", help="one-sided streaming bandwidth (ib_write_bw / ucp_put_bw)",
                         description="Streams one-sided writes (or reads) with a window of outstanding operations "
                                     "per lane, then flushes. --bidirectional runs both directions at once and "
                                     "reports the sum (perftest -b). Spawns the peer on loopback unless "
                                     "--server/--connect is given.")
    _p2p_options(bw, "4K,64K,1M,16M", 1000)
    bw.add_argument("--lanes", type=_positive, default=1, help="channels (endpoints) to the peer, like perftest -q")
    bw.add_argument("--window", type=_positive, default=None,
                    help="operations in flight per lane (default: ~8 MiB in flight, at most 32)")
    bw.add_argument("--bidirectional", "-b", action="store_true", help="both directions at once")
    bw.set_defaults(func=_bandwidth, needs=(PLOT_NEEDS,))
    serve = bsub.add_parser("serve", help="the passive side of latency/bw (what --server runs)")
    serve.add_argument("--transport", choices=TRANSPORTS, default="auto")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0)
    serve.add_argument("--workers", type=_positive, default=1)
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from .. import Device
    from ..bench import p2p
    with Device(host=args.host, port=args.port, transport=args.transport, progress="inline",
                workers=args.workers, spin_us=p2p.BENCH_SPIN_US) as dev:
        p2p.serve(dev)
    return 0


def _latency(args: argparse.Namespace) -> int:
    args.lanes = 1
    return _measure(args, "run_latency", _plot_latency)


def _bandwidth(args: argparse.Namespace) -> int:
    return _measure(args, "run_bandwidth", _plot_bandwidth)


def _measure(args: argparse.Namespace, run: str, plot) -> int:
    if args.server:
        return _serve(args)
    from ..bench import p2p
    args.budget = args.budget[0]
    report = getattr(p2p, run)(args)
    report.write_json(args.json)
    if args.plot and report.rows:
        plot(report, args)
        print(f"plot written to {args.plot}")
    return 0 if report.verdict != "FAIL" else 2


def _plot_latency(report, args: argparse.Namespace) -> None:
    from ..bench.fabric import plots
    plots.plot_lat(report, args.plot)


def _plot_bandwidth(report, args: argparse.Namespace) -> None:
    """The perftest plot, fed this command's row names."""
    from dataclasses import replace

    from ..bench.fabric import plots
    rows = [{**r, "bw_average": r["bw_MBps"], "bw_peak": r.get("bw_peak_MBps") or 0.0} for r in report.rows]
    cfg = {**report.config, "duration": None, "lanes": getattr(args, "lanes", 1)}
    plots.plot_bw(replace(report, rows=rows, config=cfg), args.plot, "MB/sec")
