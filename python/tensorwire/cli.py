"""The tensorwire command line.

  tensorwire info                      which UCX is loaded, transports, config
  tensorwire bench latency|bw|serve    one-sided point-to-point benchmarks
  tensorwire bench tensor              tensor transfer: slots vs RPC, gRPC, UCX tag, gloo
  tensorwire demo                      a two-process tensor write on loopback
"""

from __future__ import annotations

import argparse
import json
import sys

from .bench.common import arg_positive as _positive
from .bench.common import arg_sizes as _sizes

TRANSPORTS = ("auto", "tcp", "shm", "rdma")


def _tensor_sizes(text: str) -> list[int]:
    sizes = _sizes(text)
    bad = [s for s in sizes if s % 4]
    if bad:
        raise argparse.ArgumentTypeError(f"sizes must be multiples of 4 B (float32 tensors), not {bad}")
    return sizes


def _series(text: str) -> str:
    from .bench.tensor import select_series
    try:
        return ",".join(select_series(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


TENSOR_HELP = """\
Moves one float32 tensor per iteration from this process to a receiver process
(spawned on 127.0.0.1), where it is consumed (a max-reduction), and compares
tensorwire's tensor slots with the usual ways of doing it (the paper's Figure 7).

Series (default: all that are available here):
  zerocopy  tensorwire static slot, sender tensor in registered memory
  dynamic   tensorwire dynamic slot (any shape; receiver allocates)
  copy      tensorwire static slot, sender tensor copied into the pool first
  rpc-ucx   RPC over UCX active messages: serialize, send, copy out at the receiver
  grpc      gRPC (grpcio) unary call over TCP carrying the tensor bytes
  ucx-tag   UCX tagged send/recv (rendezvous for large sizes), as MPI and UCXX do
  gloo      torch.distributed gloo send/recv (needs torch)
grpc and gloo always use TCP; the others use --transport.

Each sample: sender takes t0, sends; receiver gets a usable array, reduces it,
acks by the series' own mechanism; sender takes t1 on the ack. Reported: median
per transfer, MB/s (10^6 B/s) and zerocopy's speed-up over every other series
(series time / zerocopy time). Warm-up iterations are untimed; --budget caps the
bytes moved per size and series (at least 10 iterations).

examples:
  tensorwire bench tensor --transport shm --sizes 4K,1M,16M
  tensorwire bench tensor --transport tcp --series zerocopy,grpc --plot fig7.png
  tensorwire bench tensor --sizes 1K:1G --json tensor.json --verify
"""


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tensorwire",
        description="Zero-copy one-sided tensor transport over UCX, and the tools to measure the fabric under it.")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="show the UCX in use, its transports and the configuration")
    info.add_argument("--transport", choices=TRANSPORTS, default="auto")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")

    bench = sub.add_parser("bench", help="benchmarks (perftest-style tables, --json reports)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    lat = bsub.add_parser("latency", help="one-sided latency: write ping-pong (RTT/2) or read (full RTT)",
                          description="Ping-pong of one-sided writes, each side polling the last byte of its "
                                      "buffer (ib_write_lat / ucp_put_lat); with --op read, each read is timed as "
                                      "a full round trip (ib_read_lat). Spawns the peer on loopback unless "
                                      "--server/--connect is given.")
    _p2p_options(lat, "8,64,4K,64K,1M", 10000)
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
    serve = bsub.add_parser("serve", help="the passive side of latency/bw (what --server runs)")
    serve.add_argument("--transport", choices=TRANSPORTS, default="auto")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0)
    serve.add_argument("--workers", type=_positive, default=1)

    tensor = bsub.add_parser("tensor", help="tensor transfer + consume: slots vs RPC, gRPC, UCX tag, gloo (Figure 7)",
                             description=TENSOR_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    tensor.add_argument("--transport", choices=TRANSPORTS, default="auto",
                        help="transport of the tensorwire and UCX series: tcp, shm, rdma or auto (UCX_TLS as set)")
    tensor.add_argument("--sizes", type=_tensor_sizes, default=_tensor_sizes("1K:256M"),
                        help="tensor sizes in bytes: a list like 4K,1M,16M or a range like 1K:1G (default 1K:256M)")
    tensor.add_argument("--series", type=_series, default=None,
                        help="comma-separated series to run (default: all): "
                             "zerocopy,dynamic,copy,rpc-ucx,grpc,ucx-tag,gloo")
    tensor.add_argument("--iters", type=_positive, default=100, help="timed iterations per size (default 100)")
    tensor.add_argument("--repeat", type=_positive, default=1,
                        help="passes over every series and size, interleaved; each cell reports its best pass "
                             "(lowest median), the others' medians kept in the JSON (default 1)")
    tensor.add_argument("--warmup", type=int, default=None,
                        help="untimed iterations before each size (default: a tenth of --iters, more for "
                             "small sizes: up to 200, at most an eighth of --budget)")
    tensor.add_argument("--budget", type=_sizes, default=[256 << 20], metavar="BYTES",
                        help="cap on bytes moved per size and series; lowers --iters (default 256M)")
    tensor.add_argument("--timeout", type=float, default=60.0, help="seconds any one step may take (default 60)")
    tensor.add_argument("--spin-us", type=int, default=None, metavar="US",
                        help="how long a waiter (tensorwire devices, UCX baselines) polls before it sleeps on the "
                             "worker's event fd (default: that of bench latency/bw, 100)")
    tensor.add_argument("--no-stream", dest="stream", action="store_false",
                        help="skip the stream passes (from 1 MiB up: back-to-back transfers with no bench ack, "
                             "each series paced by its own flow control) and the memcpy/write anchors")
    tensor.add_argument("--verify", action="store_true",
                        help="compare every element of every received tensor (timings then include it)")
    tensor.add_argument("--progress", choices=("inline", "blocking", "polling"), default="inline",
                        help="progress mode of the tensorwire devices (default inline: the waiter drives "
                             "progress; blocking is the Device default: a progress thread that sleeps when idle)")
    tensor.add_argument("--refresh", action="store_true",
                        help="the sender rewrites the whole tensor (same values) before each timed transfer, "
                             "untimed, like a producer that computes a new tensor every step; by default only "
                             "its first element changes, so the series that pull (ucx-tag, dynamic) may read "
                             "lines already cached on the receiver's core")
    tensor.add_argument("--json", metavar="FILE",
                        help="write the report: rows {series, transport, size, iters, median_us, MBps, ...}")
    tensor.add_argument("--plot", metavar="FILE.png", help="log-log plot, one line per series (needs matplotlib)")

    demo = sub.add_parser("demo", help="a two-process tensor write on loopback, with bandwidth and latency")
    demo.add_argument("--transport", choices=TRANSPORTS, default="auto")
    demo.add_argument("--mib", type=_positive, default=64, help="tensor size in MiB (default 64)")

    for name in COMMAND_MODULES:
        _load_commands(name).add_commands(sub, bsub)
    return parser


# Modules that add their own commands: each has add_commands(sub, bench_sub), whose
# parsers set `func` (called with the parsed args; returns the exit code). Importing
# them must stay cheap (no torch, no UCX): the work is imported inside `func`.
COMMAND_MODULES = (
    "tensorwire.launch",           # tensorwire run
    "tensorwire.bench.fabric.cli",  # bench write_bw/read_bw/write_lat/read_lat/fullmesh
    "tensorwire.bench.collectives",  # bench alltoall/allreduce
    "tensorwire.bench.terasort",   # bench terasort
    "tensorwire.testbed.cli",      # tensorwire testbed
    "tensorwire.torch.cli",        # tensorwire train, bench train
)


def _load_commands(name: str):
    import importlib
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
            raise
        # A command module not written yet (development tree): leave its commands out.
        class _Absent:
            @staticmethod
            def add_commands(sub, bsub) -> None:
                return None
        return _Absent


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from . import errors
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (errors.Error, RuntimeError) as e:
        print(f"tensorwire: error: {e}", file=sys.stderr)
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if getattr(args, "func", None) is not None:
        return int(args.func(args) or 0)
    if args.command == "info":
        from .info import collect, render
        data = collect(args.transport)
        print(json.dumps(data, indent=1) if args.json else render(data))
        return 0
    if args.command == "demo":
        from .demo import run_demo
        return run_demo(args.transport, args.mib)
    if args.bench == "tensor":
        from .bench.tensor import run_tensor
        args.budget = args.budget[0]
        report = run_tensor(args)
        report.write_json(args.json)
        return 0 if report.verdict != "FAIL" else 2
    from . import Device
    from .bench import p2p
    if args.bench == "serve" or getattr(args, "server", False):
        with Device(host=args.host, port=args.port, transport=args.transport, progress="inline",
                    workers=args.workers, spin_us=p2p.BENCH_SPIN_US) as dev:
            p2p.serve(dev)
        return 0
    args.budget = args.budget[0]
    if args.bench == "latency":
        args.lanes = 1
        report = p2p.run_latency(args)
    else:
        report = p2p.run_bandwidth(args)
    report.write_json(args.json)
    if args.plot and report.rows:
        from .bench.fabric import plots
        if args.bench == "latency":
            plots.plot_lat(report, args.plot)
        else:  # the perftest plot, fed this command's row names
            from dataclasses import replace
            rows = [{**r, "bw_average": r["bw_MBps"], "bw_peak": r.get("bw_peak_MBps") or 0.0} for r in report.rows]
            cfg = {**report.config, "duration": None, "lanes": getattr(args, "lanes", 1)}
            plots.plot_bw(replace(report, rows=rows, config=cfg), args.plot, "MB/sec")
        print(f"plot written to {args.plot}")
    return 0 if report.verdict != "FAIL" else 2


if __name__ == "__main__":
    sys.exit(main())
