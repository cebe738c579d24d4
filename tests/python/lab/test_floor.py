"""The transport floor of a PS step (tensorwire.lab.paper.floor): which flows it
moves, and that it moves them, over tcp and over shared memory."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tensorwire.lab.paper import floor  # noqa: E402

pytestmark = pytest.mark.torch


def test_flows_separate_and_colocated():
    # 2 workers, 2 servers; server 0 holds 1000 B of dense variables and 500 B of sparse ones
    push, pull = [1000, 3000], [1500, 3000]
    n, ps_, pl = floor.flows(push, pull, 2, colocate=False)
    assert n == 4
    assert sorted(ps_) == [(2, 0, 1000), (2, 1, 3000), (3, 0, 1000), (3, 1, 3000)]
    assert sorted(pl) == [(0, 2, 1500), (0, 3, 1500), (1, 2, 3000), (1, 3, 3000)]
    # colocated: process r is worker r and server r; nothing flows inside a process
    n, ps_, pl = floor.flows(push, pull, 2, colocate=True)
    assert n == 2
    assert sorted(ps_) == [(0, 1, 3000), (1, 0, 1000)]
    assert sorted(pl) == [(0, 1, 1500), (1, 0, 3000)]
    # a pair carries a push and a pull of other sizes the same way: its buffer holds the larger
    assert floor.pair_sizes(ps_ + pl) == {(0, 1): 3000, (1, 0): 3000}


@pytest.mark.parametrize("transport", floor.TRANSPORTS)
@pytest.mark.parametrize("colocate", [False, True])
def test_measure_moves_the_bytes(colocate, transport):
    # (over shm, measure() itself fails unless every flow's bytes reached its segment)
    r = floor.measure([1 << 20, 2 << 20], [1 << 20, 2 << 20], 2, colocate, steps=5, transport=transport)
    per_worker = (1 << 20) + (2 << 20)
    expected = 2 * 2 * per_worker if not colocate else 2 * per_worker
    assert r["bytes_per_step"] == expected
    assert 0 < r["min_s"] <= r["median_s"] < 10


def test_a_process_that_only_receives():
    # all-sparse variables: nothing is pushed (sparse pushes are not counted), the workers only receive
    r = floor.measure([0, 0], [1 << 20, 1 << 20], 2, False, steps=3, transport="shm")
    assert r["bytes_per_step"] == 2 * 2 * (1 << 20)


def test_unknown_transport_is_refused():
    with pytest.raises(ValueError, match="tcp or shm"):
        floor.measure([1 << 10], [1 << 10], 1, False, steps=1, transport="rdma")


def test_aggregate_of_no_variables_is_free():
    assert floor.aggregate_s([], 2) == 0.0
    assert floor.aggregate_s([(256, 256), (256,)], 2) > 0


def test_bound_of_a_small_model():
    b = floor.bound("mlp", 4, 2, 2, colocate=False, steps=4)
    assert b["floor_ms"] > 0 and b["compute_ms"] > 0 and b["aggregate_ms"] > 0
    assert b["aggregate_cpu_ms"] >= b["aggregate_ms"]
    assert b["mib_per_step"] > 0
    # sequential: one worker's compute, the floor step and the slowest server's aggregation, in turn
    step_s = (b["compute_ms"] + b["floor_ms"] + b["aggregate_ms"]) / 1e3
    assert b["sequential"] == pytest.approx(2 * 4 / step_s)
    assert b["overlapped"] > 0


def test_bounds_measure_the_floor_once_and_compute_per_batch():
    b1, b8 = floor.bounds("mlp", [1, 8], 2, 2, colocate=False, steps=4, transport="shm")
    assert (b1["batch"], b8["batch"]) == (1, 8) and b1["transport"] == "shm"
    assert b1["floor_ms"] == b8["floor_ms"] and b1["aggregate_ms"] == b8["aggregate_ms"]
    for b in (b1, b8):
        step_s = (b["compute_ms"] + b["floor_ms"] + b["aggregate_ms"]) / 1e3
        assert b["sequential"] == pytest.approx(2 * b["batch"] / step_s)
