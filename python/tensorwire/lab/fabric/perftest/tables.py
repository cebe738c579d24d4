"""The tests' tables: perftest's columns, or OSU's or IMB's (--format), printed
as the sizes are measured: open_*_table prints the header and returns the table
and the format of one row; the caller prints each row when it has it and closes
the table after the last."""

from __future__ import annotations

from typing import Any, Callable

from ..common import Progress, Table, print_line

Row = Callable[[dict[str, Any]], str]


def _kind(op: str) -> str:
    return "RDMA_Write" if op == "write" else "RDMA_Read"


def _over(cfg: dict) -> str:
    """The requested transport and the UCX transports the lanes used."""
    used = cfg.get("lane_transports")
    return f"{cfg['transport']} (lanes: {', '.join(used)})" if used else cfg["transport"]


def _preamble(lines: list[str], progress: Progress | None) -> None:
    for line in lines:
        print_line(line, progress=progress)


def open_bw_table(args, report, unit: str, progress: Progress | None = None) -> tuple[Table, Row]:
    cfg = report.config
    bidir = cfg["bidirectional"]
    if args.format == "osu":
        title = "Bi-Directional Bandwidth Test" if bidir else "Bandwidth Test"
        _preamble(
            [
                f"# OSU MPI-style {title} (tensorwire one-sided {args.op}s over {_over(cfg)}, {cfg['lanes']} lane(s))",
                "# Datatype: MPI_CHAR.",
            ],
            progress,
        )
        table = Table(
            "# Size      Bandwidth (MB/s)" + ("          Validation" if args.validate else ""),
            progress=progress,
            ruled=False,
        )
        return (
            table,
            lambda r: f"{r['size']:<10d}{r['bw_average']:20.2f}" + (f"{r['validation']:>20s}" if args.validate else ""),
        )
    if args.format == "imb":
        _preamble(
            [
                "#---------------------------------------------------",
                f"# Benchmarking {'Biband' if bidir else 'Uniband'} (tensorwire one-sided {args.op}s over "
                f"{cfg['transport']}, {cfg['lanes']} lane(s))",
                "# #processes = 2",
                "#---------------------------------------------------",
            ],
            progress,
        )
        table = Table(
            f"{'#bytes':>13}{'#repetitions':>13}{'Mbytes/sec':>13}{'Msg/sec':>13}", progress=progress, ruled=False
        )
        return (
            table,
            lambda r: (
                f"{r['size']:>13d}{r['iterations']:>13d}{r['bw_avg_Bps'] / 1e6:>13.2f}{r['msg_rate_Mpps'] * 1e6:>13.0f}"
            ),
        )
    lines = [
        "-" * 87,
        f"{'':20}{_kind(args.op)} {'Bidirectional ' if bidir else ''}BW Test (tensorwire)",
        f" Number of lanes : {cfg['lanes']:<8}\tTransport type : {_over(cfg)}",
        f" TX depth        : {cfg['tx_depth']!s:<8}\tPeer           : {cfg['mode']}",
    ]
    if args.duration:
        lines.append(
            f" Duration        : {args.duration:g} s, sampled {args.margin:g}..{args.duration - args.margin:g}"
            f" s (peak disabled)"
        )
    if args.validate:
        lines.append(" Validation      : ON (iteration-dependent pattern)")
    _preamble(lines, progress)
    table = Table(
        f" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]", progress=progress
    )
    return (
        table,
        lambda r: (
            f" {r['size']:<11d}{r['iterations']:<15d}{r['bw_peak']:<19.2f}{r['bw_average']:<21.2f}"
            f"{r['msg_rate_Mpps']:.6f}"
        ),
    )


def open_lat_table(args, report, progress: Progress | None = None) -> tuple[Table, Row]:
    cfg = report.config
    rtt = args.op == "read"
    if args.format == "osu":
        _preamble(
            [
                f"# OSU MPI-style Latency Test (tensorwire one-sided {args.op}s over {_over(cfg)}; "
                + ("latency is the FULL ROUND TRIP (rtt))" if rtt else "one-way latency = RTT/2)"),
                "# Datatype: MPI_CHAR.",
            ],
            progress,
        )
        table = Table(
            "# Size       Avg Latency(us)" + ("        Validation" if args.validate else ""),
            progress=progress,
            ruled=False,
        )
        return (
            table,
            lambda r: (
                f"{r['size']:<10d}{r['lat_us']['avg']:20.2f}" + (f"{r['validation']:>18s}" if args.validate else "")
            ),
        )
    if args.format == "imb":
        _preamble(
            [
                "#---------------------------------------------------",
                f"# Benchmarking PingPong (tensorwire one-sided {args.op}s over {_over(cfg)}; "
                + ("t is the FULL ROUND TRIP (rtt))" if rtt else "t = RTT/2)"),
                "# #processes = 2",
                "#---------------------------------------------------",
            ],
            progress,
        )
        table = Table(
            f"{'#bytes':>13}{'#repetitions':>13}{'t[usec]':>13}{'Mbytes/sec':>13}", progress=progress, ruled=False
        )

        def imb(r: dict[str, Any]) -> str:
            t = r["lat_us"]["avg"]
            return f"{r['size']:>13d}{r['iterations']:>13d}{t:>13.2f}{r['size'] / t if t > 0 else 0:>13.2f}"

        return table, imb
    lines = [
        "-" * 87,
        f"{'':20}{_kind(args.op)} Latency Test (tensorwire)"
        + (" -- full round trip (rtt)" if rtt else " -- one-way = RTT/2"),
        f" Transport type  : {_over(cfg)}\tPeer           : {cfg['mode']}",
    ]
    if args.validate:
        lines.append(" Validation      : ON (iteration-dependent pattern)")
    _preamble(lines, progress)
    table = Table(
        " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    "
        "t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]",
        progress=progress,
    )
    return (
        table,
        lambda r: (
            f" {r['size']:<7d} {r['iterations']:<11d}{r['lat_us']['min']:<15.2f}"
            f"{r['lat_us']['max']:<15.2f}{r['lat_us']['p50']:<17.2f}{r['lat_us']['avg']:<15.2f}"
            f"{r['lat_us']['stdev']:<16.2f}{r['lat_us']['p99']:<23.2f}{r['lat_us']['p99_9']:.2f}"
        ),
    )
