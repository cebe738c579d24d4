"""`tensorwire testbed check`: does the shaping do what the configuration says?

Each check streams TCP (plain sockets, the probes of _probe.py) between testbed hosts for a
second or two and compares the aggregate receive rate with the bound the configuration implies:

  host uplink      one flow between two hosts of a group: min(host rate, ...) -> host egress
  host downlink    two senders into one host (incast): the switch port's egress, one host rate
  inter-group a->b every host of group a sends to a host of group b (2 flows per pair):
                   min(ISL rate, senders x host rate, receivers x host rate)

The rate is taken at the receivers over the stream minus its first `warmup` seconds (TCP slow
start and the tbf bucket's initial burst) and its last 0.05 s. Verdict: PASS when the measured
rate is within [0.75, 1.10] of the bound, WARN otherwise (with the likely reason).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from . import Testbed, TestbedError, format_rate

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_probe.py")
PORT = 5301
LOW, HIGH = 0.75, 1.10
START_TIMEOUT_S = 10.0


@dataclass
class Result:
    link: str  # what is checked
    flows: list[tuple[str, str]]  # (src, dst) host pairs, one TCP flow each
    configured: int | None  # the configured rate of the link under test (bit/s)
    expected: int | None  # the bound the configuration implies for this traffic
    measured: float  # bit/s
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return self.measured / self.expected if self.expected else None

    @property
    def verdict(self) -> str:
        ratio = self.ratio
        if ratio is None:  # no bound (or a zero one, which no measurement is a ratio of)
            return "INFO"
        return "PASS" if LOW <= ratio <= HIGH else "WARN"

    def reason(self) -> str:
        if self.verdict != "WARN":
            return self.note
        ratio = self.ratio
        if ratio is not None and ratio > HIGH:
            return "above the configured rate: the shaping is not effective"
        busy, drops = self.extra.get("cpu_busy"), self.extra.get("drops")
        why = []
        if busy is not None and busy >= 0.9:
            why.append(f"CPU {busy:.0%} busy: the machine, not the link, limits (other load? try lower rates)")
        if drops:
            why.append(f"{drops} packets dropped by the shapers")
        return "below the bound: " + ("; ".join(why) if why else "CPU or TCP dynamics; try --seconds 3")


def stream(
    tb: Testbed, flows: list[tuple[str, str]], seconds: float = 1.5, warmup: float = 0.3, port: int = PORT
) -> tuple[float, dict]:
    """Runs the TCP flows (src, dst) at once for `seconds`; returns (aggregate bit/s, details).

    One sink per destination host (listening on its testbed address), one source process per
    sending host with a thread per flow.
    """
    if not flows:
        raise TestbedError("no flows")
    by_dst: dict[str, int] = {}
    by_src: dict[str, list[str]] = {}
    for src, dst in flows:
        by_dst[dst] = by_dst.get(dst, 0) + 1
        by_src.setdefault(src, []).append(f"{tb.address(dst)}:{port}")
    py = [sys.executable, "-S", PROBE]
    cpu0, drops0 = _cpu_times(), _drops(tb)
    sinks: dict[str, subprocess.Popen] = {}
    sources: dict[str, subprocess.Popen] = {}
    try:
        for dst, n in by_dst.items():
            sinks[dst] = tb.popen(
                dst,
                py
                + [
                    "sink",
                    "--bind",
                    tb.address(dst),
                    "--port",
                    str(port),
                    "--flows",
                    str(n),
                    "--timeout",
                    str(seconds + START_TIMEOUT_S + 10),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        for dst, p in sinks.items():
            line = _readline(p, START_TIMEOUT_S)
            if line.strip() != "READY":
                err = p.stderr.read() if p.stderr is not None and p.poll() is not None else ""
                raise TestbedError(f"probe sink in {dst} did not start: {line!r} {err}")
        for src, targets in by_src.items():
            argv = py + ["source", "--seconds", str(seconds)]
            for t in targets:
                argv += ["--to", t]
            sources[src] = tb.popen(src, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_s = seconds + START_TIMEOUT_S + 15
        outputs: dict[str, list[dict]] = {}
        for name, p in list(sources.items()) + list(sinks.items()):
            try:
                out, err = p.communicate(timeout=wait_s)
            except subprocess.TimeoutExpired:
                raise TestbedError(f"probe in {name} did not finish within {wait_s:.0f} s") from None
            if p.returncode != 0:
                raise TestbedError(f"probe in {name} failed ({p.returncode}): {err.strip() or out.strip()}")
            outputs.setdefault(name, []).append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in list(sources.values()) + list(sinks.values()):
            if p.poll() is None:
                p.kill()
                p.wait(5)
    cpu1, drops1 = _cpu_times(), _drops(tb)
    series = [o["samples"] for dst in by_dst for o in outputs[dst] if "samples" in o]
    if not all(series):
        raise TestbedError("a probe sink received nothing")
    t0 = min(s[0][0] for s in series)
    t1 = max(s[-1][0] for s in series)
    a, b = t0 + warmup, t1 - 0.05
    if b - a < 0.2:
        a, b = t0, t1
    total = sum(_bytes_at(s, b) - _bytes_at(s, a) for s in series)
    bps = total * 8 / (b - a)
    d_total, d_idle = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    return bps, {
        "window_s": round(b - a, 3),
        "bytes": total,
        "drops": drops1 - drops0,
        "cpu_busy": round(1 - d_idle / d_total, 3) if d_total > 0 else None,
    }


def _cpu_times() -> tuple[int, int]:
    """(total, idle + iowait) jiffies of all CPUs, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v[:8]), v[3] + v[4]
    except (OSError, ValueError, IndexError):
        return 0, 0


