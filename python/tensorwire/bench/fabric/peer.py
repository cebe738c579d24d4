"""The peer a fabric test measures against: rank 1 under a launcher, a
--connect'ed --server, or one spawned on loopback; and the --server side."""

from __future__ import annotations

from typing import Any, Callable


def _in_world() -> bool:
    from ...world import detect
    p = detect()
    return p.launcher != "single" and p.size > 1


def _serve_main(args) -> int:
    from ... import Device
    from .. import p2p
    with Device(host=args.host, port=args.port, transport=args.transport, progress="inline",
                workers=args.workers, spin_us=_spin_us(args)) as dev:
        p2p.serve(dev)
    return 0


def _spin_us(args) -> int:
    """How long waiters poll before sleeping: long for latency tests (perftest busy-polls), short for
    bandwidth (on 2 vCPUs a spinning target starves the kernel's TCP work)."""
    from .. import p2p
    return p2p.LATENCY_SPIN_US if args.test.endswith("_lat") else p2p.BENCH_SPIN_US


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
                      spin_us=_spin_us(args), timeout=60)
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
    args.spin_us = _spin_us(args)
    device, client, proc = p2p._open_client(args, max_size)
    try:
        return body(client)
    finally:
        p2p._finish(device, client, proc)
