"""Comparisons that run the fabric benches many times: write_bw vs
ucx_perftest, and seed 003's tcp vs shared memory table
(``python -m tensorwire.lab.fabric.perftest compare-ucx-perftest|transport-comparison``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..common import BenchError, parse_sizes


# ---------------------------------------------------------------- write_bw vs ucx_perftest


def compare_ucx_perftest(argv: list[str] | None = None) -> int:
    """`write_bw` vs `ucx_perftest -t ucp_put_bw` (the same UCX, UCX_TLS and
    devices; the same size, iterations and window) at >= 1 MiB; the runs
    alternate and each side's median of --reps is kept. Target: >= 0.95x."""
    import json
    import statistics
    import subprocess
    import tempfile

    from .... import _core
    from ..compare import perftest

    ap = argparse.ArgumentParser(
        prog="python -m tensorwire.lab.fabric.perftest compare-ucx-perftest", description=compare_ucx_perftest.__doc__
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1M,4M,16M"))
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
                    subprocess.run(
                        [
                            sys.executable,
                            "-m",
                            "tensorwire",
                            "bench",
                            "write_bw",
                            "--transport",
                            transport,
                            "-s",
                            str(size),
                            "-n",
                            str(iters),
                            "-t",
                            str(window),
                            "--json",
                            f.name,
                        ],
                        check=True,
                        capture_output=True,
                        timeout=600,
                    )
                    ours.append(json.load(open(f.name))["rows"][0]["bw_MiBps"])
                theirs.append(perftest("ucp_put_bw", transport, size, iters))  # MiB/s
            o, t = statistics.median(ours), statistics.median(theirs)
            ratio = o / t
            ok = ratio >= args.target
            oks.append(ok)
            results["rows"].append(
                {
                    "transport": transport,
                    "size": size,
                    "iters": iters,
                    "write_bw_MiBps": ours,
                    "ucp_put_bw_MiBps": theirs,
                    "median_write_bw": o,
                    "median_ucp_put_bw": t,
                    "ratio": ratio,
                    "target": args.target,
                    "pass": ok,
                }
            )
            lines.append(
                f"{transport:<6}{size:>10} {iters:>7} {o:>16.2f} {t:>18.2f} {ratio:>7.2f}x  "
                f"(target >= {args.target:.2f}x) {'PASS' if ok else 'FAIL'}"
            )
    print(
        f"# tensorwire bench write_bw vs ucx_perftest -t ucp_put_bw, UCX {results['ucx']}, window {window} per "
        f"side, 1 lane, median of {args.reps} alternating runs; MiB/sec = 2^20 B/s"
    )
    print(f"{'tr':<6}{'bytes':>10} {'iters':>7} {'write_bw[MiB/s]':>16} {'ucp_put_bw[MiB/s]':>18} {'ratio':>8}")
    for line in lines:
        print(line)
    print(
        f"{'PASS' if all(oks) else 'FAIL'} write_bw_vs_ucx_perftest {sum(oks)}/{len(oks)} sizes at >= "
        f"{args.target:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(oks) else 1


# ---------------------------------------------------------------- transport comparison (seed 003's table)

SEED_003 = {  # "Peak values" of seed 003 (LANL, OSU micro-benchmarks 3.1.1 over Open MPI, 10GbE/QDR hardware)
    "IB QDR": (1.96, 3024.8, 5481.9),
    "RoCE": (3.7, 1142.7, 2284.7),
    "Soft RoCE": (11.6, 1204.1, None),
    "No RDMA (TCP)": (21.09, 301.31, 1136.1),
}


def transport_comparison(argv: list[str] | None = None) -> int:
    """tcp vs shared memory with the fabric benches, seed 003's comparison:
    write_lat/read_lat at 8 B and 4 KiB, write_bw one-way and bidirectional
    at 64 KiB, 1 MiB and 16 MiB; each run repeated --reps times (median)."""
    import json
    import statistics
    import subprocess
    import tempfile

    ap = argparse.ArgumentParser(
        prog="python -m tensorwire.lab.fabric.perftest transport-comparison", description=transport_comparison.__doc__
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--lat-iters", type=int, default=5000)
    ap.add_argument("--bw-iters", type=int, default=5000)
    ap.add_argument("--budget", default="4G", help="bytes per bw size and run (lowers -n at 16 MiB)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    transports = args.transports.split(",")
    tests = [
        ("write_lat", ["-s", "8,4K", "-n", str(args.lat_iters)]),
        ("read_lat", ["-s", "8,4K", "-n", str(args.lat_iters)]),
        ("write_bw", ["-s", "64K,1M,16M", "-n", str(args.bw_iters), "--budget", args.budget]),
        ("write_bw_bidir", ["-s", "64K,1M,16M", "-n", str(args.bw_iters), "--budget", args.budget, "-b"]),
    ]
    raw: dict[str, dict[str, list[dict]]] = {t: {name: [] for name, _ in tests} for t in transports}
    verdicts: dict[str, list[str]] = {}
    from ..common import Progress

    progress = Progress(args.reps * len(transports) * len(tests), "transport comparison")
    for rep in range(args.reps):
        for name, extra in tests:
            for t in transports:  # alternate transports within a rep: a disturbance hits both
                with tempfile.NamedTemporaryFile(suffix=".json") as f:
                    cmd = [
                        sys.executable,
                        "-m",
                        "tensorwire",
                        "bench",
                        name.replace("_bidir", ""),
                        "--transport",
                        t,
                        "-c",
                        "--json",
                        f.name,
                        *extra,
                    ]
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                    if proc.returncode not in (0, 2):  # 2: ran, verdict FAIL (kept in the table)
                        raise BenchError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
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
    print(
        f"# tcp vs shared memory, tensorwire fabric benches over loopback on one host, median of {args.reps} "
        f"runs; latency us (write: one-way = RTT/2, read: full round trip), bandwidth MB/s (10^6 B/s), "
        f"all runs with --validate"
    )
    print(f"{'metric':<34}" + "".join(f"{t:>14}" for t in transports) + f"{'shm/tcp':>10}")
    lines = []
    for key in med[transports[0]]:
        vals = [med[t].get(key, float("nan")) for t in transports]
        name, size, *stat = key.split()
        label = f"{name} {int(size):>8} B" + (f" {stat[0]}" if stat else "")
        ratio = (vals[1] / vals[0]) if len(vals) > 1 and vals[0] else float("nan")
        lines.append(f"{label:<34}" + "".join(f"{v:>14.2f}" for v in vals) + f"{ratio:>9.2f}x")
    print("\n".join(lines))
    print()
    print(
        "# seed 003's 'Peak values' table, with tensorwire's rows (latency us at the smallest size, "
        "best bandwidth over sizes, MB/s)"
    )
    cols = list(SEED_003) + [f"tensorwire {t}" for t in transports]
    print(f"{'Peak values':<22}" + "".join(f"{c:>16}" for c in cols))
    ours = {
        t: (
            min(med[t]["write_lat 8 p50"], med[t]["write_lat 8 avg"]),
            max(v for k, v in med[t].items() if k.startswith("write_bw ")),
            max(v for k, v in med[t].items() if k.startswith("write_bw_bidir ")),
        )
        for t in transports
    }
    for i, metric in enumerate(("Latency (us)", "One-way BW (MB/s)", "Two-way BW (MB/s)")):
        peaks = [SEED_003[c][i] for c in SEED_003] + [ours[t][i] for t in transports]
        print(f"{metric:<22}" + "".join(f"{'-':>16}" if v is None else f"{v:>16.2f}" for v in peaks))
    print(
        "# seed 003 columns: 2010 hardware (QDR IB, 10GbE RoCE, rxe, kernel TCP over 10GbE) measured with OSU "
        "osu_latency/osu_bw/osu_bibw; tensorwire columns: this host's loopback, one-sided writes"
    )
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
            json.dump(
                {
                    "test": "transport_comparison",
                    "reps": args.reps,
                    "median": med,
                    "seed_003": SEED_003,
                    "verdicts": verdicts,
                    "runs": raw,
                },
                f,
                indent=1,
            )
    return 1 if bad else 0
