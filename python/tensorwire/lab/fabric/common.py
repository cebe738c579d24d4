"""Shared pieces of the benchmarks: size lists, statistics in the anchor
tools' conventions, tables, JSON reports, verdicts and a progress line."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ...errors import Error
from ...progress import Progress  # noqa: F401 - the benches' bar, the product's (PS training draws it too)


class BenchError(Error):
    """A benchmark could not measure what it was asked: a process or peer it
    depends on failed, or a result did not arrive whole."""


_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}


def parse_size(text: str) -> int:
    """'8' -> 8, '4K' -> 4096, '1M' -> 1048576 (binary units)."""
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num) :]
    try:
        value = int(float(num) * _UNITS[unit])
    except (ValueError, KeyError):
        raise ValueError(f"bad size {text!r}: use e.g. 8, 4K, 1M, 1G") from None
    if value <= 0:
        raise ValueError(f"size must be > 0: {text!r}")
    return value


def parse_sizes(text: str) -> list[int]:
    """'8,4K,1M' -> explicit list; '1:64M' -> powers of two from 1 to 64 MiB."""
    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            lo, hi = (parse_size(p) for p in part.split(":", 1))
            if lo > hi:
                raise ValueError(f"bad range {part!r}: start > end")
            s = 1 << max(0, (lo - 1).bit_length())
            while s <= hi:
                sizes.append(s)
                s <<= 1
        else:
            sizes.append(parse_size(part))
    if not sizes:
        raise ValueError("no sizes given")
    return sizes


def pick_cpus(spec: str, n: int) -> list[int] | None:
    """CPUs for the `n` processes of a bench, one each: `spec` "auto" (the first `n` of this
    process's CPUs when it has that many, else None), "none" (None: the scheduler places them)
    or a comma list of `n` CPU numbers from this process's set."""
    mine = sorted(os.sched_getaffinity(0))
    if spec == "none":
        return None
    if spec == "auto":
        return mine[:n] if len(mine) >= n else None
    try:
        cpus = [int(c) for c in spec.split(",")]
    except ValueError:
        raise ValueError(f"--cpus takes auto, none or {n} CPU numbers like 0,1; got {spec!r}") from None
    if len(cpus) != n or len(set(cpus)) != n:
        raise ValueError(f"--cpus needs {n} distinct CPUs, got {spec!r}")
    if not set(cpus) <= set(mine):
        raise ValueError(f"--cpus {spec}: this process may run on CPUs {','.join(map(str, mine))} only")
    return cpus


def bind_cpu(cpu: int | None) -> set[int]:
    """Pins the calling thread (and the threads it starts later) to `cpu`; returns the
    CPUs it had, to restore with os.sched_setaffinity(0, ...). None: leaves it as is."""
    had = os.sched_getaffinity(0)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    return had


def human_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def latency_stats(samples_s: Sequence[float], scale: float) -> dict[str, float]:
    """perftest's latency statistics (print_report_lat): sort, drop the two
    largest samples, then min/max/typical(median)/avg/stdev/99%/99.9%.
    `scale` converts a sample to the reported one-way value (0.5 for RTT/2)."""
    d = sorted(x * scale * 1e6 for x in samples_s)
    if len(d) > 3:
        d = d[:-2]  # LAT_MEASURE_TAIL
    m = len(d)
    if m == 0:
        return {k: float("nan") for k in ("min", "max", "p50", "avg", "stdev", "p99", "p99_9")}
    avg = sum(d) / m
    var = sum((x - avg) ** 2 for x in d) / m

    def pct(p: float) -> float:
        return d[min(m - 1, max(0, math.ceil(p * m) - 1))]

    return {
        "min": d[0],
        "max": d[-1],
        "p50": d[(m - 1) // 2] if m % 2 else (d[m // 2 - 1] + d[m // 2]) / 2,
        "avg": avg,
        "stdev": math.sqrt(var),
        "p99": pct(0.99),
        "p99_9": pct(0.999),
    }


@dataclass
class Report:
    """One benchmark's result in the project's JSON convention:
    {"test", "config", "rows", "verdict"} (+ "checks" explaining the verdict)."""

    test: str
    config: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    checks: list[tuple[str, str]] = field(default_factory=list)  # (level, message)

    def fail(self, msg: str) -> None:
        self.checks.append(("FAIL", msg))

    def warn(self, msg: str) -> None:
        self.checks.append(("WARN", msg))

    @property
    def verdict(self) -> str:
        levels = {lvl for lvl, _ in self.checks}
        return "FAIL" if "FAIL" in levels else "WARN" if "WARN" in levels else "PASS"

    def to_json(self) -> dict[str, Any]:
        return {
            "test": self.test,
            "config": self.config,
            "rows": self.rows,
            "verdict": self.verdict,
            "checks": [{"level": lvl, "message": msg} for lvl, msg in self.checks],
            "host": platform.node(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def write_json(self, path: str | None) -> None:
        if not path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    def verdict_line(self, key_metric: str) -> str:
        why = "; ".join(msg for lvl, msg in self.checks if lvl != "PASS")
        fabric = self.config.get("transport", "?")
        return f"{self.verdict} {self.test} {fabric} {key_metric}" + (f" ({why})" if why else "")


def check_transports(report: Report, requested: str, channels: Sequence[Any]) -> list[str]:
    """Records the UCX transports the measured channels used (config "lane_transports")
    and FAILs when none of them is of the requested family: a bench of --transport rdma
    that ran over shared memory says so instead of passing (docs/contracts.md §13).
    Returns them, for the header."""
    return check_lane_transports(report, requested, [t for ch in channels for t in ch.transports()])


def check_lane_transports(report: Report, requested: str, used: Iterable[str]) -> list[str]:
    """check_transports for names gathered elsewhere (other ranks' channels)."""
    from ... import _core

    names = sorted(set(used) | set(report.config.get("lane_transports", [])))
    report.config["lane_transports"] = names
    families = {_core.transport_family(t) for t in names}
    if requested != "auto" and names and requested not in families:
        report.fail(f"the traffic went over {', '.join(names)}, not the requested {requested}")
    return names


def check_number(report: Report, name: str, value: float, size: int) -> None:
    if value is None or not math.isfinite(value) or value <= 0:
        report.fail(f"{name} at {size} B is {value}")


def check_latency_row(report: Report, size: int, st: dict[str, float]) -> None:
    for k in ("min", "p50", "avg", "p99", "max"):
        check_number(report, f"latency {k}", st[k], size)
    order = [st["min"], st["p50"], st["p99"], st["p99_9"], st["max"]]
    if any(a > b + 1e-9 for a, b in zip(order, order[1:])):
        report.fail(f"non-monotonic percentiles at {size} B: {order}")
    if st["min"] > st["avg"] + 1e-9:
        report.fail(f"t_min > t_avg at {size} B")
    if st["avg"] > 0 and st["stdev"] / st["avg"] > 0.5:
        report.warn(f"relative stdev {st['stdev'] / st['avg']:.0%} at {size} B")


def iterations_for(size: int, iters: int, budget_bytes: int, minimum: int = 10) -> int:
    """Caps the iteration count so one size moves at most `budget_bytes`."""
    return max(minimum, min(iters, budget_bytes // max(1, size)))


def print_line(text: str, out=None, progress: Progress | None = None) -> None:
    """Prints one line of a report now (flushed: a pipe sees each row as it is
    measured), above the progress bar when one is drawn. out=None: the sys.stdout
    of the moment (tests capture it)."""
    if progress is not None:
        progress.clear()
    print(text, file=out or sys.stdout, flush=True)
    if progress is not None:
        progress.redraw()


class Table:
    """A table printed as its rows are measured, as perftest and OSU print each size
    when it finishes: the rule and the column header when made, each row by line(),
    the closing rule by close(). The caller's row format fixes the column widths,
    since rows go out before all are known."""

    def __init__(self, header: str, out=None, progress: Progress | None = None, ruled: bool = True) -> None:
        self.out, self.progress = out, progress
        self.rule = "-" * max(len(header), 87) if ruled else None
        if self.rule:
            self.line(self.rule)
        self.line(header)

    def line(self, text: str) -> None:
        print_line(text, self.out, self.progress)

    def close(self) -> None:
        if self.rule:
            self.line(self.rule)


def print_table(header: str, lines: Iterable[str], out=None) -> None:
    """A table whose rows are all known."""
    table = Table(header, out)
    for line in lines:
        table.line(line)
    table.close()


# ---- units of the anchor tools ----

MIB = float(1 << 20)


def to_unit(bytes_per_s: float, unit: str) -> float:
    """bytes/s -> 'MiB/sec' (2^20 B/s, perftest/ucx), 'Gb/sec' (10^9 bit/s),
    'MB/s' (10^6 B/s, OSU and IMB >= 2018)."""
    if unit == "Gb/sec":
        return bytes_per_s * 8 / 1e9
    if unit == "MiB/sec":
        return bytes_per_s / MIB
    if unit in ("MB/s", "MB/sec"):
        return bytes_per_s / 1e6
    raise ValueError(f"unknown unit {unit!r}")


# ---- statistics ----


def peak_bandwidth_posted(size: int, posted: Sequence[float], completed: Sequence[float], k: int) -> float:
    """perftest's BW peak over runs of consecutive operations: the best of
    k*size / (completed[i+k-1] - posted[i]) over every run of k operations,
    and of the whole run (so peak >= the average by construction; an average
    above it means a broken measurement). O(n), unlike perftest's O(n^2)."""
    n = min(len(posted), len(completed))
    if n == 0:
        return float("nan")
    best = n * size / (completed[n - 1] - posted[0]) if completed[n - 1] > posted[0] else float("nan")
    k = max(1, min(n, k))
    for i in range(0, n - k + 1):
        dt = completed[i + k - 1] - posted[i]
        if dt > 0:
            bw = k * size / dt
            if not best >= bw:
                best = bw
    return best


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 = perfectly fair, 1/n = one flow takes all."""
    xs = list(values)
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if xs and sq > 0 else float("nan")


# ---- sanity checks (the suite spec's F = fail, else warn) ----


def check_bw_row(
    report: "Report",
    size: int,
    avg: float,
    peak: float | None,
    msg_rate_mpps: float,
    link_rate: float | None = None,
    bidirectional: bool = False,
    iters_expected: int | None = None,
    iters_done: int | None = None,
) -> None:
    """Bandwidth sanity checks, all rates in bytes/s: positive finite average,
    avg <= peak (when measured), avg <= link rate (x2 bidirectional, +2%),
    MsgRate consistent with BW (1%), iterations as requested."""
    check_number(report, "BW average", avg, size)
    if peak is not None and peak == peak and peak > 0 and avg > peak * 1.001:
        report.fail(f"BW average {avg / MIB:.2f} MiB/s above BW peak {peak / MIB:.2f} MiB/s at {size} B")
    if link_rate:
        limit = link_rate * (2 if bidirectional else 1) * 1.02
        if avg > limit:
            report.fail(
                f"BW average {avg * 8 / 1e9:.3f} Gb/s above the link rate "
                f"{link_rate * 8 / 1e9:.3f} Gb/s{' x2' if bidirectional else ''} at {size} B"
            )
    if avg > 0 and abs(avg - size * msg_rate_mpps * 1e6) / avg > 0.01:
        report.fail(f"MsgRate {msg_rate_mpps:.6f} Mpps inconsistent with BW at {size} B")
    if iters_expected is not None and iters_done is not None and iters_done != iters_expected:
        report.fail(f"{iters_done} iterations completed at {size} B, {iters_expected} requested")


def check_bw_trend(report: "Report", rows: Sequence[tuple[int, float]]) -> None:
    """Warn when bandwidth falls by > 20% between consecutive sizes >= 64 KiB."""
    for (s0, b0), (s1, b1) in zip(rows, rows[1:]):
        if s0 >= 65536 and s1 > s0 and b0 > 0 and b1 < 0.8 * b0:
            report.warn(f"BW falls {1 - b1 / b0:.0%} from {s0} B to {s1} B")


def check_latency_trend(
    report: "Report", rows: Sequence[tuple[int, float]], link_rate: float | None = None, rtt: bool = False
) -> None:
    """Warn when latency is > 10% lower at a larger size; fail when a
    latency is below size / link rate (faster than light on that link)."""
    for (s0, t0), (s1, t1) in zip(rows, rows[1:]):
        if s1 > s0 and t1 < 0.9 * t0:
            report.warn(f"latency non-monotonic in size: {t1:.2f} us at {s1} B < {t0:.2f} us at {s0} B")
    if link_rate:
        for s, t in rows:
            floor_us = s / link_rate * 1e6
            if t < floor_us:
                report.fail(f"latency {t:.2f} us at {s} B is below size/link rate ({floor_us:.2f} us)")


def check_fairness(report: "Report", flows: Sequence[tuple[str, float]]) -> float:
    """Fullmesh checks over (name, bytes/s) per flow: any zero flow fails;
    Jain < 0.8 or a flow below half the mean warns. Returns Jain's index."""
    for name, bw in flows:
        if not (bw > 0):
            report.fail(f"flow {name} moved nothing in the sample window")
    values = [bw for _, bw in flows]
    j = jain_index(values)
    if values:
        mean = sum(values) / len(values)
        if j == j and j < 0.8:
            report.warn(f"Jain's fairness index {j:.3f} < 0.8")
        slow = [name for name, bw in flows if 0 < bw < 0.5 * mean]
        if slow:
            report.warn(f"flows below half the mean: {', '.join(slow)}")
    return j


# ---- content validation (OSU -c style: an iteration-dependent pattern) ----


def pattern(nbytes: int, seed: int):
    """`nbytes` of a pattern that differs per seed and per 8-byte word (numpy uint8)."""
    import numpy as np

    words = (nbytes + 7) // 8
    with np.errstate(over="ignore"):
        w = (np.arange(words, dtype=np.uint64) + np.uint64((seed * 0x9E3779B1 + 1) & 0xFFFFFFFF)) * np.uint64(
            0x9E3779B97F4A7C15
        )
        w ^= np.uint64(seed & 0xFFFFFFFFFFFF) << np.uint64(8)
    return w.view(np.uint8)[:nbytes]


def fill_pattern(buffer, nbytes: int, seed: int | None) -> None:
    """Writes pattern(nbytes, seed) (or zeros when seed is None) at the start of `buffer`."""
    import numpy as np

    view = np.frombuffer(buffer, dtype=np.uint8, count=nbytes)
    view[:] = 0 if seed is None else pattern(nbytes, seed)


def check_pattern(buffer, nbytes: int, seed: int) -> tuple[int, int]:
    """(mismatching bytes, first mismatching offset or -1) of `buffer` against pattern(nbytes, seed)."""
    import numpy as np

    view = np.frombuffer(buffer, dtype=np.uint8, count=nbytes)
    bad = np.flatnonzero(view != pattern(nbytes, seed))
    return int(bad.size), int(bad[0]) if bad.size else -1
