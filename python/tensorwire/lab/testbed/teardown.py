"""Removing a testbed: the processes left in its namespaces ended, the namespaces (with
their links and qdiscs) and the state file deleted."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Sequence

from .errors import TestbedError
from .state import owned_namespaces, state_path, validate_name, default_name
from .system import check_root, run_cmd, ns_pids, list_netns

KILL_GRACE_S = 3.0  # down: SIGTERM, then SIGKILL, for processes left in the namespaces


def down(name: str | None = None) -> bool:
    """Removes testbed `name`: ends processes left in its namespaces (SIGTERM, then SIGKILL after
    3 s), deletes the namespaces (their veths, bridges and qdiscs go with them) and the state file.

    Returns False (and does nothing) when there is no such testbed: calling it twice is fine.
    """
    check_root()
    name = validate_name(name or default_name())
    path = state_path(name)
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
    namespaces = [ns for ns in dict.fromkeys(namespaces + owned_namespaces(name, present)) if ns in present]
    found = bool(namespaces) or os.path.exists(path)
    _end_processes(namespaces)
    errors = []
    for ns in namespaces:
        r = run_cmd(["ip", "netns", "del", ns], check=False)
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
    pids = {p for ns in namespaces for p in ns_pids(ns) if p != me}
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
