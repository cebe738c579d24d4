"""The rank side of `tensorwire bench alltoall|allreduce` (see collectives.py):
timed loops for the World's C++ collectives layer (called directly, or with --api
through world.allreduce/alltoall) and, with --compare mpi|gloo, for
the same operation through mpi4py or torch.distributed gloo (the series are in
_coll_series.py), OSU statistics, tables, checks, JSON, plot."""

from __future__ import annotations

import argparse
import math
import os
import platform
import signal
import sys
import time
from typing import Any, Callable

import numpy as np

from ...errors import Error
from . import _coll_osu as osu
from ._coll_series import ApiSeries, GlooSeries, MpiSeries, Series, TensorwireSeries, Patterns
from .common import Progress, Report, check_lane_transports, human_size, print_line

FIELD = 18  # OSU's FIELD_WIDTH
SIZE_W = 10  # OSU prints the size as %-10d


def osu_counts(size: int, args: argparse.Namespace) -> tuple[int, int]:
    """(iterations, warm-up) for a size: OSU's defaults unless given."""
    if args.profile == "1mi-int32":
        iters, warm = osu.PROFILE_1MI_INT32["iters"], osu.PROFILE_1MI_INT32["warmup"]
    else:
        large = size > osu.OSU_LARGE
        iters, warm = osu.OSU_ITERS[large], osu.OSU_SKIP[large]
    return (args.iters or iters), (warm if args.warmup is None else args.warmup)


def timed_loop(
    series: Series,
    iters: int,
    warmup: int,
    validate: bool,
    barrier: bool,
    kill: Callable[[int], None] | None = None,
    start: int = 0,
) -> tuple[list[float], int]:
    """OSU's loop: [prepare] t0 call t1 [check] [barrier]; returns (timed samples in s, failed checks).
    `start` is the first iteration's number (the validation pattern depends on it)."""
    samples: list[float] = []
    errors = 0
    clock = time.perf_counter
    series.sync()
    for i in range(start, start + warmup + iters):
        if validate:
            series.prepare(i)
        if kill is not None:
            kill(i)
        t0 = clock()
        out = series.call()
        t1 = clock()
        if validate and not series.check(out, i):
            errors += 1
        if i >= start + warmup:
            samples.append(t1 - t0)
        if barrier:
            series.sync()
    if not barrier:
        series.sync()
    return samples, errors


