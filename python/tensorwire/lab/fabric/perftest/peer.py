"""The peer a point-to-point test measures against: rank 1 under a launcher,
a --connect'ed --server, or one spawned on loopback (`bench serve`); and the
passive side itself (--server, `bench serve`). The protocol between the two
sides is ../p2p.py's (p2p.serve, p2p.Client)."""

from __future__ import annotations

from typing import Any, Callable

from ..common import BenchError


def in_world() -> bool:
    """Whether this process is a rank of a launched world of two or more."""
    from ....ranks.world import detect

    p = detect()
    return p.launcher != "single" and p.size > 1


def serve_main(args) -> int:
    """`bench serve` and --server: the passive side, until the client says stop."""
    from .... import Device
    from .. import p2p

    with Device(
        host=args.host,
        port=args.port,
        transport=args.transport,
        progress="inline",
        workers=args.workers,
        spin_us=_spin_us(args),
        net_devices=args.net_devices,
    ) as dev:
        p2p.serve(dev)
    return 0


def _spin_us(args) -> int:
    """How long waiters poll before sleeping: long for latency tests (perftest busy-polls), short for
    bandwidth (on 2 vCPUs a spinning target starves the kernel's TCP work). `bench serve` (test "serve")
    takes TENSORWIRE_BENCH_SPIN_US (p2p.BENCH_SPIN_US)."""
    from .. import p2p

    return p2p.LATENCY_SPIN_US if args.test.endswith("_lat") else p2p.BENCH_SPIN_US


def _server_role(conn, transport: str, workers: int, spin_us: int, net_devices: str) -> None:
    """The spawned peer (a role of roles.py): the passive side on loopback,
    its address sent to the client once its handlers are in place."""
    try:
        from .... import Device
        from .. import p2p

        with Device(
            host="127.0.0.1",
            port=0,
            transport=transport,
            progress="inline",
            workers=workers,
            spin_us=spin_us,
            net_devices=net_devices,
        ) as dev:
            p2p.serve(dev, announce=False, ready=lambda: conn.send(("address", dev.address)))
        conn.send(("result", None))
    except Exception as e:  # noqa: BLE001 - the client names it
        conn.send(("error", f"{type(e).__name__}: {e}"))


def spawn_server(transport: str, workers: int = 1, spin_us: int | None = None, net_devices: str = "auto"):
    """Starts the passive side on loopback in a process of its own (roles.py's
    launcher); returns (its Roles, its address). Roles.stop() ends it."""
    from ....ranks.roles import RoleError, Roles
    from .. import p2p

    roles = Roles()
    roles.spawn("benchmark server", _server_role, transport, workers, spin_us or p2p.BENCH_SPIN_US, net_devices)
    try:
        ((_, address),) = roles.gather("address", 60, during="start-up")
    except RoleError as e:
        roles.stop()
        raise BenchError(f"the benchmark server did not start: {e}") from None
    return roles, address


def with_client(args, max_size: int, body: Callable[[Any], Any]) -> Any:
    """Runs body(client) against the right peer: rank 1 under a launcher, a
    --connect'ed server, or one spawned on loopback. Returns body's result on
    the measuring side, None on the others (ranks other than 0)."""
    from .. import p2p

    if in_world():
        if args.connect:
            raise SystemExit("--connect makes no sense under a launcher: rank 0 measures against rank 1")
        from ....ranks.world import World

        world = World(
            transport=args.transport,
            progress="inline",
            workers=args.workers,
            spin_us=_spin_us(args),
            timeout=60,
            net_devices=args.net_devices,
        )
        out = None
        try:
            if world.rank == 1:  # handlers first, then the barrier that lets rank 0 go
                p2p.serve(world.device, announce=False, idle_timeout=3600, ready=world.barrier)
            else:
                world.barrier()
            if world.rank == 0:
                peer = p2p.Client(world.device, world.addresses[1], args.lanes, max_size)
                try:
                    out = body(peer)
                finally:
                    peer.close()
            world.barrier(timeout=24 * 3600)  # the others wait for the measurement (the launcher watches them)
        finally:
            world.close()
        return out
    from .... import Device

    spin_us = _spin_us(args)
    # Our device first: a transport this machine lacks fails here, once, before a server is spawned.
    with Device(
        host=args.host,
        transport=args.transport,
        progress="inline",
        workers=args.workers,
        spin_us=spin_us,
        net_devices=args.net_devices,
    ) as device:
        server, address = (
            spawn_server(args.transport, args.workers, spin_us, args.net_devices)
            if not args.connect
            else (None, args.connect)
        )
        client = None
        try:
            client = p2p.Client(device, address, args.lanes, max_size)
            try:
                return body(client)
            finally:
                client.close()  # bench.stop: the spawned server exits
        finally:
            if server is not None:  # told to stop by client.close(): given 15 s to end on its own
                server.stop(wait=15 if client is not None else 0)
