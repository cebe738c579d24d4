"""`tensorwire testbed up|down|run|status|check`: the emulated fabric from the command line.

Listed in tensorwire.lab.commands's COMMAND_MODULES (register adds the commands); the work is imported inside each func.
"""

from __future__ import annotations

import argparse
import sys

TESTBED_HELP = """\
An emulated fabric on this machine: N hosts as network namespaces (h1..hN, addresses
10.77.0.1..N), each with a veth into a leaf bridge, optionally two groups of hosts whose leaves
are joined by a shaped inter-switch link. Rates are shaped with tbf in both directions. The
switches live in their own namespace: the root namespace gets no link, address or route.
Needs root and iproute2. A testbed lasts until 'down' (or a reboot).

examples:
  sudo tensorwire testbed up --num-hosts 8 --groups 2 --host-rate 1gbit --isl-rate 4gbit
  sudo tensorwire testbed status
  sudo tensorwire testbed check
  sudo tensorwire testbed run --host h2 -- tensorwire bench bw --server --transport tcp --host 10.77.0.2 --port 7000
  sudo tensorwire testbed run --host h1 -- tensorwire bench bw --connect 10.77.0.2:7000 --host 10.77.0.1 --transport tcp
  sudo tensorwire testbed down
Several testbeds can coexist under different --name (or $TENSORWIRE_TESTBED); default 'tw'.
"""

UP_HELP = """\
Creates the testbed: namespaces tw-<name>-h1..hN (the hosts) and tw-<name>-sw (the switches).
All or nothing: a failure, Ctrl-C or SIGTERM during the build removes what was made.

examples:
  tensorwire testbed up --num-hosts 4                                   one leaf, 1 Gbit/s host links
  tensorwire testbed up --num-hosts 8 --groups 2 --isl-rate 4gbit       leaf/spine: h1-h4 | h5-h8
  tensorwire testbed up --num-hosts 2 --host-rate 200mbit --name small  a second testbed beside 'tw'
  tensorwire testbed up --num-hosts 4 --host-rate none --force          unshaped; replace an existing one
"""

RUN_HELP = """\
Runs CMD inside a testbed host (ip netns exec) with this environment plus
TENSORWIRE_TESTBED, TENSORWIRE_TESTBED_HOST and TENSORWIRE_TESTBED_ADDR, and exits with CMD's exit
status (128+N if a signal N ended it). Ctrl-C or SIGTERM ends CMD too. Across testbed hosts use
--transport tcp: namespaces do not separate shared memory, so shm would bypass the fabric.

examples:
  tensorwire testbed run --host h3 -- ip addr
  tensorwire testbed run --host h2 -- tensorwire bench bw --server --transport tcp --host 10.77.0.2 --port 7000
  tensorwire testbed run --host h1 -- tensorwire bench bw --connect 10.77.0.2:7000 --host 10.77.0.1 --transport tcp
(the client's --host is its own address: left at 127.0.0.1, UCX would use only lo)
"""

CHECK_HELP = """\
Measures each configured limit with short TCP streams between hosts (plain sockets, not
UCX) and prints configured vs measured rate with a PASS/WARN verdict per link type:
host uplink (one flow), host downlink (two senders into one host), and with two groups the
inter-group link in each direction (every host of one group sending to the other, 2 flows each).
PASS: measured within 0.75-1.10 of the bound the configuration implies. Takes a few seconds.

examples:
  tensorwire testbed check
  tensorwire testbed check --name small --seconds 3
"""


