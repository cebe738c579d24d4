"""`tensorwire bench tensor --memory cuda` (tensorwire/lab/fabric/tensor/cuda.py).

On a machine without a CUDA GPU: the command refuses with exit 2 and says
why, the series are checked against --memory, the host bench keeps its
default, and the GPU series' machinery (checker, page-locking, one-way times,
targets, table) runs with CPU torch tensors standing in for GPU ones. The
tests marked gpu run the real series and skip, saying so, without a GPU.
"""

from __future__ import annotations

import importlib.util
import io
import json
import queue
import re
import time
from argparse import Namespace
from contextlib import redirect_stdout

import pytest

from tensorwire import cli
from tensorwire.lab.fabric import tensor as bt
from tensorwire.lab.fabric.common import BenchError, Report
from tensorwire.lab.fabric.tensor import cuda, harness, registry
from tensorwire.ranks.roles import Roles

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (pip install torch)")


def _has_gpu() -> bool:
    if not HAS_TORCH:
        return False
    import torch

    return torch.cuda.is_available()


HAS_GPU = _has_gpu()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU (torch.cuda.is_available() is False)")
CUDA_ORDER = ["zerocopy", "dynamic", "staged", "gloo", "cuda_ipc"]


# --- the command line ---------------------------------------------------------------------------


def test_help_mentions_memory(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "tensor", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--memory {host,cuda}" in out and "cuda_ipc" in out and "staged" in out


def test_memory_cuda_without_a_gpu_exits_2(monkeypatch, capsys):
    if HAS_TORCH:
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        want = "tensorwire bench tensor --memory cuda needs a CUDA GPU (torch.cuda.is_available() is False)\n"
    else:
        want = "tensorwire bench tensor --memory cuda needs torch: pip install tensorwire[torch]\n"
    assert cli.main(["bench", "tensor", "--memory", "cuda", "--sizes", "4K"]) == 2
    assert capsys.readouterr().err == want


def test_series_are_checked_against_the_memory(capsys):
    assert cli.main(["bench", "tensor", "--memory", "cuda", "--series", "zerocopy,copy"]) == 2
    assert (
        "series copy not available with --memory cuda; choose from zerocopy, dynamic, staged, gloo, cuda_ipc"
        in capsys.readouterr().err
    )
    assert cli.main(["bench", "tensor", "--series", "staged"]) == 2  # --memory host, the default
    assert "series staged not available with --memory host" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "tensor", "--memory", "cuda", "--series", "nope"])
    assert "unknown series nope" in capsys.readouterr().err


def test_registry_by_memory():
    assert bt.select_series(None, "cuda") == CUDA_ORDER
    assert bt.select_series("cuda_ipc,zerocopy", "cuda") == ["zerocopy", "cuda_ipc"]
    assert bt.select_series(None) == list(bt.SERIES_ORDER)  # the host's, as before
    assert bt.series_class("zerocopy", "cuda") is bt.CudaZeroCopy
    assert bt.series_class("zerocopy") is bt.ZeroCopy
    assert bt.series_class("gloo", "cuda").fixed_transport == "tcp"
    args = cli.build_parser().parse_args(["bench", "tensor"])
    assert args.memory == "host" and args.series is None


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal on a machine without a GPU")
def test_cuda_series_are_unavailable_without_a_gpu():
    for name in CUDA_ORDER:
        why = bt.series_class(name, "cuda").unavailable()
        assert why and ("torch.cuda.is_available() is False" in why or "torch is not installed" in why), why


def test_host_bench_is_unchanged_by_default(tmp_path):
    out = tmp_path / "host.json"
    rc = cli.main(
        [
            "bench",
            "tensor",
            "--series",
            "socket",
            "--sizes",
            "4K",
            "--iters",
            "10",
            "--warmup",
            "2",
            "--timeout",
            "20",
            "--verify",
            "--json",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert rc == 0 and report["verdict"] == "PASS", report["checks"]
    assert report["config"]["memory"] == "host"
    (row,) = report["rows"]
    assert row["verified"] == row["iters"] + row["warmup"]
    assert not {"oneway_us", "oneway_MBps", "first_verified"} & set(row)  # no GPU columns on the host


# --- the GPU machinery, with CPU tensors ------------------------------------------------------


class FakeCudart:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes))
        return 1 if self.fail else 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


