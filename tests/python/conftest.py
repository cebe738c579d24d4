"""Shared fixtures and helpers of the tensorwire Python tests.

Everything runs on 127.0.0.1 only (the library then picks UCX_NET_DEVICES=lo
itself). Peers in other processes are started with multiprocessing's "spawn"
context (never fork: UCX runs threads) and report their address through a
Pipe; every wait is bounded.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# Loading UCX patches mmap and its kin (UCM's bistro hooks) and waits UCX's grace period, 50 ms,
# after each patch for threads inside the function to leave: 0.4 s of sched_yield for every
# process that imports tensorwire, and the tests start hundreds. A test process loads UCX before
# it runs anything of its own; the tests' processes (and their children) take 1 ms. Only for the
# UCX wheel's versions, which know the variable (an unknown UCX_ variable draws a warning).
try:
    from importlib.metadata import version as _version

    _version("libucx-cu13")
    if os.environ.get("TENSORWIRE_UCX", "wheel") == "wheel":
        os.environ.setdefault("UCX_MEM_BISTRO_GRACE_DURATION", "1ms")
except Exception:  # noqa: BLE001 - no wheel: the system's UCX, its own defaults
    pass
if HERE not in sys.path:  # spawned children inherit sys.path: they import _peers too
    sys.path.insert(0, HERE)

import tensorwire as tw  # noqa: E402

import _peers  # noqa: E402

HOST = "127.0.0.1"
TRANSPORTS = ["tcp", "shm"]
# The two forms of the slot protocols and of write/read (docs/contracts.md
# §12): forced with TENSORWIRE_LANE_FORM, so both run on any machine (auto
# picks messages over tcp and one-sided RMA over shared memory). "placed" is
# the message form with every static-slot tensor placed (TENSORWIRE_PLACE
# covering all sizes; by default only 256 KiB-4 MiB are).
LANE_FORMS = ["rma", "messages"]
PLACE_EVERY_SIZE = "0-1099511627776"


class lane_form:
    """Sets TENSORWIRE_LANE_FORM (and for "placed" TENSORWIRE_PLACE) for the
    devices made (and processes spawned) inside it."""

    def __init__(self, form: str | None):
        self.form = form

    def __enter__(self):
        self.old = {k: os.environ.get(k) for k in ("TENSORWIRE_LANE_FORM", "TENSORWIRE_PLACE")}
        if self.form == "placed":
            os.environ["TENSORWIRE_LANE_FORM"] = "messages"
            os.environ["TENSORWIRE_PLACE"] = PLACE_EVERY_SIZE
        elif self.form is not None:
            os.environ["TENSORWIRE_LANE_FORM"] = self.form
        return self

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


PEER_START_TIMEOUT_S = 30.0
PAIR_SLAB_SIZE = 4 << 20


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    return request.param


@dataclass
class DevicePair:
    server: tw.Device
    client: tw.Device
    transport: str

    def channel(self, lane: int = 0) -> tw.Channel:
        return self.client.connect(self.server.address, lane)

    def __iter__(self):  # server, client = device_pair
        return iter((self.server, self.client))


@pytest.fixture(params=TRANSPORTS)
def device_pair(request):
    """Two devices in this process on one transport: (server, client)."""
    # small slabs: every fresh slab is zeroed (page faults), 64 MiB ones cost ~0.1 s each
    server = tw.Device(host=HOST, transport=request.param, slab_size=PAIR_SLAB_SIZE)
    try:
        client = tw.Device(host=HOST, transport=request.param, slab_size=PAIR_SLAB_SIZE)
    except BaseException:
        server.close()
        raise
    try:
        yield DevicePair(server, client, request.param)
    finally:
        client.close()
        server.close()


def free_port() -> int:
    """A port nobody listens on, from below the ephemeral range so that no
    socket is handed it before the test binds it (tensorwire.ranks.launch.free_port)."""
    from tensorwire.ranks.launch import free_port as pick

    return pick(HOST)


def torchrun(
    n: int, script: Any, *args: str, timeout: float = 150, env: dict | None = None, launcher: tuple[str, ...] = ()
):
    """`python -m torch.distributed.run` of `script` with n processes on a free master port
    (`launcher`: more of torchrun's own options).
    When the agent could not bind that port (another process took it after free_port's
    probe: EADDRINUSE, before any rank ran), it runs again on another, at most 3 times."""
    import subprocess

    for attempt in range(3):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(n),
            "--master-port",
            str(free_port()),
            *launcher,
            str(script),
            *args,
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {})))
        lost_port = "failed to listen on any local network address" in run.stderr and "EADDRINUSE" in run.stderr
        if run.returncode == 0 or not lost_port or attempt == 2:
            return run
    raise AssertionError("unreachable")


def tensorwire_run(n: int, script: Any, *args: str, timeout: float = 150, env: dict | None = None):
    """`tensorwire run -n N -- python script ARGS`: ranks with torchrun's variables (env://), without
    torchrun's agent (a process that imports torch: seconds a run). The ranks' "[rank r] " prefixes are
    taken off, so stdout and stderr read as under torchrun. For what is not about torchrun itself: a
    killed rank ends a `tensorwire run` at once, where torchrun's agent looks every --monitor-interval."""
    import re
    import subprocess

    cmd = [sys.executable, "-m", "tensorwire", "run", "-n", str(n), "--", sys.executable, str(script), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {})))
    unprefix = re.compile(r"^\[rank \d+\] ", re.M)
    return subprocess.CompletedProcess(cmd, run.returncode, unprefix.sub("", run.stdout), unprefix.sub("", run.stderr))


