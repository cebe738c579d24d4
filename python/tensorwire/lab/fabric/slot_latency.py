"""One-way latency of a static-slot transfer through the Python API: two
processes ping-pong a tensor, each receiving into its own static slot
(send, recv, release on each side); one-way = RTT/2, perftest-style
statistics. This is what a Python user of tensorwire gets end to end. The
two connect once, as World's ranks do: this side dials, the peer takes the
channel back (Device.channel_to), so over tcp both directions share one socket.
Over tcp the slot's one-way 8 B time has a bar, 6 us (issue 35; UCX's own
ucp_am_lat is 4.9 us on the development VM); a run that misses a bar says MISS.

--series notify (or both) measures a write with a notification the same way:
each side writes the tensor into the other's published block with
notify=b"" and waits for the other's notification (docs/contracts.md §1:
the notification arrives after the data). Target: notify <= 1.2x slot.

--memory cuda keeps both sides' tensors and slot buffers in GPU memory (the
sequence words stay in host memory): the GPU one-way latency of issue 20.

  python -m tensorwire.lab.fabric.slot_latency --transport shm --sizes 8,4K [--series both] [--memory cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

from ...ranks.roles import Roles
from ... import TRANSPORTS
from .common import Report, check_latency_row, latency_stats, parse_sizes, print_table


def _shape(size: int) -> tuple[int, ...]:
    return (max(1, size // 4),)


def _publish(dev, sizes: list[int], prefix: str, memory: str) -> dict:
    """Notify series: a block per size that the other side writes into."""
    blocks = {s: dev.empty(_shape(s), "float32", memory=memory) for s in sizes}
    for s, b in blocks.items():
        dev.publish(f"{prefix}{s}", b)
    return blocks


# Bars on the slot series' typical one-way time, by transport (issue 35: over tcp
# UCX's own active-message latency, ucp_am_lat, is 4.9 us on this machine kind).
ONE_WAY_BARS = {"tcp": ((8, 6.0),)}


def _peer(conn, transport: str, sizes: list[int], iters: int, progress: str, series: str, memory: str) -> None:
    import tensorwire as tw

    with tw.Device(transport=transport, progress=progress) as dev:
        slots = {s: dev.static_slot(f"ping{s}", _shape(s), "float32", depth=2, memory=memory) for s in sizes}
        keep = _publish(dev, sizes, "nping", memory) if series != "slot" else {}  # noqa: F841 (the peer writes)
        conn.send(dev.address)
        # One connection per pair, as World makes them: the measuring side
        # connects, this side takes the channel back on that connection.
        ch = dev.channel_to(dev.wait_for_peer(30)["device_id"])
        for s in sizes:
            src = dev.empty(_shape(s), "float32", memory=memory)
            if series != "notify":
                sender = ch.static_sender(f"pong{s}", timeout=30)
                slot = slots[s]
                for _ in range(iters):
                    view = slot.recv(30)
                    slot.release(view)
                    sender.send(src, 30)
            if series != "slot":
                remote = ch.lookup(f"npong{s}")
                pending = 0
                for _ in range(iters):
                    while pending == 0:
                        pending += len(dev.wait_notifications(30))
                    pending -= 1
                    ch.write(src, remote, notify=b"")
        conn.recv()  # wait until the other side is done


def measure(
    transport: str,
    sizes: list[int],
    iters: int,
    warmup: int,
    progress: str = "blocking",
    series: str = "slot",
    memory: str = "host",
) -> list[dict]:
    import tensorwire as tw

    with Roles() as roles:
        peer = roles.spawn("the latency peer", _peer, transport, sizes, iters + warmup, progress, series, memory)
        address = peer.recv(60, "start")
        rows = []
        with tw.Device(transport=transport, progress=progress) as dev:
            slots = {s: dev.static_slot(f"pong{s}", _shape(s), "float32", depth=2, memory=memory) for s in sizes}
            keep = _publish(dev, sizes, "npong", memory) if series != "slot" else {}  # noqa: F841
            ch = dev.connect(address)
            for s in sizes:
                src = dev.empty(_shape(s), "float32", memory=memory)
                if series != "notify":
                    sender = ch.static_sender(f"ping{s}", timeout=30)
                    slot = slots[s]
                    samples = []
                    for i in range(iters + warmup):
                        t0 = time.perf_counter()
                        sender.send(src, 30)
                        view = slot.recv(30)
                        slot.release(view)
                        if i >= warmup:
                            samples.append(time.perf_counter() - t0)
                    rows.append(
                        {
                            "series": "slot",
                            "size": s,
                            "iters": iters,
                            "lat_us": latency_stats(samples, 0.5),
                            "rtt": False,
                            "memory": src.memory,
                        }
                    )
                if series != "slot":
                    remote = ch.lookup(f"nping{s}")
                    samples, pending = [], 0
                    for i in range(iters + warmup):
                        t0 = time.perf_counter()
                        ch.write(src, remote, notify=b"")
                        while pending == 0:
                            pending += len(dev.wait_notifications(30))
                        pending -= 1
                        if i >= warmup:
                            samples.append(time.perf_counter() - t0)
                    rows.append(
                        {
                            "series": "notify",
                            "size": s,
                            "iters": iters,
                            "lat_us": latency_stats(samples, 0.5),
                            "rtt": False,
                            "memory": src.memory,
                        }
                    )
            peer.send("done")
        roles.stop(wait=30)
        return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", default="shm", choices=TRANSPORTS)
    ap.add_argument("--sizes", default="8,4K")
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument(
        "--progress-mode",
        default="blocking",
        choices=("inline", "blocking", "polling"),
        help="the Devices' progress mode: blocking (default, as Device(): progress threads that "
        "sleep when idle), inline (the waiting thread drives UCX) or polling",
    )
    ap.add_argument(
        "--series",
        default="slot",
        choices=("slot", "notify", "both"),
        help="slot: static-slot send (default); notify: write with notify=; both, and the ratio",
    )
    ap.add_argument(
        "--memory",
        default="host",
        choices=("host", "cuda"),
        help="where both sides' tensors and slot buffers live: host (default) or cuda (GPU memory; "
        "the slots' sequence words stay in host memory)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = parse_sizes(args.sizes)
    if args.memory == "cuda":
        import tensorwire as tw

        if not tw.cuda_available():
            ap.error(f"--memory cuda: tensorwire sees no GPU ({tw.cuda_info()['reason']})")
    report = Report(
        "slot_latency",
        {
            "transport": args.transport,
            "iters": args.iters,
            "sizes": sizes,
            "api": "Python",
            "latency": "one-way (RTT/2)",
            "unit": "usec",
            "progress": args.progress_mode,
            "series": args.series,
            "memory": args.memory,
        },
    )
    report.rows = measure(
        args.transport, sizes, args.iters, max(100, args.iters // 10), args.progress_mode, args.series, args.memory
    )
    lines = []
    for r in report.rows:
        st = r["lat_us"]
        check_latency_row(report, r["size"], st)
        lines.append(
            f" {r['series']:<7} {r['size']:<7d} {r['iters']:<11d}{st['min']:<15.2f}{st['max']:<15.2f}"
            f"{st['p50']:<17.2f}{st['avg']:<15.2f}{st['stdev']:<16.2f}{st['p99']:<23.2f}{st['p99_9']:.2f}"
        )
    print(
        f"# ping-pong through the Python API over {args.transport}, {args.memory} memory, {args.progress_mode} "
        "progress (one-way = RTT/2): slot = static-slot send, notify = write with notify="
    )
    print_table(
        " series  #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    "
        "t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]",
        lines,
    )
    by = {(r["series"], r["size"]): r["lat_us"]["p50"] for r in report.rows}
    missed = []
    for s in sizes:
        if ("slot", s) in by and ("notify", s) in by:
            ratio = by[("notify", s)] / by[("slot", s)]
            report.config.setdefault("notify_over_slot", {})[s] = ratio
            print(
                f"# {'PASS' if ratio <= 1.2 else 'MISS'} notify <= 1.2x slot at {s} B: {ratio:.2f}x "
                f"({by[('notify', s)]:.2f} vs {by[('slot', s)]:.2f} us)"
            )
            if ratio > 1.2:
                missed.append(f"notify <= 1.2x slot at {s} B")
    if args.memory == "host":
        for size, bar in ONE_WAY_BARS.get(args.transport, ()):
            if ("slot", size) in by:
                met = by[("slot", size)] <= bar
                report.config.setdefault("targets", []).append(
                    {
                        "target": f"slot one-way <= {bar:g} us at {size} B",
                        "bar": bar,
                        "worst": by[("slot", size)],
                        "met": met,
                    }
                )
                print(
                    f"# {'PASS' if met else 'MISS'} slot one-way <= {bar:g} us at {size} B: {by[('slot', size)]:.2f} us"
                )
                if not met:
                    missed.append(f"slot one-way <= {bar:g} us at {size} B")
    first = report.rows[0]
    line = report.verdict_line(f"t_typical={first['lat_us']['p50']:.2f}us@{first['size']}B")
    if missed and line.startswith("PASS"):  # a run that misses its own bars never says PASS
        line = f"MISS{line[4:]} (missed: {'; '.join(missed)})"
    print(line)
    report.write_json(args.json)
    return 0 if report.verdict != "FAIL" else 2


if __name__ == "__main__":
    sys.exit(main())
