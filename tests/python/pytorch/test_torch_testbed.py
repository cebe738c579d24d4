"""Two hosts under torchrun: two network namespaces of `tensorwire testbed` each run
`torchrun --nnodes 2 --nproc-per-node 1` (static rendezvous at h1's testbed address, the c10d store
on its agent); DDP trains a small model a few steps on "tensorwire" (over tcp between the
namespaces) and on "gloo", and both end with the same parameters (docs/torch.md, "Two hosts").

Needs root and `ip netns` (skipped with the reason from testbed.available() otherwise) and torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tensorwire.lab import testbed  # noqa: E402
from tensorwire.lab.testbed import Testbed, system  # noqa: E402

OK, WHY = testbed.available()
pytestmark = [
    pytest.mark.torch,
    pytest.mark.netns,
    pytest.mark.skipif(not OK, reason=f"no testbed here: {WHY or 'ip netns unusable'}"),
]

HERE = Path(__file__).parent
PROGRAM = HERE / "_torch_ddp_steps.py"
RUN_S = 90  # one backend's two torchruns (both ranks' start-up, rendezvous, 5 steps)


def torchrun_on_both_hosts(tb: Testbed, backend: str, port: int, out: Path) -> None:
    """One torchrun per host, node rank = host index, the rendezvous at h1:port; both must exit 0
    within RUN_S. Past it, or once one failed, every process in the two namespaces (this test's
    torchruns and their ranks, which torchrun starts in sessions of their own) is killed."""
    procs, logs = [], []
    for node, host in enumerate(tb.hosts):
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node),
            "--master-addr",
            tb.address("h1"),
            "--master-port",
            str(port),
            str(PROGRAM),
            backend,
            str(out),
        ]
        # gloo finds its interface from the machine's hostname, an address of the root namespace: name eth0
        env = dict(os.environ, TENSORWIRE_TRANSPORT="tcp", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
        logs.append(out / f"{backend}_{host}.log")
        with open(logs[-1], "w") as log:
            procs.append(tb.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + RUN_S
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one failed: the other would wait for it until its timeout
            time.sleep(0.2)
    finally:
        if any(p.poll() is None for p in procs):
            for host in tb.hosts:
                for pid in system.ns_pids(tb.netns(host)):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for p in procs:
            p.wait(30)
    for host, p, log in zip(tb.hosts, procs, logs):
        assert p.returncode == 0, f"{backend} on {host}: exit {p.returncode}\n{log.read_text()[-3000:]}"


@pytest.mark.timeout(180)
def test_ddp_across_two_namespaces_under_torchrun_equals_gloo(tmp_path: Path) -> None:
    tb = Testbed.up(hosts=2, host_rate=None, name=f"tr{os.getpid()}")
    try:
        for port, backend in enumerate(("tensorwire", "gloo"), start=29500):
            torchrun_on_both_hosts(tb, backend, port, tmp_path)
    finally:
        tb.down()
    got = {
        (b, r): torch.load(tmp_path / f"{b}_rank{r}.pt", weights_only=False)
        for b in ("tensorwire", "gloo")
        for r in (0, 1)
    }
    for b in ("tensorwire", "gloo"):
        assert got[(b, 0)]["world"] == 2 and got[(b, 0)]["backend_of_group"] == b
    # tensorwire's group ran over tcp from each namespace's own testbed address
    for r, host in enumerate(tb.hosts):
        where = got[("tensorwire", r)]["where"]
        assert "transport=tcp" in where and f"{tb.address(host)}:" in where, where
    tw, gl = got[("tensorwire", 0)]["params"], got[("gloo", 0)]["params"]
    assert tw.keys() == gl.keys()
    for k in tw:
        assert torch.equal(tw[k], got[("tensorwire", 1)]["params"][k]), f"{k}: the ranks' parameters differ"
        assert not torch.equal(tw[k], got[("tensorwire", 0)]["initial"][k]), f"{k}: not trained"
        assert torch.allclose(tw[k], gl[k], rtol=1e-5, atol=1e-6), (
            f"{k}: tensorwire {tw[k].flatten()[:4]} != gloo {gl[k].flatten()[:4]}"
        )