class FakeHostTensor:
    def __init__(self, ptr: int, nbytes: int, pinned: bool = False) -> None:
        self.ptr, self.nbytes, self.pinned = ptr, nbytes, pinned

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.nbytes

    def element_size(self):
        return 1

    def is_pinned(self):
        return self.pinned


def test_pins_lock_each_page_once_and_unlock_them():
    P = cuda.PAGE
    rt = FakeCudart()
    pins = cuda.Pins(rt)
    pins.pin(FakeHostTensor(10 * P + 100, 50))
    assert rt.calls == [("register", 10 * P, P)]  # whole pages around the tensor
    pins.pin(FakeHostTensor(10 * P + 100, 50))
    assert len(rt.calls) == 1  # already locked: no CUDA call (it runs on every receive)
    # shares page 10, whose lock makes is_pinned() true: still pages 11 and 12
    pins.pin(FakeHostTensor(10 * P + 200, 2 * P, pinned=True))
    assert rt.calls[-1] == ("register", 11 * P, 2 * P)
    pins.pin(FakeHostTensor(40 * P, P, pinned=True))  # locked by someone else: left to them
    assert len(rt.calls) == 2
    pins.clear()
    assert rt.calls[2:] == [("unregister", 10 * P), ("unregister", 11 * P)]
    assert pins.ranges == [] and pins.known == []
    pins.clear()  # nothing left: no calls
    assert len(rt.calls) == 4
    with pytest.raises(BenchError, match="cudaHostRegister"):
        cuda.Pins(FakeCudart(fail=True)).pin(FakeHostTensor(P, 8))


@needs_torch
def test_cuda_checker_on_cpu_tensors():
    import torch

    n = 1024
    ch = cuda.CudaChecker(n * 4, 3, verify=False, serial=True, device="cpu")
    t = cuda.pattern(n, "cpu")
    t[0] = 1.0
    ch.consume(t)
    t[0] = 2.0
    t[7] = 0.5  # not compared: only the first tensor is, without --verify
    ch.consume(t)
    ch.consume(t)  # stale: max is 2, not 3
    res = ch.result()
    assert res["received"] == 3 and res["first_verified"] is True and len(res["arrived"]) == 3
    assert res["errors"] == ["transfer 2: max 2.0 != 3.0 (stale or corrupted tensor)"]

    ch = cuda.CudaChecker(n * 4, 3, verify=True, device="cpu")
    t = cuda.pattern(n, "cpu")
    t[0] = 1.0
    ch.consume(t)
    t[0], t[9] = 2.0, 0.25
    ch.consume(t)
    ch.consume(torch.zeros(n, dtype=torch.float64))
    res = ch.result()
    assert res["verified"] == 1 and "arrived" not in res
    assert res["errors"][0] == "transfer 1: 1 element(s) differ, the first at index 9"
    assert res["errors"][1].startswith("transfer 2: got torch.float64[1024]")


# Two stand-ins for GPU series, run by the real harness with the receiver in
# a thread of this process (it sees them): tensors go through a queue, cloned
# as a slot would land them.
WIRE: "queue.Queue" = queue.Queue()
ACKS: "queue.Queue" = queue.Queue()


class CpuZeroCopy(cuda._Cuda, bt.Series):
    name = "zerocopy"
    device = "cpu"

    @classmethod
    def unavailable(cls):
        return None

    def recv(self):
        return WIRE.get(timeout=self.timeout)

    def ack(self):
        ACKS.put(1)

    def s_prepare(self, size, info):
        return self._gpu_tensor(size)

    def post(self):
        WIRE.put(self.sent.clone())

    def transfer(self):
        self.post()
        ACKS.get(timeout=self.timeout)

    def stamp(self, view, k):
        super().stamp(view, k)
        self.sent = view