def run_size(
    series: list[Series],
    iters: int,
    warmup: int,
    rounds: int,
    validate: bool,
    barrier: bool,
    kill: Callable[[int], None] | None = None,
) -> dict[str, tuple[list[float], int]]:
    """Every series at one size. With rounds > 1 the timed iterations are split into `rounds`
    blocks and the series take turns block by block, so a change in the machine's load hits
    both alike (the first block of each series has the warm-up, later blocks one untimed call)."""
    if not validate:
        for s in series:
            s.prepare(0)
    rounds = max(1, min(rounds, iters))
    chunks = [iters // rounds + (1 if r < iters % rounds else 0) for r in range(rounds)]
    got: dict[str, tuple[list[float], int]] = {s.name: ([], 0) for s in series}
    next_i = {s.name: 0 for s in series}
    for r, n_it in enumerate(chunks):
        for s in series:
            w = warmup if r == 0 else min(1, warmup)
            samples, errors = timed_loop(
                s, n_it, w, validate, barrier, kill if s.name == "tensorwire" else None, start=next_i[s.name]
            )
            next_i[s.name] += w + n_it
            old = got[s.name]
            got[s.name] = (old[0] + samples, old[1] + errors)
    return got


def run_rank(args: argparse.Namespace) -> int:
    from ...ranks.world import World

    if getattr(args, "threshold", None):  # read when the World makes its collectives layer
        os.environ["TENSORWIRE_COLL_SMALL_BYTES"] = str(args.threshold[0])
    if args.compare == "mpi" and os.environ.get("OMPI_COMM_WORLD_SIZE"):
        # MPI_Init first: it waits for every rank holding the GIL, which would stall rank 0's
        # control-plane handlers (the World's bootstrap) if the World came first.
        from mpi4py import MPI  # noqa: F401
    world = World(transport=args.transport, progress=args.progress_mode, timeout=max(30.0, args.timeout))
    try:
        return _run(world, args)
    except Error as e:  # a peer failed or timed out (named), or bad input
        print(f"tensorwire bench {args.coll_op}: {e}", file=sys.stderr, flush=True)
        return 3
    finally:
        world.close()


def _mpi_comm(world: Any, args: argparse.Namespace) -> tuple[Any, str]:
    if world.placement.launcher != "mpirun":
        raise SystemExit(
            f"tensorwire bench {args.coll_op}: --compare mpi needs ranks started by mpirun "
            f"(these were started by {world.placement.launcher}); run it without a launcher "
            f"and it starts them so, or use mpirun -n N ... yourself"
        )
    why = osu.mpi_unavailable()
    if why and "mpirun" not in why:
        raise SystemExit(f"tensorwire bench {args.coll_op}: --compare mpi: {why}")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != world.size or comm.Get_rank() != world.rank:
        raise SystemExit(
            f"MPI says rank {comm.Get_rank()} of {comm.Get_size()}, tensorwire says {world.rank} of {world.size}"
        )
    return comm, MPI.Get_library_version().strip("\x00 \n").splitlines()[0].strip()


def _mpi_env() -> dict[str, str]:
    """The OMPI_MCA_* settings that choose how MPI moves data (not mpirun's own plumbing)."""
    keep = (
        "OMPI_MCA_pml",
        "OMPI_MCA_btl",
        "OMPI_MCA_coll",
        "OMPI_MCA_mtl",
        "OMPI_MCA_osc",
        "OMPI_MCA_mpi_",
        "OMPI_MCA_rmaps_base_oversubscribe",
    )
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(keep)}


