"""The machine's side: whether it can build a testbed (root, iproute2, ``ip netns``), and
running its ip and tc commands."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Sequence

from .errors import NotRoot, TestbedError

CMD_TIMEOUT_S = 30.0  # any single ip/tc call


# ---------------------------------------------------------------------------------------------
# environment checks


def find_tool(tool: str) -> str | None:
    return shutil.which(tool) or next(
        (p for p in (f"/usr/sbin/{tool}", f"/sbin/{tool}", f"/usr/bin/{tool}") if os.access(p, os.X_OK)), None
    )


def check_root() -> None:
    if os.geteuid() != 0:
        raise NotRoot(
            "the testbed needs root: it creates network namespaces, veths, bridges and tc "
            "qdiscs (run it with sudo, or as root in a container with CAP_NET_ADMIN and "
            "CAP_SYS_ADMIN)"
        )


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
        check_root()
    except NotRoot as e:
        return False, str(e)
    for tool in ("ip", "tc"):
        if find_tool(tool) is None:
            return False, f"'{tool}' (iproute2) is not installed"
    probe = f"tw-probe-{os.getpid()}"
    ip = find_tool("ip")
    assert ip is not None  # found above
    try:
        r = subprocess.run([ip, "netns", "add", probe], capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
        if r.returncode != 0:
            result = (False, f"'ip netns add' fails here: {r.stderr.strip() or r.returncode}")
        else:
            r = subprocess.run(
                [ip, "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
                capture_output=True,
                text=True,
                timeout=CMD_TIMEOUT_S,
            )
            result = (
                (True, "")
                if r.returncode == 0
                else (False, f"veth links cannot be created in a namespace: {r.stderr.strip()}")
            )
    except (OSError, subprocess.TimeoutExpired) as e:
        result = (False, f"'ip netns' unusable: {e}")
    finally:
        subprocess.run([find_tool("ip") or "ip", "netns", "del", probe], capture_output=True, timeout=CMD_TIMEOUT_S)
    _available_cache = result
    return result


# ---------------------------------------------------------------------------------------------
# command helpers


def run_cmd(argv: Sequence[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Runs an ip/tc command; a failure raises TestbedError with the command and its stderr."""
    argv = list(argv)
    if argv[0] in ("ip", "tc"):
        argv[0] = find_tool(argv[0]) or argv[0]
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


def run_batch(tool: str, ns: str, lines: Sequence[str]) -> None:
    """Runs many ip/tc commands in namespace ns in one process (-batch; stops at the first error)."""
    if lines:
        run_cmd([tool, "-n", ns, "-batch", "-"], stdin="".join(line + "\n" for line in lines))


def list_netns() -> list[str]:
    r = run_cmd(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def ns_pids(ns: str) -> list[int]:
    r = run_cmd(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]
