"""A requested transport is a promise (issue 19 §1, docs/contracts.md §13): a
Device fails closed when UCX does not offer what was asked, a channel says
which UCX transports its lanes use, benches record them and FAIL when the
traffic went elsewhere, and `tensorwire info` says what is usable here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tensorwire as tw
from tensorwire import _core
from tensorwire.lab.fabric.common import Report, check_transports

HAS_VERBS = any(_core.transport_family(t) == "rdma" for t in tw.Device(progress="inline").resources())


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tensorwire", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "UCX_LOG_LEVEL": "error"},
    )


@pytest.mark.skipif(HAS_VERBS, reason="this machine has verbs: rdma is usable")
def test_rdma_without_verbs_fails_closed_naming_what_is_missing():
    with pytest.raises(
        tw.InvalidArgument,
        match=r"transport 'rdma' was asked for but is not usable here: "
        r"no verbs transport.*UCX offers",
    ):
        tw.Device(transport="rdma")


def test_require_names_a_family_and_refuses_unknown_ones():
    with pytest.raises(tw.InvalidArgument, match="unknown transport 'gpu'"):
        tw.Device(require="gpu")
    if not tw.cuda_available():
        with pytest.raises(tw.InvalidArgument, match="transport 'cuda' .* no GPU"):
            tw.Device(require=["cuda"])
    with tw.Device(require=["tcp", "shm"]) as dev:  # auto offers both here
        assert {"tcp", "shm"} <= {_core.transport_family(t) for t in dev.resources()}
    with pytest.raises(tw.InvalidArgument, match="transport 'tcp' .* no tcp transport"):
        tw.Device(transport="shm", require="tcp")  # shm alone has no tcp


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_channel_says_which_transports_its_lanes_use(transport):
    with tw.Device(transport=transport) as a, tw.Device(transport=transport) as b:
        used = a.connect(b.address).transports()
        assert used, "UCX reported no transports"
        assert all("/" in t for t in used)
        assert {_core.transport_family(t) for t in used} == {transport}


class _Lane:
    def __init__(self, used: list[str]) -> None:
        self.used = used

    def transports(self) -> list[str]:
        return self.used


def test_a_bench_whose_traffic_went_elsewhere_fails():
    report = Report("write_lat", {"transport": "rdma"})
    assert check_transports(report, "rdma", [_Lane(["posix/memory", "cma/memory"])]) == ["cma/memory", "posix/memory"]
    assert report.verdict == "FAIL"
    assert "not the requested rdma" in report.verdict_line("x")
    ok = Report("write_lat", {"transport": "shm"})
    check_transports(ok, "shm", [_Lane(["posix/memory"]), _Lane(["sysv/memory"])])
    assert ok.verdict == "PASS" and ok.config["lane_transports"] == ["posix/memory", "sysv/memory"]
    anything = Report("write_lat", {"transport": "auto"})
    check_transports(anything, "auto", [_Lane(["tcp/lo"])])
    assert anything.verdict == "PASS"


def test_bench_header_and_json_show_the_lanes(tmp_path):
    out = tmp_path / "lat.json"
    p = _cli("bench", "write_lat", "-s", "8", "-n", "50", "--transport", "tcp", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "Transport type  : tcp (lanes: tcp/socket)" in p.stdout
    data = json.loads(out.read_text())
    assert data["config"]["lane_transports"] == ["tcp/socket"]
    # the run is sound; 50 samples on a busy machine may draw the spread warning, nothing else
    assert data["verdict"] in ("PASS", "WARN"), data["checks"]
    assert all(c["level"] == "WARN" and "relative stdev" in c["message"] for c in data["checks"]), data["checks"]


@pytest.mark.skipif(HAS_VERBS, reason="this machine has verbs: rdma is usable")
def test_cli_with_an_unusable_transport_exits_with_the_reason():
    p = _cli("bench", "write_lat", "-s", "8", "--transport", "rdma")
    assert p.returncode == 1
    assert "transport 'rdma' was asked for but is not usable here" in p.stderr
    assert p.stderr.count("not usable here") == 1  # said once, before any server was spawned
    info = _cli("info", "--transport", "rdma")
    assert info.returncode == 1
    assert "rdma  no: no verbs transport" in info.stdout and "tcp   yes" in info.stdout
    assert _cli("info").returncode == 0


def test_perftest_style_device_choice():
    """-d/--ib-dev picks the network device(s) the lanes may use (perftest -d), for the peer too:
    over tcp the interface its sockets bind to."""
    ok = _cli("bench", "write_lat", "-s", "8", "-n", "50", "--transport", "tcp", "-d", "lo")
    assert ok.returncode == 0, ok.stderr
    assert "(lanes: tcp/lo)" in ok.stdout
    bad = _cli("bench", "write_lat", "-s", "8", "-n", "50", "--transport", "tcp", "-d", "nosuchdev0")
    assert bad.returncode == 1
    assert "no network interface 'nosuchdev0' for transport 'tcp'" in bad.stderr


def test_auto_gives_a_peer_ucx_cannot_reach_a_tcp_lane(monkeypatch):
    """Transport auto: a peer that no UCX transport of this device reaches (here UCX_TLS=self, as for
    a peer on another host without RDMA) gets a tcp lane, tensorwire's own socket, and data moves."""
    monkeypatch.setenv("UCX_TLS", "self")
    with tw.Device() as a, tw.Device() as b:
        dst = b.alloc(4096)
        b.publish("dst", dst)
        ch = a.connect(b.address)
        assert ch.transports() == ["tcp/socket"]
        src = a.alloc(4096)
        np.asarray(src)[:] = 7
        ch.write(src, ch.lookup("dst")).wait(10)
        assert (np.asarray(dst) == 7).all()
