"""Smoke tests of the fabric benchmarks (`bench write_bw|read_bw|write_lat|read_lat|fullmesh`) at tiny
sizes with validation, and unit tests of their sanity checks (verdicts)."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tensorwire.lab.fabric.common import (
    Report,
    check_bw_row,
    check_fairness,
    check_latency_row,
    check_latency_trend,
    jain_index,
    peak_bandwidth_posted,
)

TRANSPORTS = ["tcp", "shm"]


def tw(*args, timeout=90, env=None):
    return subprocess.run(
        [sys.executable, "-m", "tensorwire", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def ok(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("test", ["write_bw", "read_bw"])
def test_bw_smoke_validated(tmp_path, transport, test):
    out = tmp_path / "bw.json"
    text = ok(
        tw("bench", test, "--transport", transport, "-s", "4K,2M", "-n", "40", "-q", "2", "-c", "--json", str(out))
    )
    assert "BW average[MiB/sec]" in text and "MsgRate[Mpps]" in text
    rep = json.loads(out.read_text())
    assert rep["verdict"] in ("PASS", "WARN"), rep["checks"]
    assert [r["size"] for r in rep["rows"]] == [4096, 2 << 20]
    for r in rep["rows"]:
        assert r["iterations"] == 80  # perftest: iters per lane, shown as iters x lanes
        assert r["validation"] == "Pass"
        assert 0 < r["bw_avg_Bps"] <= r["bw_peak_Bps"] * 1.001
        assert len(r["raw"]["completed_us"]) == 80 and len(r["raw"]["posted_us"]) == 80
    assert text.strip().splitlines()[-1].startswith(("PASS", "WARN"))


def test_bw_duration_bidirectional_gbits(tmp_path):
    out = tmp_path / "d.json"
    text = ok(
        tw(
            "bench",
            "write_bw",
            "--transport",
            "tcp",
            "-s",
            "64K",
            "-D",
            "1",
            "-b",
            "-c",
            "--report-gbits",
            "--json",
            str(out),
        )
    )
    assert "BW average[Gb/sec]" in text and "sampled 0.25..0.75 s" in text
    rep = json.loads(out.read_text())
    assert rep["verdict"] in ("PASS", "WARN"), rep["checks"]
    (row,) = rep["rows"]
    assert row["bw_peak"] == 0.0 and row["bw_peak_Bps"] is None  # perftest: no peak in duration mode
    assert row["iterations"] > 0 and row["validation"] == "Pass"
    assert abs(row["bw_Gbps"] - row["bw_average"]) < 1e-9
    assert row["raw"]["peer_per_lane_bins"]  # both sides streamed


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("test", ["write_lat", "read_lat"])
def test_lat_smoke_validated(tmp_path, transport, test):
    out = tmp_path / "lat.json"
    text = ok(tw("bench", test, "--transport", transport, "-s", "8,16K", "-n", "100", "-c", "--json", str(out)))
    assert "t_typical[usec]" in text and "99.9% percentile[usec]" in text
    assert ("full round trip" in text) == (test == "read_lat")
    rep = json.loads(out.read_text())
    assert rep["verdict"] in ("PASS", "WARN"), rep["checks"]
    for r in rep["rows"]:
        lat = r["lat_us"]
        assert 0 < lat["min"] <= lat["p50"] <= lat["p99"] <= lat["p99_9"] <= lat["max"]
        assert r["validation"] == "Pass" and len(r["samples_us"]) == 100
        assert r["rtt"] == (test == "read_lat")


def _rows_after(text, header):
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.strip().startswith(header))
    rows = []
    for line in lines[i + 1 :]:
        parts = line.split()
        if not parts or not parts[0].isdigit():
            break
        rows.append(parts)
    return rows


def test_formats_parse_like_the_anchors():
    osu = ok(tw("bench", "write_bw", "--transport", "shm", "-s", "1K,64K", "-n", "50", "--format", "osu", "-c"))
    rows = _rows_after(osu, "# Size      Bandwidth (MB/s)")
    assert [int(r[0]) for r in rows] == [1024, 65536] and all(float(r[1]) > 0 and r[2] == "Pass" for r in rows)
    imb = ok(tw("bench", "write_lat", "--transport", "shm", "-s", "8,1K", "-n", "50", "--format", "imb"))
    rows = _rows_after(imb, "#bytes #repetitions      t[usec]   Mbytes/sec")
    assert [int(r[0]) for r in rows] == [8, 1024]
    for size, reps, t, mbs in ((int(a), int(b), float(c), float(d)) for a, b, c, d in rows):
        # Mbytes/sec = bytes / t[usec], up to the rounding of the printed t
        # (|t - t_true| <= 0.005, so |size/t - size/t_true| <= size*0.005 / (t*(t-0.005)))
        assert reps == 50 and abs(mbs - size / t) <= size * 0.0051 / (t * (t - 0.0051)) + 0.011
    imb_bw = ok(tw("bench", "read_bw", "--transport", "shm", "-s", "4K", "-n", "50", "--format", "imb"))
    assert _rows_after(imb_bw, "#bytes #repetitions   Mbytes/sec      Msg/sec")
    osu_lat = ok(tw("bench", "read_lat", "--transport", "shm", "-s", "8", "-n", "50", "--format", "osu"))
    assert _rows_after(osu_lat, "# Size       Avg Latency(us)") and "FULL ROUND TRIP" in osu_lat


def test_p2p_between_ranks_under_the_launcher(tmp_path):
    out = tmp_path / "w.json"
    text = ok(
        tw(
            "run",
            "-n",
            "3",
            "--",
            sys.executable,
            "-m",
            "tensorwire",
            "bench",
            "write_bw",
            "--transport",
            "tcp",
            "-s",
            "8K",
            "-n",
            "40",
            "-c",
            "--json",
            str(out),
        )
    )
    rep = json.loads(out.read_text())
    assert rep["config"]["mode"] == "world" and rep["rows"][0]["validation"] == "Pass"
    assert "PASS write_bw tcp" in text or "WARN write_bw tcp" in text


def test_fullmesh_three_ranks(tmp_path):
    out = tmp_path / "fm.json"
    text = ok(
        tw(
            "run",
            "-n",
            "3",
            "--",
            sys.executable,
            "-m",
            "tensorwire",
            "bench",
            "fullmesh",
            "--transport",
            "tcp",
            "-D",
            "1",
            "-q",
            "2",
            "-s",
            "16K",
            "--json",
            str(out),
        )
    )
    assert "jain_fairness" in text and "aggregate[Gb/sec]" in text
    rep = json.loads(out.read_text())
    assert rep["verdict"] in ("PASS", "WARN"), rep["checks"]
    row = rep["rows"][0]
    assert row["flows"] == 6 and len(row["per_flow"]) == 6
    assert {(f["src"], f["dst"]) for f in row["per_flow"]} == {(s, d) for s in range(3) for d in range(3) if s != d}
    assert all(f["iterations"] > 0 and f["lanes"] == 2 for f in row["per_flow"])
    assert abs(sum(h["tx_Gbps"] for h in row["per_rank"]) - row["aggregate_Gbps"]) < 1e-6
    assert abs(sum(h["rx_Gbps"] for h in row["per_rank"]) - row["aggregate_Gbps"]) < 1e-6
    assert 1 / 6 <= row["jain"] <= 1.0


def _pid_of_rank(marker, rank, deadline):
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if f"FULLMESH_TEST_MARK={marker}".encode() in env and f"TENSORWIRE_RANK={rank}".encode() in env:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} did not start")


def test_fullmesh_killed_rank_fails_the_run_naming_it():
    marker = uuid.uuid4().hex
    env = dict(os.environ, FULLMESH_TEST_MARK=marker)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorwire",
            "run",
            "-n",
            "3",
            "--",
            sys.executable,
            "-m",
            "tensorwire",
            "bench",
            "fullmesh",
            "--transport",
            "tcp",
            "-D",
            "30",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pid = _pid_of_rank(marker, 2, time.monotonic() + 30)
        time.sleep(2.0)  # mid-run: connected and streaming
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        out, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "rank 2 was killed by SIGKILL" in err, err
    assert elapsed < 10, elapsed


# ---- rows as they are measured ----


class _Lane:
    def transports(self):
        return ["tcp"]


class _Peer:
    """A peer that answers at once with made-up timings; before measuring size k+1
    it notes what stdout already shows."""

    def __init__(self, out: io.StringIO):
        self.channels, self.out, self.seen = [_Lane()], out, []

    def latency(self, op, size, iters, warmup):
        self.seen.append(self.out.getvalue())
        return [1e-6 * (1 + size / 1e3) * (1 + k % 7 / 100) for k in range(iters)]

    def stream_ops(self, op, size, iters, window, bidir, warmup):
        self.seen.append(self.out.getvalue())
        t = 1e-6 * (1 + size / 1e4)
        return {
            "posted": [k * t for k in range(iters)],
            "completions": [(k + 1) * t for k in range(iters)],
            "seconds": iters * t,
        }, None


@pytest.mark.parametrize(
    "argv",
    [
        ["write_lat", "-s", "8,4K", "-n", "50"],
        ["read_lat", "-s", "8,4K", "-n", "50", "--format", "osu"],
        ["write_bw", "-s", "4K,64K", "-n", "20"],
        ["read_bw", "-s", "4K,64K", "-n", "20", "--format", "imb"],
    ],
)
def test_each_row_prints_when_its_size_is_measured(argv):
    """perftest and OSU print a size's row when it finishes: the header is out
    before the first size is measured and row 1 before size 2 is; the JSON rows
    are the ones the table shows."""
    from tensorwire.cli import build_parser
    from tensorwire.lab.fabric.perftest import measure

    args = build_parser().parse_args(["bench", *argv])
    kind = argv[0].split("_")[1]
    if kind == "bw":
        args.iters = 20
    buf = io.StringIO()
    peer = _Peer(buf)
    with contextlib.redirect_stdout(buf):
        report, _, _ = (measure.measure_bw if kind == "bw" else measure.measure_lat)(args, peer, args.sizes)
    text = buf.getvalue().splitlines()
    rows = [line for line in text if line.split() and line.split()[0].isdigit()]
    assert [int(r.split()[0]) for r in rows] == [row["size"] for row in report.rows] == args.sizes
    before_first, before_second = peer.seen
    assert before_first.strip() and not any(line in before_first for line in rows)  # the header alone
    assert rows[0] in before_second and rows[1] not in before_second
    assert text.index(rows[1]) > text.index(rows[0])
    keys = {"size", "bytes", "iterations", "seconds", "warmup"}
    assert keys <= set(report.rows[0]) and ("lat_us" in report.rows[0]) == (kind == "lat")


def test_fullmesh_sweep_prints_each_world_size_when_it_finishes(tmp_path, monkeypatch, capsys):
    """The scaling table's row of N is out before the run of the next N starts."""
    from tensorwire import cli
    from tensorwire.lab.fabric import fullmesh

    shown = []

    def run(cmd, **_):  # stands in for `tensorwire run -n N -- ... bench fullmesh --json OUT`
        shown.append(capsys.readouterr().out)
        n = int(cmd[cmd.index("-n") + 1])
        row = {
            "ranks": n,
            "flows": n * (n - 1),
            "aggregate_Gbps": 2.0 * n,
            "flow_mean_Gbps": 2.0 / (n - 1),
            "flow_min_Gbps": 1.0 / (n - 1),
            "jain": 1.0,
            "per_flow": [],
            "per_rank": [{"tx_Gbps": 2.0}] * n,
        }
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump({"rows": [row], "checks": [], "verdict": "PASS"}, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fullmesh.subprocess, "run", run)
    out = tmp_path / "fm.json"
    assert cli.main(["bench", "fullmesh", "--sweep-ranks", "2,3", "-D", "1", "--no-progress", "--json", str(out)]) == 0
    rest = capsys.readouterr().out
    row_of = {n: next(line for line in (shown[1] + rest).splitlines() if line.startswith(f" {n}  ")) for n in (2, 3)}
    assert "jain_fairness" in shown[0] and row_of[2] in shown[1] and row_of[3] in rest
    assert row_of[2].split()[:3] == ["2", "2", "4.000"] and row_of[3].split()[:3] == ["3", "6", "6.000"]
    assert [r["ranks"] for r in json.loads(out.read_text())["rows"]] == [2, 3]
    assert rest.splitlines()[-1].startswith("PASS fullmesh_scaling tcp max aggregate=6.000Gb/s@N=3")


