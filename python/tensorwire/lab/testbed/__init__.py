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
on ``isl1`` and group 2 -> 1 on ``isl2``. See ``shaping.shaping_commands`` for the qdisc and
its sizes.

State: ``/run/tensorwire/testbed-<name>.json`` (``/run`` is a tmpfs: a reboot forgets the
testbed together with its namespaces). It is written before anything is created, so ``down``
can find a half-built testbed; ``down`` also removes namespaces that match the testbed's
naming scheme when the state file is gone.

Needs root (``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN`` for ``ip netns``) and iproute2 (``ip``,
``tc``). ``available()`` says whether this machine can run one, and why not.

The package, one job per file: ``topology.py`` holds :class:`Testbed` (its hosts and
configuration, the commands run in its hosts, its state file, and building its namespaces and
links); ``shaping.py`` the qdiscs; ``teardown.py`` ``down()``; ``system.py`` the machine's
checks (``available()``) and the ip/tc calls; ``state.py`` names and state files; ``rates.py``
rate parsing; ``signals.py`` the signal handling of ``up``; ``errors.py`` the errors.
``cli.py`` and ``check.py`` are the ``tensorwire testbed`` command and its ``check``.
"""

from .errors import NotRoot, TestbedError
from .rates import format_rate, parse_rate
from .shaping import QUEUE_MS
from .state import DEFAULT_NAME, STATE_DIR, default_name, list_testbeds
from .system import available, list_netns
from .teardown import down
from .topology import SUBNET, Config, Host, Testbed

__all__ = [
    "Testbed",
    "TestbedError",
    "NotRoot",
    "available",
    "default_name",
    "parse_rate",
    "format_rate",
    "DEFAULT_NAME",
    "STATE_DIR",
    "SUBNET",
]
