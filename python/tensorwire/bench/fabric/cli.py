"""Fabric benchmarks in the anchor tools' semantics: `bench write_bw|read_bw`
(perftest ib_write_bw/ib_read_bw), `bench write_lat|read_lat` (ib_write_lat/
ib_read_lat) and `bench fullmesh` (the all-pairs ib_write_bw scripts of
seed 004). The point-to-point tests run against a peer spawned on loopback,
against `--connect HOST:PORT` (a `--server` elsewhere), or between ranks 0
and 1 under `tensorwire run -n 2` (which is how they cross testbed hosts).

Importing this module is cheap (the CLI imports it to add the commands);
the work is imported inside the commands.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from ..common import parse_rate, parse_sizes
from ..common import arg_positive as _positive, arg_sizes as _sizes

TRANSPORTS = ("auto", "tcp", "shm", "rdma")
FORMATS = ("perftest", "osu", "imb")
ALL_SIZES = "2:8M"  # perftest -a: 2^1..2^23


def _seconds(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return v


def _rate(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


BW_HELP = """\
Streams one-sided {op}s of each size on --lanes channels (perftest -q), at most
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


def _common_options(p: argparse.ArgumentParser, sizes: str) -> None:
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="data transport: tcp, shm (shared memory), rdma, or auto (UCX_TLS as set)")
    p.add_argument("-s", "--size", "--sizes", dest="sizes", type=_sizes, default=None,
                   help=f"message sizes: 8,4K,1M or a power-of-two range 2:8M (default {sizes})")
    p.add_argument("-a", "--all", action="store_true", help=f"all sizes 2 B..8 MiB (perftest -a: {ALL_SIZES})")
    p.add_argument("--budget", type=_sizes, default=None, metavar="BYTES",
                   help="cap on bytes moved per size (lowers --iters for big sizes; default: no cap, as perftest)")
    p.add_argument("-F", "--format", choices=FORMATS, default="perftest",
                   help="table columns and units of which anchor (default perftest)")
    p.add_argument("-c", "--validate", action="store_true",
                   help="check received contents against an iteration-dependent pattern (FAIL on mismatch)")
    p.add_argument("--link-rate", type=_rate, default=None, metavar="RATE",
                   help="the link's rate (e.g. 1gbit, 25G): results above it FAIL")
    p.add_argument("--workers", type=_positive, default=1, help="UCP workers per device (default 1)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--server", action="store_true",
                      help="run only the passive side and wait for a client (perftest without a host)")
    mode.add_argument("--connect", metavar="HOST:PORT", help="run the active side against a --server elsewhere")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to listen on with --server (default: pick one)")
    p.add_argument("--json", metavar="FILE", help="write the report (with raw samples) as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot the results (needs matplotlib)")


def add_commands(sub, bench_sub) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    for op in ("write", "read"):
        name = f"{op}_bw"
        p = bench_sub.add_parser(name, formatter_class=fmt,
                                 help=f"one-sided {op} bandwidth, perftest ib_{op}_bw semantics (-q, -D, -b)",
                                 description=BW_HELP.format(op=op, name=name))
        _common_options(p, "65536")
        p.add_argument("-n", "--iters", type=_positive, default=5000 if op == "write" else 1000,
                       help=f"iterations per lane (perftest -n; default {5000 if op == 'write' else 1000})")
        p.add_argument("-q", "--lanes", type=_positive, default=1, help="channels to the peer (perftest -q)")
        p.add_argument("-t", "--tx-depth", dest="window", type=_positive, default=None,
                       help="operations in flight per lane (default: ~8 MiB in flight, 2..32)")
        p.add_argument("-D", "--duration", type=_seconds, default=None, metavar="S",
                       help="run S seconds instead of --iters; sample the middle (perftest -D)")
        p.add_argument("-f", "--margin", type=float, default=None, metavar="S",
                       help="warm-up and cool-down margin of --duration (default D/4)")
        p.add_argument("-b", "--bidirectional", action="store_true", help="both directions at once (sum)")
        p.add_argument("--report-gbits", "--report_gbits", dest="report_gbits", action="store_true",
                       help="report Gb/sec (10^9 bit/s) instead of MiB/sec")
        p.add_argument("-N", "--no-peak", action="store_true", help="do not compute BW peak (prints 0.00)")
        p.set_defaults(func=_bw_main, op=op, test=name)
    for op, what, rtt in (
            ("write", "Ping-pong of one-sided writes: each side polls the last byte of its receive buffer and "
                      "answers (ib_write_lat / ucp_put_lat).",
             "Latency is one-way: half the round trip (RTT/2)."),
            ("read", "One read at a time, timed from post to completion (ib_read_lat).",
             "Latency is the FULL ROUND TRIP (labelled rtt), as perftest reports reads.")):
        name = f"{op}_lat"
        p = bench_sub.add_parser(name, formatter_class=fmt,
                                 help=f"one-sided {op} latency, perftest ib_{op}_lat semantics"
                                      + (" (full RTT)" if op == "read" else " (RTT/2)"),
                                 description=LAT_HELP.format(what=what, rtt=rtt, name=name))
        _common_options(p, "2")
        p.add_argument("-n", "--iters", type=_positive, default=1000, help="iterations per size (default 1000)")
        p.set_defaults(func=_lat_main, op=op, test=name, lanes=1)
    from ..fullmesh import add_command
    add_command(bench_sub)