# ---- the verdicts' sanity checks ----


def test_avg_above_peak_fails():
    r = Report("t", {})
    check_bw_row(r, 65536, avg=2e9, peak=1e9, msg_rate_mpps=2e9 / 65536 / 1e6)
    assert r.verdict == "FAIL" and "above BW peak" in r.checks[0][1]
    r = Report("t", {})
    check_bw_row(r, 65536, avg=1e9, peak=1.0005e9 / 1.001, msg_rate_mpps=1e9 / 65536 / 1e6)
    assert r.verdict == "PASS"  # within perftest's 0.1%


def test_above_link_rate_fails_and_bidirectional_doubles_it():
    link = 1e9 / 8  # 1 Gbit/s
    r = Report("t", {})
    check_bw_row(r, 1 << 20, avg=1.1 * link, peak=None, msg_rate_mpps=1.1 * link / (1 << 20) / 1e6, link_rate=link)
    assert r.verdict == "FAIL" and "link rate" in r.checks[0][1]
    r = Report("t", {})
    check_bw_row(
        r,
        1 << 20,
        avg=1.9 * link,
        peak=None,
        msg_rate_mpps=1.9 * link / (1 << 20) / 1e6,
        link_rate=link,
        bidirectional=True,
    )
    assert r.verdict == "PASS"


