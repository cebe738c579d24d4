"""A testbed: its hosts and configuration, and :class:`Testbed` itself (its queries, the
commands run in its hosts, its state file, building its namespaces, links and shapers)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from .errors import TestbedError
from .rates import format_rate, parse_rate
from .shaping import QUEUE_MS, require_qdisc, shaping_commands
from .signals import signals_as_interrupt, signals_ignored
from .state import STATE_DIR, owned_namespaces, state_path, validate_name, default_name
from .system import run_batch, check_root, run_cmd, find_tool, list_netns
from .teardown import down

SUBNET = "10.77.0"  # hosts get SUBNET.<i>/24, i = 1..N; only inside the testbed's namespaces
PREFIX_LEN = 24
MAX_HOSTS = 250
HOST_IFACE = "eth0"


@dataclass
class Host:
    name: str  # h1..hN
    index: int  # 1..N
    netns: str  # tw-<testbed>-h<i>
    address: str  # 10.77.0.<i>
    group: int  # 1 or 2
    port: str  # the switch port (in the switch namespace) of this host's link


@dataclass
class Config:
    name: str
    hosts: int
    groups: int
    host_rate: int | None  # bit/s, each direction of each host link; None = unshaped
    isl_rate: int | None  # bit/s, each direction of the inter-switch link; None = unshaped
    delay_ms: float | None  # one-way delay added on every host's egress (needs sch_netem)
    queue_ms: float = QUEUE_MS
    mtu: int = 1500
    isl_shared: bool = False  # True: both directions of the ISL share isl_rate (one token bucket)


@dataclass
class Testbed:
    """A running testbed. Create with ``Testbed.up(...)``, find with ``Testbed.load(name)``.

    ``tb.hosts`` are the host names h1..hN; ``tb.address(h)``, ``tb.exec_prefix(h)``,
    ``tb.run(h, argv)`` and ``tb.popen(h, argv)`` serve launchers; ``tb.down()`` removes it all.
    """

    __test__ = False  # not a pytest test class

    config: Config
    host_info: dict[str, Host]
    switch_netns: str
    status: str = "up"
    created: float = field(default_factory=time.time)
    qdiscs: list[dict[str, Any]] = field(default_factory=list)

    # -- queries ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def hosts(self) -> list[str]:
        return sorted(self.host_info, key=lambda h: self.host_info[h].index)

    @property
    def namespaces(self) -> list[str]:
        return [self.switch_netns] + [self.host_info[h].netns for h in self.hosts]

    def _host(self, host: str) -> Host:
        try:
            return self.host_info[host]
        except KeyError:
            raise TestbedError(f"testbed {self.name!r} has no host {host!r} (hosts: {', '.join(self.hosts)})") from None

    def address(self, host: str) -> str:
        """The host's IPv4 address inside the testbed (reachable from the other hosts only)."""
        return self._host(host).address

    def netns(self, host: str) -> str:
        return self._host(host).netns

    def group(self, host: str) -> int:
        return self._host(host).group

    def group_hosts(self, group: int) -> list[str]:
        return [h for h in self.hosts if self.host_info[h].group == group]

    def exec_prefix(self, host: str) -> list[str]:
        """argv prefix that runs a command inside `host`: ['ip', 'netns', 'exec', <netns>]."""
        return [find_tool("ip") or "ip", "netns", "exec", self._host(host).netns]

    def host_env(self, host: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a command in `host`: `env` (default os.environ) plus TENSORWIRE_TESTBED,
        TENSORWIRE_TESTBED_HOST and TENSORWIRE_TESTBED_ADDR."""
        out = dict(os.environ if env is None else env)
        out.update(
            TENSORWIRE_TESTBED=self.name, TENSORWIRE_TESTBED_HOST=host, TENSORWIRE_TESTBED_ADDR=self.address(host)
        )
        return out

    def popen(
        self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """Starts argv inside `host` (subprocess.Popen keyword arguments pass through)."""
        return subprocess.Popen(self.exec_prefix(host) + list(argv), env=self.host_env(host, env), **kwargs)

    def run(
        self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.CompletedProcess:
        """Runs argv inside `host` to completion (subprocess.run keyword arguments pass through)."""
        return subprocess.run(self.exec_prefix(host) + list(argv), env=self.host_env(host, env), **kwargs)

    def describe(self) -> str:
        c = self.config
        lines = [
            f"testbed {c.name}: {c.hosts} hosts, {c.groups} group{'s' if c.groups > 1 else ''}, "
            f"switches in netns {self.switch_netns}, subnet {SUBNET}.0/{PREFIX_LEN}",
            f"  host link   {format_rate(c.host_rate)}{' each direction' if c.host_rate else ''}"
            + (f", +{c.delay_ms:g} ms one-way delay" if c.delay_ms else ""),
        ]
        if c.groups == 2:
            lines.append(
                f"  inter-group {format_rate(c.isl_rate)} "
                + (
                    "both directions together (isl1 <-> isl2, one bucket)"
                    if c.isl_shared
                    else "each direction (isl1 <-> isl2)"
                    if c.isl_rate
                    else "(isl1 <-> isl2)"
                )
            )
        for what, q in (
            ("host links", next((q for q in self.qdiscs if q["link"].startswith("h")), None)),
            ("ISL", next((q for q in self.qdiscs if q["link"].startswith("isl")), None)),
        ):
            if q:
                lines.append(
                    f"  shaping     {what}: tbf, burst {q['burst'] // 1024} KiB, queue limit "
                    f"{q['limit'] // 1024} KiB ({c.queue_ms:g} ms at the rate)"
                )
        lines.append(f"  {'host':<5} {'group':>5}  {'address':<12} netns")
        for h in self.hosts:
            i = self.host_info[h]
            lines.append(f"  {h:<5} {i.group:>5}  {i.address:<12} {i.netns}")
        return "\n".join(lines)

    # -- state ----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "version": 1,
            "config": asdict(self.config),
            "switch_netns": self.switch_netns,
            "status": self.status,
            "created": self.created,
            "qdiscs": self.qdiscs,
            "hosts": [asdict(self.host_info[h]) for h in self.hosts],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Testbed":
        hosts = {h["name"]: Host(**h) for h in data["hosts"]}
        return cls(
            config=Config(**data["config"]),
            host_info=hosts,
            switch_netns=data["switch_netns"],
            status=data.get("status", "up"),
            created=data.get("created", 0.0),
            qdiscs=list(data.get("qdiscs", [])),
        )

    def _write_state(self, exclusive: bool = False) -> None:
        os.makedirs(STATE_DIR, mode=0o755, exist_ok=True)
        path = state_path(self.name)
        text = json.dumps(self.to_json(), indent=1) + "\n"
        if exclusive:  # O_EXCL: a second concurrent `up` of the same name fails here
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            return
        tmp = path + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    @classmethod
    def exists(cls, name: str) -> bool:
        return os.path.exists(state_path(name)) or bool(owned_namespaces(name, list_netns()))

    @classmethod
    def load(cls, name: str | None = None) -> "Testbed":
        """The running testbed `name` (default: default_name()); TestbedError if there is none."""
        name = validate_name(name or default_name())
        path = state_path(name)
        try:
            with open(path) as f:
                tb = cls.from_json(json.load(f))
        except FileNotFoundError:
            raise TestbedError(
                f"no testbed {name!r} (no {path}); create one with 'tensorwire testbed up --name {name}'"
            ) from None
        except (ValueError, KeyError, TypeError) as e:
            raise TestbedError(
                f"unreadable testbed state {path}: {e}; remove the testbed with 'tensorwire testbed down --name {name}'"
            ) from None
        if tb.status != "up":
            raise TestbedError(
                f"testbed {name!r} is {tb.status!r} (an 'up' did not finish); "
                f"remove it with 'tensorwire testbed down --name {name}'"
            )
        present = set(list_netns())
        missing = [ns for ns in tb.namespaces if ns not in present]
        if missing:
            raise TestbedError(
                f"testbed {name!r} is broken: namespaces {', '.join(missing)} are gone; "
                f"'tensorwire testbed down --name {name}' removes the rest"
            )
        return tb

    # -- creation ---------------------------------------------------------------------------

    @classmethod
    def plan(
        cls,
        hosts: int,
        groups: int = 1,
        host_rate: str | int | None = "1gbit",
        isl_rate: str | int | None = None,
        delay: float | None = None,
        name: str | None = None,
        queue_ms: float = QUEUE_MS,
        isl_shared: bool = False,
    ) -> "Testbed":
        """The testbed `up` would build, without building it (validates the arguments)."""
        name = validate_name(name or default_name())
        if not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise TestbedError(f"hosts must be 1..{MAX_HOSTS}, got {hosts!r}")
        if groups not in (1, 2):
            raise TestbedError(f"groups must be 1 or 2, got {groups!r}")
        if groups == 2 and hosts < 2:
            raise TestbedError("two groups need at least 2 hosts")
        try:
            hr, ir = parse_rate(host_rate), parse_rate(isl_rate)
        except ValueError as e:
            raise TestbedError(str(e)) from None
        if groups == 1 and ir is not None:
            raise TestbedError("an inter-group rate needs groups=2")
        if isl_shared and ir is None:
            raise TestbedError("a shared inter-group link needs an inter-group rate")
        if delay is not None and delay < 0:
            raise TestbedError(f"delay must be >= 0 ms, got {delay}")
        if not queue_ms > 0:
            raise TestbedError(f"queue must be > 0 ms, got {queue_ms}")
        g1 = math.ceil(hosts / 2) if groups == 2 else hosts
        info = {}
        for i in range(1, hosts + 1):
            h = f"h{i}"
            info[h] = Host(
                name=h, index=i, netns=f"tw-{name}-{h}", address=f"{SUBNET}.{i}", group=1 if i <= g1 else 2, port=h
            )
        cfg = Config(
            name=name,
            hosts=hosts,
            groups=groups,
            host_rate=hr,
            isl_rate=ir,
            delay_ms=float(delay) if delay else None,
            queue_ms=float(queue_ms),
            isl_shared=bool(isl_shared),
        )
        return cls(config=cfg, host_info=info, switch_netns=f"tw-{name}-sw", status="creating")

    @classmethod
    def up(
        cls,
        hosts: int,
        groups: int = 1,
        host_rate: str | int | None = "1gbit",
        isl_rate: str | int | None = None,
        delay: float | None = None,
        name: str | None = None,
        force: bool = False,
        queue_ms: float = QUEUE_MS,
        isl_shared: bool = False,
    ) -> "Testbed":
        """Builds a testbed and returns it; all or nothing.

        hosts: N hosts h1..hN. groups: 1 (one leaf) or 2 (two leaves, group 1 = first half,
        joined by the inter-switch link). host_rate / isl_rate: tc rates ('1gbit', '200mbit') for
        each direction of every host link / of the inter-switch link; None leaves a link unshaped.
        delay: extra one-way milliseconds on every host's egress (netem; not every kernel has it).
        name: testbed name (namespaces tw-<name>-*). force: remove an existing testbed of that
        name first, else that is an error. queue_ms: shaper queue length in time at the rate.
        isl_shared: both directions of the inter-switch link share isl_rate (a half-duplex or
        oversubscribed uplink) instead of isl_rate each way.

        Any failure, KeyboardInterrupt or SIGTERM during the build removes what was made, then
        raises.
        """
        check_root()
        tb = cls.plan(hosts, groups, host_rate, isl_rate, delay, name, queue_ms, isl_shared)
        if cls.exists(tb.name):
            if not force:
                raise TestbedError(
                    f"testbed {tb.name!r} exists already; use it, remove it with "
                    f"'tensorwire testbed down --name {tb.name}', or recreate it with --force"
                )
            down(tb.name)
        with signals_as_interrupt():
            try:
                tb._write_state(exclusive=True)
            except FileExistsError:
                raise TestbedError(f"testbed {tb.name!r} is being created by another process") from None
            try:
                tb._build()
                tb.status = "up"
                tb._write_state()
            except BaseException:
                with signals_ignored():
                    try:
                        down(tb.name)
                    except Exception as cleanup_error:  # noqa: BLE001 - report, keep the first error
                        import sys

                        print(
                            f"tensorwire testbed: cleanup after a failed 'up' failed too: {cleanup_error}",
                            file=sys.stderr,
                        )
                raise
        return tb

    def _build(self) -> None:
        c = self.config
        if c.delay_ms:
            require_qdisc("netem", "delay needs the sch_netem kernel module")
        self._make_switch()
        for h in self.hosts:
            self._make_host(h)
        self._attach_ports()
        self._shape()

    def _make_switch(self) -> None:
        sw = self.switch_netns
        run_cmd(["ip", "netns", "add", sw])
        leaves = [f"leaf{g}" for g in range(1, self.config.groups + 1)]
        lines = ["link set lo up"]
        for leaf in leaves:
            # STP off (a tree of two bridges has no loop) and no forwarding delay: ports forward at once
            lines += [
                f"link add {leaf} type bridge stp_state 0 forward_delay 0",
                f"link set {leaf} mtu {self.config.mtu} up",
            ]
        if self.config.groups == 2:
            lines += [
                f"link add isl1 mtu {self.config.mtu} type veth peer name isl2 mtu {self.config.mtu}",
                "link set isl1 master leaf1 up",
                "link set isl2 master leaf2 up",
            ]
        run_batch("ip", sw, lines)
        # With br_netfilter loaded, bridged IPv4 would also run through this namespace's (empty)
        # iptables hooks: skip that work. Per-namespace since Linux 5.3; best effort.
        for key in ("bridge-nf-call-iptables", "bridge-nf-call-ip6tables", "bridge-nf-call-arptables"):
            run_cmd(["ip", "netns", "exec", sw, "sh", "-c", f"echo 0 > /proc/sys/net/bridge/{key}"], check=False)

    def _make_host(self, host: str) -> None:
        i = self.host_info[host]
        run_cmd(["ip", "netns", "add", i.netns])
        # the pair is made inside the switch namespace with its other end moved straight into the
        # host's: neither end ever exists in the root namespace
        run_cmd(
            [
                "ip",
                "-n",
                self.switch_netns,
                "link",
                "add",
                i.port,
                "mtu",
                str(self.config.mtu),
                "type",
                "veth",
                "peer",
                "name",
                HOST_IFACE,
                "mtu",
                str(self.config.mtu),
                "netns",
                i.netns,
            ]
        )
        run_batch(
            "ip",
            i.netns,
            [
                "link set lo up",  # UCX and anything bound to 127.0.0.1 need it
                f"addr add {i.address}/{PREFIX_LEN} dev {HOST_IFACE}",
                f"link set {HOST_IFACE} up",
            ],
        )

    def _attach_ports(self) -> None:
        run_batch(
            "ip",
            self.switch_netns,
            [f"link set {self.host_info[h].port} master leaf{self.host_info[h].group} up" for h in self.hosts],
        )

    def _shape(self) -> None:
        c = self.config
        sw_lines: list[str] = []
        self.qdiscs = []
        for h in self.hosts:
            i = self.host_info[h]
            if c.host_rate is not None or c.delay_ms:
                host_lines, q = shaping_commands(HOST_IFACE, c.host_rate, c.queue_ms, c.delay_ms)
                run_batch("tc", i.netns, host_lines)
                if q:
                    self.qdiscs.append({"netns": i.netns, "dev": HOST_IFACE, "link": f"{h} up", **q})
            if c.host_rate is not None:
                lines, q = shaping_commands(i.port, c.host_rate, c.queue_ms, None)
                sw_lines += lines
                self.qdiscs.append({"netns": self.switch_netns, "dev": i.port, "link": f"{h} down", **q})
        if c.groups == 2 and c.isl_rate is not None and not c.isl_shared:
            for dev, link in (("isl1", "isl 1->2"), ("isl2", "isl 2->1")):
                lines, q = shaping_commands(dev, c.isl_rate, c.queue_ms, None)
                sw_lines += lines
                self.qdiscs.append({"netns": self.switch_netns, "dev": dev, "link": link, **q})
        elif c.groups == 2 and c.isl_rate is not None:
            # One bucket for both directions: what arrives at either end of the ISL (isl2 receives
            # group 1's traffic, isl1 group 2's) is redirected into one ifb device whose tbf paces
            # it; ifb then hands each packet back to the receive path of the port it came in on.
            run_batch("ip", self.switch_netns, ["link add islq type ifb", "link set islq up"])
            for dev in ("isl1", "isl2"):
                sw_lines += [
                    f"qdisc add dev {dev} handle ffff: ingress",
                    f"filter add dev {dev} parent ffff: protocol all u32 match u32 0 0 "
                    "action mirred egress redirect dev islq",
                ]
            lines, q = shaping_commands("islq", c.isl_rate, c.queue_ms, None)
            sw_lines += lines
            self.qdiscs.append({"netns": self.switch_netns, "dev": "islq", "link": "isl both ways", **q})
        run_batch("tc", self.switch_netns, sw_lines)

    # -- removal ------------------------------------------------------------------------------

    def down(self) -> bool:
        """Removes this testbed; see the module function down()."""
        return down(self.name)

    def __enter__(self) -> "Testbed":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.down()
