"""An emulated fabric on one Linux machine: hosts as network namespaces behind shaped links.

Topology (``groups=2``; with ``groups=1`` there is one leaf and no inter-switch link)::

      ns tw-<name>-h1 ... tw-<name>-hK           ns tw-<name>-hK+1 ... tw-<name>-hN
        eth0 10.77.0.1 ... 10.77.0.K               eth0 10.77.0.K+1 ... 10.77.0.N
          |  host link (host_rate, each way)          |
    +-----h1 ... hK------------------+        +-------hK+1 ... hN---------------+
    |  bridge leaf1          isl1 ===|========|=== isl2          bridge leaf2    |
    +--------------------------------+  ISL   +---------------------------------+
                 ns tw-<name>-sw (the switches: one namespace, no addresses)

* Every host is a network namespace ``tw-<name>-h<i>`` with ``lo`` up and one veth ``eth0``
  (address ``10.77.0.<i>/24``). Its peer, named ``h<i>``, is a port of a leaf bridge.
* The bridges and the inter-switch link (a veth pair ``isl1``/``isl2``, one end a port of each
  leaf) live in the switch namespace ``tw-<name>-sw``. The root namespace gets nothing: no link,
  address, route or firewall rule, so a testbed cannot disturb the machine, and two testbeds of
  different names share no interface (every name is local to the testbed's own namespaces).
* Group 1 is the first half of the hosts (``ceil(N/2)``), group 2 the rest.

Shaping is egress-only, so each direction of a link is shaped where it leaves a device:
host -> switch on the host's ``eth0``; switch -> host on the switch port ``h<i>``; group 1 -> 2
on ``isl1`` and group 2 -> 1 on ``isl2``. See ``_shaping_commands`` for the qdisc and its sizes.

State: ``/run/tensorwire/testbed-<name>.json`` (``/run`` is a tmpfs: a reboot forgets the
testbed together with its namespaces). It is written before anything is created, so ``down``
can find a half-built testbed; ``down`` also removes namespaces that match the testbed's
naming scheme when the state file is gone.

Needs root (``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN`` for ``ip netns``) and iproute2 (``ip``,
``tc``). ``available()`` says whether this machine can run one, and why not.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import Error

__all__ = [
    "Testbed", "TestbedError", "NotRoot", "available", "default_name", "parse_rate", "format_rate",
    "DEFAULT_NAME", "STATE_DIR", "SUBNET",
]

DEFAULT_NAME = "tw"
STATE_DIR = "/run/tensorwire"
SUBNET = "10.77.0"          # hosts get SUBNET.<i>/24, i = 1..N; only inside the testbed's namespaces
PREFIX_LEN = 24
MAX_HOSTS = 250
HOST_IFACE = "eth0"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
CMD_TIMEOUT_S = 30.0        # any single ip/tc call
KILL_GRACE_S = 3.0          # down: SIGTERM, then SIGKILL, for processes left in the namespaces

# tbf sizing (see _tbf): the bucket holds at least this much, whatever the rate.
MIN_BURST_B = 128 * 1024
QUEUE_MS = 10.0             # time a full queue takes to drain at the link rate


class TestbedError(Error, RuntimeError):
    """A testbed could not be created, found or removed."""

    __test__ = False  # not a pytest test class


class NotRoot(TestbedError, PermissionError):
    """The caller lacks the privileges (root) or the tools (ip netns, tc) a testbed needs."""


def default_name() -> str:
    """The testbed name commands use when none is given: $TENSORWIRE_TESTBED or 'tw'."""
    return os.environ.get("TENSORWIRE_TESTBED") or DEFAULT_NAME


# ---------------------------------------------------------------------------------------------
# rates

_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b)?\s*$", re.IGNORECASE)
_RATE_MUL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_rate(text: str | int | float | None) -> int | None:
    """A link rate in bit/s from tc-style text: '1gbit', '200mbit', '500k', '4g', 1e9.

    'bit' and a bare suffix mean bits; 'bps' means bytes per second (tc's meaning).
    None, '', 'none', 'off' and 0 mean unshaped (None).
    """
    if text is None:
        return None
    if isinstance(text, (int, float)):
        value = int(text)
    else:
        s = text.strip().lower()
        if s in ("", "none", "off", "0", "unlimited"):
            return None
        m = _RATE_RE.match(s)
        if not m:
            raise ValueError(f"bad rate {text!r}: use tc units like 1gbit, 200mbit, 500kbit")
        num, prefix, unit = m.groups()
        value = int(float(num) * _RATE_MUL[prefix.lower()] * (8 if (unit or "").lower() == "bps" else 1))
    if value <= 0:
        return None
    if value < 8000:
        raise ValueError(f"rate {text!r} is below 8 kbit/s")
    return value


def format_rate(bps: float | None) -> str:
    if bps is None:
        return "unshaped"
    for unit, mul in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= mul:
            v = bps / mul
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{bps:.0f} bit/s"


# ---------------------------------------------------------------------------------------------
# environment checks


def _which(tool: str) -> str | None:
    return shutil.which(tool) or next(
        (p for p in (f"/usr/sbin/{tool}", f"/sbin/{tool}", f"/usr/bin/{tool}") if os.access(p, os.X_OK)), None)


def _check_root() -> None:
    if os.geteuid() != 0:
        raise NotRoot("the testbed needs root: it creates network namespaces, veths, bridges and tc "
                      "qdiscs (run it with sudo, or as root in a container with CAP_NET_ADMIN and "
                      "CAP_SYS_ADMIN)")


_available_cache: tuple[bool, str] | None = None


def available(refresh: bool = False) -> tuple[bool, str]:
    """(True, '') when this process can build a testbed, else (False, why not).

    Checks root, the ip and tc tools and that a network namespace can really be created here
    (containers often forbid it even for root); the probe namespace is removed at once.
    """
    global _available_cache
    if _available_cache is not None and not refresh:
        return _available_cache
    try:
        _check_root()
    except NotRoot as e:
        return False, str(e)
    for tool in ("ip", "tc"):
        if _which(tool) is None:
            return False, f"'{tool}' (iproute2) is not installed"
    probe = f"tw-probe-{os.getpid()}"
    try:
        r = subprocess.run([_which("ip"), "netns", "add", probe], capture_output=True, text=True,
                           timeout=CMD_TIMEOUT_S)
        if r.returncode != 0:
            result = (False, f"'ip netns add' fails here: {r.stderr.strip() or r.returncode}")
        else:
            r = subprocess.run([_which("ip"), "-n", probe, "link", "add", "p0", "type", "veth", "peer",
                                "name", "p1"], capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
            result = (True, "") if r.returncode == 0 else (
                False, f"veth links cannot be created in a namespace: {r.stderr.strip()}")
    except (OSError, subprocess.TimeoutExpired) as e:
        result = (False, f"'ip netns' unusable: {e}")
    finally:
        subprocess.run([_which("ip") or "ip", "netns", "del", probe], capture_output=True, timeout=CMD_TIMEOUT_S)
    _available_cache = result
    return result


# ---------------------------------------------------------------------------------------------
# command helpers


def _cmd(argv: Sequence[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Runs an ip/tc command; a failure raises TestbedError with the command and its stderr."""
    argv = list(argv)
    if argv[0] in ("ip", "tc"):
        argv[0] = _which(argv[0]) or argv[0]
    try:
        r = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"timed out after {CMD_TIMEOUT_S:.0f} s: {' '.join(argv)}") from None
    except FileNotFoundError:
        raise TestbedError(f"{argv[0]} not found (install iproute2)") from None
    if check and r.returncode != 0:
        what = " ".join(argv)
        if stdin:
            what += " <<EOF\n" + stdin + "EOF"
        raise TestbedError(f"command failed ({r.returncode}): {what}\n{r.stderr.strip()}")
    return r


