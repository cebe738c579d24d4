"""The tests: one-sided bandwidth (write_bw/read_bw) and latency
(write_lat/read_lat) measured against a client, checked, and reported: each
size's row is printed when it is measured, as perftest does."""

from __future__ import annotations

from typing import Any

from .peer import in_world
from .plots import plot_bw, plot_lat
from .tables import open_bw_table, open_lat_table


def _config(args, sizes: list[int], unit: str, **specific: Any) -> dict[str, Any]:
    """The report's config: the keys every test of the family has, then its own (docs/benchmarks.md)."""
    return {
        "command": getattr(args, "bench", None) or args.test,
        "transport": args.transport,
        "op": args.op,
        "sizes": sizes,
        "iters": args.iters,
        "lanes": args.lanes,
        "budget": args.budget[0] if args.budget else None,
        "workers": args.workers,
        "format": args.format,
        "unit": unit,
        "validate": args.validate,
        "link_rate_Gbps": args.link_rate * 8 / 1e9 if args.link_rate else None,
        "mode": "world" if in_world() else ("connect" if args.connect else "spawned peer"),
        **specific,
    }


def _iterations(args, size: int) -> int:
    """Per lane: -n, lowered by --budget for big sizes."""
    from ..common import iterations_for

    return iterations_for(size, args.iters, args.budget[0]) if args.budget else args.iters


