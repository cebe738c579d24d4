"""A selection of PyTorch's own distributed suite (torch.testing._internal.distributed.
distributed_test) on the "tensorwire" backend, through `tensorwire conformance`: 29 tests that
pass on gloo (bench/results/conformance_gloo.txt), covering point to point (send/recv, tags,
isend/irecv, recv from any source, batch_isend_irecv), every collective of the suite's CPU tests
with the coalesced ones, barriers and their timeout, DDP, futures. Run with --gates gloo: the tests
PyTorch gates to gloo's name (batched p2p, coalesced all_reduce, barrier timeouts, get_future) run
on tensorwire too, since it replaces gloo (issue 48). Not selected: test_monitored_barrier_gloo
(torch's monitored_barrier refuses every backend but gloo, by name) and tests whose bodies branch
on the backend's name (test_accumulate_gradients_no_sync: "mpi or gloo" builds its CPU model).

The harness runs the suite as PyTorch's runner does, without MASTER_PORT in the environment (it
scrubs the launcher's variables), so the selection's tests pass that way; its ranks are forked from
a forkserver that imported torch and the suite once (`--start forkserver`; `make conformance`
spawns them, as PyTorch's runner does).

A test that fails on today's backend is an xfail(strict=True) with its error: once the backend
passes it, the xfail fails, and the mark goes. The whole suite: `make conformance`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")

# One run of the harness for the module: every item on one xdist worker.
pytestmark = [pytest.mark.torch, pytest.mark.xdist_group("torch_conformance")]

PER_TEST_S = 120

# test -> None (passes today) or why it fails today (an xfail until it passes)
SELECTION: dict[str, str | None] = {
    # point to point
    "test_send_recv": None,
    "test_send_recv_with_tag": None,
    "test_isend": None,
    "test_send_recv_any_source": None,
    "test_batch_isend_irecv_gloo": None,
    # collectives
    "test_broadcast": None,
    "test_reduce_sum": None,
    "test_all_reduce_sum": None,
    "test_all_reduce_sum_complex": None,
    "test_all_gather": None,
    "test_gather": None,
    "test_scatter": None,
    "test_all_gather_coalesced_simple": None,
    "test_all_reduce_coalesced_sum": None,
    "test_scatter_object_list": None,
    # barriers, timeouts
    "test_barrier": None,
    "test_barrier_timeout_full_group": None,
    # DDP
    "test_DistributedDataParallelCPU": None,
    "test_ddp_logging_data_cpu": "DDP's logging data names the backend 'custom': DDP's logger asks torch's "
    "ProcessGroup, not the backend, and ProcessGroup::getBackendName() is "
    'backendTypeToString(CUSTOM) == "custom" for every plugin (ProcessGroup.hpp; '
    "docs/torch.md)",
    # futures
    "test_all_reduce_sum_async": None,
    "test_get_future": None,
}


def conformance(tmp: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp / "conformance"
    cmd = [
        sys.executable,
        "-m",
        "tensorwire.lab.conformance",
        "--backend",
        "tensorwire",
        "--quiet",
        "--out",
        str(out),
        "--log",
        str(tmp / "conformance.log"),
        *args,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the harness ends its runner and ranks (a SIGKILL would orphan them)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
    run = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    summary = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else None
    return run, summary


@pytest.fixture(scope="module")
def selection(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("conformance")
    run, summary = conformance(
        tmp,
        "--gates",
        "gloo",
        "--exact",
        "-k",
        ",".join(SELECTION),
        "--timeout",
        str(PER_TEST_S),
        "--start",
        "forkserver",  # ranks forked from one process that imported torch and the suite: 3-4 s less a rank
        timeout=len(SELECTION) * PER_TEST_S,
    )
    assert summary is not None, f"no summary: exit {run.returncode}\n{run.stderr[-3000:]}"
    assert set(summary["tests"]) == set(SELECTION), "the harness ran another selection"
    assert summary["start"] == "forkserver"
    return summary


@pytest.mark.timeout(len(SELECTION) * PER_TEST_S + 60)  # the first item also waits for the whole run
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=why)) if why else n for n, why in SELECTION.items()],
)
def test_suite_test_passes(selection: dict, name: str) -> None:
    r = selection["tests"][name]
    assert r["outcome"] == "passed", f"{name}: {r['outcome']}: {r.get('error', '')}"


@pytest.mark.timeout(200)
def test_a_test_past_its_limit_is_hung_not_passed(tmp_path: Path) -> None:
    """--timeout: the suite's own mechanism kills the ranks of a test that outlives it, and the harness
    reports it hung (a 1 s limit: the ranks cannot even start in that time), exit status 1."""
    run, summary = conformance(
        tmp_path, "--backend", "gloo", "--exact", "-k", "test_get_rank", "--timeout", "1", timeout=180
    )
    assert summary is not None, run.stderr[-3000:]
    assert summary["tests"]["test_get_rank"]["outcome"] == "hung", summary["tests"]
    assert summary["totals"]["hung"] == 1 and run.returncode == 1


@pytest.mark.timeout(200)
def test_listing_and_bad_input(tmp_path: Path) -> None:
    """--list selects by pattern without running; an unknown --exact name, a bad --env and a backend no
    module registered are usage errors."""
    base = [sys.executable, "-m", "tensorwire.lab.conformance", "--backend", "gloo"]
    listed = subprocess.run(
        base + ["--list", "-k", "test_all_reduce_coalesced_*sum"], capture_output=True, text=True, timeout=180
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    names = [ln.split()[0] for ln in listed.stdout.splitlines() if ln.strip()]
    assert names == [
        "test_all_reduce_coalesced_full_group_sum",
        "test_all_reduce_coalesced_group_sum",
        "test_all_reduce_coalesced_sum",
    ], listed.stdout
    unknown = subprocess.run(
        base + ["--list", "--exact", "-k", "test_no_such_test"], capture_output=True, text=True, timeout=180
    )
    assert unknown.returncode == 2 and "no such test in the suite: test_no_such_test" in unknown.stderr
    bad = subprocess.run(base + ["--env", "NOEQUALS"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "expected KEY=VALUE" in bad.stderr
    nosuch = subprocess.run(
        [sys.executable, "-m", "tensorwire.lab.conformance", "--backend", "nosuch", "--list"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert nosuch.returncode == 2 and "no torch.distributed backend 'nosuch' is registered" in nosuch.stderr
