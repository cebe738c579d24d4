"""The tests' tables: perftest's columns, or OSU's or IMB's (--format)."""

from __future__ import annotations

import sys


def _kind(op: str) -> str:
    return "RDMA_Write" if op == "write" else "RDMA_Read"


def _over(cfg: dict) -> str:
    """The requested transport and the UCX transports the lanes used."""
    used = cfg.get("lane_transports")
    return f"{cfg['transport']} (UCX: {', '.join(used)})" if used else cfg["transport"]


def print_bw_table(args, report, unit: str, out=None) -> None:
    from ..common import print_table
    out = out or sys.stdout
    cfg = report.config
    bidir = cfg["bidirectional"]
    rows = report.rows
    if args.format == "osu":
        title = "Bi-Directional Bandwidth Test" if bidir else "Bandwidth Test"
        print(f"# OSU MPI-style {title} (tensorwire one-sided {args.op}s over {_over(cfg)}, "
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
    print(f" Number of lanes : {cfg['lanes']:<8}\tTransport type : {_over(cfg)}", file=out)
    print(f" TX depth        : {cfg['tx_depth']!s:<8}\tPeer           : {cfg['mode']}", file=out)
    if args.duration:
        print(f" Duration        : {args.duration:g} s, sampled {args.margin:g}..{args.duration - args.margin:g} s"
              f" (peak disabled)", file=out)
    if args.validate:
        print(" Validation      : ON (iteration-dependent pattern)", file=out)
    print_table(f" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]",
                [f" {r['size']:<11d}{r['iterations']:<15d}{r['bw_peak']:<19.2f}{r['bw_average']:<21.2f}"
                 f"{r['msg_rate_Mpps']:.6f}" for r in rows], out=out)


def print_lat_table(args, report, out=None) -> None:
    from ..common import print_table
    out = out or sys.stdout
    cfg = report.config
    rtt = args.op == "read"
    rows = report.rows
    if args.format == "osu":
        print(f"# OSU MPI-style Latency Test (tensorwire one-sided {args.op}s over {_over(cfg)}; "
              + ("latency is the FULL ROUND TRIP (rtt))" if rtt else "one-way latency = RTT/2)"), file=out)
        print("# Datatype: MPI_CHAR.", file=out)
        print("# Size       Avg Latency(us)" + ("        Validation" if args.validate else ""), file=out)
        for r in rows:
            print(f"{r['size']:<10d}{r['lat_us']['avg']:20.2f}"
                  + (f"{r['validation']:>18s}" if args.validate else ""), file=out)
        return
    if args.format == "imb":
        print("#---------------------------------------------------", file=out)
        print(f"# Benchmarking PingPong (tensorwire one-sided {args.op}s over {_over(cfg)}; "
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
    print(f" Transport type  : {_over(cfg)}\tPeer           : {cfg['mode']}", file=out)
    if args.validate:
        print(" Validation      : ON (iteration-dependent pattern)", file=out)
    print_table(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    "
                "t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]",
                [f" {r['size']:<7d} {r['iterations']:<11d}{r['lat_us']['min']:<15.2f}{r['lat_us']['max']:<15.2f}"
                 f"{r['lat_us']['p50']:<17.2f}{r['lat_us']['avg']:<15.2f}{r['lat_us']['stdev']:<16.2f}"
                 f"{r['lat_us']['p99']:<23.2f}{r['lat_us']['p99_9']:.2f}" for r in rows], out=out)