def measure_bw(args, client, sizes: list[int]):
    from .. import p2p
    from ..common import (
        MIB,
        Progress,
        Report,
        check_bw_row,
        check_bw_trend,
        check_transports,
        human_size,
        peak_bandwidth_posted,
        to_unit,
    )

    op, bidir, lanes = args.op, args.bidirectional, args.lanes
    unit = {"perftest": "Gb/sec" if args.report_gbits else "MiB/sec", "osu": "MB/s", "imb": "MB/s"}[args.format]
    report = Report(
        args.test + ("_bidir" if bidir else ""),
        _config(
            args,
            sizes,
            unit,
            tx_depth=args.window or "auto",
            bidirectional=bidir,
            duration=args.duration,
            margin=args.margin,
            peak="disabled" if (args.duration or args.no_peak) else "best run of >= in-flight consecutive ops",
        ),
    )
    check_transports(report, args.transport, client.channels)
    progress = Progress(len(sizes), report.test)
    table, line = open_bw_table(args, report, unit, progress)
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
            row.update(
                {
                    "iterations": ops,
                    "seconds": seconds,
                    "duration": args.duration,
                    "margin": args.margin,
                    "raw": {
                        "bin_s": ours["bin"],
                        "per_lane_bins": _split_bins(ours),
                        "peer_per_lane_bins": _split_bins(theirs) if theirs else None,
                        "per_lane_in_window": list(ours["in_window"]),
                        "per_lane_total": list(ours["total"]),
                    },
                }
            )
            iters_expected = None
        else:
            iters = lanes * _iterations(args, size)
            warmup = max(2, min(iters // 10, 100))
            ours, theirs = client.stream_ops(op, size, iters, window, bidir, warmup)
            sides = [ours] + ([theirs] if theirs else [])
            avg = sum(len(s["completions"]) * size / s["seconds"] for s in sides)
            peak = None
            if not args.no_peak:
                peak = 0.0
                for s in sides:
                    n = len(s["completions"])
                    peak += max(
                        peak_bandwidth_posted(size, s["posted"], s["completions"], k)
                        for k in {window * lanes, max(1, n // 4), n}
                    )
            ops = sum(len(s["completions"]) for s in sides)
            seconds = ours["seconds"]
            row.update(
                {
                    "iterations": ops,
                    "seconds": seconds,
                    "warmup": warmup,
                    "raw": {
                        "posted_us": _us(ours["posted"]),
                        "completed_us": _us(ours["completions"]),
                        "peer_posted_us": _us(theirs["posted"]) if theirs else None,
                        "peer_completed_us": _us(theirs["completions"]) if theirs else None,
                    },
                }
            )
            iters_expected = iters * len(sides)
        msg_rate = avg / size / 1e6
        check_bw_row(report, size, avg, peak, msg_rate, args.link_rate, bidir, iters_expected, ops)
        if args.validate:
            errors = client.check_validation(op, size, seed, bidir)
            errors += client.validate_rounds(op, size, max(4, lanes), seed + 2)
            row["validation"] = "Fail" if errors else "Pass"
            for e in errors:
                report.fail(f"DATA VALIDATION ERROR at {size} B: {e}")
        row.update(
            {
                "bw_avg_Bps": avg,
                "bw_peak_Bps": peak,
                "bw_average": to_unit(avg, unit),
                "bw_peak": to_unit(peak, unit) if peak else 0.0,
                "unit": unit,
                "msg_rate_Mpps": msg_rate,
                "bw_MiBps": avg / MIB,
                "bw_Gbps": avg * 8 / 1e9,
            }
        )
        report.rows.append(row)
        table.line(line(row))
        trend.append((size, avg))
        progress.step(human_size(size))
    table.close()
    check_bw_trend(report, trend)

    def plotter(path: str) -> None:
        plot_bw(report, path, unit)

    best = max(report.rows, key=lambda r: r["bw_avg_Bps"])
    key = f"BW average={best['bw_average']:.2f}{unit}@{best['size']}B"
    return report, plotter, key


def _us(xs) -> list[float]:
    return [round(x * 1e6, 3) for x in xs]


def _split_bins(side: dict[str, Any] | None) -> list[list[int]]:
    if not side:
        return []
    nb = int(side["nbins"])
    bins = list(side["bins"])
    return [bins[i * nb : (i + 1) * nb] for i in range(len(bins) // max(1, nb))]


def measure_lat(args, client, sizes: list[int]):
    from ..common import (
        Progress,
        Report,
        check_latency_row,
        check_latency_trend,
        check_transports,
        human_size,
        latency_stats,
    )

    rtt = args.op == "read"
    report = Report(
        args.test,
        _config(
            args,
            sizes,
            "usec",
            latency="full round trip (rtt)" if rtt else "one-way (RTT/2)",
            tail="2 largest samples dropped (perftest LAT_MEASURE_TAIL)",
        ),
    )
    check_transports(report, args.transport, client.channels)
    progress = Progress(len(sizes), report.test)
    table, line = open_lat_table(args, report, progress)
    trend = []
    for i, size in enumerate(sizes):
        iters = _iterations(args, size)
        warmup = max(10, iters // 10)
        samples = client.latency(args.op, size, iters, warmup)
        st = latency_stats(samples, 1.0 if rtt else 0.5)
        check_latency_row(report, size, st)
        if len(samples) != iters:
            report.fail(f"{len(samples)} samples at {size} B, {iters} requested")
        row: dict[str, Any] = {
            "size": size,
            "bytes": size,
            "iterations": iters,
            "warmup": warmup,
            "rtt": rtt,
            "lat_us": st,
            "seconds": sum(samples),
            "samples_us": [round(s * 1e6, 3) for s in samples],
            "sample": "round trip per iteration (us); reported values scale it by " + ("1" if rtt else "1/2"),
        }
        if args.validate:
            errors = client.validate_rounds(args.op, size, 4, 1000 * (i + 1))
            row["validation"] = "Fail" if errors else "Pass"
            for e in errors:
                report.fail(f"DATA VALIDATION ERROR at {size} B: {e}")
        report.rows.append(row)
        table.line(line(row))
        trend.append((size, st["p50"]))
        progress.step(human_size(size))
    table.close()
    # A one-way time below size/rate is impossible; a full RTT moves the size once as well.
    check_latency_trend(report, trend, args.link_rate, rtt)

    def plotter(path: str) -> None:
        plot_lat(report, path)

    first = report.rows[0]
    key = f"t_typical={first['lat_us']['p50']:.2f}us{'(rtt)' if rtt else ''}@{first['size']}B"
    return report, plotter, key
