"""The peer a point-to-point test measures against: rank 1 under a launcher,
a --connect'ed --server, or one spawned on loopback (`bench serve`); and the
passive side itself (--server, `bench serve`). The protocol between the two
sides is ../p2p.py's (p2p.serve, p2p.Client)."""

from __future__ import annotations

from typing import Any, Callable

from ..common import BenchError


def _in_world() -> bool:
    from ...world import detect
    p = detect()
    return p.launcher != "single" and p.size > 1


def _serve_main(args) -> int:
    from ... import Device
    from .. import p2p
    with Device(host=args.host, port=args.port, transport=args.transport, progress="inline",
                workers=args.workers, spin_us=_spin_us(args), net_devices=args.net_devices) as dev:
        p2p.serve(dev)
    return 0


def _spin_us(args) -> int:
    """How long waiters poll before sleeping: long for latency tests (perftest busy-polls), short for
    bandwidth (on 2 vCPUs a spinning target starves the kernel's TCP work). `bench serve` (test "serve")
    takes TENSORWIRE_BENCH_SPIN_US, which the client that spawns it sets to its own value."""
    from .. import p2p
    return p2p.LATENCY_SPIN_US if args.test.endswith("_lat") else p2p.BENCH_SPIN_US


def spawn_server(transport: str, workers: int = 1, spin_us: int | None = None, net_devices: str = "auto"):
    """Starts `tensorwire bench serve` on loopback and returns (process, address)."""
    import os
    import subprocess
    import sys
    import time

    from ..p2p import ADDRESS_TAG
    cmd = [sys.executable, "-m", "tensorwire", "bench", "serve", "--transport", transport,
           "--host", "127.0.0.1", "--port", "0", "--workers", str(workers), "--net-devices", net_devices]
    env = dict(os.environ, **({"TENSORWIRE_BENCH_SPIN_US": str(spin_us)} if spin_us else {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(ADDRESS_TAG):
            return proc, line.split()[1]
    proc.kill()
    raise BenchError(f"the benchmark server did not start (exit code {proc.poll()})")


def with_client(args, max_size: int, body: Callable[[Any], Any]) -> Any:
    """Runs body(client) against the right peer: rank 1 under a launcher, a
    --connect'ed server, or one spawned on loopback. Returns body's result on
    the measuring side, None on the others (ranks other than 0)."""
    from .. import p2p
    if _in_world():
        if args.connect:
            raise SystemExit("--connect makes no sense under a launcher: rank 0 measures against rank 1")
        from ...world import World
        world = World(transport=args.transport, progress="inline", workers=args.workers,
                      spin_us=_spin_us(args), timeout=60, net_devices=args.net_devices)
        out = None
        try:
            if world.rank == 1:  # handlers first, then the barrier that lets rank 0 go
                p2p.serve(world.device, announce=False, idle_timeout=3600, ready=world.barrier)
            else:
                world.barrier()
            if world.rank == 0:
                client = p2p.Client(world.device, world.addresses[1], args.lanes, max_size)
                try:
                    out = body(client)
                finally:
                    client.close()
            world.barrier(timeout=24 * 3600)  # the others wait for the measurement (the launcher watches them)
        finally:
            world.close()
        return out
    import subprocess

    from ... import Device
    spin_us = _spin_us(args)
    # Our device first: a transport this machine lacks fails here, once, before a server is spawned.
    with Device(host=args.host, transport=args.transport, progress="inline", workers=args.workers,
                spin_us=spin_us, net_devices=args.net_devices) as device:
        proc, address = (spawn_server(args.transport, args.workers, spin_us, args.net_devices) if not args.connect
                         else (None, args.connect))
        client = None
        try:
            client = p2p.Client(device, address, args.lanes, max_size)
            try:
                return body(client)
            finally:
                client.close()  # bench.stop: the spawned server exits
        finally:
            if proc is not None:
                try:
                    proc.wait(timeout=15 if client is not None else 0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
