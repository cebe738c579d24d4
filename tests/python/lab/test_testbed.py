"""The emulated-fabric testbed (tensorwire.lab.testbed): namespaces, shaping, run, down, cleanup.

Needs root and `ip netns` (marker netns); skipped with the reason from available() otherwise.
Testbed names carry this process id, so a run never meets a user's testbed or another run's.
Rates are low (100-200 Mbit/s) so that a rate is measured in a second on a loaded 2-core box;
the bounds are generous (0.3x to 1.3x the configured rate).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time

import pytest

from tensorwire.lab import testbed
from tensorwire.lab.testbed import NotRoot, Testbed, TestbedError, parse_rate, state, system
from tensorwire.lab.testbed.check import stream

OK, WHY = testbed.available()
needs_netns = pytest.mark.skipif(not OK, reason=WHY or "ip netns unusable")
TAG = f"pt{os.getpid()}"
CLI = [sys.executable, "-m", "tensorwire", "testbed"]
LOW, HIGH = 0.3, 1.3


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def _leftovers(name: str) -> list[str]:
    ns = [n for n in testbed.list_netns() if n.startswith(f"tw-{name}-")]
    state = os.path.join(testbed.STATE_DIR, f"testbed-{name}.json")
    return ns + ([state] if os.path.exists(state) else [])


@pytest.fixture(scope="module")
def root_links_before():
    return _root_links() if OK else set()


@pytest.fixture(scope="module")
def tb2(root_links_before):
    """2 hosts, one leaf, 200 Mbit/s host links."""
    tb = Testbed.up(hosts=2, host_rate="200mbit", name=TAG + "a")
    try:
        yield tb
    finally:
        tb.down()


@pytest.fixture(scope="module")
def tb4(root_links_before):
    """4 hosts in 2 groups (h1,h2 | h3,h4), 200 Mbit/s host links, 100 Mbit/s inter-switch link."""
    tb = Testbed.up(hosts=4, groups=2, host_rate="200mbit", isl_rate="100mbit", name=TAG + "b")
    try:
        yield tb
    finally:
        tb.down()


def _in_range(measured: float, rate: str) -> None:
    r = parse_rate(rate)
    assert LOW * r <= measured <= HIGH * r, f"measured {measured / 1e6:.1f} Mbit/s for a {rate} link"


# -- no root needed ------------------------------------------------------------------------------


def test_parse_rate():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("200mbit") == 200 * 10**6
    assert parse_rate("4g") == 4 * 10**9
    assert parse_rate("1mbps") == 8 * 10**6  # tc: bps = bytes per second
    assert parse_rate("none") is None and parse_rate(None) is None
    with pytest.raises(ValueError):
        parse_rate("fast")


def test_plan_validates():
    tb = Testbed.plan(hosts=5, groups=2, host_rate="1gbit", isl_rate="4gbit", name="x-y")
    assert tb.hosts == ["h1", "h2", "h3", "h4", "h5"]
    assert tb.group_hosts(1) == ["h1", "h2", "h3"] and tb.group_hosts(2) == ["h4", "h5"]
    assert tb.address("h5") == "10.77.0.5" and tb.netns("h5") == "tw-x-y-h5"
    assert tb.exec_prefix("h2")[-3:] == ["netns", "exec", "tw-x-y-h2"]
    for bad in (
        dict(hosts=0),
        dict(hosts=2, groups=3),
        dict(hosts=2, name="Bad Name"),
        dict(hosts=2, isl_rate="1gbit"),
        dict(hosts=2, host_rate="quick"),
    ):
        with pytest.raises(TestbedError):
            Testbed.plan(**bad)
    # a testbed's namespaces are told apart from those of a testbed whose name extends its own
    assert state.owned_namespaces("a", ["tw-a-h1", "tw-a-sw", "tw-a-b-h1", "tw-a-b-sw", "tw-ab-h1"]) == [
        "tw-a-h1",
        "tw-a-sw",
    ]


def test_not_root_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(system.os, "geteuid", lambda: 1000)
    ok, why = testbed.available(refresh=True)
    assert not ok and "root" in why
    with pytest.raises(NotRoot, match="needs root"):
        Testbed.up(hosts=2, name=TAG + "nr")
    from tensorwire.cli import main

    for argv in (
        ["testbed", "up", "--num-hosts", "2", "--name", TAG + "nr"],
        ["testbed", "down"],
        ["testbed", "run", "--host", "h1", "--", "true"],
        ["testbed", "check"],
    ):
        assert main(argv) == 2
        assert "needs root" in capsys.readouterr().err
    monkeypatch.undo()
    testbed.available(refresh=True)


def test_run_ends_a_command_interrupted_while_it_starts(monkeypatch):
    """A SIGINT that reaches `testbed run` while Popen is starting the command (made here by the
    stand-in testbed, which signals the CLI from inside popen) is held until the command runs, then
    ends it: exit 130 and nothing left running (raised inside Popen, it left the command behind)."""
    import tensorwire.lab.testbed as tb_pkg
    from tensorwire.lab.testbed import cli as tb_cli

    started = []

    class StandIn:
        def popen(self, host, cmd):
            p = subprocess.Popen(["sleep", "60"])
            started.append(p)
            os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: still inside popen
            time.sleep(0.05)
            return p

    monkeypatch.setattr(system, "check_root", lambda: None)
    monkeypatch.setattr(tb_pkg.Testbed, "load", classmethod(lambda cls, name: StandIn()))
    before = signal.getsignal(signal.SIGINT)
    args = tb_cli.argparse.Namespace(name="standin", host="h1", cmd=["--", "sleep", "60"])
    try:
        assert tb_cli._run(args) == 130
        assert started and started[0].poll() is not None, "the command was left running"
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert signal.getsignal(signal.SIGINT) is before  # the CLI's handlers are restored


# -- testbeds ------------------------------------------------------------------------------------


@pytest.mark.netns
@needs_netns
def test_layout(tb4, root_links_before):
    assert tb4.hosts == ["h1", "h2", "h3", "h4"]
    assert [tb4.group(h) for h in tb4.hosts] == [1, 1, 2, 2]
    loaded = Testbed.load(tb4.name)
    assert loaded.to_json()["hosts"] == tb4.to_json()["hosts"]
    present = testbed.list_netns()
    assert all(ns in present for ns in tb4.namespaces)
    # lo is up (UCX and anything bound to 127.0.0.1 need it), eth0 carries the testbed address
    r = tb4.run("h3", ["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True)
    assert "127.0.0.1/8" in r.stdout and "10.77.0.3/24" in r.stdout
    r = tb4.run(
        "h3",
        [
            sys.executable,
            "-c",
            "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
            "s.listen(); socket.create_connection(s.getsockname(), 2)",
        ],
    )
    assert r.returncode == 0
    # the root namespace gained nothing
    assert _root_links() - root_links_before == set()
    # shaping: a tbf on both ends of every host link and on both ends of the ISL
    r = subprocess.run(["tc", "-n", tb4.switch_netns, "qdisc", "show"], capture_output=True, text=True, check=True)
    for dev in ("h1", "h2", "h3", "h4", "isl1", "isl2"):
        assert f"tbf 1: dev {dev} root" in r.stdout, r.stdout
    r = subprocess.run(
        ["tc", "-n", tb4.netns("h1"), "qdisc", "show", "dev", "eth0"], capture_output=True, text=True, check=True
    )
    assert "tbf" in r.stdout and "rate 200Mbit" in r.stdout


@pytest.mark.netns
@needs_netns
def test_host_rate_enforced(tb2):
    bps, _ = stream(tb2, [("h1", "h2")], seconds=1.2, warmup=0.3)
    _in_range(bps, "200mbit")
    bps, _ = stream(tb2, [("h2", "h1")], seconds=1.2, warmup=0.3)
    _in_range(bps, "200mbit")


@pytest.mark.netns
@needs_netns
def test_isl_rate_enforced(tb4):
    # both group-1 hosts send across: the 100 Mbit/s ISL, not the 2 x 200 Mbit/s host links, limits
    bps, _ = stream(tb4, [("h1", "h3"), ("h2", "h4")], seconds=1.2, warmup=0.3)
    _in_range(bps, "100mbit")
    # inside a group the ISL is not in the path: the host link limits
    bps, _ = stream(tb4, [("h3", "h4")], seconds=1.2, warmup=0.3)
    _in_range(bps, "200mbit")
    assert bps > parse_rate("100mbit") * 1.3


@pytest.mark.netns
@needs_netns
def test_run_exit_code_and_env(tb2):
    assert tb2.run("h1", ["sh", "-c", "exit 7"]).returncode == 7
    r = subprocess.run(
        CLI
        + [
            "run",
            "--name",
            tb2.name,
            "--host",
            "h2",
            "--",
            "sh",
            "-c",
            'echo "$TENSORWIRE_TESTBED_HOST $TENSORWIRE_TESTBED_ADDR"; exit 5',
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 5, r.stderr
    assert r.stdout.split() == ["h2", "10.77.0.2"]
    r = subprocess.run(
        CLI + ["run", "--name", tb2.name, "--host", "h9", "--", "true"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 1 and "no host 'h9'" in r.stderr


@pytest.mark.netns
@needs_netns
def test_run_interrupted_ends_the_command(tb2):
    p = subprocess.Popen(
        CLI + ["run", "--name", tb2.name, "--host", "h1", "--", "sleep", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def sleeping() -> bool:  # the command itself runs in h1 (not `ip netns exec` on its way to it)
        for pid in system.ns_pids(tb2.netns("h1")):
            try:
                if open(f"/proc/{pid}/comm").read().strip() == "sleep":
                    return True
            except OSError:
                pass
        return False

    try:
        deadline = time.monotonic() + 20
        while not sleeping() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleeping(), "the command never started"
        p.send_signal(signal.SIGINT)  # to the CLI only: it must pass the end on
        assert p.wait(20) == 130
        assert system.ns_pids(tb2.netns("h1")) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.netns
@needs_netns
def test_duplicate_up_refused(tb2):
    with pytest.raises(TestbedError, match="exists already"):
        Testbed.up(hosts=3, name=tb2.name)
    r = subprocess.run(CLI + ["up", "--num-hosts", "2", "--name", tb2.name], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "--force" in r.stderr
    assert Testbed.load(tb2.name).config.hosts == 2  # untouched


@pytest.mark.netns
@needs_netns
def test_status_and_check_cli(tb2):
    r = subprocess.run(CLI + ["status", "--name", tb2.name], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "10.77.0.2" in r.stdout and "200 Mbit/s" in r.stdout
    r = subprocess.run(
        CLI + ["check", "--name", tb2.name, "--seconds", "1"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("host uplink"))
    assert line.split()[-1] in ("PASS", "WARN") or "WARN" in line


@pytest.mark.netns
@needs_netns
def test_tensorwire_run_places_ranks_in_the_testbed_hosts(tb2):
    """`tensorwire run --testbed` (a product command; the lab's commands give it the testbed
    through tensorwire.cli's hook): rank i runs in host i, with that host's address."""
    show = "import os; print(os.environ['TENSORWIRE_RANK'], os.environ['TENSORWIRE_HOST'])"
    r = subprocess.run(
        [sys.executable, "-m", "tensorwire", "run", "-n", "2", "--testbed", tb2.name, "--", sys.executable, "-c", show],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(r.stdout.replace("[rank 1] ", "").split("\n")[:2]) == [
        f"0 {tb2.address('h1')}",
        f"1 {tb2.address('h2')}",
    ], r.stdout


@pytest.mark.netns
@needs_netns
def test_tensorwire_bench_across_hosts(tb2, tmp_path):
    """UCX over tcp from h1 to a server in h2: completes, at most the 200 Mbit/s host link."""
    port = 7100
    server = tb2.popen(
        "h2",
        [
            sys.executable,
            "-m",
            "tensorwire",
            "bench",
            "bw",
            "--server",
            "--transport",
            "tcp",
            "--host",
            tb2.address("h2"),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        # wait for its address line; read the pipe itself (a buffered readline could take the next
        # line too, and a select on the pipe would then wait for nothing)
        fd = server.stdout.fileno()
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + 30
        seen = b""
        while b"TENSORWIRE_ADDRESS" not in seen and time.monotonic() < deadline and server.poll() is None:
            if sel.select(0.2):
                seen += os.read(fd, 4096)
        assert b"TENSORWIRE_ADDRESS" in seen, seen
        out = tmp_path / "bw.json"
        # the client binds its own testbed address: on 127.0.0.1 UCX would be limited to lo
        r = tb2.run(
            "h1",
            [
                sys.executable,
                "-m",
                "tensorwire",
                "bench",
                "bw",
                "--connect",
                f"{tb2.address('h2')}:{port}",
                "--host",
                tb2.address("h1"),
                "--transport",
                "tcp",
                "--sizes",
                "64K",
                "--iters",
                "50",
                "--json",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        row = json.loads(out.read_text())["rows"][0]
        mbit = row["bw_avg_Bps"] * 8 / 1e6
        assert 0 < mbit <= 200 * 1.15, row
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


@pytest.mark.netns
@needs_netns
def test_down_removes_everything(root_links_before):
    name = TAG + "d"
    tb = Testbed.up(hosts=3, groups=2, host_rate="100mbit", isl_rate="50mbit", isl_shared=True, name=name)
    try:
        sleeper = tb.popen("h2", ["sleep", "60"])  # a process left inside must not keep the namespace
        assert _leftovers(name)
        assert tb.down() is True
        assert sleeper.wait(10) is not None
        assert _leftovers(name) == []
        assert _root_links() - root_links_before == set()
        assert tb.down() is False  # idempotent
        r = subprocess.run(CLI + ["down", "--name", name], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "nothing to remove" in r.stdout
        with pytest.raises(TestbedError, match="no testbed"):
            Testbed.load(name)
        # a testbed whose state file is lost (crash, manual rm) is still found by its names
        tb = Testbed.up(hosts=2, host_rate=None, name=name)
        os.unlink(os.path.join(testbed.STATE_DIR, f"testbed-{name}.json"))
        with pytest.raises(TestbedError, match="exists already"):
            Testbed.up(hosts=2, name=name)
        assert testbed.down(name) is True and _leftovers(name) == []
    finally:
        testbed.down(name)


@pytest.mark.netns
@needs_netns
def test_delay_needs_netem():
    """--delay uses netem: where the kernel lacks it, up fails cleanly with the reason."""
    name = TAG + "n"
    try:
        try:
            tb = Testbed.up(hosts=2, host_rate="100mbit", delay=2, name=name)
        except TestbedError as e:
            assert "netem" in str(e)
            assert _leftovers(name) == []
            return
        r = tb.run("h1", ["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True, check=True)
        assert "netem" in r.stdout and "tbf" in r.stdout
    finally:
        testbed.down(name)


@pytest.mark.netns
@needs_netns
@pytest.mark.parametrize("failure", ["error", "ctrl-c", "sigterm"])
def test_interrupted_up_cleans_up(monkeypatch, failure):
    name = TAG + "i" + failure[0]
    made = []
    real = Testbed._make_host

    def make_host(self, host):
        made.append(host)
        if host == "h3":
            if failure == "error":
                raise TestbedError("injected failure")
            if failure == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)  # the handler installed by up turns it into an interrupt
            time.sleep(5)  # never reached when the signal works
        real(self, host)

    monkeypatch.setattr(Testbed, "_make_host", make_host)
    expected = TestbedError if failure == "error" else KeyboardInterrupt
    try:
        with pytest.raises(expected):
            Testbed.up(hosts=4, groups=2, host_rate="100mbit", isl_rate="100mbit", name=name)
        assert made == ["h1", "h2", "h3"]
        assert _leftovers(name) == []
        assert signal.getsignal(signal.SIGTERM) is not None  # handler restored (not left as the up one)
    finally:
        testbed.down(name)
