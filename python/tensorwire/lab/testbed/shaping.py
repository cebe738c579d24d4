"""Shaping: the tbf (and netem) qdiscs that give a link its rate and delay, and their sizes."""

from __future__ import annotations

import os
from typing import Any, overload

from .errors import TestbedError
from .system import run_cmd

# tbf sizing (see _tbf): the bucket holds at least this much, whatever the rate.
MIN_BURST_B = 128 * 1024
QUEUE_MS = 10.0  # time a full queue takes to drain at the link rate


def _tbf(rate_bps: int, queue_ms: float) -> tuple[int, int]:
    """(burst, limit) in bytes of a tbf shaping to rate_bps.

    burst (bucket size): at least rate/HZ, or a kernel ticking at HZ (250 on most distributions)
    could not release a full rate's worth of bytes per tick; we take 4 ms of traffic (rate/250),
    so 500 KB at 1 Gbit/s. It is also never below 128 KiB: veths hand tbf GSO super-packets of up
    to 64 KiB, and a packet larger than the bucket is segmented or dropped by tbf. Over a
    measurement of a second, a 4 ms bucket adds 0.4% to the average rate at most.
    limit (queue): burst plus queue_ms (default 10 ms) of traffic at the rate, 1.75 MB at
    1 Gbit/s. A queue too short for TCP's bursts drops packets that a real switch port would
    buffer, and TCP then backs off far below the rate; a longer one only adds latency under load.
    """
    rate_Bps = rate_bps / 8
    burst = max(int(rate_Bps / 250), MIN_BURST_B)
    limit = burst + int(rate_Bps * queue_ms / 1000)
    return burst, limit


@overload
def shaping_commands(
    dev: str, rate_bps: int, queue_ms: float, delay_ms: float | None
) -> tuple[list[str], dict[str, Any]]: ...
@overload
def shaping_commands(
    dev: str, rate_bps: int | None, queue_ms: float, delay_ms: float | None
) -> tuple[list[str], dict[str, Any] | None]: ...
def shaping_commands(
    dev: str, rate_bps: int | None, queue_ms: float, delay_ms: float | None
) -> tuple[list[str], dict[str, Any] | None]:
    """tc batch lines that shape the egress of dev, and the tbf parameters (None if unshaped).

    tbf rather than htb: one class-less qdisc per direction is all a point-to-point link needs.
    Offloads stay on: tbf charges a GSO super-packet its full on-the-wire size (all segments and
    their headers), so the long-run rate is exact, and a 64 KiB release is 0.5 ms at 1 Gbit/s, far
    finer than any measurement; segmenting on the veth would only burn the CPU the 2-core
    machines need for the traffic itself.
    """
    lines: list[str] = []
    if delay_ms:
        # netem first (it delays), tbf as its child (it paces what netem releases)
        lines.append(f"qdisc replace dev {dev} root handle 1: netem delay {delay_ms:g}ms limit 100000")
        parent = "parent 1:1 handle 10:"
    else:
        parent = "root handle 1:"
    if rate_bps is None:
        return lines, None
    burst, limit = _tbf(rate_bps, queue_ms)
    lines.append(f"qdisc replace dev {dev} {parent} tbf rate {rate_bps}bit burst {burst} limit {limit}")
    return lines, {"qdisc": "tbf", "rate": rate_bps, "burst": burst, "limit": limit}


def require_qdisc(kind: str, why: str) -> None:
    probe = f"tw-probe-{os.getpid()}-q"
    try:
        run_cmd(["ip", "netns", "add", probe])
        r = run_cmd(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", kind], check=False)
        if r.returncode != 0:
            raise TestbedError(f"{why}; this kernel has no '{kind}' qdisc ({r.stderr.strip()})")
    finally:
        run_cmd(["ip", "netns", "del", probe], check=False)