def _batch(tool: str, ns: str, lines: Sequence[str]) -> None:
    """Runs many ip/tc commands in namespace ns in one process (-batch; stops at the first error)."""
    if lines:
        _cmd([tool, "-n", ns, "-batch", "-"], stdin="".join(line + "\n" for line in lines))


def list_netns() -> list[str]:
    r = _cmd(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _ns_pids(ns: str) -> list[int]:
    r = _cmd(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def _state_path(name: str) -> str:
    return os.path.join(STATE_DIR, f"testbed-{name}.json")


def _validate_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise TestbedError(f"bad testbed name {name!r}: 1-32 characters of a-z, 0-9, '-' and '_', "
                           "starting with a letter or digit")
    return name


def _owned_namespaces(name: str, present: Sequence[str]) -> list[str]:
    """The namespaces of testbed `name` among `present` (exact scheme, so 'a' never takes 'a-b''s)."""
    pat = re.compile(rf"^tw-{re.escape(name)}-(sw|h[0-9]+)$")
    return [ns for ns in present if pat.match(ns)]


# ---------------------------------------------------------------------------------------------
# the testbed


@dataclass
class Host:
    name: str          # h1..hN
    index: int         # 1..N
    netns: str         # tw-<testbed>-h<i>
    address: str       # 10.77.0.<i>
    group: int         # 1 or 2
    port: str          # the switch port (in the switch namespace) of this host's link


@dataclass
class Config:
    name: str
    hosts: int
    groups: int
    host_rate: int | None      # bit/s, each direction of each host link; None = unshaped
    isl_rate: int | None       # bit/s, each direction of the inter-switch link; None = unshaped
    delay_ms: float | None     # one-way delay added on every host's egress (needs sch_netem)
    queue_ms: float = QUEUE_MS
    mtu: int = 1500
    isl_shared: bool = False   # True: both directions of the ISL share isl_rate (one token bucket)


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
            raise TestbedError(f"testbed {self.name!r} has no host {host!r} (hosts: "
                               f"{', '.join(self.hosts)})") from None

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
        return [_which("ip") or "ip", "netns", "exec", self._host(host).netns]

    def host_env(self, host: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a command in `host`: `env` (default os.environ) plus TENSORWIRE_TESTBED,
        TENSORWIRE_TESTBED_HOST and TENSORWIRE_TESTBED_ADDR."""
        out = dict(os.environ if env is None else env)
        out.update(TENSORWIRE_TESTBED=self.name, TENSORWIRE_TESTBED_HOST=host,
                   TENSORWIRE_TESTBED_ADDR=self.address(host))
        return out

    def popen(self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Starts argv inside `host` (subprocess.Popen keyword arguments pass through)."""
        return subprocess.Popen(self.exec_prefix(host) + list(argv), env=self.host_env(host, env), **kwargs)

    def run(self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
            **kwargs: Any) -> subprocess.CompletedProcess:
        """Runs argv inside `host` to completion (subprocess.run keyword arguments pass through)."""
        return subprocess.run(self.exec_prefix(host) + list(argv), env=self.host_env(host, env), **kwargs)

    def describe(self) -> str:
        c = self.config
        lines = [f"testbed {c.name}: {c.hosts} hosts, {c.groups} group{'s' if c.groups > 1 else ''}, "
                 f"switches in netns {self.switch_netns}, subnet {SUBNET}.0/{PREFIX_LEN}",
                 f"  host link   {format_rate(c.host_rate)}{' each direction' if c.host_rate else ''}"
                 + (f", +{c.delay_ms:g} ms one-way delay" if c.delay_ms else "")]
        if c.groups == 2:
            lines.append(f"  inter-group {format_rate(c.isl_rate)} "
                         + ("both directions together (isl1 <-> isl2, one bucket)" if c.isl_shared
                            else "each direction (isl1 <-> isl2)" if c.isl_rate else "(isl1 <-> isl2)"))
        for what, q in (("host links", next((q for q in self.qdiscs if q["link"].startswith("h")), None)),
                        ("ISL", next((q for q in self.qdiscs if q["link"].startswith("isl")), None))):
            if q:
                lines.append(f"  shaping     {what}: tbf, burst {q['burst'] // 1024} KiB, queue limit "
                             f"{q['limit'] // 1024} KiB ({c.queue_ms:g} ms at the rate)")
        lines.append(f"  {'host':<5} {'group':>5}  {'address':<12} netns")
        for h in self.hosts:
            i = self.host_info[h]
            lines.append(f"  {h:<5} {i.group:>5}  {i.address:<12} {i.netns}")
        return "\n".join(lines)

    # -- state ----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, "config": asdict(self.config), "switch_netns": self.switch_netns,
                "status": self.status, "created": self.created, "qdiscs": self.qdiscs,
                "hosts": [asdict(self.host_info[h]) for h in self.hosts]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Testbed":
        hosts = {h["name"]: Host(**h) for h in data["hosts"]}
        return cls(config=Config(**data["config"]), host_info=hosts, switch_netns=data["switch_netns"],
                   status=data.get("status", "up"), created=data.get("created", 0.0),
                   qdiscs=list(data.get("qdiscs", [])))

    def _write_state(self, exclusive: bool = False) -> None:
        os.makedirs(STATE_DIR, mode=0o755, exist_ok=True)
        path = _state_path(self.name)
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
        return os.path.exists(_state_path(name)) or bool(_owned_namespaces(name, list_netns()))

    @classmethod
    def load(cls, name: str | None = None) -> "Testbed":
        """The running testbed `name` (default: default_name()); TestbedError if there is none."""
        name = _validate_name(name or default_name())
        path = _state_path(name)
        try:
            with open(path) as f:
                tb = cls.from_json(json.load(f))
        except FileNotFoundError:
            raise TestbedError(f"no testbed {name!r} (no {path}); create one with "
                               f"'tensorwire testbed up --name {name}'") from None
        except (ValueError, KeyError, TypeError) as e:
            raise TestbedError(f"unreadable testbed state {path}: {e}; remove the testbed with "
                               f"'tensorwire testbed down --name {name}'") from None
        if tb.status != "up":
            raise TestbedError(f"testbed {name!r} is {tb.status!r} (an 'up' did not finish); "
                               f"remove it with 'tensorwire testbed down --name {name}'")
        present = set(list_netns())
        missing = [ns for ns in tb.namespaces if ns not in present]
        if missing:
            raise TestbedError(f"testbed {name!r} is broken: namespaces {', '.join(missing)} are gone; "
                               f"'tensorwire testbed down --name {name}' removes the rest")
        return tb

    # -- creation ---------------------------------------------------------------------------

    @classmethod
    def plan(cls, hosts: int, groups: int = 1, host_rate: str | int | None = "1gbit",
             isl_rate: str | int | None = None, delay: float | None = None, name: str | None = None,
             queue_ms: float = QUEUE_MS, isl_shared: bool = False) -> "Testbed":
        """The testbed `up` would build, without building it (validates the arguments)."""
        name = _validate_name(name or default_name())
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
            info[h] = Host(name=h, index=i, netns=f"tw-{name}-{h}", address=f"{SUBNET}.{i}",
                           group=1 if i <= g1 else 2, port=h)
        cfg = Config(name=name, hosts=hosts, groups=groups, host_rate=hr, isl_rate=ir,
                     delay_ms=float(delay) if delay else None, queue_ms=float(queue_ms),
                     isl_shared=bool(isl_shared))
        return cls(config=cfg, host_info=info, switch_netns=f"tw-{name}-sw", status="creating")

    @classmethod
    def up(cls, hosts: int, groups: int = 1, host_rate: str | int | None = "1gbit",
           isl_rate: str | int | None = None, delay: float | None = None, name: str | None = None,
           force: bool = False, queue_ms: float = QUEUE_MS, isl_shared: bool = False) -> "Testbed":
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
        _check_root()
        tb = cls.plan(hosts, groups, host_rate, isl_rate, delay, name, queue_ms, isl_shared)
        if cls.exists(tb.name):
            if not force:
                raise TestbedError(f"testbed {tb.name!r} exists already; use it, remove it with "
                                   f"'tensorwire testbed down --name {tb.name}', or recreate it with --force")
            down(tb.name)
        with _signals_as_interrupt():
            try:
                tb._write_state(exclusive=True)
            except FileExistsError:
                raise TestbedError(f"testbed {tb.name!r} is being created by another process") from None
            try:
                tb._build()
                tb.status = "up"
                tb._write_state()
            except BaseException:
                with _signals_ignored():
                    try:
                        down(tb.name)
                    except Exception as cleanup_error:  # noqa: BLE001 - report, keep the first error
                        import sys
                        print(f"tensorwire testbed: cleanup after a failed 'up' failed too: {cleanup_error}",
                              file=sys.stderr)
                raise
        return tb

    def _build(self) -> None:
        c = self.config
        if c.delay_ms:
            _require_qdisc("netem", "delay needs the sch_netem kernel module")
        self._make_switch()
        for h in self.hosts:
            self._make_host(h)
        self._attach_ports()
        self._shape()

    def _make_switch(self) -> None:
        sw = self.switch_netns
        _cmd(["ip", "netns", "add", sw])
        leaves = [f"leaf{g}" for g in range(1, self.config.groups + 1)]
        lines = ["link set lo up"]
        for leaf in leaves:
            # STP off (a tree of two bridges has no loop) and no forwarding delay: ports forward at once
            lines += [f"link add {leaf} type bridge stp_state 0 forward_delay 0",
                      f"link set {leaf} mtu {self.config.mtu} up"]
        if self.config.groups == 2:
            lines += [f"link add isl1 mtu {self.config.mtu} type veth peer name isl2 mtu {self.config.mtu}",
                      "link set isl1 master leaf1 up", "link set isl2 master leaf2 up"]
        _batch("ip", sw, lines)
        # With br_netfilter loaded, bridged IPv4 would also run through this namespace's (empty)
        # iptables hooks: skip that work. Per-namespace since Linux 5.3; best effort.
        for key in ("bridge-nf-call-iptables", "bridge-nf-call-ip6tables", "bridge-nf-call-arptables"):
            _cmd(["ip", "netns", "exec", sw, "sh", "-c", f"echo 0 > /proc/sys/net/bridge/{key}"], check=False)

    def _make_host(self, host: str) -> None:
        i = self.host_info[host]
        _cmd(["ip", "netns", "add", i.netns])
        # the pair is made inside the switch namespace with its other end moved straight into the
        # host's: neither end ever exists in the root namespace
        _cmd(["ip", "-n", self.switch_netns, "link", "add", i.port, "mtu", str(self.config.mtu), "type", "veth",
              "peer", "name", HOST_IFACE, "mtu", str(self.config.mtu), "netns", i.netns])
        _batch("ip", i.netns, ["link set lo up",  # UCX and anything bound to 127.0.0.1 need it
                               f"addr add {i.address}/{PREFIX_LEN} dev {HOST_IFACE}",
                               f"link set {HOST_IFACE} up"])

    def _attach_ports(self) -> None:
        _batch("ip", self.switch_netns,
               [f"link set {self.host_info[h].port} master leaf{self.host_info[h].group} up" for h in self.hosts])

    def _shape(self) -> None:
        c = self.config
        sw_lines: list[str] = []
        self.qdiscs = []
        for h in self.hosts:
            i = self.host_info[h]
            if c.host_rate is not None or c.delay_ms:
                host_lines, q = _shaping_commands(HOST_IFACE, c.host_rate, c.queue_ms, c.delay_ms)
                _batch("tc", i.netns, host_lines)
                if q:
                    self.qdiscs.append({"netns": i.netns, "dev": HOST_IFACE, "link": f"{h} up", **q})
            if c.host_rate is not None:
                lines, q = _shaping_commands(i.port, c.host_rate, c.queue_ms, None)
                sw_lines += lines
                self.qdiscs.append({"netns": self.switch_netns, "dev": i.port, "link": f"{h} down", **q})
        if c.groups == 2 and c.isl_rate is not None and not c.isl_shared:
            for dev, link in (("isl1", "isl 1->2"), ("isl2", "isl 2->1")):
                lines, q = _shaping_commands(dev, c.isl_rate, c.queue_ms, None)
                sw_lines += lines
                self.qdiscs.append({"netns": self.switch_netns, "dev": dev, "link": link, **q})
        elif c.groups == 2 and c.isl_rate is not None:
            # One bucket for both directions: what arrives at either end of the ISL (isl2 receives
            # group 1's traffic, isl1 group 2's) is redirected into one ifb device whose tbf paces
            # it; ifb then hands each packet back to the receive path of the port it came in on.
            _batch("ip", self.switch_netns, ["link add islq type ifb", "link set islq up"])
            for dev in ("isl1", "isl2"):
                sw_lines += [f"qdisc add dev {dev} handle ffff: ingress",
                             f"filter add dev {dev} parent ffff: protocol all u32 match u32 0 0 "
                             "action mirred egress redirect dev islq"]
            lines, q = _shaping_commands("islq", c.isl_rate, c.queue_ms, None)
            sw_lines += lines
            self.qdiscs.append({"netns": self.switch_netns, "dev": "islq", "link": "isl both ways", **q})
        _batch("tc", self.switch_netns, sw_lines)

    # -- removal ------------------------------------------------------------------------------

    def down(self) -> bool:
        """Removes this testbed; see the module function down()."""
        return down(self.name)

    def __enter__(self) -> "Testbed":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.down()


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


def _shaping_commands(dev: str, rate_bps: int | None, queue_ms: float,
                      delay_ms: float | None) -> tuple[list[str], dict[str, Any] | None]:
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


def _require_qdisc(kind: str, why: str) -> None:
    probe = f"tw-probe-{os.getpid()}-q"
    try:
        _cmd(["ip", "netns", "add", probe])
        r = _cmd(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", kind], check=False)
        if r.returncode != 0:
            raise TestbedError(f"{why}; this kernel has no '{kind}' qdisc ({r.stderr.strip()})")
    finally:
        _cmd(["ip", "netns", "del", probe], check=False)


def down(name: str | None = None) -> bool:
    """Removes testbed `name`: ends processes left in its namespaces (SIGTERM, then SIGKILL after
    3 s), deletes the namespaces (their veths, bridges and qdiscs go with them) and the state file.

    Returns False (and does nothing) when there is no such testbed: calling it twice is fine.
    """
    _check_root()
    name = _validate_name(name or default_name())
    path = _state_path(name)
    namespaces: list[str] = []
    try:
        with open(path) as f:
            data = json.load(f)
        namespaces = [data["switch_netns"]] + [h["netns"] for h in data["hosts"]]
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError):
        pass  # a torn state file: the naming scheme below still finds everything
    present = list_netns()
    namespaces = [ns for ns in dict.fromkeys(namespaces + _owned_namespaces(name, present)) if ns in present]
    found = bool(namespaces) or os.path.exists(path)
    _end_processes(namespaces)
    errors = []
    for ns in namespaces:
        r = _cmd(["ip", "netns", "del", ns], check=False)
        if r.returncode != 0 and ns in list_netns():
            errors.append(f"{ns}: {r.stderr.strip()}")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    if errors:
        raise TestbedError(f"could not remove namespaces of testbed {name!r}: " + "; ".join(errors))
    return found


def _end_processes(namespaces: Sequence[str]) -> None:
    """SIGTERM to every process in the namespaces, SIGKILL to those alive after KILL_GRACE_S.

    A namespace whose name is deleted lives on (with its links) while a process is inside it.
    """
    me = os.getpid()
    pids = {p for ns in namespaces for p in _ns_pids(ns) if p != me}
    if not pids:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < deadline:
            pids = {p for p in pids if _alive(p)}
            if not pids:
                return
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False


def list_testbeds() -> list[str]:
    """Names of the testbeds with a state file here."""
    try:
        names = os.listdir(STATE_DIR)
    except FileNotFoundError:
        return []
    return sorted(n[len("testbed-"):-len(".json")] for n in names
                  if n.startswith("testbed-") and n.endswith(".json"))


class _Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGHUP during `up`: handled like Ctrl-C, so the partial testbed is removed."""


class _signals_as_interrupt:
    """Within the block, SIGTERM and SIGHUP raise _Interrupted (main thread only; elsewhere the
    caller's handlers stay)."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __enter__(self) -> None:
        self.saved: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            raise _Interrupted(f"signal {signal.Signals(signum).name}")

        for s in self.SIGNALS:
            self.saved[s] = signal.signal(s, handler)

    def __exit__(self, *exc: Any) -> None:
        for s, h in self.saved.items():
            signal.signal(s, h)


class _signals_ignored:
    """Cleanup must finish: a second Ctrl-C or SIGTERM while it runs is ignored (main thread)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __enter__(self) -> None:
        self.saved: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self.saved[s] = signal.signal(s, signal.SIG_IGN)

    def __exit__(self, *exc: Any) -> None:
        for s, h in self.saved.items():
            signal.signal(s, h)
