"""`tensorwire run`: start N ranks of a command on this machine or inside testbed hosts.

Each rank gets TW_RANK, TW_SIZE, TW_LOCAL_RANK and TW_ROOT (rank 0's address,
see tensorwire.world), plus TW_HOST (the address it listens on) inside a
testbed. Rank 0's stdout passes through untouched (it writes the report);
the others' stdout and everybody's stderr are prefixed with "[rank r]".

The run ends as soon as one rank fails: the launcher names it (exit code or
signal), stops the others (SIGTERM, then SIGKILL after a grace period) and
exits with that rank's code. Ctrl-C stops every rank the same way.
"""

from __future__ import annotations

import argparse
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

GRACE_S = 3.0


def register(commands) -> None:
    p = commands.top.add_parser(
        "run", help="start N ranks of a command (tensorwire run -n 4 -- tensorwire bench fullmesh)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n", 1)[1] + """
examples:
  tensorwire run -n 4 -- tensorwire bench alltoall --sizes 1M
  tensorwire run -n 8 --testbed tw --hosts h1,h2,h3,h4,h5,h6,h7,h8 -- tensorwire bench fullmesh --transport tcp
ranks started by mpirun, srun or torchrun find each other without this
launcher (see `python -c "import tensorwire.world as w; help(w)"`).""")
    p.add_argument("-n", "--ranks", type=int, required=True, help="number of ranks to start")
    p.add_argument("--hosts", default=None,
                   help="comma-separated testbed hosts; rank i runs on host i mod len (needs --testbed)")
    p.add_argument("--testbed", default=None, metavar="NAME",
                   help="run inside the hosts of this testbed (see `tensorwire testbed up`)")
    p.add_argument("--port", type=int, default=0, help="rank 0's listening port (default: a free one)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="end the run (FAIL) after S seconds (default: no limit)")
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
    placements = plan(args.ranks, args.testbed, args.hosts, args.port)
    return run(cmd, placements, timeout=args.timeout, quiet=args.quiet)


@dataclass
class RankPlacement:
    rank: int
    env: dict[str, str]
    prefix: list[str] = field(default_factory=list)  # argv prefix (e.g. ip netns exec)
    where: str = "localhost"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def plan(n: int, testbed: str | None = None, hosts: str | None = None, port: int = 0) -> list[RankPlacement]:
    """Where each rank runs and with which environment."""
    if hosts and not testbed:
        raise SystemExit("tensorwire run: --hosts names testbed hosts; give --testbed NAME too")
    if testbed:
        from .testbed import Testbed
        tb = Testbed.load(testbed)
        names = hosts.split(",") if hosts else list(tb.hosts)
        unknown = [h for h in names if h not in tb.hosts]
        if unknown:
            raise SystemExit(f"tensorwire run: testbed {testbed!r} has no host {', '.join(unknown)} "
                             f"(it has {', '.join(tb.hosts)})")
        where = [names[i % len(names)] for i in range(n)]
        addr = {h: tb.address(h) for h in set(where)}
        # The root's port cannot be probed from here (it is bound inside a host's
        # namespace): pick one at random so back-to-back runs never meet the
        # previous run's socket.
        import random
        root = f"{addr[where[0]]}:{port or random.randint(20000, 29999)}"
        local_rank = {}
        out = []
        for r, h in enumerate(where):
            local_rank[h] = local_rank.get(h, -1) + 1
            env = tb.host_env(h, {})
            env.update(TW_RANK=str(r), TW_SIZE=str(n), TW_ROOT=root, TW_HOST=addr[h],
                       TW_LOCAL_RANK=str(local_rank[h]))
            out.append(RankPlacement(r, env, list(tb.exec_prefix(h)), h))
        return out
    root = f"127.0.0.1:{port or _free_port('127.0.0.1')}"
    return [RankPlacement(r, {"TW_RANK": str(r), "TW_SIZE": str(n), "TW_ROOT": root,
                              "TW_LOCAL_RANK": str(r)}) for r in range(n)]


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def run(cmd: list[str], placements: list[RankPlacement], timeout: float | None = None,
        quiet: bool = False) -> int:
    """Starts every rank, relays output, and returns the run's exit code."""
    procs: list[subprocess.Popen] = []
    sel = selectors.DefaultSelector()
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for p in placements:
            env = dict(os.environ)
            env.update(p.env)
            env.setdefault("PYTHONUNBUFFERED", "1")
            proc = subprocess.Popen(p.prefix + cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
            procs.append(proc)
            sel.register(proc.stdout, selectors.EVENT_READ, (p.rank, sys.stdout, p.rank == 0))
            sel.register(proc.stderr, selectors.EVENT_READ, (p.rank, sys.stderr, False))
        deadline = None if timeout is None else time.monotonic() + timeout
        partial: dict[tuple[int, int], bytes] = {}
        failed: tuple[int, int] | None = None
        open_streams = 2 * len(procs)
        while True:
            for key, _ in sel.select(timeout=0.1):
                rank, stream, raw = key.data
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    rest = partial.pop((rank, key.fd), b"")
                    if rest:
                        _emit(stream, rank, rest, raw, quiet)
                    continue
                buf = partial.get((rank, key.fd), b"") + chunk
                *lines, tail = buf.split(b"\n")
                partial[(rank, key.fd)] = tail
                if lines:
                    _emit(stream, rank, b"\n".join(lines) + b"\n", raw, quiet)
            codes = [p.poll() for p in procs]
            if failed is None:
                bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    # Of the ranks seen failing in the same poll, name one killed by a
                    # signal: the others usually fail because it died.
                    failed = min(bad, key=lambda rc: (rc[1] > 0, rc[0]))
                    print(f"tensorwire run: rank {failed[0]} {_describe_exit(failed[1])}; stopping the other "
                          f"ranks", file=sys.stderr, flush=True)
                    _stop(procs)
                elif stopping["signal"] is not None:
                    print("tensorwire run: interrupted; stopping every rank", file=sys.stderr, flush=True)
                    _stop(procs)
                    failed = (-1, 130)
                elif deadline is not None and time.monotonic() > deadline:
                    slow = [r for r, c in enumerate(codes) if c is None]
                    print(f"tensorwire run: timed out after {timeout:g} s; ranks still running: "
                          f"{', '.join(map(str, slow))}", file=sys.stderr, flush=True)
                    _stop(procs)
                    failed = (-1, 124)
            if all(c is not None for c in codes) and open_streams == 0:
                break
        if failed is not None:
            code = failed[1]
            return code if 0 < code < 256 else 1
        return 0
    finally:
        _stop(procs)
        for s, h in old.items():
            signal.signal(s, h)
        sel.close()


def _emit(stream, rank: int, data: bytes, raw: bool, quiet: bool) -> None:
    if raw:
        stream.buffer.write(data)
    elif quiet and stream is sys.stdout:
        return
    else:
        text = data.decode(errors="replace")
        stream.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    stream.flush()


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every live rank's process group, SIGKILL what is left after GRACE_S."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GRACE_S
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