def register(commands) -> None:
    tb = commands.top.add_parser(
        "testbed",
        help="emulated fabric: hosts as network namespaces behind shaped links (root)",
        description=TESTBED_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tsub = tb.add_subparsers(dest="testbed", required=True, metavar="{up,down,run,status,check}")

    def name_opt(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--name",
            default=None,
            help="testbed name (default: $TENSORWIRE_TESTBED or 'tw'); namespaces are tw-<name>-*",
        )

    up = tsub.add_parser(
        "up", help="create a testbed", description=UP_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    name_opt(up)
    up.add_argument(
        "--num-hosts",
        "-n",
        type=int,
        default=4,
        help="number of hosts h1..hN (default 4; --hosts names hosts, in `run` and `bench fullmesh`)",
    )
    up.add_argument(
        "--groups",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: one leaf bridge; 2: two leaves (group 1 = first half of the hosts) joined by "
        "the inter-switch link (default 1)",
    )
    up.add_argument(
        "--host-rate",
        default="1gbit",
        help="rate of each host link, each direction, in tc units (default 1gbit; 'none' = unshaped)",
    )
    up.add_argument(
        "--isl-rate",
        default=None,
        help="rate of the inter-switch link, each direction (with --groups 2; default unshaped)",
    )
    up.add_argument(
        "--isl-shared",
        action="store_true",
        help="both directions of the inter-switch link share --isl-rate (one token bucket) "
        "instead of --isl-rate each way",
    )
    up.add_argument(
        "--delay",
        type=float,
        default=None,
        metavar="MS",
        help="extra one-way delay in ms between any two hosts (netem on each host's egress; "
        "needs the sch_netem module)",
    )
    up.add_argument(
        "--queue",
        type=float,
        default=None,
        metavar="MS",
        help="shaper queue length, as milliseconds at the link rate (default 10)",
    )
    up.add_argument("--force", action="store_true", help="remove an existing testbed of this name first")
    up.set_defaults(func=_up)

    down = tsub.add_parser(
        "down",
        help="remove a testbed (idempotent)",
        description="Ends the processes still inside the testbed's hosts (SIGTERM, then "
        "SIGKILL after 3 s), deletes its namespaces with their links, bridges "
        "and qdiscs, and its state file. A missing testbed is reported, exit 0.",
    )
    name_opt(down)
    down.add_argument("--all", action="store_true", help="remove every testbed with a state file here")
    down.set_defaults(func=_down)

    run = tsub.add_parser(
        "run",
        help="run a command inside a testbed host",
        description=RUN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="tensorwire testbed run [--name NAME] --host HOST -- CMD [ARG ...]",
    )
    name_opt(run)
    run.add_argument("--host", required=True, help="host to run in: h1..hN")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command (after --)")
    run.set_defaults(func=_run)

    status = tsub.add_parser(
        "status",
        help="show hosts, addresses, groups and rates",
        description="Prints the testbed's hosts, addresses, groups, rates and shaper "
        "sizes; with no --name and no default testbed, lists them all.",
    )
    name_opt(status)
    status.add_argument("--json", action="store_true", help="print the state as JSON")
    status.set_defaults(func=_status)

    check = tsub.add_parser(
        "check",
        help="measure each shaped link with TCP streams (PASS/WARN)",
        description=CHECK_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    name_opt(check)
    check.add_argument("--seconds", type=float, default=1.5, help="length of each stream (default 1.5)")
    check.add_argument(
        "--warmup",
        type=float,
        default=0.3,
        help="seconds at the start of each stream left out of the rate (default 0.3)",
    )
    check.set_defaults(func=_check)


def _guard(fn):
    """Not root (or no ip netns): the reason on stderr, exit 2. Testbed errors: exit 1."""

    def wrapped(args: argparse.Namespace) -> int:
        from . import NotRoot, TestbedError

        try:
            return fn(args)
        except NotRoot as e:
            print(f"tensorwire testbed: {e}", file=sys.stderr)
            return 2
        except TestbedError as e:
            print(f"tensorwire testbed: error: {e}", file=sys.stderr)
            return 1

    return wrapped


@_guard
def _up(args: argparse.Namespace) -> int:
    from . import QUEUE_MS, Testbed
    from .system import check_root

    check_root()
    tb = Testbed.up(
        hosts=args.num_hosts,
        groups=args.groups,
        host_rate=args.host_rate,
        isl_rate=args.isl_rate,
        delay=args.delay,
        name=args.name,
        force=args.force,
        isl_shared=args.isl_shared,
        queue_ms=args.queue if args.queue is not None else QUEUE_MS,
    )
    print(tb.describe())
    return 0


@_guard
def _down(args: argparse.Namespace) -> int:
    from . import default_name, down, list_testbeds
    from .system import check_root

    check_root()
    names = list_testbeds() if args.all else [args.name or default_name()]
    if args.all and not names:
        print("no testbeds")
    for name in names:
        if down(name):
            print(f"testbed {name} removed")
        else:
            print(f"no testbed {name!r}: nothing to remove")
    return 0


@_guard
def _status(args: argparse.Namespace) -> int:
    import json
    import os
    from . import Testbed, default_name, list_testbeds
    from .system import check_root

    check_root()
    if args.name is None and not os.environ.get("TENSORWIRE_TESTBED"):
        names = list_testbeds()
        if default_name() not in names:
            print("testbeds: " + (", ".join(names) if names else "none"))
            return 0 if names else 1
    tb = Testbed.load(args.name)
    print(json.dumps(tb.to_json(), indent=1) if args.json else tb.describe())
    return 0


@_guard
def _run(args: argparse.Namespace) -> int:
    import signal
    from . import Testbed, TestbedError
    from .system import check_root

    check_root()
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise TestbedError("no command: tensorwire testbed run --host h1 -- CMD [ARG ...]")
    tb = Testbed.load(args.name)
    p = None

    # SIGTERM/SIGHUP to us: pass it on to the command and keep waiting for it
    def forward(signum, frame):
        if p is not None and p.poll() is None:
            p.send_signal(signum)

    # A SIGINT while the command starts is held until it runs (then it ends it): raised inside
    # Popen, it would leave the command running with nobody to end it.
    held: list[int] = []
    saved = {signal.SIGINT: signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))}
    try:
        saved.update({s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP)})
        try:
            p = tb.popen(args.host, cmd)
        except FileNotFoundError as e:
            raise TestbedError(str(e)) from None
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if held:
            raise KeyboardInterrupt
        rc = p.wait()
    except KeyboardInterrupt:
        # Ctrl-C from a terminal reached the command too (same process group); a SIGINT sent to
        # us alone did not: end it, politely first
        if p is None:
            return 130
        _end(p)
        rc = p.returncode if p.returncode is not None else 130
        if rc >= 0:
            rc = 130
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        if p is not None and p.poll() is None:
            _end(p)
    return rc if rc >= 0 else 128 - rc