# ---------------------------------------------------------------- running


def _sizes_of(args, default: str) -> list[int]:
    if args.all:
        return parse_sizes(ALL_SIZES)
    return args.sizes or parse_sizes(default)


def _in_world() -> bool:
    from ...world import detect
    p = detect()
    return p.launcher != "single" and p.size > 1


def _serve_main(args) -> int:
    from ... import Device
    from .. import p2p
    with Device(host=args.host, port=args.port, transport=args.transport, progress="inline",
                workers=args.workers, spin_us=_spin_us(args)) as dev:
        p2p.serve(dev)
    return 0


def _spin_us(args) -> int:
    """How long waiters poll before sleeping: long for latency tests (perftest busy-polls), short for
    bandwidth (on 2 vCPUs a spinning target starves the kernel's TCP work)."""
    from .. import p2p
    return p2p.LATENCY_SPIN_US if args.test.endswith("_lat") else p2p.BENCH_SPIN_US


def with_client(args, max_size: int, body: Callable[[Any], Any]) -> Any:
    """Runs body(client) against the right peer: rank 1 under a launcher, a
    --connect'ed server, or one spawned on loopback. Returns body's result on
    the measuring side, None on the others (ranks other than 0)."""
    from .. import p2p
    if _in_world():
        if args.connect:
            raise SystemExit("--connect makes no sense under a launcher: rank 0 measures against rank 1")
        from ...world import World
        world = World(transport=args.transport, progress="inline", workers=args.workers,
                      spin_us=_spin_us(args), timeout=60)
        out = None
        try:
            if world.rank == 1:  # handlers first, then the barrier that lets rank 0 go
                p2p.serve(world.device, announce=False, idle_timeout=3600, ready=world.barrier)
            else:
                world.barrier()
            if world.rank == 0:
                client = p2p.Client(world.device, world.addresses[1], args.lanes, max_size)
                try:
                    out = body(client)
                finally:
                    client.close()
            world.barrier(timeout=24 * 3600)  # the others wait for the measurement (the launcher watches them)
        finally:
            world.close()
        return out
    args.spin_us = _spin_us(args)
    device, client, proc = p2p._open_client(args, max_size)
    try:
        return body(client)
    finally:
        p2p._finish(device, client, proc)


def _finish_report(args, report, printer: Callable[[], None], plotter: Callable[[str], None], key: str) -> int:
    printer()
    if args.plot:
        try:
            plotter(args.plot)
        except ImportError:
            report.warn("no plot: matplotlib is not installed")
    print(report.verdict_line(key))
    report.write_json(args.json)
    return 0 if report.verdict != "FAIL" else 2


def _bw_main(args) -> int:
    if args.server:
        return _serve_main(args)
    from ..common import iterations_for
    sizes = _sizes_of(args, "65536")
    if args.duration is not None:
        margin = args.duration / 4 if args.margin is None else args.margin
        if margin < 0 or 2 * margin >= args.duration:
            raise SystemExit(f"--margin {margin:g} leaves no sample window in --duration {args.duration:g}")
        args.margin = margin
    out = with_client(args, max(sizes), lambda client: measure_bw(args, client, sizes, iterations_for))
    if out is None:
        return 0
    report, printer, plotter, key = out
    return _finish_report(args, report, printer, plotter, key)


