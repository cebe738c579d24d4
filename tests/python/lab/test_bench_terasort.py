"""bench terasort: TeraGen records byte for byte, the CRC sum, the partitioner, the
TeraValidate checks, and 3-rank runs (tcp, shm, a rank killed mid-run)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from tensorwire.lab.fabric import teragen
from tensorwire.lab.fabric._terasort_core import (
    partition_of,
    pick_splitters,
    sample_keys,
    sort_records,
    summarize,
    validate,
)

# -- an independent, straightforward gensort: Python ints, one LCG step per row --

A = 0x2360ED051FC65DA44385DF649FCCF645  # gensort rand16 / Hadoop Random16 multiplier
C = 0x4A696D47726179524950202020202001  # ... and increment ("JimGrayRIP   \x01")


def reference_record(row: int, rand: int) -> bytes:
    key = rand.to_bytes(16, "big")[:10]
    filler = b"".join(bytes([d]) * 4 for d in b"%012X" % (rand & ((1 << 48) - 1)))
    return key + b"\x00\x11" + (b"%032X" % row) + b"\x88\x99\xaa\xbb" + filler + b"\xcc\xdd\xee\xff"


def reference_records(first: int, count: int) -> list[bytes]:
    x = teragen.rand_of_row(first - 1) if first else 0  # f^first(0)
    out = []
    for r in range(first, first + count):
        x = (A * x + C) % (1 << 128)
        out.append(reference_record(r, x))
    return out


def test_first_records_step_by_step():
    """Rows 0..299 from the sequential LCG, byte for byte (gensort's loop: skip to
    the first row, then next_rand before every record)."""
    want = reference_records(0, 300)
    got = teragen.generate(0, 300)
    for r in range(300):
        assert got[r].tobytes() == want[r], r
    assert got[0, :10].tobytes() == b"JimGrayRIP"  # f(0) = C: the generator's tribute to Jim Gray


# First 6 key bytes of rows 0..5, 10, 64, 128 as published in gensort 1.5's
# Skew_binary table (gensort.c) -- data from the reference, not derived here.
GENSORT_KEY_PREFIXES = {
    0: "4a696d477261",
    1: "95e0e48262b3",
    2: "45979353dbed",
    3: "882a02c31536",
    4: "5c90ab38ae52",
    5: "72dc0ca51e33",
    10: "b3e9689de16b",
    64: "33d5b5b15c70",
    128: "e1dc46b645c4",
}
# Hadoop Random16.genArray[i].c = f^(2^i)(0), the random value of row 2^i - 1 (Random16.java).
HADOOP_GEN_C = {
    1: 0x95E0E48262B3EDFE04479485C755B646,
    9: 0x00BE4A36657C98CD204E8C8AF7DAFE00,
    20: 0x1B25CB9CFE5A0C963174F91A97F00000,
    40: 0xE941A65D66B64BFD71A97F0000000000,
    63: 0x7858CA25FEB8D4BF8000000000000000,
    64: 0xF0B1944BFD71A97F0000000000000000,
}
HADOOP_GEN_A = {9: 0x4A5C31E0654C28AA60474E83BF3F7801, 64: 0x5F0BA18C53CD8FBC0000000000000001}


@pytest.mark.parametrize("row", sorted(GENSORT_KEY_PREFIXES))
def test_key_prefix_matches_gensort_table(row):
    assert teragen.generate(row, 1)[0, :6].tobytes().hex() == GENSORT_KEY_PREFIXES[row]


@pytest.mark.parametrize("i", sorted(HADOOP_GEN_C))
def test_skip_ahead_matches_hadoop_random16(i):
    row = (1 << i) - 1
    rec = teragen.generate(row, 1)[0].tobytes()
    assert rec == reference_record(row, HADOOP_GEN_C[i])
    if i in HADOOP_GEN_A:
        assert teragen.lcg_power(1 << i) == (HADOOP_GEN_A[i], HADOOP_GEN_C[i])


@pytest.mark.parametrize("first", [8191, 123_456_789_012, (1 << 40) + 5, (1 << 64) - 40])
def test_records_far_out_byte_for_byte(first):
    got = teragen.generate(first, 40)
    for j, want in enumerate(reference_records(first, 40)):
        assert got[j].tobytes() == want


def test_layout_constants_and_partitioned_generation():
    recs = teragen.generate(1000, 5000)
    assert (recs[:, 10:12] == (0x00, 0x11)).all()
    assert (recs[:, 44:48] == (0x88, 0x99, 0xAA, 0xBB)).all()
    assert (recs[:, 96:100] == (0xCC, 0xDD, 0xEE, 0xFF)).all()
    assert recs[7, 12:44].tobytes() == b"%032X" % 1007
    filler = recs[:, 48:96].reshape(-1, 12, 4)
    assert (filler == filler[:, :, :1]).all()  # each hex digit 4 times
    # gensort -b0 N + -b N M == gensort -b0 N+M (ranks generate disjoint ranges)
    parts = [teragen.generate(*teragen.split_rows(5000, 3, r)) for r in range(3)]
    assert [teragen.split_rows(5000, 3, r) for r in range(3)] == [(0, 1667), (1667, 1667), (3334, 1666)]
    assert np.array_equal(np.concatenate(parts), teragen.generate(0, 5000))
    assert teragen.generate(0, 0).shape == (0, 100)


def test_checksum_is_sum_of_zlib_crc32(tmp_path):
    recs = teragen.generate(77, 2000)
    crcs = [zlib.crc32(recs[i].tobytes()) for i in range(len(recs))]
    assert list(teragen.crc32_rows(recs)) == crcs
    assert teragen.checksum(recs) == sum(crcs)
    path = tmp_path / "part"
    assert teragen.write_file(str(path), 2000, start=77, chunk=700) == sum(crcs)
    assert path.read_bytes() == recs.tobytes()
    junk = np.random.default_rng(3).integers(0, 256, (500, 100), dtype=np.uint8)
    assert list(teragen.crc32_rows(junk)) == [zlib.crc32(junk[i].tobytes()) for i in range(500)]


# -- partitioner and validator (no processes) --


def _job_in_memory(rows: int = 30_000, parts: int = 3):
    recs = teragen.generate(0, rows)
    splitters = pick_splitters(sample_keys(recs, 1000), parts)
    dest = partition_of(recs, splitters)
    outputs = [sort_records(recs[dest == p]) for p in range(parts)]
    return recs, splitters, outputs


def test_partitioner_is_a_total_order():
    recs, splitters, outputs = _job_in_memory()
    assert splitters.shape == (2, 10)
    assert sum(len(o) for o in outputs) == len(recs)
    for lo_part, hi_part in zip(outputs, outputs[1:]):
        assert lo_part[-1, :10].tobytes() <= hi_part[0, :10].tobytes()
    assert all(len(o) > 0.5 * len(recs) / 3 for o in outputs)


def test_partition_of_compares_all_ten_bytes():
    keys = np.zeros((5, 100), np.uint8)
    prefix = bytes.fromhex("0102030405060708")
    for i, tail in enumerate([b"\x00\x01", b"\x00\x02", b"\x00\x03", b"\xff\xff", b"\x00\x00"]):
        keys[i, :10] = np.frombuffer(prefix + tail, np.uint8)
    splitters = np.array([np.frombuffer(prefix + b"\x00\x02", np.uint8), np.frombuffer(prefix + b"\x00\x03", np.uint8)])
    # first i with splitters[i] > key
    assert list(partition_of(keys, splitters)) == [0, 1, 2, 2, 0]


def test_sort_with_equal_prefixes_and_duplicate_keys():
    recs = teragen.generate(0, 2000)
    recs[:600, :8] = 7  # equal first 8 bytes: the last 2 decide
    recs[600:900, :10] = 3  # fully equal keys: kept in input order (stable)
    got = sort_records(recs)
    from tensorwire.lab.fabric.teragen import keys_of

    hi, lo = keys_of(recs)
    assert np.array_equal(got, recs[np.lexsort((lo, hi))])


def test_validator_passes_a_correct_sort():
    recs, _, outputs = _job_in_memory()
    v = validate([summarize(o, p) for p, o in enumerate(outputs)], len(recs), teragen.checksum(recs))
    assert v.ok, v.errors


def test_validator_catches_a_swapped_pair():
    recs, _, outputs = _job_in_memory()
    bad = outputs[1].copy()
    bad[[100, 101]] = bad[[101, 100]]
    v = validate(
        [summarize(o, p) for p, o in enumerate([outputs[0], bad, outputs[2]])], len(recs), teragen.checksum(recs)
    )
    assert not v.ok
    assert any("misorder in partition 1" in e and "row 101" in e for e in v.errors), v.errors
    assert not any("checksum" in e or "row count" in e for e in v.errors)  # same records, other order


def test_validator_catches_a_pair_swapped_across_partitions():
    recs, _, outputs = _job_in_memory()
    a, b = outputs[0].copy(), outputs[1].copy()
    a[-1], b[0] = outputs[1][0], outputs[0][-1]
    v = validate([summarize(o, p) for p, o in enumerate([a, b, outputs[2]])], len(recs), teragen.checksum(recs))
    assert any("bad key partitioning" in e for e in v.errors), v.errors


def test_validator_catches_a_dropped_record():
    recs, _, outputs = _job_in_memory()
    short = np.delete(outputs[2], 1234, axis=0)
    v = validate(
        [summarize(o, p) for p, o in enumerate([outputs[0], outputs[1], short])], len(recs), teragen.checksum(recs)
    )
    assert any("row count 29999 != 30000" in e for e in v.errors), v.errors
    assert any("checksum" in e for e in v.errors), v.errors


def test_validator_catches_a_corrupted_value_byte():
    recs, _, outputs = _job_in_memory()
    bad = outputs[0].copy()
    bad[5, 60] ^= 0x01  # a value byte: order is intact, only the CRC sum sees it
    v = validate(
        [summarize(o, p) for p, o in enumerate([bad, outputs[1], outputs[2]])], len(recs), teragen.checksum(recs)
    )
    assert [e for e in v.errors if "checksum" in e] and len(v.errors) == 1, v.errors


# -- whole runs: 3 ranks (odd) --


def _terasort(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tensorwire", "bench", "terasort", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_three_ranks_sort_and_validate(transport, tmp_path):
    out = tmp_path / "ts.json"
    # pairs exchange ~0.8 MB: 300 KB chunks send each partition in several pieces
    r = _terasort(
        "--rows",
        "25k",
        "--ranks",
        "3",
        "--transport",
        transport,
        "--baseline",
        "tcp",
        "--chunk",
        "300K",
        "--samples",
        "3000",
        "--json",
        str(out),
        "--output",
        str(tmp_path / "out"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(rf"^PASS terasort {transport} 25000 rows", r.stdout, re.M), r.stdout
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS"
    assert (
        rep["config"]["checksum"]
        == rep["config"]["gen_checksum"]
        == f"{teragen.checksum(teragen.generate(0, 25_000)):x}"
    )
    assert sum(rep["config"]["partition_rows"]) == 25_000
    phases = {row["phase"]: row for row in rep["rows"]}
    assert set(phases) == {"teragen", "partition", "shuffle", "shuffle_tcp", "sort", "validate"}
    assert phases["shuffle"]["bytes"] == phases["shuffle_tcp"]["bytes"] > 0
    # with a baseline the default is 5 rounds each, alternating (one round is one noisy sample)
    assert rep["config"]["repeat"] == 5
    assert len(phases["shuffle"]["rounds_seconds"]) == len(phases["shuffle_tcp"]["rounds_seconds"]) == 5
    assert all(row["seconds"] > 0 and row["MBps"] > 0 for row in rep["rows"])
    # the part files, in rank order, are exactly the generated records sorted
    whole = b"".join((tmp_path / "out" / f"part-r-{r:05d}").read_bytes() for r in range(3))
    assert whole == sort_records(teragen.generate(0, 25_000)).tobytes()


@pytest.mark.parametrize("inject, words", [("swap", "misorder in partition 2"), ("drop", "row count 9999 != 10000")])
def test_validation_failure_fails_the_run(inject, words):
    r = _terasort("--rows", "10k", "--ranks", "3", "--transport", "tcp", "--inject", inject)
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(rf"^FAIL terasort tcp .*{words}", r.stdout, re.M), r.stdout


def test_empty_partition_is_signalled():
    r = _terasort("--rows", "2", "--ranks", "3", "--transport", "shm", "--baseline", "tcp")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# partitions (rows per rank): 1 0 1" in r.stdout
    assert re.search(r"^PASS terasort shm 2 rows", r.stdout, re.M), r.stdout


def test_killed_rank_fails_the_run_naming_it():
    t0 = time.monotonic()
    r = _terasort("--rows", "20k", "--ranks", "3", "--transport", "tcp", "--kill-rank", "1", "--kill-phase", "shuffle")
    ended = time.time()
    assert r.returncode != 0
    assert "rank 1 was killed by SIGKILL" in r.stderr, r.stderr
    killed_at = float(re.search(r"kills itself at the start of shuffle \(t=([0-9.]+)\)", r.stderr).group(1))
    assert ended - killed_at < 10, (ended - killed_at, r.stderr)
    assert time.monotonic() - t0 < 40