class CpuIpc(CpuZeroCopy):
    name = "cuda_ipc"
    fixed_transport = "cuda-ipc"

    def transfer(self):
        t0 = time.perf_counter()
        self.post()
        own = time.perf_counter() - t0
        ACKS.get(timeout=self.timeout)
        return own


def _thread_receiver(self, name, cfg):
    self.roles = Roles()
    self.role = self.roles.thread(f"{name} receiver", harness._receiver_main, name, cfg)
    self.name = name


@needs_torch
def test_harness_runs_gpu_series_with_cpu_stand_ins(monkeypatch, tmp_path, capsys):
    """fill, stamp, the GPU checker, one-way times (from arrivals, or the
    series' own), the stream pass, targets and the table of --memory cuda."""
    monkeypatch.setattr(harness._Receiver, "__init__", _thread_receiver)
    monkeypatch.setitem(registry.CUDA_SERIES, "zerocopy", CpuZeroCopy)
    monkeypatch.setitem(registry.CUDA_SERIES, "cuda_ipc", CpuIpc)
    args = cli.build_parser().parse_args(
        [
            "bench",
            "tensor",
            "--memory",
            "cuda",
            "--series",
            "zerocopy,cuda_ipc",
            "--sizes",
            "4K,1M",
            "--iters",
            "10",
            "--warmup",
            "2",
            "--timeout",
            "20",
            "--verify",
            "--refresh",
            "--cpus",
            "none",
        ]
    )  # the receiver is a thread of this process here: no CPUs of their own
    args.budget = args.budget[0]
    report = bt.run_tensor(args)
    assert report.verdict == "PASS", report.checks
    assert report.config["memory"] == "cuda"
    by = {(r["series"], r["size"]): r for r in report.rows}
    for (series, size), r in by.items():
        assert r["verified"] == r["iters"] + r["warmup"] and r["first_verified"] is True
        assert r["oneway_us"] > 0 and r["oneway_MBps"] == pytest.approx(size / r["oneway_us"])
        assert r["oneway_us"] <= r["median_us"]  # a part of each round trip
    assert by[("zerocopy", 1 << 20)]["stream_MBps"] > 0 and by[("cuda_ipc", 1 << 20)]["transport"] == "cuda-ipc"
    assert by[("cuda_ipc", 4096)]["zerocopy_speedup"] > 0
    (lat,) = [t for t in report.config["targets"] if t.get("unit") == "us"]
    assert lat["at"] == 4096 and lat["anchor_us"] == pytest.approx(by[("cuda_ipc", 4096)]["oneway_us"])
    out = capsys.readouterr().out
    assert "one-way[usec]" in out and "# targets for --memory cuda" in out and "us (bar 25 us)" in out
    # the last line's form; whether the stand-ins meet the one-way bar is the machine's business
    assert re.search(r"^(PASS|MISS) tensor auto cuda zerocopy=", out, re.M) and "one-way@4K: zerocopy" in out


