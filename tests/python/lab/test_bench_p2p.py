"""Smoke tests of `tensorwire bench latency|bw` (aliases of the family write_lat|read_lat|
write_bw|read_bw, with their older flags) and `tensorwire info` at tiny sizes: each spawns its own
peer on loopback, writes the JSON report, and must end with a PASS/WARN verdict."""

import json
import subprocess
import sys

import pytest

import tensorwire as tw

TRANSPORTS = ["tcp", "shm"]


def run_cli(*args, timeout=120):
    proc = subprocess.run([sys.executable, "-m", "tensorwire", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "extra", [[], ["--bidirectional"], ["--op", "read"], ["--lanes", "2"]], ids=["write", "bidir", "read", "lanes2"]
)
def test_bench_bw(tmp_path, transport, extra):
    out = tmp_path / "bw.json"
    text = run_cli(
        "bench", "bw", "--transport", transport, "--sizes", "4K,2M", "--iters", "50", "--json", str(out), *extra
    )
    assert "BW average[MiB/sec]" in text  # the family's table and unit
    report = json.loads(out.read_text())
    assert report["verdict"] in ("PASS", "WARN")
    op = "read" if "read" in extra else "write"
    assert report["test"] == f"{op}_bw" + ("_bidir" if "--bidirectional" in extra else "")
    assert report["config"]["command"] == "bw" and report["config"]["unit"] == "MiB/sec"
    assert [r["size"] for r in report["rows"]] == [4096, 2 << 20]
    lanes = 2 if "--lanes" in extra else 1
    sides = 2 if "--bidirectional" in extra else 1
    for row in report["rows"]:  # --iters is per lane (perftest -n); the rows count every side's operations
        assert row["iterations"] == 50 * lanes * sides and row["bw_avg_Bps"] > 0
        assert row["bw_average"] == pytest.approx(row["bw_MiBps"])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("op", ["write", "read"])
def test_bench_latency(tmp_path, transport, op):
    out = tmp_path / "lat.json"
    text = run_cli(
        "bench",
        "latency",
        "--transport",
        transport,
        "--op",
        op,
        "--sizes",
        "8,2M",
        "--iters",
        "200",
        "--json",
        str(out),
    )
    assert "t_typical[usec]" in text
    assert ("full round trip" in text) == (op == "read")
    report = json.loads(out.read_text())
    assert report["verdict"] in ("PASS", "WARN")
    assert report["test"] == f"{op}_lat"
    for row in report["rows"]:
        lat = row["lat_us"]
        assert 0 < lat["min"] <= lat["p50"] <= lat["p99"] <= lat["max"]
        assert row["rtt"] == (op == "read") and row["iterations"] == 200


@pytest.mark.parametrize(
    "alias, member, flags",
    [
        (
            ["bw", "--op", "read", "--sizes", "4K", "--iters", "20", "--window", "4", "--raw"],
            "read_bw",
            ["-s", "4K", "-n", "20", "-t", "4"],
        ),
        (
            ["latency", "--sizes", "8", "--iters", "50", "--budget", "1K"],
            "write_lat",
            ["-s", "8", "-n", "50", "--budget", "1K"],
        ),
    ],
    ids=["bw", "latency"],
)
def test_alias_prints_the_family_output(tmp_path, alias, member, flags):
    """The same flags, old spelling or new, give the same table, config and row keys."""
    texts, reports = [], []
    for i, argv in enumerate((alias, [member, *flags])):
        out = tmp_path / f"{i}.json"
        texts.append(run_cli("bench", *argv, "--transport", "shm", "--ucp-workers", "2", "--json", str(out)))
        reports.append(json.loads(out.read_text()))
    a, f = reports
    assert a["test"] == f["test"] == member
    assert a["config"].pop("command") == alias[0] and f["config"].pop("command") == member
    assert a["config"] == f["config"] and a["config"]["workers"] == 2
    assert [sorted(r) for r in a["rows"]] == [sorted(r) for r in f["rows"]]
    assert [r["iterations"] for r in a["rows"]] == [r["iterations"] for r in f["rows"]]

    def header(text):
        return next(line for line in text.splitlines() if line.startswith(" #bytes"))

    assert header(texts[0]) == header(texts[1])
    assert texts[0].splitlines()[-1].split()[1:3] == texts[1].splitlines()[-1].split()[1:3]  # "PASS read_bw shm"


def test_budget_lowers_the_iterations(tmp_path):
    out = tmp_path / "b.json"
    run_cli(
        "bench", "bw", "--transport", "shm", "--sizes", "4K,2M", "--iters", "50", "--budget", "20M", "--json", str(out)
    )
    assert [r["iterations"] for r in json.loads(out.read_text())["rows"]] == [50, 10]


@pytest.mark.parametrize("bench", ["bw", "latency", "write_bw", "read_lat"])
def test_bench_plot(tmp_path, bench):
    pytest.importorskip("matplotlib")
    png = tmp_path / f"{bench}.png"
    text = run_cli("bench", bench, "--transport", "shm", "--sizes", "8,4K", "--iters", "50", "--plot", str(png))
    assert "plot written to" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_bad_sizes():
    for bench in ("bw", "write_bw"):
        proc = subprocess.run(
            [sys.executable, "-m", "tensorwire", "bench", bench, "--sizes", "12Q"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and "bad size" in proc.stderr


def test_info_names_the_loaded_ucx():
    data = json.loads(run_cli("info", "--json"))
    assert data["ucx_version"] and data["ucx_library"].endswith(tuple(f"libucp.so{s}" for s in ("", ".0")))
    assert any(t.startswith("tcp") for t in data["transports"])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("progress", ["inline", "blocking"])
def test_slot_latency_bench(tmp_path, transport, progress):
    out = tmp_path / "slot.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tensorwire.lab.fabric.slot_latency",
            "--transport",
            transport,
            "--sizes",
            "8,4K",
            "--iters",
            "200",
            "--progress-mode",
            progress,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["progress"] == progress
    assert [r["size"] for r in report["rows"]] == [8, 4096]
    assert {r["memory"] for r in report["rows"]} == {"host"}
    for row in report["rows"]:
        assert 0 < row["lat_us"]["min"] <= row["lat_us"]["p50"] <= row["lat_us"]["max"]


def _gpu_missing() -> str | None:
    info = tw.cuda_info()
    return None if info["available"] else info["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_missing() is not None, reason=f"no GPU for tensorwire ({_gpu_missing()})")
def test_slot_latency_bench_in_gpu_memory(tmp_path):
    out = tmp_path / "slot.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tensorwire.lab.fabric.slot_latency",
            "--transport",
            "shm",
            "--sizes",
            "8,4K",
            "--iters",
            "200",
            "--memory",
            "cuda",
            "--series",
            "both",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["memory"] == "cuda"
    assert all(r["memory"].startswith("cuda") for r in report["rows"]), report["rows"]  # not only the config's word
    assert sorted((r["series"], r["size"]) for r in report["rows"]) == [
        ("notify", 8),
        ("notify", 4096),
        ("slot", 8),
        ("slot", 4096),
    ]
    for row in report["rows"]:
        assert 0 < row["lat_us"]["min"] <= row["lat_us"]["p50"] <= row["lat_us"]["max"]


@pytest.mark.skipif(_gpu_missing() is None, reason="this machine has a GPU")
def test_slot_latency_in_gpu_memory_without_a_gpu_exits_2_saying_why():
    proc = subprocess.run(
        [sys.executable, "-m", "tensorwire.lab.fabric.slot_latency", "--memory", "cuda"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--memory cuda: tensorwire sees no GPU" in proc.stderr, proc.stderr
