"""Smoke tests of `tensorwire bench latency|bw` and `tensorwire info` at tiny sizes: each spawns
its own peer on loopback, writes the JSON report, and must end with a PASS/WARN verdict."""

import json
import subprocess
import sys

import pytest

TRANSPORTS = ["tcp", "shm"]


def run_cli(*args, timeout=120):
    proc = subprocess.run([sys.executable, "-m", "tensorwire", *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("extra", [[], ["--bidirectional"], ["--op", "read"], ["--lanes", "2"]],
                         ids=["write", "bidir", "read", "lanes2"])
def test_bench_bw(tmp_path, transport, extra):
    out = tmp_path / "bw.json"
    text = run_cli("bench", "bw", "--transport", transport, "--sizes", "4K,2M", "--iters", "50",
                   "--json", str(out), *extra)
    assert "BW average[MB/sec]" in text
    report = json.loads(out.read_text())
    assert report["verdict"] in ("PASS", "WARN")
    assert [r["size"] for r in report["rows"]] == [4096, 2 << 20]
    for row in report["rows"]:
        assert row["iters"] == 50 and row["bw_MBps"] > 0


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("op", ["write", "read"])
def test_bench_latency(tmp_path, transport, op):
    out = tmp_path / "lat.json"
    text = run_cli("bench", "latency", "--transport", transport, "--op", op, "--sizes", "8,2M", "--iters", "200",
                   "--json", str(out))
    assert "t_typical[usec]" in text
    report = json.loads(out.read_text())
    assert report["verdict"] in ("PASS", "WARN")
    for row in report["rows"]:
        lat = row["lat_us"]
        assert 0 < lat["min"] <= lat["p50"] <= lat["p99"] <= lat["max"]
        assert row["rtt"] == (op == "read")


@pytest.mark.parametrize("bench", ["bw", "latency"])
def test_bench_plot(tmp_path, bench):
    pytest.importorskip("matplotlib")
    png = tmp_path / f"{bench}.png"
    text = run_cli("bench", bench, "--transport", "shm", "--sizes", "8,4K", "--iters", "50", "--plot", str(png))
    assert "plot written to" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_bad_sizes():
    proc = subprocess.run([sys.executable, "-m", "tensorwire", "bench", "bw", "--sizes", "12Q"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "bad size" in proc.stderr


def test_info_names_the_loaded_ucx():
    data = json.loads(run_cli("info", "--json"))
    assert data["ucx_version"] and data["ucx_library"].endswith(tuple(f"libucp.so{s}" for s in ("", ".0")))
    assert any(t.startswith("tcp") for t in data["transports"])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("progress", ["inline", "blocking"])
def test_slot_latency_bench(tmp_path, transport, progress):
    out = tmp_path / "slot.json"
    proc = subprocess.run([sys.executable, "-m", "tensorwire.bench.slot_latency", "--transport", transport,
                           "--sizes", "8,4K", "--iters", "200", "--progress", progress, "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["progress"] == progress
    assert [r["size"] for r in report["rows"]] == [8, 4096]
    for row in report["rows"]:
        assert 0 < row["lat_us"]["min"] <= row["lat_us"]["p50"] <= row["lat_us"]["max"]