def cli_in_process(args: list[str], capsys: Any) -> Any:
    """`tensorwire ARGS` through the CLI's main in this process, for what ends before anything runs
    (usage errors, --help, listings): a process of its own costs seconds of torch's import each.
    A subprocess.CompletedProcess with the exit status and what was printed."""
    import subprocess

    from tensorwire.cli import main

    try:
        code = main(args)
    except SystemExit as e:  # argparse: usage errors and --help
        code = e.code if isinstance(e.code, int) else 2
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


class PeerError(RuntimeError):
    """The peer process failed; carries its traceback."""


class PeerProcess:
    """Runs ``target(conn, *args)`` in a spawned process.

    The target reports a dict through ``conn`` once ready (``info``); the test
    may ``send``/``recv`` more messages, ``stop()`` it cleanly or ``kill()`` it.
    Leaving the ``with`` block always ends the process (SIGKILL as a last resort).
    """

    def __init__(self, target: Callable[..., Any], *args: Any, start_timeout: float = PEER_START_TIMEOUT_S):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child_conn, *args), daemon=True)
        self.proc.start()
        child_conn.close()
        self.info: dict = self.recv(start_timeout)

    @property
    def address(self) -> str:
        return self.info["address"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def recv(self, timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.1):
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise PeerError(f"peer process exited with code {self.proc.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no message from the peer process within {timeout} s")
        msg = self.conn.recv()
        if isinstance(msg, dict) and "error" in msg:
            raise PeerError("peer process failed:\n" + msg["error"])
        return msg

    def send(self, msg: Any) -> None:
        self.conn.send(msg)

    def request(self, msg: Any, timeout: float = 10.0) -> Any:
        self.send(msg)
        return self.recv(timeout)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL, then reap (bounded)."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(timeout)
        assert not self.proc.is_alive(), "peer process survived SIGKILL"

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.is_alive():
            try:
                self.send("stop")
            except OSError:
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()

    def __enter__(self) -> "PeerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(transport: str, regions: dict, **device_kwargs: Any) -> PeerProcess:
    """A server process (see _peers.serve) publishing zeroed regions name -> bytes."""
    return PeerProcess(_peers.serve, transport, regions, device_kwargs)


def call_json(ch: tw.Channel, handler: str, timeout: float = 10.0, **kwargs: Any) -> bytes:
    """Calls the peer's handler with the keyword arguments as a JSON payload."""
    return ch.call(handler, json.dumps(kwargs).encode(), timeout)


def remote_crc(ch: tw.Channel, name: str, offset: int, nbytes: int) -> int:
    """crc32 of bytes [offset, offset+nbytes) of the peer's region `name`, computed there."""
    return int(call_json(ch, "checksum", name=name, offset=offset, nbytes=nbytes))


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    """Bounded polling: True as soon as pred() holds, False after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def start_slot_peer(transport: str, **device_kwargs: Any) -> PeerProcess:
    """A process holding tensor slots or senders, driven by {"op": ...} messages (see _peers.slot_peer)."""
    return PeerProcess(_peers.slot_peer, transport, device_kwargs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (make test: --dist loadgroup) the tests that build testbeds (root network
    namespaces, links in the root namespace, tc) run one after another on one worker: they compare
    the machine's links before and after and time signals to processes in namespaces, which another
    testbed built at the same time disturbs. And the longest tests go first."""
    for item in items:
        if item.get_closest_marker("netns") is not None or item.path.name == "test_testbed.py":
            item.add_marker(pytest.mark.xdist_group("testbed"))

    # The longest first, so that no worker is left with a long test while the others are done:
    # the conformance module (one block on one worker: the selection's run, about 25 s with its
    # forked ranks, and two runs that spawn theirs), then the torch programs, then the rest in their
    # order (a stable sort keeps each module's tests together).
    def rank(item: pytest.Item) -> int:
        if item.path.name == "test_torch_conformance.py":
            return 0
        return 1 if item.path.parent.name == "pytorch" else 2

    items.sort(key=rank)
