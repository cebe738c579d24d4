"""`tensorwire run`: start N ranks of a command on this machine or inside testbed hosts.

Each rank gets TENSORWIRE_RANK, TENSORWIRE_SIZE, TENSORWIRE_LOCAL_RANK and
TENSORWIRE_ROOT (rank 0's address, see tensorwire.ranks.world), plus TENSORWIRE_HOST
(the address it listens on) inside a testbed, and TENSORWIRE_PROGRESS_BAR=1
when the launcher's stderr is a terminal (unless set: docs/configuration.md).
It also gets what torchrun gives a rank for torch.distributed's env:// (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, and MASTER_PORT: a second
port, not the root's), so an unchanged PyTorch program runs under it as under
torchrun.
Rank 0's stdout passes through untouched (it writes the report); the others'
stdout and everybody's stderr are prefixed with "[rank r]".

The run ends as soon as one rank fails: the launcher names it (exit code or
signal), stops the others (SIGTERM, then SIGKILL after a grace period) and
exits with that rank's code. Ctrl-C stops every rank the same way.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

from ..config import PROGRESS_BAR
from .roles import GRACE_S, Role, RoleError, Roles, describe_exit


def register(commands) -> None:
    p = commands.top.add_parser(
        "run",
        help="start N ranks of a command (tensorwire run -n 4 -- tensorwire bench fullmesh)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n", 1)[1]
        + """
examples:
  tensorwire run -n 4 -- tensorwire bench alltoall --sizes 1M
  tensorwire run -n 8 --testbed tw --hosts h1,h2,h3,h4,h5,h6,h7,h8 -- tensorwire bench fullmesh --transport tcp
ranks started by mpirun, srun or torchrun find each other without this
launcher (see `python -c "import tensorwire.ranks.world as w; help(w)"`).""",
    )
    p.add_argument("-n", "--ranks", type=int, required=True, help="number of ranks to start")
    p.add_argument(
        "--hosts", default=None, help="comma-separated testbed hosts; rank i runs on host i mod len (needs --testbed)"
    )
    p.add_argument(
        "--testbed",
        default=None,
        metavar="NAME",
        help="run inside the hosts of this testbed (see `tensorwire testbed up`)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=0,
        help="rank 0's listening port (default: a free one below the kernel's ephemeral range, "
        "which no other socket is handed meanwhile)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="end the run (FAIL) after S seconds (default: no limit)",
    )
    p.add_argument("--quiet", action="store_true", help="drop the stdout of ranks other than 0")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each rank runs")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("tensorwire run: give the command after --", file=sys.stderr)
        return 2
    if args.ranks < 1:
        print(f"tensorwire run: -n must be >= 1, got {args.ranks}", file=sys.stderr)
        return 2
    testbed = None
    if args.testbed:
        # The testbed is the lab's (tensorwire.lab.testbed): its commands give this
        # parser the loader (tensorwire.lab.commands.register); the product names no lab module.
        load: Callable[[str], Hosts] | None = getattr(args, "load_testbed", None)
        if load is None:
            print(
                "tensorwire run: --testbed needs the lab (tensorwire.lab.testbed), which is not installed",
                file=sys.stderr,
            )
            return 2
        testbed = load(args.testbed)
    elif args.hosts:
        raise SystemExit("tensorwire run: --hosts names testbed hosts; give --testbed NAME too")
    placements = plan(args.ranks, testbed, args.hosts, args.port)
    return run(cmd, placements, timeout=args.timeout, quiet=args.quiet)


class Hosts(Protocol):
    """Hosts that ranks can be placed in, each in its own network namespace: what
    plan() needs of a testbed (tensorwire.lab.testbed.Testbed is one)."""

    @property
    def name(self) -> str: ...

    @property
    def hosts(self) -> Sequence[str]: ...

    def address(self, host: str) -> str: ...  # the host's IP address
    def host_env(self, host: str, env: Mapping[str, str] | None = None) -> dict[str, str]: ...
    def exec_prefix(self, host: str) -> list[str]: ...  # argv prefix that runs a command in the host


@dataclass
class RankPlacement:
    rank: int
    env: dict[str, str]
    prefix: list[str] = field(default_factory=list)  # argv prefix (e.g. ip netns exec)
    where: str = "localhost"


def free_port(host: str = "127.0.0.1") -> int:
    """A port for a root address that stays free until rank 0 binds it.

    A port probed by binding to 0 comes from the kernel's ephemeral range, and
    between the probe and rank 0's bind any process may be handed it again: the
    other ranks' outgoing connections, or UCX's tcp listener in every rank's
    worker (CI saw rank 0 lose its port to that). Below the ephemeral range the
    kernel hands out nothing, so a port there can only be taken by an explicit
    bind.
    """
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    candidates = [random.randint(20000, ephemeral_low - 1) for _ in range(64)] if ephemeral_low > 20100 else []
    for port in candidates + [0]:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free port on {host}")


def plan(n: int, testbed: Hosts | None = None, hosts: str | None = None, port: int = 0) -> list[RankPlacement]:
    """Where each rank runs and with which environment: on this machine, or in
    the hosts of `testbed` (a loaded one; `hosts`: a comma list of its hosts)."""
    if hosts and testbed is None:
        raise SystemExit("tensorwire run: --hosts names testbed hosts; give --testbed NAME too")
    if testbed is not None:
        tb = testbed
        names = hosts.split(",") if hosts else list(tb.hosts)
        unknown = [h for h in names if h not in tb.hosts]
        if unknown:
            raise SystemExit(
                f"tensorwire run: testbed {tb.name!r} has no host {', '.join(unknown)} (it has {', '.join(tb.hosts)})"
            )
        where = [names[i % len(names)] for i in range(n)]
        addr = {h: tb.address(h) for h in set(where)}
        # The root's port cannot be probed from here (it is bound inside a host's
        # namespace): pick one at random so back-to-back runs never meet the
        # previous run's socket.
        import random

        root_port = port or random.randint(20000, 29999)
        master_port = 20000 + (root_port - 20000 + random.randint(1, 9999)) % 10000  # never the root's
        local_rank: dict[str, int] = {}
        out = []
        for r, h in enumerate(where):
            local_rank[h] = local_rank.get(h, -1) + 1
            env = tb.host_env(h, {})
            env.update(
                TENSORWIRE_RANK=str(r),
                TENSORWIRE_SIZE=str(n),
                TENSORWIRE_ROOT=f"{addr[where[0]]}:{root_port}",
                TENSORWIRE_HOST=addr[h],
                TENSORWIRE_LOCAL_RANK=str(local_rank[h]),
                **_torch_env(r, n, local_rank[h], where.count(h), addr[where[0]], master_port),
            )
            out.append(RankPlacement(r, env, list(tb.exec_prefix(h)), h))
        return out
    root_port = port or free_port()
    master_port = next(p for p in iter(free_port, None) if p != root_port)
    return [
        RankPlacement(
            r,
            {
                "TENSORWIRE_RANK": str(r),
                "TENSORWIRE_SIZE": str(n),
                "TENSORWIRE_ROOT": f"127.0.0.1:{root_port}",
                "TENSORWIRE_LOCAL_RANK": str(r),
                **_torch_env(r, n, r, n, "127.0.0.1", master_port),
            },
        )
        for r in range(n)
    ]


def _torch_env(rank: int, size: int, local_rank: int, local_size: int, master: str, port: int) -> dict[str, str]:
    """What torchrun gives a rank for torch.distributed's env:// rendezvous (rank 0 hosts the store
    at MASTER_ADDR:MASTER_PORT). tensorwire's own World keeps TENSORWIRE_ROOT: it reads TENSORWIRE_RANK
    first (tensorwire.ranks.world.detect)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
    }


