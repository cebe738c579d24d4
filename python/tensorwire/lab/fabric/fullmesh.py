"""`tensorwire bench fullmesh`: every ordered pair of N ranks streams one-sided
writes at once, the fullmesh ib_write_bw scripts of seed 004 (Figure 6/7).

Under `tensorwire run -n N` (or mpirun/srun/torchrun) each rank:
  1. allocates a send buffer (an iteration-independent pattern of its own)
     and publishes one receive buffer per peer ("fm.recv.<src>") and a word
     per rank ("fm.flags");
  2. connects --lanes channels to every peer and looks the buffers up;
  3. after a barrier, streams writes on all (N-1) x lanes channels for
     --duration seconds, at most --tx-depth in flight per channel; only the
     completions inside [margin, D - margin] count (perftest -D, margin D/4);
  4. flushes, raises its word in every peer's "fm.flags" and keeps serving
     the others (progress) until every peer has raised its word in ours;
  5. checks the pattern of every receive buffer, and sends its numbers to
     rank 0, which prints per-flow, per-rank TX/RX, aggregate and Jain's
     fairness index, with the verdicts, --json and --plot.

Without a launcher, `bench fullmesh --sweep-ranks 2,3,4` runs the sweep itself
(`tensorwire run -n k` per k, inside --testbed hosts if given) and prints
the scaling table: aggregate vs N, per-flow mean/min, Jain.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from .common import BenchError

# ------------------------------------------------------------------ one run


def run_rank(args) -> int:
    import numpy as np

    from ... import _core
    from ...ranks.world import World
    from .common import check_pattern, fill_pattern
    from .p2p import BENCH_SPIN_US, window_for

    world = World(transport=args.transport, progress="inline", workers=1, spin_us=BENCH_SPIN_US, timeout=60)
    try:
        n, me, dev = world.size, world.rank, world.device
        size, lanes = args.size, args.lanes
        window = window_for(size, args.window)
        timeout = args.duration + 60
        send = dev.alloc(size, alignment=4096)
        fill_pattern(send, size, me + 1)
        recv = {}
        for src in range(n):
            if src != me:
                recv[src] = dev.alloc(size, alignment=4096)
                fill_pattern(recv[src], size, None)
                dev.publish(f"fm.recv.{src}", recv[src])
        flags = dev.alloc(8 * n)
        flag_words = np.frombuffer(memoryview(flags), dtype=np.uint64, count=n)
        flag_words[:] = 0
        dev.publish("fm.flags", flags)
        world.barrier()
        # Peers in a staggered order (me+1, me+2, ...) so that not every rank
        # hits rank 0 first; lanes of one peer are consecutive.
        peers = [(me + k) % n for k in range(1, n)]
        channels, remotes = [], []
        for peer in peers:
            for lane in range(lanes):
                ch = world.channel(peer, lane)
                channels.append(ch)
                remotes.append(ch.lookup(f"fm.recv.{me}"))
        remote_flags = {peer: world.channel(peer, 0).lookup("fm.flags") for peer in peers}
        world.barrier()
        started = time.time()
        try:
            res = _core.bench_stream_for(
                channels, True, send, remotes, size, window, args.duration, args.margin, 0.1, timeout
            )
        except Exception as e:  # a peer died (the control plane's keepalive fails its channels): name its rank
            dead = [r for r, a in enumerate(world.addresses) if r != me and a in str(e)]
            who = f"rank {dead[0]} ({world.addresses[dead[0]]})" if dead else "a peer"
            raise BenchError(f"rank {me}: fullmesh stream failed, {who}: {e}") from None
        # Done: raise our word at every peer, then keep progressing (their
        # writes to us may still need it) until every peer raised its word here.
        seq = 1
        flag_words[me] = seq
        src_word = dev.alloc(8)
        np.frombuffer(memoryview(src_word), dtype=np.uint64, count=1)[0] = seq
        for peer in peers:
            world.channel(peer, 0).write(src_word, remote_flags[peer], remote_offset=8 * me, nbytes=8).wait(timeout)
        if not _core.bench_wait_flags(channels, flags.ptr, n, seq, timeout):
            late = [r for r in range(n) if flag_words[r] < seq]
            raise BenchError(f"rank {me}: ranks {late} did not finish their streams within {timeout:g} s")
        validation = {}
        for src, block in recv.items():
            bad, first = check_pattern(block, size, src + 1)
            validation[str(src)] = {"mismatches": bad, "first": first}
        nb = int(res["nbins"])
        flows = []
        for i, peer in enumerate(peers):
            idx = range(i * lanes, (i + 1) * lanes)
            bins = [sum(res["bins"][c * nb + b] for c in idx) for b in range(nb)]
            flows.append(
                {
                    "src": me,
                    "dst": peer,
                    "lanes": lanes,
                    "iterations": sum(res["in_window"][c] for c in idx),
                    "total": sum(res["total"][c] for c in idx),
                    "per_lane_in_window": [res["in_window"][c] for c in idx],
                    "bins": bins,
                }
            )
        mine = {
            "rank": me,
            "host": world.hosts[me],
            "address": world.addresses[me],
            "started": started,
            "lane_transports": sorted({t for ch in channels for t in ch.transports()}),
            "window_start": res["window_start"],
            "window_end": res["window_end"],
            "elapsed": res["elapsed"],
            "bin_s": res["bin"],
            "flows": flows,
            "validation": validation,
        }
        everyone = world.allgather(mine, timeout=timeout)
        code = 0
        if me == 0:
            report = build_report(args, everyone, window, n)
            print_report(report)
            if args.plot:
                plot_flows(report, args.plot)
            print(
                report.verdict_line(
                    f"aggregate={report.rows[0]['aggregate_Gbps']:.3f}Gb/s jain={report.rows[0]['jain']:.3f} N={n}"
                )
            )
            report.write_json(args.json)
            code = 0 if report.verdict != "FAIL" else 2
        world.barrier(timeout=timeout)
        return code
    finally:
        world.close()


def build_report(args, everyone: list[dict[str, Any]], window: int, n: int):
    from .common import Report, check_fairness, check_lane_transports

    size = args.size
    report = Report(
        "fullmesh",
        {
            "transport": args.transport,
            "ranks": n,
            "size": size,
            "lanes": args.lanes,
            "tx_depth": window,
            "duration": args.duration,
            "margin": args.margin,
            "unit": "Gb/sec (10^9 bit/s)",
            "hosts": [e["host"] for e in everyone],
            "addresses": [e["address"] for e in everyone],
            "link_rate_Gbps": args.link_rate * 8 / 1e9 if args.link_rate else None,
            "start_skew_s": max(e["started"] for e in everyone) - min(e["started"] for e in everyone),
        },
    )
    check_lane_transports(report, args.transport, [t for e in everyone for t in e.get("lane_transports", [])])
    flows = []
    tx = [0.0] * n
    rx = [0.0] * n
    for e in everyone:
        t = e["window_end"] - e["window_start"]
        for f in e["flows"]:
            bps = f["iterations"] * size / t
            flows.append(
                {
                    **f,
                    "bw_Bps": bps,
                    "bw_Gbps": bps * 8 / 1e9,
                    "msg_rate_Mpps": f["iterations"] / t / 1e6,
                    "seconds": t,
                    "bytes": f["iterations"] * size,
                }
            )
            tx[f["src"]] += bps
            rx[f["dst"]] += bps
        for src, v in e["validation"].items():
            if v["mismatches"]:
                report.fail(
                    f"DATA VALIDATION ERROR: rank {e['rank']}'s buffer from rank {src}: {v['mismatches']} "
                    f"bytes differ from offset {v['first']}"
                )
    flows.sort(key=lambda f: (f["src"], f["dst"]))
    jain = check_fairness(report, [(f"{f['src']}->{f['dst']}", f["bw_Bps"]) for f in flows])
    if args.link_rate:
        limit = args.link_rate * 1.02
        for r in range(n):
            for what, v in (("TX", tx[r]), ("RX", rx[r])):
                if v > limit:
                    report.fail(
                        f"rank {r} {what} {v * 8 / 1e9:.3f} Gb/s above the link rate "
                        f"{args.link_rate * 8 / 1e9:.3f} Gb/s"
                    )
    if report.config["start_skew_s"] > args.margin:
        report.warn(f"ranks started {report.config['start_skew_s']:.3f} s apart, more than the margin")
    aggregate = sum(f["bw_Bps"] for f in flows)
    bws = [f["bw_Bps"] for f in flows]
    report.rows.append(
        {
            "ranks": n,
            "flows": len(flows),
            "aggregate_Bps": aggregate,
            "aggregate_Gbps": aggregate * 8 / 1e9,
            "jain": jain,
            "flow_mean_Gbps": (sum(bws) / len(bws) * 8 / 1e9) if bws else 0.0,
            "flow_min_Gbps": min(bws) * 8 / 1e9 if bws else 0.0,
            "flow_max_Gbps": max(bws) * 8 / 1e9 if bws else 0.0,
            "per_rank": [
                {
                    "rank": r,
                    "host": everyone[r]["host"],
                    "tx_Gbps": tx[r] * 8 / 1e9,
                    "rx_Gbps": rx[r] * 8 / 1e9,
                    "flows_out": n - 1,
                }
                for r in range(n)
            ],
            "per_flow": flows,
            "bin_s": everyone[0]["bin_s"],
        }
    )
    return report


def print_report(report, out=None) -> None:
    from .common import print_table

    out = out or sys.stdout
    cfg, row = report.config, report.rows[0]
    print("-" * 87, file=out)
    print(f"{'':20}Fullmesh RDMA_Write BW Test (tensorwire)", file=out)
    used = cfg.get("lane_transports")
    over = f"{cfg['transport']} (lanes: {', '.join(used)})" if used else cfg["transport"]
    print(f" Ranks           : {cfg['ranks']:<8}\tTransport type : {over}", file=out)
    print(f" Lanes per pair  : {cfg['lanes']:<8}\tTX depth       : {cfg['tx_depth']}", file=out)
    print(
        f" Message size    : {cfg['size']:<8}\tDuration       : {cfg['duration']:g} s, sampled "
        f"{cfg['margin']:g}..{cfg['duration'] - cfg['margin']:g} s",
        file=out,
    )
    print_table(
        " src  dst  #lanes  #iterations   BW average[Gb/sec]   MsgRate[Mpps]",
        [
            f" {f['src']:<5d}{f['dst']:<5d}{f['lanes']:<8d}{f['iterations']:<14d}{f['bw_Gbps']:<21.3f}"
            f"{f['msg_rate_Mpps']:.6f}"
            for f in row["per_flow"]
        ],
        out=out,
    )
    print_table(
        " rank host             TX[Gb/sec]   RX[Gb/sec]   flows",
        [
            f" {h['rank']:<5d}{h['host'][:16]:<17s}{h['tx_Gbps']:<13.3f}{h['rx_Gbps']:<13.3f}{h['flows_out']}"
            for h in row["per_rank"]
        ],
        out=out,
    )
    print(
        f" aggregate[Gb/sec] {row['aggregate_Gbps']:.3f}   jain_fairness {row['jain']:.4f}   flows {row['flows']}"
        f"   flow mean/min/max[Gb/sec] {row['flow_mean_Gbps']:.3f}/{row['flow_min_Gbps']:.3f}/"
        f"{row['flow_max_Gbps']:.3f}",
        file=out,
    )


def plot_flows(report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    row = report.rows[0]
    flows = row["per_flow"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    a1.bar([f"{f['src']}→{f['dst']}" for f in flows], [f["bw_Gbps"] for f in flows])
    a1.set_ylabel("BW average [Gb/s]")
    a1.set_title(f"per flow, Jain {row['jain']:.3f}")
    a1.tick_params(axis="x", rotation=60)
    bin_s = row["bin_s"]
    size = report.config["size"]
    for f in flows:
        a2.plot(
            [(i + 0.5) * bin_s for i in range(len(f["bins"]))],
            [c * size * 8 / bin_s / 1e9 for c in f["bins"]],
            lw=0.8,
            label=f"{f['src']}→{f['dst']}",
        )
    m, d = report.config["margin"], report.config["duration"]
    a2.axvspan(m, d - m, color="grey", alpha=0.15, label="sampled")
    a2.set_xlabel("time [s]")
    a2.set_ylabel("Gb/s per flow")
    a2.set_title("throughput over time")
    if len(flows) <= 12:
        a2.legend(fontsize=6, ncol=2)
    fig.suptitle(
        f"tensorwire fullmesh, {report.config['ranks']} ranks over {report.config['transport']}, "
        f"aggregate {row['aggregate_Gbps']:.2f} Gb/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ sweep


def _testbed_hosts(args) -> list[str]:
    if args.hosts:
        return args.hosts.split(",")
    from ..testbed import Testbed

    return list(Testbed.load(args.testbed).hosts)


def sweep(args) -> int:
    from .common import Progress, Report

    hosts = _testbed_hosts(args) if args.testbed else None
    if args.sweep_ranks:
        ranks = list(args.sweep_ranks)
    else:
        ranks = list(range(2, len(hosts) + 1)) if hosts else [2, 3, 4]
    if any(k < 2 for k in ranks):
        raise SystemExit("--sweep-ranks: a fullmesh needs at least 2 ranks")
    if hosts and max(ranks) > len(hosts):
        raise SystemExit(f"--sweep-ranks up to {max(ranks)} but only {len(hosts)} testbed hosts given")
    groups = None
    if hosts:
        from ..testbed import Testbed

        tb = Testbed.load(args.testbed)
        groups = {h: tb.group(h) for h in hosts}
    timeout = args.run_timeout or args.duration + 90
    report = Report(
        "fullmesh_scaling",
        {
            "transport": args.transport,
            "ranks": ranks,
            "size": args.size,
            "lanes": args.lanes,
            "duration": args.duration,
            "margin": args.margin,
            "testbed": args.testbed,
            "hosts": hosts,
            "link_rate_Gbps": args.link_rate * 8 / 1e9 if args.link_rate else None,
            "isl_rate_Gbps": args.isl_rate * 8 / 1e9 if args.isl_rate else None,
            "unit": "Gb/sec (10^9 bit/s)",
        },
    )
    runs = []
    progress = Progress(len(ranks), "fullmesh")
    table, line = open_scaling(report, bool(groups), progress)  # a testbed's runs all have the inter-group columns
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="tw-fullmesh-") as tmp:
        for k in ranks:
            out = os.path.join(tmp, f"n{k}.json")
            cmd = [sys.executable, "-m", "tensorwire", "run", "-n", str(k), "--timeout", f"{timeout:g}"]
            if hosts:
                # the launcher picks a fresh root port per run (tensorwire.ranks.launch.plan)
                cmd += ["--testbed", args.testbed, "--hosts", ",".join(hosts[:k])]
            cmd += [
                "--",
                sys.executable,
                "-m",
                "tensorwire",
                "bench",
                "fullmesh",
                "--transport",
                args.transport,
                "-s",
                str(args.size),
                "-q",
                str(args.lanes),
                "-D",
                f"{args.duration:g}",
                "-f",
                f"{args.margin:g}",
                "--json",
                out,
            ]
            if args.window:
                cmd += ["-t", str(args.window)]
            if args.link_rate:
                cmd += ["--link-rate", f"{args.link_rate * 8:.0f}"]
            t0 = time.monotonic()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.monotonic() - t0
            if not os.path.exists(out):
                tail = "; ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
                report.fail(f"N={k}: the run failed (exit {proc.returncode}): {tail}")
                verdicts.append(f"FAIL fullmesh {args.transport} N={k} run failed (exit {proc.returncode})")
                progress.step(f"N={k} FAIL")
                continue
            run = json.load(open(out))
            run["wall_s"] = wall
            runs.append(run)
            row = run["rows"][0]
            extra = {
                "per_rank_tx_mean_Gbps": sum(h["tx_Gbps"] for h in row["per_rank"]) / k,
                "verdict": run["verdict"],
                "hosts": hosts[:k] if hosts else None,
            }
            if groups and hosts:  # (groups: the hosts' groups)
                # What crossed the inter-group link, per direction (rank r runs on hosts[r]).
                g = [groups[hosts[r]] for r in range(k)]
                extra["inter_group_Gbps"] = {
                    f"{a}->{b}": sum(f["bw_Gbps"] for f in row["per_flow"] if g[f["src"]] == a and g[f["dst"]] == b)
                    for a, b in ((1, 2), (2, 1))
                }
                extra["intra_group_Gbps"] = sum(f["bw_Gbps"] for f in row["per_flow"] if g[f["src"]] == g[f["dst"]])
                if args.isl_rate and max(extra["inter_group_Gbps"].values()) > args.isl_rate * 8 / 1e9 * 1.02:
                    report.fail(f"N={k}: inter-group traffic above the inter-group link rate")
            report.rows.append({k2: v for k2, v in row.items() if k2 not in ("per_flow", "per_rank")} | extra)
            table.line(line(report.rows[-1]))
            for c in run["checks"]:
                (report.fail if c["level"] == "FAIL" else report.warn)(f"N={k}: {c['message']}")
            verdicts.append(
                f"{run['verdict']} fullmesh {args.transport} N={k} aggregate={row['aggregate_Gbps']:.3f}"
                f"Gb/s jain={row['jain']:.3f}"
            )
            progress.step(f"N={k}")
    close_scaling(report, table)
    if args.plot and report.rows:
        plot_scaling(report, args.plot)
    for v in verdicts:
        print(v)
    best = max(report.rows, key=lambda r: r["aggregate_Gbps"]) if report.rows else None
    print(
        report.verdict_line(
            f"max aggregate={best['aggregate_Gbps']:.3f}Gb/s@N={best['ranks']}" if best else "no run finished"
        )
    )
    if args.json:
        data = report.to_json()
        data["runs"] = runs
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    return 0 if report.verdict != "FAIL" else 2


def open_scaling(report, cross: bool, progress=None):
    """Prints the scaling table's title and header; returns the table and the format of a
    row (printed as each world size finishes). cross: the inter-group columns (a testbed)."""
    from .common import Table, print_line

    cfg = report.config
    where = f"testbed {cfg['testbed']}" if cfg["testbed"] else "this host (loopback)"
    print_line(
        f"# fullmesh scaling over {cfg['transport']} on {where}: size {cfg['size']}, {cfg['lanes']} lane(s) "
        f"per pair, {cfg['duration']:g} s per run (sampled {cfg['margin']:g}..{cfg['duration'] - cfg['margin']:g}"
        f" s)",
        progress=progress,
    )
    table = Table(
        " #ranks  #flows  aggregate[Gb/sec]  per-rank TX[Gb/sec]  flow mean[Gb/sec]  flow min[Gb/sec]  "
        "jain_fairness" + ("  inter-group 1->2 2->1[Gb/sec]" if cross else ""),
        progress=progress,
    )

    def row(r) -> str:
        v = r.get("inter_group_Gbps")
        xg = f"  {v['1->2']:<8.3f}{v['2->1']:.3f}" if v else ""
        return (
            f" {r['ranks']:<8d}{r['flows']:<8d}{r['aggregate_Gbps']:<19.3f}{r['per_rank_tx_mean_Gbps']:<21.3f}"
            f"{r['flow_mean_Gbps']:<19.3f}{r['flow_min_Gbps']:<18.3f}"
            + (f"{r['jain']:<13.4f}{xg}" if cross else f"{r['jain']:.4f}")
        )

    return table, row


def close_scaling(report, table) -> None:
    table.close()
    cfg = report.config
    if cfg.get("hosts"):
        print(
            f"# hosts in rank order: {','.join(cfg['hosts'])}; link rate "
            f"{cfg['link_rate_Gbps'] or '-'} Gb/s, inter-group rate {cfg['isl_rate_Gbps'] or '-'} Gb/s "
            f"(each direction)"
        )


def plot_scaling(report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(report.rows, key=lambda r: r["ranks"])
    ns = [r["ranks"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ns, [r["aggregate_Gbps"] for r in rows], "o-", label="aggregate (sum of flows)")
    ax.plot(ns, [r["flow_mean_Gbps"] * r["flows"] / r["ranks"] for r in rows], "s--", label="per-rank TX (mean)")
    if rows:
        per_rank = rows[0]["aggregate_Gbps"] / rows[0]["ranks"]
        ax.plot(ns, [per_rank * n for n in ns], ":", color="grey", label=f"linear from N={rows[0]['ranks']}")
    cfg = report.config
    if any(r.get("inter_group_Gbps") for r in rows):
        ax.plot(
            ns,
            [max(r["inter_group_Gbps"].values()) if r.get("inter_group_Gbps") else float("nan") for r in rows],
            "d-",
            color="purple",
            label="inter-group traffic (busier direction)",
        )
    if cfg.get("isl_rate_Gbps"):
        ax.axhline(cfg["isl_rate_Gbps"], color="red", ls="--", lw=1, label="inter-group capacity (each direction)")
    if cfg.get("link_rate_Gbps"):
        ax.plot(ns, [cfg["link_rate_Gbps"] * n for n in ns], "-.", color="orange", lw=1, label="N x host link rate")
    ax.set_xlabel("ranks (N), N(N-1) flows")
    ax.set_ylabel("throughput [Gb/s]")
    ax.set_xticks(ns)
    ax.set_title(
        f"tensorwire fullmesh over {cfg['transport']}"
        + (f" on testbed {cfg['testbed']}" if cfg.get("testbed") else " on loopback")
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
