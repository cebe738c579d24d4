"""`tensorwire demo`: a two-process tensor write on loopback.

A child process publishes a float32 tensor in registered memory; this process
writes its own tensor into it with one-sided writes, checks the contents
through a control-plane call, and measures bandwidth and one-way latency.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from .. import Device
from .fabric import p2p
from ..ranks.roles import RoleError, Roles


def _child(conn, transport: str, n: int) -> None:
    """The receiving side (a role of roles.py): a published tensor, a checksum
    call, and the bench server; its address goes to the parent once ready.
    Blocking progress: over tcp a one-sided write lands only while the target's
    worker progresses, and here nobody else drives it."""
    with Device(transport=transport) as dev:
        tensor = dev.empty((n,), "float32")
        np.asarray(tensor)[:] = 0
        dev.publish("demo.tensor", tensor)
        dev.on_call("demo.checksum", lambda _: repr(float(np.asarray(tensor).sum(dtype=np.float64))).encode())
        p2p.serve(dev, announce=False, ready=lambda: conn.send(("address", dev.address)))
    conn.send(("result", None))


def run_demo(transport: str = "auto", mib: int = 64) -> int:
    n = mib * (1 << 20) // 4
    with Roles() as roles:  # leaving it: the receiver gets the group's grace to end, then is stopped
        roles.spawn("demo receiver", _child, transport, n)
        try:
            ((_, address),) = roles.gather("address", 60, during="start-up")
        except RoleError as e:
            print(f"demo: the receiver process did not start: {e}", file=sys.stderr)
            return 1
        with Device(transport=transport, progress="inline", spin_us=p2p.BENCH_SPIN_US) as dev:
            src = dev.empty((n,), "float32")
            np.asarray(src)[:] = np.arange(n, dtype=np.float32) % 1000
            client = p2p.Client(dev, address, lanes=1, max_size=4096)
            ch = client.channels[0]
            remote = ch.lookup("demo.tensor")
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                ch.write(src, remote).wait(60)
                ch.flush().wait(60)
                best = min(best, time.perf_counter() - t0)
            expected = float(np.asarray(src).sum(dtype=np.float64))
            got = float(ch.call("demo.checksum", b"", timeout=60))
            samples = client.latency("write", 8, 20000, 2000)
            samples.sort()
            lat_us = samples[len(samples) // 2] / 2 * 1e6
            info = ch.peer
            client.close()
        ok = got == expected
        print(
            f"tensorwire demo: wrote a {mib} MiB float32 tensor into pid {info['pid']} "
            f"(transport {transport}) with one-sided writes"
        )
        print(f"  bandwidth: {n * 4 / best / 1e6:,.0f} MB/s (best of 5, write + flush)")
        print(f"  latency:   {lat_us:.2f} us one-way for 8 B (median of 20000 ping-pongs, RTT/2)")
        print(f"  contents:  {'verified' if ok else 'MISMATCH'} (checksum {got:.0f} vs {expected:.0f})")
        return 0 if ok else 1