def run(cmd: list[str], placements: list[RankPlacement], timeout: float | None = None, quiet: bool = False) -> int:
    """Starts every rank, relays output, and returns the run's exit code."""
    rank_of: dict[int, int] = {}

    def relay(role: Role, which: str, data: bytes) -> None:
        rank = rank_of[id(role)]
        _emit(sys.stdout if which == "stdout" else sys.stderr, rank, data, which == "stdout" and rank == 0, quiet)

    def announce(err: RoleError) -> None:
        if err.interrupted is not None:
            what = "interrupted; stopping every rank"
        elif err.timed_out:
            slow = [str(rank_of[id(r)]) for r in roles if r.alive]
            what = f"timed out after {timeout:g} s; ranks still running: {', '.join(slow)}"
        else:
            assert err.first is not None  # neither interrupted nor timed out: a rank failed first
            what = f"{err.first.name} {describe_exit(err.first.exitcode)}; stopping the other ranks"
        print(f"tensorwire run: {what}", file=sys.stderr, flush=True)

    with Roles(grace=GRACE_S) as roles:
        for p in placements:
            env = dict(os.environ)
            env.update(p.env)
            env.setdefault("PYTHONUNBUFFERED", "1")
            # A rank's stderr is a pipe to us: whether the user watches is our terminal's
            # to say (the ranks' bars then come as whole lines, which the relay passes).
            env.setdefault(PROGRESS_BAR, "1" if sys.stderr.isatty() else "0")
            rank_of[id(roles.command(f"rank {p.rank}", p.prefix + cmd, env=env, on_output=relay))] = p.rank
        try:
            roles.supervise(timeout, need_result=False, interruptible=True, before_stop=announce)
        except RoleError as e:
            if e.interrupted is not None:
                return 130
            if e.timed_out:
                return 124
            assert e.first is not None  # neither interrupted nor timed out: a rank failed first
            code = e.first.exitcode or 1
            return code if 0 < code < 256 else 1
        roles.stop()  # the rest of their output
    return 0


def _emit(stream, rank: int, data: bytes, raw: bool, quiet: bool) -> None:
    if raw:
        stream.buffer.write(data)
    elif quiet and stream is sys.stdout:
        return
    else:
        text = data.decode(errors="replace")
        stream.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    stream.flush()