def _end(p, grace: float = 3.0) -> None:
    import signal
    import subprocess

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        if p.poll() is not None:
            return
        try:
            p.send_signal(sig)
            p.wait(grace)
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:
            continue


@_guard
def _check(args: argparse.Namespace) -> int:
    from . import Testbed, format_rate
    from .system import check_root
    from .check import HEADER, run_checks

    check_root()
    tb = Testbed.load(args.name)
    c = tb.config
    print(
        f"testbed {tb.name}: {c.hosts} hosts, {c.groups} group(s), host link {format_rate(c.host_rate)}"
        + (f", inter-group {format_rate(c.isl_rate)}" if c.groups == 2 else "")
        + f"; TCP streams of {args.seconds:g} s, first {args.warmup:g} s left out"
    )
    print(HEADER, flush=True)
    results = run_checks(tb, seconds=args.seconds, warmup=args.warmup, out=sys.stdout)
    warn = [r for r in results if r.verdict == "WARN"]
    print(f"{len(results) - len(warn)}/{len(results)} PASS" + (f", {len(warn)} WARN" if warn else ""))
    print(
        "measured: TCP payload at the receivers; tbf counts whole frames, so at MTU 1500 the payload "
        "ceiling is ~0.955 x the rate (1448 B of 1514).\ndrops: packets the testbed's shapers dropped "
        "during the stream; cpu: how busy the machine's CPUs were (all processes)"
    )
    return 0