def test_cuda_targets():
    rows = [
        {"series": "zerocopy", "size": 4096, "median_us": 30.0, "oneway_us": 12.0},
        {"series": "cuda_ipc", "size": 4096, "median_us": 25.0, "oneway_us": 8.0},
        {"series": "zerocopy", "size": 16 << 20, "median_us": 100.0, "oneway_us": 60.0},
        {"series": "staged", "size": 16 << 20, "median_us": 1000.0},
        {"series": "gloo", "size": 16 << 20, "median_us": 400.0},
        {"series": "zerocopy", "size": 64 << 20, "median_us": 300.0, "oneway_us": 100.0},
        {"series": "cuda_ipc", "size": 64 << 20, "median_us": 200.0, "oneway_us": 70.0},
        {"series": "staged", "size": 64 << 20, "median_us": 4000.0},
        {"series": "gloo", "size": 64 << 20, "median_us": 20000.0},
    ]
    got = {t["target"]: t for t in bt.targets(rows, "auto", "cuda")}
    assert set(got) == {t[0] for t in bt.CUDA_TARGETS}
    ipc = got["zerocopy >= 0.8x cuda_ipc (one-way MB/s)"]
    assert (ipc["worst"], ipc["at"], ipc["sizes"], ipc["met"]) == (pytest.approx(0.7), 64 << 20, 1, False)
    st = got["zerocopy >= 5x staged"]
    assert (st["worst"], st["at"], st["sizes"], st["met"]) == (pytest.approx(10.0), 16 << 20, 2, True)
    gl = got["zerocopy >= 5x gloo"]
    assert (gl["worst"], gl["at"], gl["met"]) == (pytest.approx(4.0), 16 << 20, False)
    lat = got["zerocopy one-way <= 25 us at 4 KiB"]
    assert (lat["worst"], lat["at"], lat["met"], lat["unit"], lat["anchor_us"]) == (12.0, 4096, True, "us", 8.0)
    assert bt.targets(rows, "shm") == bt.targets(rows, "shm", "host")  # the host's bars, not these

    report = Report("tensor", {"transport": "auto", "memory": "cuda", "targets": bt.targets(rows, "auto", "cuda")})
    for r in rows:
        r.update(transport="tcp" if r["series"] == "gloo" else "auto", iters=10, MBps=r["size"] / r["median_us"])
    bt.speedups(rows)
    report.rows = rows
    buf = io.StringIO()
    with redirect_stdout(buf):
        bt.print_report(report, Namespace(transport="auto", verify=False))
    text = buf.getvalue()
    assert " 4096       cuda_ipc  auto      10       25.00" in text and "8.00" in text
    assert "MISS zerocopy >= 0.8x cuda_ipc (one-way MB/s)" in text
    assert "PASS zerocopy one-way <= 25 us at 4 KiB" in text and "12.00 us (bar 25 us)" in text
    assert "cuda_ipc 8.00 us" in text


# --- on a GPU ------------------------------------------------------------------------------------


def run_cuda(tmp_path, series: str, sizes: str, *extra: str) -> dict:
    out = tmp_path / f"cuda-{series.replace(',', '_')}.json"
    rc = cli.main(
        [
            "bench",
            "tensor",
            "--memory",
            "cuda",
            "--series",
            series,
            "--sizes",
            sizes,
            "--iters",
            "10",
            "--warmup",
            "2",
            "--timeout",
            "60",
            "--json",
            str(out),
            *extra,
        ]
    )
    report = json.loads(out.read_text())
    assert rc == 0 and report["verdict"] == "PASS", report["checks"]
    assert report["config"]["memory"] == "cuda" and report["config"]["unavailable"] == {}
    return report


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("series", CUDA_ORDER)
def test_gpu_series_delivers_every_tensor(tmp_path, series):
    """Each series, serial and stream (1 MiB), every tensor compared on the GPU."""
    report = run_cuda(tmp_path, series, "4K,1M", "--verify")
    rows = {r["size"]: r for r in report["rows"]}
    assert sorted(rows) == [4096, 1 << 20]
    for r in rows.values():
        assert r["series"] == series and r["verified"] == r["iters"] + r["warmup"]
        assert r["first_verified"] is True and r["oneway_us"] > 0
    assert rows[1 << 20]["stream_MBps"] > 0


@pytest.mark.gpu
@needs_gpu
def test_gpu_all_series_anchors_and_targets(tmp_path):
    """All series in one run at 4 KiB and 64 MiB: zerocopy's anchors and
    every --memory cuda target are reported (met or not: a bar, not a check)."""
    report = run_cuda(tmp_path, ",".join(CUDA_ORDER), "4K,64M")
    by = {(r["series"], r["size"]): r for r in report["rows"]}
    assert {s for s, _ in by} == set(CUDA_ORDER)
    zc = by[("zerocopy", 64 << 20)]
    assert zc["write_MBps"] > 0 and zc["memcpy_MBps"] > 0 and zc["transfer_MBps"] > 0
    assert {t["target"] for t in report["config"]["targets"]} == {t[0] for t in bt.CUDA_TARGETS}
    for t in report["config"]["targets"]:
        assert t["met"] == (t["worst"] <= t["bar"] if t.get("unit") == "us" else t["worst"] >= t["bar"])
