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

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """'8' -> 8, '4K' -> 4096, '1M' -> 1048576 (binary units)."""
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
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

    return {"min": d[0], "max": d[-1], "p50": d[(m - 1) // 2] if m % 2 else (d[m // 2 - 1] + d[m // 2]) / 2,
            "avg": avg, "stdev": math.sqrt(var), "p99": pct(0.99), "p99_9": pct(0.999)}


def peak_bandwidth(size: int, completions: Sequence[float], in_flight: int) -> float:
    """Best throughput over a run of consecutive completions (bytes/s),
    perftest's "BW peak" idea. The run spans at least every operation that can
    be in flight (completions are observed in batches) and a quarter of all;
    NaN when too few completions."""
    n = len(completions)
    k = max(1, min(n - 1, max(in_flight, n // 4)))
    best = float("nan")
    for j in range(k, n):
        dt = completions[j] - completions[j - k]
        if dt > 0:
            bw = k * size / dt
            if not best >= bw:
                best = bw
    return best


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
        return {"test": self.test, "config": self.config, "rows": self.rows, "verdict": self.verdict,
                "checks": [{"level": lvl, "message": msg} for lvl, msg in self.checks],
                "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

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


class Progress:
    """A one-line progress indicator on stderr for sweeps (quiet when piped
    unless TENSORWIRE_PROGRESS=1)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0
        self.enabled = sys.stderr.isatty() or os.environ.get("TENSORWIRE_PROGRESS") == "1"
        self.start = time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        if self.enabled:
            width = 24
            filled = int(width * self.done / max(1, self.total))
            elapsed = time.monotonic() - self.start
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                             f"{self.done}/{self.total} {what:<12} {elapsed:6.1f}s")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def iterations_for(size: int, iters: int, budget_bytes: int, minimum: int = 10) -> int:
    """Caps the iteration count so one size moves at most `budget_bytes`."""
    return max(minimum, min(iters, budget_bytes // max(1, size)))


def print_table(header: str, lines: Iterable[str], out=sys.stdout) -> None:
    rule = "-" * max(len(header), 87)
    print(rule, file=out)
    print(header, file=out)
    for line in lines:
        print(line, file=out)
    print(rule, file=out)