def measure_bw(args, client, sizes: list[int], iterations_for):
    from .. import p2p
    from ..common import (MIB, Progress, Report, check_bw_row, check_bw_trend, human_size,
                         peak_bandwidth_posted, to_unit)
    op, bidir, lanes = args.op, args.bidirectional, args.lanes
    unit = {"perftest": "Gb/sec" if args.report_gbits else "MiB/sec", "osu": "MB/s", "imb": "MB/s"}[args.format]
    report = Report(args.test + ("_bidir" if bidir else ""), {
        "transport": args.transport, "op": op, "iters_per_lane": args.iters, "lanes": lanes,
        "tx_depth": args.window or "auto", "bidirectional": bidir, "duration": args.duration,
        "margin": args.margin, "sizes": sizes, "format": args.format, "unit": unit, "validate": args.validate,
        "link_rate_Gbps": args.link_rate * 8 / 1e9 if args.link_rate else None,
        "peak": "disabled" if (args.duration or args.no_peak) else "best run of >= in-flight consecutive ops",
        "mode": "world" if _in_world() else ("connect" if args.connect else "spawned peer")})
    progress = Progress(len(sizes), report.test)
    trend = []
    for i, size in enumerate(sizes):
        window = p2p.window_for(size, args.window)
        seed = 1000 * (i + 1)
        if args.validate:
            client.prepare_validation(op, size, seed, bidir)
        row: dict[str, Any] = {"size": size, "bytes": size, "lanes": lanes, "window": window}
        if args.duration:
            ours, theirs = client.stream_for(op, size, window, args.duration, args.margin, bidir)
            sides = [ours] + ([theirs] if theirs else [])
            avg = 0.0
            ops = 0
            for side in sides:
                t = side["window_end"] - side["window_start"]
                n = sum(side["in_window"])
                ops += n
                avg += n * size / t
            seconds = ours["window_end"] - ours["window_start"]
            peak = None
            row.update({"iterations": ops, "seconds": seconds, "duration": args.duration, "margin": args.margin,
                        "raw": {"bin_s": ours["bin"], "per_lane_bins": _split_bins(ours),
                                "peer_per_lane_bins": _split_bins(theirs) if theirs else None,
                                "per_lane_in_window": list(ours["in_window"]),
                                "per_lane_total": list(ours["total"])}})
            iters_expected = None
        else:
            iters = lanes * (iterations_for(size, args.iters, args.budget[0]) if args.budget else args.iters)
            warmup = max(2, min(iters // 10, 100))
            ours, theirs = client.stream_ops(op, size, iters, window, bidir, warmup)
            sides = [ours] + ([theirs] if theirs else [])
            avg = sum(len(s["completions"]) * size / s["seconds"] for s in sides)
            peak = None
            if not args.no_peak:
                peak = 0.0
                for s in sides:
                    n = len(s["completions"])
                    peak += max(peak_bandwidth_posted(size, s["posted"], s["completions"], k)
                                for k in {window * lanes, max(1, n // 4), n})
            ops = sum(len(s["completions"]) for s in sides)
            seconds = ours["seconds"]
            row.update({"iterations": ops, "seconds": seconds, "warmup": warmup,
                        "raw": {"posted_us": _us(ours["posted"]), "completed_us": _us(ours["completions"]),
                                "peer_posted_us": _us(theirs["posted"]) if theirs else None,
                                "peer_completed_us": _us(theirs["completions"]) if theirs else None}})
            iters_expected = iters * len(sides)
        msg_rate = avg / size / 1e6
        check_bw_row(report, size, avg, peak, msg_rate, args.link_rate, bidir, iters_expected, ops)
        if args.validate:
            errors = client.check_validation(op, size, seed, bidir)
            errors += client.validate_rounds(op, size, max(4, lanes), seed + 2)
            row["validation"] = "Fail" if errors else "Pass"
            for e in errors:
                report.fail(f"DATA VALIDATION ERROR at {size} B: {e}")
        row.update({"bw_avg_Bps": avg, "bw_peak_Bps": peak, "bw_average": to_unit(avg, unit),
                    "bw_peak": to_unit(peak, unit) if peak else 0.0, "unit": unit, "msg_rate_Mpps": msg_rate,
                    "bw_MiBps": avg / MIB, "bw_Gbps": avg * 8 / 1e9})
        report.rows.append(row)
        trend.append((size, avg))
        progress.step(human_size(size))
    check_bw_trend(report, trend)

    def printer() -> None:
        print_bw_table(args, report, unit)

    def plotter(path: str) -> None:
        plot_bw(report, path, unit)

    best = max(report.rows, key=lambda r: r["bw_avg_Bps"])
    key = f"BW average={best['bw_average']:.2f}{unit}@{best['size']}B"
    return report, printer, plotter, key


def _us(xs) -> list[float]:
    return [round(x * 1e6, 3) for x in xs]


def _split_bins(side: dict[str, Any] | None) -> list[list[int]]:
    if not side:
        return []
    nb = int(side["nbins"])
    bins = list(side["bins"])
    return [bins[i * nb:(i + 1) * nb] for i in range(len(bins) // max(1, nb))]


def _kind(op: str) -> str:
    return "RDMA_Write" if op == "write" else "RDMA_Read"


def print_bw_table(args, report, unit: str, out=None) -> None:
    from ..common import print_table
    out = out or sys.stdout
    cfg = report.config
    bidir = cfg["bidirectional"]
    rows = report.rows
    if args.format == "osu":
        title = "Bi-Directional Bandwidth Test" if bidir else "Bandwidth Test"
        print(f"# OSU MPI-style {title} (tensorwire one-sided {args.op}s over {cfg['transport']}, "
              f"{cfg['lanes']} lane(s))", file=out)
        print("# Datatype: MPI_CHAR.", file=out)
        print("# Size      Bandwidth (MB/s)" + ("          Validation" if args.validate else ""), file=out)
        for r in rows:
            print(f"{r['size']:<10d}{r['bw_average']:20.2f}" + (f"{r['validation']:>20s}" if args.validate else ""),
                  file=out)
        return
    if args.format == "imb":
        print("#---------------------------------------------------", file=out)
        print(f"# Benchmarking {'Biband' if bidir else 'Uniband'} (tensorwire one-sided {args.op}s over "
              f"{cfg['transport']}, {cfg['lanes']} lane(s))", file=out)
        print("# #processes = 2", file=out)
        print("#---------------------------------------------------", file=out)
        print(f"{'#bytes':>13}{'#repetitions':>13}{'Mbytes/sec':>13}{'Msg/sec':>13}", file=out)
        for r in rows:
            print(f"{r['size']:>13d}{r['iterations']:>13d}{r['bw_avg_Bps'] / 1e6:>13.2f}"
                  f"{r['msg_rate_Mpps'] * 1e6:>13.0f}", file=out)
        return
    rule = "-" * 87
    print(rule, file=out)
    print(f"{'':20}{_kind(args.op)} {'Bidirectional ' if bidir else ''}BW Test (tensorwire)", file=out)
    print(f" Number of lanes : {cfg['lanes']:<8}\tTransport type : {cfg['transport']}", file=out)
    print(f" TX depth        : {cfg['tx_depth']!s:<8}\tPeer           : {cfg['mode']}", file=out)
    if args.duration:
        print(f" Duration        : {args.duration:g} s, sampled {args.margin:g}..{args.duration - args.margin:g} s"
              f" (peak disabled)", file=out)
    if args.validate:
        print(" Validation      : ON (iteration-dependent pattern)", file=out)
    print_table(f" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]",
                [f" {r['size']:<11d}{r['iterations']:<15d}{r['bw_peak']:<19.2f}{r['bw_average']:<21.2f}"
                 f"{r['msg_rate_Mpps']:.6f}" for r in rows], out=out)


def to_unit_plot(bytes_per_s: float, unit: str) -> float:
    from ..common import to_unit
    return to_unit(bytes_per_s, unit)


def plot_bw(report, path: str, unit: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = report.rows
    timed = bool(report.config.get("duration"))
    if timed:  # duration mode: also the throughput over time, from the per-lane bins
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in rows:
            raw = r["raw"]
            lanes = [raw["per_lane_bins"]] + ([raw["peer_per_lane_bins"]] if raw.get("peer_per_lane_bins") else [])
            nb = len(raw["per_lane_bins"][0]) if raw["per_lane_bins"] else 0
            counts = [sum(side[l][b] for side in lanes for l in range(len(side))) for b in range(nb)]
            ax2.plot([(b + 0.5) * raw["bin_s"] for b in range(nb)],
                     [to_unit_plot(c * r["size"] / raw["bin_s"], unit) for c in counts], lw=1,
                     label=f"{r['size']} B")
        m, d = report.config["margin"], report.config["duration"]
        ax2.axvspan(m, d - m, color="grey", alpha=0.15, label="sampled")
        ax2.set_xlabel("time [s]")
        ax2.set_ylabel(f"bandwidth [{unit}]")
        ax2.set_title("throughput over time (completions per 100 ms)")
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize=7)
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = [r["size"] for r in rows]
    ax.plot(sizes, [r["bw_average"] for r in rows], "o-", label="BW average")
    if any(r["bw_peak"] for r in rows):
        ax.plot(sizes, [r["bw_peak"] for r in rows], "x--", label="BW peak")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size [bytes]")
    ax.set_ylabel(f"bandwidth [{unit}]")
    cfg = report.config
    ax.set_title(f"tensorwire {report.test} over {cfg['transport']}, {cfg['lanes']} lane(s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- latency


def _lat_main(args) -> int:
    if args.server:
        return _serve_main(args)
    sizes = _sizes_of(args, "2")
    out = with_client(args, max(sizes), lambda client: measure_lat(args, client, sizes))
    if out is None:
        return 0
    report, printer, plotter, key = out
    return _finish_report(args, report, printer, plotter, key)


def measure_lat(args, client, sizes: list[int]):
    from ..common import (Progress, Report, check_latency_row, check_latency_trend, human_size, iterations_for,
                         latency_stats)
    rtt = args.op == "read"
    report = Report(args.test, {
        "transport": args.transport, "op": args.op, "iters": args.iters, "sizes": sizes, "format": args.format,
        "unit": "usec", "latency": "full round trip (rtt)" if rtt else "one-way (RTT/2)",
        "validate": args.validate, "link_rate_Gbps": args.link_rate * 8 / 1e9 if args.link_rate else None,
        "tail": "2 largest samples dropped (perftest LAT_MEASURE_TAIL)",
        "mode": "world" if _in_world() else ("connect" if args.connect else "spawned peer")})
    progress = Progress(len(sizes), report.test)
    trend = []
    for i, size in enumerate(sizes):
        iters = iterations_for(size, args.iters, args.budget[0]) if args.budget else args.iters
        warmup = max(10, iters // 10)
        samples = client.latency(args.op, size, iters, warmup)
        st = latency_stats(samples, 1.0 if rtt else 0.5)
        check_latency_row(report, size, st)
        if len(samples) != iters:
            report.fail(f"{len(samples)} samples at {size} B, {iters} requested")
        row: dict[str, Any] = {"size": size, "bytes": size, "iterations": iters, "warmup": warmup, "rtt": rtt,
                               "lat_us": st, "seconds": sum(samples),
                               "samples_us": [round(s * 1e6, 3) for s in samples],
                               "sample": "round trip per iteration (us); reported values scale it by "
                                         + ("1" if rtt else "1/2")}
        if args.validate:
            errors = client.validate_rounds(args.op, size, 4, 1000 * (i + 1))
            row["validation"] = "Fail" if errors else "Pass"
            for e in errors:
                report.fail(f"DATA VALIDATION ERROR at {size} B: {e}")
        report.rows.append(row)
        trend.append((size, st["p50"]))
        progress.step(human_size(size))
    # A one-way time below size/rate is impossible; a full RTT moves the size once as well.
    check_latency_trend(report, trend, args.link_rate, rtt)

    def printer() -> None:
        print_lat_table(args, report)

    def plotter(path: str) -> None:
        plot_lat(report, path)

    first = report.rows[0]
    key = f"t_typical={first['lat_us']['p50']:.2f}us{'(rtt)' if rtt else ''}@{first['size']}B"
    return report, printer, plotter, key


def print_lat_table(args, report, out=None) -> None:
    from ..common import print_table
    out = out or sys.stdout
    cfg = report.config
    rtt = args.op == "read"
    rows = report.rows
    if args.format == "osu":
        print(f"# OSU MPI-style Latency Test (tensorwire one-sided {args.op}s over {cfg['transport']}; "
              + ("latency is the FULL ROUND TRIP (rtt))" if rtt else "one-way latency = RTT/2)"), file=out)
        print("# Datatype: MPI_CHAR.", file=out)
        print("# Size       Avg Latency(us)" + ("        Validation" if args.validate else ""), file=out)
        for r in rows:
            print(f"{r['size']:<10d}{r['lat_us']['avg']:20.2f}"
                  + (f"{r['validation']:>18s}" if args.validate else ""), file=out)
        return
    if args.format == "imb":
        print("#---------------------------------------------------", file=out)
        print(f"# Benchmarking PingPong (tensorwire one-sided {args.op}s over {cfg['transport']}; "
              + ("t is the FULL ROUND TRIP (rtt))" if rtt else "t = RTT/2)"), file=out)
        print("# #processes = 2", file=out)
        print("#---------------------------------------------------", file=out)
        print(f"{'#bytes':>13}{'#repetitions':>13}{'t[usec]':>13}{'Mbytes/sec':>13}", file=out)
        for r in rows:
            t = r["lat_us"]["avg"]
            print(f"{r['size']:>13d}{r['iterations']:>13d}{t:>13.2f}{r['size'] / t if t > 0 else 0:>13.2f}",
                  file=out)
        return
    rule = "-" * 87
    print(rule, file=out)
    print(f"{'':20}{_kind(args.op)} Latency Test (tensorwire)" + (" -- full round trip (rtt)" if rtt else
                                                                  " -- one-way = RTT/2"), file=out)
    print(f" Transport type  : {cfg['transport']:<8}\tPeer           : {cfg['mode']}", file=out)
    if args.validate:
        print(" Validation      : ON (iteration-dependent pattern)", file=out)
    print_table(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    "
                "t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]",
                [f" {r['size']:<7d} {r['iterations']:<11d}{r['lat_us']['min']:<15.2f}{r['lat_us']['max']:<15.2f}"
                 f"{r['lat_us']['p50']:<17.2f}{r['lat_us']['avg']:<15.2f}{r['lat_us']['stdev']:<16.2f}"
                 f"{r['lat_us']['p99']:<23.2f}{r['lat_us']['p99_9']:.2f}" for r in rows], out=out)


def plot_lat(report, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = report.rows
    sizes = [r["size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (("p50", "t_typical", "o-"), ("avg", "t_avg", "s-"), ("p99", "99%", "^--"),
                              ("p99_9", "99.9%", "v:"), ("min", "t_min", ".-")):
        ax.plot(sizes, [r["lat_us"][key] for r in rows], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size [bytes]")
    rtt = report.config["op"] == "read"
    ax.set_ylabel("latency [usec]" + (" (full round trip)" if rtt else " (one-way, RTT/2)"))
    ax.set_title(f"tensorwire {report.test} over {report.config['transport']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



# ---------------------------------------------------------------- write_bw vs ucx_perftest


def compare_ucx_perftest(argv: list[str] | None = None) -> int:
    """`write_bw` vs `ucx_perftest -t ucp_put_bw` (the same UCX, UCX_TLS and
    devices; the same size, iterations and window) at >= 1 MiB; the runs
    alternate and each side's median of --reps is kept. Target: >= 0.95x."""
    import json
    import statistics
    import subprocess
    import tempfile

    from ... import _core
    from ..compare import perftest
    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench.fabric compare-ucx-perftest",
                                 description=compare_ucx_perftest.__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--sizes", type=_sizes, default=parse_sizes("1M,4M,16M"))
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--json", help="write all samples here")
    args = ap.parse_args(argv)
    window = 32  # ucp_put_bw's default outstanding window (-O)
    results: dict[str, Any] = {"ucx": _core.ucx_version(), "reps": args.reps, "window": window, "rows": []}
    lines, oks = [], []
    for transport in args.transports.split(","):
        for size in args.sizes:
            iters = max(100, min(2000, (2 << 30) // size))
            ours, theirs = [], []
            for _ in range(args.reps):
                with tempfile.NamedTemporaryFile(suffix=".json") as f:
                    subprocess.run([sys.executable, "-m", "tensorwire", "bench", "write_bw", "--transport", transport,
                                    "-s", str(size), "-n", str(iters), "-t", str(window), "--json", f.name],
                                   check=True, capture_output=True, timeout=600)
                    ours.append(json.load(open(f.name))["rows"][0]["bw_MiBps"])
                theirs.append(perftest("ucp_put_bw", transport, size, iters) / 1.048576)  # MB/s(10^6) -> MiB/s
            o, t = statistics.median(ours), statistics.median(theirs)
            ratio = o / t
            ok = ratio >= args.target
            oks.append(ok)
            results["rows"].append({"transport": transport, "size": size, "iters": iters, "write_bw_MiBps": ours,
                                    "ucp_put_bw_MiBps": theirs, "median_write_bw": o, "median_ucp_put_bw": t,
                                    "ratio": ratio, "target": args.target, "pass": ok})
            lines.append(f"{transport:<6}{size:>10} {iters:>7} {o:>16.2f} {t:>18.2f} {ratio:>7.2f}x  "
                         f"(target >= {args.target:.2f}x) {'PASS' if ok else 'FAIL'}")
    print(f"# tensorwire bench write_bw vs ucx_perftest -t ucp_put_bw, UCX {results['ucx']}, window {window} per "
          f"side, 1 lane, median of {args.reps} alternating runs; MiB/sec = 2^20 B/s")
    print(f"{'tr':<6}{'bytes':>10} {'iters':>7} {'write_bw[MiB/s]':>16} {'ucp_put_bw[MiB/s]':>18} {'ratio':>8}")
    for line in lines:
        print(line)
    print(f"{'PASS' if all(oks) else 'FAIL'} write_bw_vs_ucx_perftest {sum(oks)}/{len(oks)} sizes at >= "
          f"{args.target:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(oks) else 1


# ---------------------------------------------------------------- transport comparison (seed 003's table)

SEED_003 = {  # "Peak values" of seed 003 (LANL, OSU micro-benchmarks 3.1.1 over Open MPI, 10GbE/QDR hardware)
    "IB QDR": (1.96, 3024.8, 5481.9), "RoCE": (3.7, 1142.7, 2284.7), "Soft RoCE": (11.6, 1204.1, None),
    "No RDMA (TCP)": (21.09, 301.31, 1136.1)}


def transport_comparison(argv: list[str] | None = None) -> int:
    """tcp vs shared memory with the fabric benches, seed 003's comparison:
    write_lat/read_lat at 8 B and 4 KiB, write_bw one-way and bidirectional
    at 64 KiB, 1 MiB and 16 MiB; each run repeated --reps times (median)."""
    import json
    import statistics
    import subprocess
    import tempfile
    ap = argparse.ArgumentParser(prog="python -m tensorwire.bench.fabric transport-comparison",
                                 description=transport_comparison.__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--lat-iters", type=int, default=5000)
    ap.add_argument("--bw-iters", type=int, default=5000)
    ap.add_argument("--budget", default="4G", help="bytes per bw size and run (lowers -n at 16 MiB)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    transports = args.transports.split(",")
    tests = [("write_lat", ["-s", "8,4K", "-n", str(args.lat_iters)]),
             ("read_lat", ["-s", "8,4K", "-n", str(args.lat_iters)]),
             ("write_bw", ["-s", "64K,1M,16M", "-n", str(args.bw_iters), "--budget", args.budget]),
             ("write_bw_bidir", ["-s", "64K,1M,16M", "-n", str(args.bw_iters), "--budget", args.budget, "-b"])]
    raw: dict[str, dict[str, list[dict]]] = {t: {name: [] for name, _ in tests} for t in transports}
    verdicts: dict[str, list[str]] = {}
    from ..common import Progress
    progress = Progress(args.reps * len(transports) * len(tests), "transport comparison")
    for rep in range(args.reps):
        for name, extra in tests:
            for t in transports:  # alternate transports within a rep: a disturbance hits both
                with tempfile.NamedTemporaryFile(suffix=".json") as f:
                    cmd = [sys.executable, "-m", "tensorwire", "bench", name.replace("_bidir", ""), "--transport", t,
                           "-c", "--json", f.name, *extra]
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                    if proc.returncode not in (0, 2):  # 2: ran, verdict FAIL (kept in the table)
                        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
                    rep_json = json.load(open(f.name))
                raw[t][name].append(rep_json)
                verdicts.setdefault(f"{t} {name}", []).append(rep_json["verdict"])
                progress.step(f"{t} {name}")
    med: dict[str, dict[str, float]] = {t: {} for t in transports}
    for t in transports:
        for name, _ in tests:
            runs = raw[t][name]
            for i, row in enumerate(runs[0]["rows"]):
                size = row["size"]
                if "lat_us" in row:
                    for k in ("p50", "avg", "p99", "min"):
                        med[t][f"{name} {size} {k}"] = statistics.median(r["rows"][i]["lat_us"][k] for r in runs)
                else:
                    med[t][f"{name} {size}"] = statistics.median(r["rows"][i]["bw_avg_Bps"] for r in runs) / 1e6
    print(f"# tcp vs shared memory, tensorwire fabric benches over loopback on one host, median of {args.reps} "
          f"runs; latency us (write: one-way = RTT/2, read: full round trip), bandwidth MB/s (10^6 B/s), "
          f"all runs with --validate")
    print(f"{'metric':<34}" + "".join(f"{t:>14}" for t in transports) + f"{'shm/tcp':>10}")
    lines = []
    for key in med[transports[0]]:
        vals = [med[t].get(key, float("nan")) for t in transports]
        name, size, *k = key.split()
        label = f"{name} {int(size):>8} B" + (f" {k[0]}" if k else "")
        ratio = (vals[1] / vals[0]) if len(vals) > 1 and vals[0] else float("nan")
        lines.append(f"{label:<34}" + "".join(f"{v:>14.2f}" for v in vals) + f"{ratio:>9.2f}x")
    print("\n".join(lines))
    print()
    print("# seed 003's 'Peak values' table, with tensorwire's rows (latency us at the smallest size, "
          "best bandwidth over sizes, MB/s)")
    cols = list(SEED_003) + [f"tensorwire {t}" for t in transports]
    print(f"{'Peak values':<22}" + "".join(f"{c:>16}" for c in cols))
    ours = {t: (min(med[t]["write_lat 8 p50"], med[t]["write_lat 8 avg"]),
                max(v for k, v in med[t].items() if k.startswith("write_bw ")),
                max(v for k, v in med[t].items() if k.startswith("write_bw_bidir "))) for t in transports}
    for i, metric in enumerate(("Latency (us)", "One-way BW (MB/s)", "Two-way BW (MB/s)")):
        vals = [SEED_003[c][i] for c in SEED_003] + [ours[t][i] for t in transports]
        print(f"{metric:<22}" + "".join(f"{'-':>16}" if v is None else f"{v:>16.2f}" for v in vals))
    print("# seed 003 columns: 2010 hardware (QDR IB, 10GbE RoCE, rxe, kernel TCP over 10GbE) measured with OSU "
          "osu_latency/osu_bw/osu_bibw; tensorwire columns: this host's loopback, one-sided writes")
    bad = {k: v for k, v in verdicts.items() if "FAIL" in v}
    for k, v in verdicts.items():
        worst = "FAIL" if "FAIL" in v else "WARN" if "WARN" in v else "PASS"
        print(f"{worst} transport_comparison {k} ({','.join(v)})")
    if args.json:
        # Keep the file small: the latency samples of the first run of each test, no bandwidth time stamps
        # (each bench's own --json has them all).
        for t in transports:
            for name, runs in raw[t].items():
                for i, run in enumerate(runs):
                    for row in run["rows"]:
                        row.pop("raw", None)
                        if i > 0:
                            row.pop("samples_us", None)
        with open(args.json, "w") as f:
            json.dump({"test": "transport_comparison", "reps": args.reps, "median": med, "seed_003": SEED_003,
                       "verdicts": verdicts, "runs": raw}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["compare-ucx-perftest"]:
        sys.exit(compare_ucx_perftest(sys.argv[2:]))
    if sys.argv[1:2] == ["transport-comparison"]:
        sys.exit(transport_comparison(sys.argv[2:]))
    sys.exit("usage: python -m tensorwire.bench.fabric compare-ucx-perftest|transport-comparison [--help]")