def _run(world: Any, args: argparse.Namespace) -> int:
    op, n, rank = args.coll_op, world.size, world.rank
    sizes = list(args.sizes)
    dtype = None
    if op == "allreduce":
        dtype = np.dtype("int32" if args.type == "int" or args.profile == "1mi-int32" else "float32")
    comm, mpi_version = (None, None)
    if args.compare == "mpi":
        comm, mpi_version = _mpi_comm(world, args)
    if args.plot and rank == 0:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise SystemExit("--plot needs matplotlib: pip install matplotlib")
    coll = world.collectives  # made here, on every rank: the World's one collectives layer
    threshold = coll.small_allreduce_limit
    if args.api:
        series: list[Series] = [ApiSeries(world, op, dtype)]
    else:
        series = [TensorwireSeries(world, op, dtype, getattr(args, "algorithm", ""), args.timeout)]
    quiesce = world.barrier  # the layer's barrier, now that it exists
    if comm is not None:
        series.append(MpiSeries(comm, op, dtype))
    elif args.compare == "gloo":
        series.append(GlooSeries(world, op, dtype, quiesce))
    seed = args.profile == "1mi-int32"
    rounds = args.rounds if args.rounds else (5 if len(series) > 1 else 1)
    test = op + ("_1mi_int32" if seed else "")
    config = {
        "op": op,
        "ranks": n,
        "transport": args.transport,
        "progress": args.progress_mode,
        "sizes": sizes,
        "size_unit": "bytes per peer" if op == "alltoall" else "bytes of the vector",
        "dtype": ("int32" if seed else "bytes (MPI_BYTE)") if op == "alltoall" else str(dtype),
        "iters": args.iters,
        "warmup": args.warmup,
        "rounds": rounds,
        "validate": bool(args.validate),
        "profile": args.profile,
        "algorithm": getattr(args, "algorithm", "pairwise"),
        "rd_ring_threshold": threshold if op == "allreduce" else None,
        "compare": args.compare,
        "mpi": mpi_version,
        "gloo": series[1].version if args.compare == "gloo" else None,
        "path": (
            "api: world.allreduce/alltoall on numpy arrays (their checks timed)"
            if args.api
            else "layer: world.collectives (C++) on numpy arrays, the algorithm as asked"
        ),
        "mpi_env": _mpi_env() if comm else None,
        "engine": {"layer": "C++ Collectives on the Messenger (tagged messages)", "spin_us": world.device.spin_us},
        "launcher": world.placement.launcher,
        "hosts": sorted(set(world.hosts)),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "unit": "usec (OSU: per-rank average over the timed iterations; Avg over ranks, Min/Max rank)",
        "method": (
            "back-to-back calls, no barrier in between (the seed-004 experiment)"
            if seed
            else "OSU: each call timed alone, then a barrier outside the timer"
        ),
        "bandwidth": (
            "nccl-tests: alltoall algbw = N*bytes_per_peer/t_avg, busbw = algbw*(N-1)/N; allreduce "
            "algbw = bytes/t_avg, busbw = algbw*2(N-1)/N; GB/s = 1e9 B/s; TX/rank = "
            "(N-1)*bytes_per_peer*8/t_avg Gb/s (the paper's per-node throughput)"
        ),
    }
    report = Report(test, config)
    out = _Printer(args, op, n, series, report, seed)
    if rank == 0:
        out.header(world)
    progress = out.progress = Progress(len(sizes) * len(series), test, None if rank == 0 else False)
    kill_at: Callable[[int], None] | None = None
    if args.kill_rank is not None and args.kill_rank == rank:

        def kill_at(i: int) -> None:  # noqa: F811 - the tests' hook: this rank dies mid-run (10 timed calls into size 1)
            if current["size"] == sizes[0] and i == current["warmup"] + 10:
                print(f"test hook: SIGKILL to rank {rank} at t={time.time():.3f}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    current: dict[str, Any] = {"size": None, "warmup": 0}
    for size in sizes:
        iters, warm = osu_counts(size, args)
        current.update(size=size, warmup=warm)
        pat = Patterns(op, rank, n, size, dtype)
        for s in series:
            s.setup(size, pat)
        got = run_size(series, iters, warm, rounds, args.validate, barrier=not seed, kill=kill_at)
        results = {}
        for s in series:
            samples, errors = got[s.name]
            mine = {
                "avg": float(np.mean(samples) * 1e6) if samples else float("nan"),
                "errors": errors,
                "n": len(samples),
                "samples": [round(x * 1e6, 3) for x in samples],
            }
            every = world.allgather(mine, timeout=max(60.0, args.timeout))
            results[s.name] = (every, s.algo_used)
            progress.step(f"{s.name} {human_size(size)}")
        if rank == 0:
            out.row(size, iters, warm, results)
    for s in series:
        s.close()
    # Which UCX transports the ranks' channels used (a control-plane call, after the last one above).
    lanes = world.allgather(
        sorted({t for p in range(n) if p != rank for t in world.channel(p).transports()}),
        timeout=max(60.0, args.timeout),
    )
    if rank == 0:
        used = check_lane_transports(report, args.transport, [t for mine in lanes for t in mine])
        if used:
            print(f"# tensorwire's lanes used: {', '.join(used)}")
        _checks(report, op, n, args)
        out.finish()
        report.write_json(args.json)
        if args.plot:
            plot(report, args.plot)
        print(report.verdict_line(_key_metric(report, n)), flush=True)
    world.barrier()
    return 0 if report.verdict != "FAIL" or rank != 0 else 2


def _stats(every: list[dict[str, Any]]) -> dict[str, Any]:
    avgs = [e["avg"] for e in every]
    every_sample = sorted(x for e in every for x in e["samples"])
    p50 = every_sample[len(every_sample) // 2] if every_sample else float("nan")
    return {
        "avg_us": sum(avgs) / len(avgs),
        "min_us": min(avgs),
        "max_us": max(avgs),
        "p50_us": p50,
        "errors": sum(e["errors"] for e in every),
        "per_rank_avg_us": avgs,
        "iterations_done": [e["n"] for e in every],
        "samples_us": [e["samples"] for e in every],
    }


class _Printer:
    def __init__(
        self, args: argparse.Namespace, op: str, n: int, series: list[Series], report: Report, seed: bool
    ) -> None:
        self.args, self.op, self.n, self.series, self.report, self.seed = args, op, n, series, report, seed
        self.osu_buffer: dict[str, list[str]] = {s.name: [] for s in series}
        self.other = series[1] if len(series) > 1 else None  # the comparison (mpi or gloo)
        self.progress: Progress | None = None  # rows are printed above its bar

    def header(self, world: Any) -> None:
        a = self.args
        what = (
            "pairwise exchange"
            if self.op == "alltoall"
            else f"allreduce SUM {self.report.config['dtype']}, algorithm {a.algorithm}"
            + (
                f" (rd up to {self.report.config['rd_ring_threshold']} B, then the ring)"
                if a.algorithm == "auto"
                else ""
            )
        )
        print(
            f"# tensorwire bench {self.op}: {self.n} ranks, transport {a.transport}, {what}, C++ collectives"
            f"{', validation on' if a.validate else ''}",
            flush=True,
        )
        print(f"# tensorwire path: {self.report.config['path']}", flush=True)
        if self.other is not None:
            via = (
                "through mpi4py"
                if self.other.name == "mpi"
                else "torch.distributed, TCP (gloo has no shared-memory transport)"
            )
            print(
                f"# compared with: {self.report.config[self.other.name]} {via}, in the same processes; the "
                f"series take turns in {self.report.config['rounds']} blocks per size",
                flush=True,
            )
        if self.seed:
            print(
                "# profile 1mi-int32: 1 Mi int32 "
                + ("per peer" if self.op == "alltoall" else "vector")
                + ", back-to-back calls; "
                + self.report.config["bandwidth"],
                flush=True,
            )
            print(
                f"{'#ranks':>6} {'#bytes' + ('/peer' if self.op == 'alltoall' else ''):>12} {'#iterations':>11} "
                f"{'t_avg[usec]':>12} {'t_min[usec]':>12} {'t_max[usec]':>12} {'algbw[GB/s]':>12} "
                f"{'busbw[GB/s]':>12} {'TX/rank[Gb/s]':>14}  series" + ("  validation" if a.validate else ""),
                flush=True,
            )
            return
        if a.format == "osu":
            self._osu_header("tensorwire")
            return
        cols = (
            f"{'# Size':<{SIZE_W}}{'Avg Latency(us)':>{FIELD}}{'Min Latency(us)':>{FIELD}}"
            f"{'Max Latency(us)':>{FIELD}}{'Iterations':>12}"
        )
        if a.validate:
            cols += f"{'Validation':>12}"
        if self.op == "allreduce":
            cols += f"{'Algorithm':>10}"
        if self.other is not None:
            x = self.other.label
            cols += f"{x + ' Avg(us)':>{FIELD}}{x + ' Min(us)':>{FIELD - 4}}{x + ' Max(us)':>{FIELD - 4}}"
            if a.validate:
                cols += f"{x + ' Valid.':>12}"
            cols += f"{x + '/tw':>8}"
        print(cols, flush=True)

    def _osu_header(self, name: str) -> None:
        print(osu.OSU_TITLES[self.op] + {"mpi": "", "gloo": " (torch.distributed gloo)"}.get(name, " (tensorwire)"))
        dt = (
            "MPI_CHAR"
            if self.op == "alltoall"
            else ("MPI_INT" if self.report.config["dtype"] == "int32" else "MPI_FLOAT")
        )
        print(f"# Datatype: {dt}.")
        line = (
            f"{'# Size':<{SIZE_W}}{'Avg Latency(us)':>{FIELD}}{'Min Latency(us)':>{FIELD}}"
            f"{'Max Latency(us)':>{FIELD}}{'Iterations':>12}"
        )
        if self.args.validate:
            line += f"{'Validation':>{FIELD}}"
        print(line, flush=True)

    def row(self, size: int, iters: int, warm: int, results: dict[str, tuple[list, str]]) -> None:
        stats = {}
        for name, (every, algo) in results.items():
            st = _stats(every)
            st.update(
                {
                    "series": name,
                    "size": size,
                    "iterations": iters,
                    "warmup": warm,
                    "algorithm": algo,
                    "validation": ("Pass" if st["errors"] == 0 else "Fail") if self.args.validate else None,
                }
            )
            if self.seed:
                st.update(_bandwidths(self.op, self.n, size, st["avg_us"]))
            self.report.rows.append(st)
            stats[name] = st
        tw = stats["tensorwire"]
        mp = stats.get(self.other.name) if self.other is not None else None
        ratio = f"{self.other.name}_over_tw" if self.other is not None else ""
        if mp is not None:
            tw[ratio] = mp["avg_us"] / tw["avg_us"] if tw["avg_us"] > 0 else float("nan")
        a = self.args
        if self.seed:
            for st in stats.values():
                print_line(
                    f"{self.n:>6} {size:>12} {iters:>11} {st['avg_us']:>12.2f} {st['min_us']:>12.2f} "
                    f"{st['max_us']:>12.2f} {st['algbw_GBps']:>12.3f} {st['busbw_GBps']:>12.3f} "
                    f"{_fmt(st.get('tx_per_rank_Gbps')):>14}  {st['series']}"
                    + (f"  {st['validation']}" if a.validate else ""),
                    progress=self.progress,
                )
            return
        if a.format == "osu":
            for name, st in stats.items():
                line = (
                    f"{size:<{SIZE_W}d}{st['avg_us']:>{FIELD}.2f}{st['min_us']:>{FIELD}.2f}"
                    f"{st['max_us']:>{FIELD}.2f}{iters:>12d}"
                )
                if a.validate:
                    line += f"{st['validation']:>{FIELD}}"
                if name == "tensorwire":
                    print_line(line, progress=self.progress)
                else:
                    self.osu_buffer[name].append(line)
            return
        line = (
            f"{size:<{SIZE_W}d}{tw['avg_us']:>{FIELD}.2f}{tw['min_us']:>{FIELD}.2f}"
            f"{tw['max_us']:>{FIELD}.2f}{iters:>12d}"
        )
        if a.validate:
            line += f"{tw['validation']:>12}"
        if self.op == "allreduce":
            line += f"{tw['algorithm']:>10}"
        if mp is not None:
            line += f"{mp['avg_us']:>{FIELD}.2f}{mp['min_us']:>{FIELD - 4}.2f}{mp['max_us']:>{FIELD - 4}.2f}"
            if a.validate:
                line += f"{mp['validation']:>12}"
            line += f"{tw[ratio]:>7.2f}x"
        print_line(line, progress=self.progress)

    def finish(self) -> None:
        if self.args.format == "osu" and not self.seed:
            for name, lines in self.osu_buffer.items():
                if name == "tensorwire" or not lines:
                    continue
                print()
                self._osu_header(name)
                for line in lines:
                    print(line)
        if self.other is not None and self.args.format != "osu" and not self.seed:
            x = self.other.label
            print(f"# {x}/tw: {x}'s Avg over tensorwire's (> 1: tensorwire is faster)")
        sys.stdout.flush()


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _bandwidths(op: str, n: int, size: int, t_us: float) -> dict[str, float]:
    t = t_us * 1e-6
    if op == "alltoall":
        alg = n * size / t / 1e9
        return {"algbw_GBps": alg, "busbw_GBps": alg * (n - 1) / n, "tx_per_rank_Gbps": (n - 1) * size * 8 / t / 1e9}
    alg = size / t / 1e9
    return {"algbw_GBps": alg, "busbw_GBps": alg * 2 * (n - 1) / n}


def _checks(report: Report, op: str, n: int, args: argparse.Namespace) -> None:
    """The sanity checks of bench-anchors section 7 that apply to collectives (F = FAIL, else WARN)."""
    for st in report.rows:
        where = f"{st['series']} {st['size']} B"
        if st["errors"]:
            report.fail(f"validation failed: {where}, {st['errors']} of {st['iterations'] * n} rank-iterations")
        for k in ("avg_us", "min_us", "max_us"):
            v = st[k]
            if not (isinstance(v, float) and math.isfinite(v) and v > 0):
                report.fail(f"{k} is {v} at {where}")
        if st["min_us"] > st["avg_us"] + 1e-9 or st["avg_us"] > st["max_us"] + 1e-9:
            report.fail(f"min <= avg <= max does not hold at {where}")
        if any(k != st["iterations"] for k in st["iterations_done"]):
            report.fail(f"iterations done {st['iterations_done']} differ from the {st['iterations']} asked at {where}")
    # latency should grow with size: warn when a size >= 64 KiB is >10% faster than the one before
    for name in {r["series"] for r in report.rows}:
        rows = sorted((r for r in report.rows if r["series"] == name), key=lambda r: r["size"])
        for a, b in zip(rows, rows[1:]):
            if a["size"] >= 64 << 10 and b["avg_us"] < 0.9 * a["avg_us"]:
                report.warn(f"{name}: {b['size']} B is {1 - b['avg_us'] / a['avg_us']:.0%} faster than {a['size']} B")
    # performance goal: not slower than MPI (or gloo) from 1 MiB on
    for r in report.rows:
        for other, label in (("mpi", "MPI"), ("gloo", "gloo")):
            x = r.get(f"{other}_over_tw")
            if r["series"] == "tensorwire" and x is not None and r["size"] >= 1 << 20 and x < 1:
                report.warn(
                    f"slower than {label} at {human_size(r['size'])}: {r['avg_us']:.1f} us vs {r['avg_us'] * x:.1f} us"
                )


def _key_metric(report: Report, n: int) -> str:
    tw = [r for r in report.rows if r["series"] == "tensorwire"]
    if not tw:
        return f"{n} ranks: no rows"
    r = max(tw, key=lambda r: r["size"])
    s = f"{n} ranks, {human_size(r['size'])}: avg {r['avg_us']:.1f} us"
    if "algbw_GBps" in r:
        s += f", algbw {r['algbw_GBps']:.2f} GB/s, busbw {r['busbw_GBps']:.2f} GB/s"
    for other, label in (("mpi", "MPI"), ("gloo", "gloo")):
        if f"{other}_over_tw" in r:
            x = r[f"{other}_over_tw"]
            s += f" ({label} {r['avg_us'] * x:.1f} us: {x:.2f}x)"
    if report.config.get("validate"):
        bad = sum(1 for x in report.rows if x["errors"])
        s += ", validation " + ("Pass" if not bad else f"Fail in {bad} rows")
    return s


def plot(report: Report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = report.config
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, color in (("tensorwire", "tab:blue"), ("mpi", "tab:orange"), ("gloo", "tab:green")):
        rows = sorted((r for r in report.rows if r["series"] == name), key=lambda r: r["size"])
        if not rows:
            continue
        xs = [r["size"] for r in rows]
        label = "tensorwire" if name == "tensorwire" else (cfg.get(name) or name).split(",")[0]
        ax.plot(xs, [r["avg_us"] for r in rows], marker="o", markersize=3, color=color, label=f"{label}: Avg")
        ax.fill_between(
            xs,
            [r["min_us"] for r in rows],
            [r["max_us"] for r in rows],
            color=color,
            alpha=0.2,
            label=f"{label}: Min-Max rank",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({r["size"] for r in report.rows})
    ticks = sizes[:: max(1, len(sizes) // 8)]
    ax.set_xticks(ticks)
    ax.set_xticklabels([human_size(s) for s in ticks])
    ax.set_xlabel(f"size [{cfg['size_unit']}]")
    ax.set_ylabel("latency [µs]")
    ax.set_title(f"{report.test}: {cfg['ranks']} ranks, transport {cfg['transport']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
