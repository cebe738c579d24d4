"""An emulated fabric (see topology.py's doc). testbed/__init__.py moved there whole, so that its
history follows; the next commit splits it by job."""

from .topology import *  # noqa: F401,F403
from .topology import (__all__, QUEUE_MS, _check_root, _ns_pids, _owned_namespaces, _which,  # noqa: F401
                       down, list_netns, list_testbeds, os)