def _drops(tb: Testbed) -> int:
    """Packets dropped so far by the testbed's qdiscs (all namespaces)."""
    import re

    n = 0
    for ns in tb.namespaces:
        r = subprocess.run([_tc(), "-n", ns, "-s", "qdisc", "show"], capture_output=True, text=True, timeout=10)
        n += sum(int(x) for x in re.findall(r"dropped (\d+)", r.stdout))
    return n


def _tc() -> str:
    from .system import find_tool

    return find_tool("tc") or "tc"


def _bytes_at(samples: list[list[float]], t: float) -> float:
    """Bytes received by time t, interpolated between samples."""
    if t <= samples[0][0]:
        return 0.0
    for (ta, ba), (tb_, bb) in zip(samples, samples[1:]):
        if ta <= t <= tb_:
            return ba + (bb - ba) * ((t - ta) / (tb_ - ta) if tb_ > ta else 1.0)
    return float(samples[-1][1])


def _readline(p: subprocess.Popen, timeout: float) -> str:
    """The first line of p's stdout, read byte by byte from the pipe itself: a buffered readline
    could swallow later output that communicate() (which reads the raw pipe) would then miss."""
    import selectors

    assert p.stdout is not None  # started with stdout=PIPE
    fd = p.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    line = b""
    while time.monotonic() < deadline and not line.endswith(b"\n"):
        if sel.select(timeout=0.1):
            c = os.read(fd, 1)
            if not c:
                break
            line += c
    sel.close()
    return line.decode(errors="replace")


def _bound(tb: Testbed, flows: list[tuple[str, str]]) -> int | None:
    """Upper bound of the aggregate of flows from the configured rates (None: nothing shaped)."""
    c = tb.config
    bounds = []
    if c.host_rate is not None:
        bounds += [len({s for s, _ in flows}) * c.host_rate, len({d for _, d in flows}) * c.host_rate]
    if c.groups == 2 and c.isl_rate is not None:
        cross = {(tb.group(s), tb.group(d)) for s, d in flows}
        if all(a != b for a, b in cross):  # every flow crosses the ISL
            if c.isl_shared or len(cross) == 1:
                bounds.append(c.isl_rate)
            else:  # both directions, each its own bucket
                bounds.append(2 * c.isl_rate)
    return min(bounds) if bounds else None