def test_msgrate_iterations_and_nan_checks():
    r = Report("t", {})
    check_bw_row(r, 4096, avg=1e9, peak=None, msg_rate_mpps=1.0)
    assert r.verdict == "FAIL" and "inconsistent" in r.checks[0][1]
    r = Report("t", {})
    check_bw_row(r, 4096, avg=1e9, peak=None, msg_rate_mpps=1e9 / 4096 / 1e6, iters_expected=100, iters_done=99)
    assert r.verdict == "FAIL"
    r = Report("t", {})
    check_bw_row(r, 4096, avg=float("nan"), peak=None, msg_rate_mpps=0)
    assert r.verdict == "FAIL"


def test_non_monotonic_percentiles_fail():
    r = Report("t", {})
    check_latency_row(r, 8, {"min": 1.0, "p50": 2.0, "avg": 2.0, "stdev": 0.1, "p99": 1.5, "p99_9": 3.0, "max": 4.0})
    assert r.verdict == "FAIL" and "non-monotonic" in r.checks[0][1]
    r = Report("t", {})
    check_latency_row(r, 8, {"min": 1.0, "p50": 2.0, "avg": 2.0, "stdev": 0.1, "p99": 3.0, "p99_9": 3.5, "max": 4.0})
    assert r.verdict == "PASS"


def test_latency_below_wire_time_fails():
    r = Report("t", {})
    check_latency_trend(r, [(8, 1.0), (8 << 20, 100.0)], link_rate=1e9 / 8)  # 8 MiB at 1 Gb/s needs 67 ms
    assert r.verdict == "FAIL"
    r = Report("t", {})
    check_latency_trend(r, [(8, 10.0), (4096, 5.0)])
    assert r.verdict == "WARN"


def test_fairness_checks_and_jain():
    assert jain_index([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    r = Report("t", {})
    assert check_fairness(r, [("0->1", 1.0), ("1->0", 0.0)]) == pytest.approx(0.5)
    assert r.verdict == "FAIL"
    r = Report("t", {})
    check_fairness(r, [("a", 1.0), ("b", 1.0), ("c", 0.3)])
    assert r.verdict == "WARN"


def test_peak_is_never_below_the_average():
    posted = [i * 1e-3 for i in range(100)]
    completed = [p + 5e-3 for p in posted]
    avg = 100 * 4096 / (completed[-1] - posted[0])
    for k in (1, 8, 25, 100):
        assert peak_bandwidth_posted(4096, posted, completed, k) >= avg
