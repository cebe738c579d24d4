"""Runs both sides of the core performance comparison in one go and prints
the ratios (bench/compare_ucx_perftest.sh calls this):

* `tensorwire bench write_bw` vs `ucx_perftest -t ucp_put_bw` (same UCX, same
  UCX_TLS, same devices) at 1 MiB and 16 MiB, for tcp and shared memory;
* over tcp, vs a plain TCP socket stream between two processes;
* `tensorwire bench write_lat` at 8 B vs `ucx_perftest -t ucp_put_lat`.

Bandwidth in MiB/s (2^20 B/s), the unit of write_bw and of ucx_perftest.

Each measurement is repeated (--reps) and the median kept: single runs on a
2-vCPU machine vary by tens of percent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ... import _core
from . import tcp_stream
from .common import MIB, BenchError

TLS = {"tcp": "tcp", "shm": "sm"}
PERFTEST_PORT = 13457


def ucx_bin(name: str) -> str:
    lib = os.path.realpath(_core.ucx_library_path())
    path = os.path.join(os.path.dirname(os.path.dirname(lib)), "bin", name)
    if not os.path.exists(path):
        raise SystemExit(f"{name} not found next to the loaded UCX ({path})")
    return path


def ucx_env(transport: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    lib = os.path.dirname(os.path.realpath(_core.ucx_library_path()))
    env = dict(
        os.environ,
        UCX_TLS=TLS[transport],
        UCX_NET_DEVICES="lo",
        LD_LIBRARY_PATH=lib + ":" + os.environ.get("LD_LIBRARY_PATH", ""),
    )
    env.update(extra or {})
    return env


def perftest(test: str, transport: str, size: int, iters: int, extra: dict[str, str] | None = None) -> float:
    """ucx_perftest's final row: MiB/s (its "MB/s" is 2^20 B/s) for *_bw, median one-way us for *_lat."""
    exe, env = ucx_bin("ucx_perftest"), ucx_env(transport, extra)
    args = ["-t", test, "-s", str(size), "-n", str(iters), "-p", str(PERFTEST_PORT)]
    server = subprocess.Popen([exe, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run(
            [exe, "127.0.0.1", *args, "-f"], env=env, capture_output=True, text=True, timeout=300
        ).stdout
    finally:
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    if not rows:
        raise BenchError(f"ucx_perftest printed no result:\n{out}")
    cols = [float(x) for x in rows[-1]]
    # iterations, lat p50, lat avg, lat overall, bw avg, bw overall (MiB/s), msgrate avg, overall
    return cols[5] if test.endswith("_bw") else cols[1]


def tensorwire_bench(test: str, transport: str, sizes: str, iters: int, budget: str = "1G") -> dict[int, float]:
    """`tensorwire bench write_bw|write_lat`: MiB/s (BW average) or one-way us (t_typical) per size;
    --budget lowers -n for the big sizes."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [
            sys.executable,
            "-m",
            "tensorwire",
            "bench",
            test,
            "--transport",
            transport,
            "-s",
            sizes,
            "-n",
            str(iters),
            "--budget",
            budget,
            "--json",
            f.name,
        ]
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
        rows = json.load(open(f.name))["rows"]
    if test.endswith("_bw"):
        return {r["size"]: r["bw_MiBps"] for r in rows}
    return {r["size"]: r["lat_us"]["p50"] for r in rows}


def median_of(reps: int, fn) -> float:
    return statistics.median(fn() for _ in range(reps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--json", help="write all numbers here")
    args = ap.parse_args()
    sizes = [1 << 20, 16 << 20]
    results: dict = {"ucx": _core.ucx_version(), "ucx_library": _core.ucx_library_path(), "reps": args.reps, "rows": []}
    lines, verdicts = [], []

    def row(transport, metric, size, ours, anchor_name, anchor, target, higher_is_better=True):
        ratio = ours / anchor if higher_is_better else anchor / ours
        ok = ratio >= target
        results["rows"].append(
            {
                "transport": transport,
                "metric": metric,
                "size": size,
                "tensorwire": ours,
                "anchor": anchor_name,
                "anchor_value": anchor,
                "ratio": ratio,
                "target": target,
                "pass": ok,
            }
        )
        unit = "MiB/s" if metric == "bw" else "us"
        lines.append(
            f"{transport:<5}{metric:<9}{size:>10} {ours:>11.2f} {anchor_name:<30}{anchor:>11.2f} {unit:<5}"
            f"{ratio:>7.2f}x  (target >= {target:.2f}x) {'PASS' if ok else 'FAIL'}"
        )
        verdicts.append(ok)

    for transport in args.transports.split(","):
        bw: dict[int, list[float]] = {s: [] for s in sizes}
        lat = []
        for _ in range(args.reps):
            r = tensorwire_bench("write_bw", transport, "1M,16M", 1000)
            for s in sizes:
                bw[s].append(r[s])
            lat.append(tensorwire_bench("write_lat", transport, "8", 20000)[8])
        ours_bw = {s: statistics.median(v) for s, v in bw.items()}
        ours_lat = statistics.median(lat)
        for s in sizes:
            iters = 1000 if s <= (1 << 20) else 100
            pt = median_of(args.reps, lambda: perftest("ucp_put_bw", transport, s, iters))
            row(transport, "bw", s, ours_bw[s], "ucx_perftest ucp_put_bw", pt, 0.9)
            if transport == "tcp":
                # The same socket buffers tensorwire sets by default, for a like-for-like view.
                tuned = median_of(
                    args.reps,
                    lambda: perftest(
                        "ucp_put_bw", transport, s, iters, {"UCX_TCP_SNDBUF": "4M", "UCX_TCP_RCVBUF": "4M"}
                    ),
                )
                row(transport, "bw", s, ours_bw[s], "ucx_perftest (4M socket bufs)", tuned, 0.9)
                sock = statistics.median(
                    next(r["bw_MBps"] * 1e6 / MIB for r in tcp_stream.measure([s], 1000) if r["size"] == s)
                    for _ in range(args.reps)
                )
                row(transport, "bw", s, ours_bw[s], "plain TCP socket stream", sock, 1.0)
        pl = median_of(args.reps, lambda: perftest("ucp_put_lat", transport, 8, 100000))
        row(transport, "lat", 8, ours_lat, "ucx_perftest ucp_put_lat", pl, 1 / 1.3, higher_is_better=False)

    header = (
        f"{'tr':<5}{'metric':<9}{'bytes':>10} {'tensorwire':>11} {'anchor':<30}{'anchor':>11} {'unit':<5}{'ratio':>8}"
    )
    print(f"# tensorwire vs anchors, UCX {results['ucx']} ({results['ucx_library']}), median of {args.reps} runs")
    print("# ratio: bandwidth ours/anchor; latency anchor/ours (so >= target is good on both)")
    print(header)
    for line in lines:
        print(line)
    print(
        f"{'PASS' if all(verdicts) else 'FAIL'} compare_ucx_perftest {sum(verdicts)}/{len(verdicts)} ratios "
        f"meet their targets"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