def plan(tb: Testbed) -> list[tuple[str, list[tuple[str, str]], int | None, str]]:
    """The checks for tb: (link, flows, configured rate, note)."""
    c = tb.config
    checks: list[tuple[str, list[tuple[str, str]], int | None, str]] = []
    hosts = tb.hosts
    if len(hosts) < 2:
        return checks
    g1 = tb.group_hosts(1)
    pair = (g1[0], g1[1]) if len(g1) >= 2 else (hosts[0], hosts[1])
    checks.append(("host uplink", [pair], c.host_rate, ""))
    if len(hosts) >= 3:
        dst = pair[1]
        same = [h for h in tb.group_hosts(tb.group(dst)) if h != dst]
        others = same if len(same) >= 2 else [h for h in hosts if h != dst]
        checks.append(("host downlink (incast)", [(others[0], dst), (others[1], dst)], c.host_rate, ""))
    if c.groups == 2:
        ga, gb = tb.group_hosts(1), tb.group_hosts(2)
        for name, srcs, dsts in (("inter-group 1->2", ga, gb), ("inter-group 2->1", gb, ga)):
            flows = [(s, dsts[i % len(dsts)]) for i, s in enumerate(srcs) for _ in range(2)]
            note = ""
            b = _bound(tb, flows)
            if c.isl_rate is not None and b is not None and b < c.isl_rate:
                note = (
                    f"ISL not saturable here: {len(srcs)} senders x {format_rate(c.host_rate)} < "
                    f"{format_rate(c.isl_rate)}; checks the path, not the ISL limit"
                )
            checks.append((name, flows, c.isl_rate, note))
        if c.isl_shared and c.isl_rate is not None:
            flows = [(s, gb[i % len(gb)]) for i, s in enumerate(ga)] + [(s, ga[i % len(ga)]) for i, s in enumerate(gb)]
            checks.append(("inter-group both ways", flows, c.isl_rate, "shared: one bucket for both directions"))
    return checks


def run_checks(tb: Testbed, seconds: float = 1.5, warmup: float = 0.3, out=None) -> list[Result]:
    """Runs plan(tb), printing one line per check to `out` as it finishes."""
    results = []
    for i, (link, flows, configured, note) in enumerate(plan(tb)):
        measured, extra = stream(tb, flows, seconds=seconds, warmup=warmup, port=PORT + i)
        r = Result(
            link=link,
            flows=flows,
            configured=configured,
            expected=_bound(tb, flows),
            measured=measured,
            note=note,
            extra=extra,
        )
        results.append(r)
        if out is not None:
            print(format_result(r), file=out, flush=True)
    return results


HEADER = (
    f"{'link':<24} {'flows':<28} {'configured':>12} {'bound':>12} {'measured':>12} {'ratio':>6} "
    f"{'drops':>6} {'cpu':>5}  verdict"
)


def _flows_text(flows: list[tuple[str, str]]) -> str:
    seen: dict[tuple[str, str], int] = {}
    for f in flows:
        seen[f] = seen.get(f, 0) + 1
    return ",".join(f"{s}>{d}" + (f"x{n}" if n > 1 else "") for (s, d), n in seen.items())


def format_result(r: Result) -> str:
    ratio = f"{r.ratio:6.2f}" if r.ratio is not None else f"{'-':>6}"
    line = (
        f"{r.link:<24} {_flows_text(r.flows):<28} {format_rate(r.configured):>12} "
        f"{format_rate(r.expected):>12} {format_rate(r.measured):>12} {ratio} {r.extra.get('drops', 0):>6} "
        f"{_pct(r.extra.get('cpu_busy')):>5}  {r.verdict}"
    )
    why = r.reason()
    return line + (f"  ({why})" if why else "")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"
