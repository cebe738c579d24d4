"""Graph partitioning (tensorwire.torch.partition): the plan's cuts and edge
kinds, the rewritten allocation sites, and pipelines of stage processes that
must reproduce the model's own outputs."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from tensorwire.lab.paper import data, models  # noqa: E402
from tensorwire.torch import partition  # noqa: E402
from tensorwire.torch.partition import PartitionError  # noqa: E402

pytestmark = pytest.mark.torch


class Skip(nn.Module):
    """Two values cross the cut (a skip connection), one of them twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.a(x)
        r = torch.relu(h)
        y = self.b(r) + h
        return self.c(torch.relu(y)), r.sum(dim=1)


def skip_model() -> nn.Module:
    return Skip()


def skip_inputs(step: int):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(6, 16, generator=g),)


def test_plan_balances_parameters_and_classifies_edges():
    m = models.get("fcn5").factory()
    p = partition.plan(m, (torch.randn(4, 784),), stages=2)
    assert p.stages == 2 and len(p.edges) == 1
    e = p.edges[0]
    assert (e.src, e.dsts, e.kind, e.shape, e.dtype) == (0, (1,), "static", (4, 4096), "float32")
    # 12 + 64 MiB against 2 x 64 MiB: the most even contiguous cut of four large layers
    assert max(p.param_bytes) < 0.65 * sum(p.param_bytes)
    assert "static" in p.describe()
    # a batch size that changes from step to step makes the edges dynamic
    p = partition.plan(m, (torch.randn(4, 784),), stages=3, other_inputs=[(torch.randn(8, 784),)])
    assert [e.kind for e in p.edges] == ["dynamic", "dynamic"]


def test_plan_cuts_where_told_and_refuses_bad_cuts():
    m = models.get("alexnet").factory()
    x = (torch.randn(1, 3, 96, 96),)
    p = partition.plan(m, x, cuts=["classifier"])
    assert p.stages == 2
    assert p.nodes[1][0].startswith("classifier") and all(n.startswith("features") for n in p.nodes[0])
    assert p.edges[0].shape == (1, 256, 5, 5)
    with pytest.raises(PartitionError, match="no node or module named 'nope'"):
        partition.plan(m, x, cuts=["nope"])
    with pytest.raises(PartitionError, match="in graph order"):
        partition.plan(m, x, cuts=["classifier", "features"])
    with pytest.raises(PartitionError, match="only 3 operations"):
        partition.plan(models.get("mlp").factory(), (torch.randn(2, 64),), stages=4)
    with pytest.raises(PartitionError, match="fails on the example inputs: .*[Kk]ernel size"):  # the model's own words
        partition.plan(m, (torch.randn(1, 3, 8, 8),), stages=2)


def test_plan_refuses_an_untraceable_model():
    class Branchy(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    with pytest.raises(PartitionError, match="cannot trace"):
        partition.plan(Branchy(), (torch.ones(2),), stages=1)


def test_place_outputs_writes_into_the_given_buffers():
    m = Skip()
    p = partition.plan(m, skip_inputs(0), cuts=["b"])
    sub = p.stage_module(0)
    x = skip_inputs(0)[0]
    want = sub(x)
    bufs = {i: torch.empty_like(t) for i, t in enumerate(want)}
    done = partition.place_outputs(sub, bufs)
    assert done == set(range(len(want)))  # a Linear (h) and a ReLU (r)
    got = sub(x)
    for i, t in enumerate(got):
        assert t.data_ptr() == bufs[i].data_ptr()
        torch.testing.assert_close(t, want[i])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_pipeline_reproduces_the_model(transport):
    r = partition.run(skip_model, skip_inputs, cuts=["b"], steps=6, transport=transport, check=True)
    assert r.max_abs_error < 1e-5  # addmm(out=) may round unlike F.linear, nothing more
    assert r.steps == 5 and r.steps_per_s > 0
    assert len(r.outputs) == 6 and len(r.outputs[0]) == 2
    kinds = {e["name"]: e["kind"] for e in r.edges}
    assert len(kinds) == 2 and set(kinds.values()) == {"static"}
    first = r.stage_stats[0]
    # both crossing values are produced in registered memory (Linear, ReLU): no copy
    assert first.sends_zero_copy == 2 * 6 and first.sends_copied == 0
    assert first.bytes_sent == 6 * 2 * 6 * 32 * 4


def test_pipeline_with_dynamic_edges_follows_the_batch_size():
    inputs = data.ModelInputs("mlp", batches=(3, 7))
    r = partition.run(
        models.get("mlp").factory, inputs, stages=3, steps=6, probe_steps=(1,), transport="shm", check=True
    )
    assert [e["kind"] for e in r.edges] == ["dynamic", "dynamic"]
    assert r.max_abs_error < 1e-5
    assert [o[0].shape[0] for o in r.outputs] == [3, 7, 3, 7, 3, 7]
    assert r.stage_stats[0].sends_copied == 6  # dynamic sends go through the copy path


def test_a_static_plan_refuses_inputs_of_another_shape():
    inputs = data.ModelInputs("mlp", batches=(3, 7))
    with pytest.raises(PartitionError, match="probe|other_inputs"):
        partition.run(models.get("mlp").factory, inputs, stages=2, steps=4, transport="shm", timeout=20)


@pytest.mark.parametrize("dead", [0, 1])
def test_a_dead_stage_fails_the_pipeline_fast(dead):
    t0 = time.monotonic()
    with pytest.raises(PartitionError, match=f"stage {dead}"):
        partition.run(skip_model, skip_inputs, cuts=["b"], steps=20, transport="tcp", die=(dead, 3), timeout=60)
    assert time.monotonic() - t0 < 30


def test_run_checks_its_arguments():
    with pytest.raises(ValueError, match="warmup"):
        partition.run(skip_model, skip_inputs, steps=2, warmup=2)


def test_cli_partition(tmp_path):
    import importlib.util
    import json
    import subprocess
    import sys

    out = tmp_path / "p.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tensorwire",
            "partition",
            "--model",
            "mlp",
            "--stages",
            "2",
            "--batch",
            "4,6",
            "--steps",
            "5",
            "--warmup",
            "1",
            "--transport",
            "tcp",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "dynamic" in r.stdout and "one process" in r.stdout
    d = json.loads(out.read_text())
    assert d["max_abs_error"] < 1e-5 and d["samples_per_s"] > 0 and d["steps"] == 4
    assert [e["kind"] for e in d["edges"]] == ["dynamic"]
    png = tmp_path / "p.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    tr = subprocess.run(
        [
            sys.executable,
            "-m",
            "tensorwire",
            "partition",
            "--model",
            "mlp",
            "--stages",
            "2",
            "--train",
            "--lr",
            "0.1",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--transport",
            "shm",
            "--json",
            str(out),
            *plot,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tr.returncode == 0, tr.stderr
    d = json.loads(out.read_text())
    assert d["train"] and len(d["losses"]) == 4 and d["max_abs_error"] < 1e-5
    assert [st["stage"] for st in d["stage_stats"]] == [0, 1] and all(st["steps"] == 3 for st in d["stage_stats"])
    if plot:  # the per-stage split, the rates and the loss, from the same result as the JSON
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in tr.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "tensorwire", "partition", "--model", "mlp", "--cut", "nope", "--plan"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "no node or module named 'nope'" in bad.stderr and "Traceback" not in bad.stderr


class SkipOne(Skip):
    """One output (training needs one); the skip connection still crosses the cut."""

    def forward(self, x):
        h = self.a(x)
        y = self.b(torch.relu(h)) + h
        return self.c(torch.relu(y))


def skip_one_model() -> nn.Module:
    return SkipOne()


def skip_data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 16, generator=g), torch.randint(0, 4, (6,), generator=g)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_training_in_stages_matches_single_process_sgd(transport):
    r = partition.train(skip_one_model, skip_data, cuts=["b"], steps=6, transport=transport, check=True, lr=0.1)
    assert r.max_abs_error < 1e-5  # final parameters and every step's loss
    assert len(r.losses) == 6
    kinds = {e["name"]: e["kind"] for e in r.edges}
    assert set(kinds.values()) == {"static"} and len(kinds) == 2  # h and relu(h) cross
    # activations forward and their gradients back, every step
    assert r.stage_stats[0].sends_copied == 2 * 6 and r.stage_stats[1].sends_copied == 2 * 6


def test_training_with_dynamic_edges_and_three_stages():
    r = partition.train(
        models.get("mlp").factory,
        data.ModelData("mlp", batches=(3, 5)),
        stages=3,
        steps=6,
        probe_steps=(1,),
        transport="shm",
        check=True,
        optimizer="adam",
        lr=1e-3,
    )
    assert [e["kind"] for e in r.edges] == ["dynamic", "dynamic"]
    assert r.max_abs_error < 1e-5


def test_training_refuses_weights_shared_across_stages():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            return self.a(torch.relu(self.a(x)))

    with pytest.raises(PartitionError, match="shared across stages"):
        partition.train(Tied, lambda step: (torch.randn(2, 8), torch.randint(0, 8, (2,))), stages=2, steps=2)


def test_a_dead_stage_fails_training_fast():
    t0 = time.monotonic()
    with pytest.raises(PartitionError, match="stage 1"):
        partition.train(skip_one_model, skip_data, cuts=["b"], steps=20, transport="tcp", die=(1, 3), timeout=60)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("micro", [2, 3])
def test_micro_batches_match_single_process_sgd(micro):
    # batches of 6 in 2 or 3 micro-batches; the gradients accumulate to the whole batch's
    r = partition.train(
        skip_one_model,
        skip_data,
        cuts=["b"],
        steps=5,
        transport="tcp",
        micro_batches=micro,
        check=True,
        lr=0.1,
        momentum=0.9,
    )
    assert r.max_abs_error < 1e-5
    assert r.stage_stats[0].sends_copied == 2 * micro * 5  # two activations per micro-batch
    assert {tuple(e["shape"]) for e in r.edges} == {(6 // micro, 32)}


def test_micro_batches_must_split_the_batch_evenly():
    with pytest.raises(PartitionError, match="does not split into 4"):
        partition.train(skip_one_model, skip_data, cuts=["b"], steps=2, micro_batches=4)


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.c = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.relu(self.bn(self.a(x))))


def normed_model() -> nn.Module:
    return Normed()


def test_training_with_batch_norm_matches_single_process_sgd():
    # the plan's shape probes run in eval mode: they must not move the batch statistics
    r = partition.train(normed_model, skip_data, cuts=["bn"], steps=4, transport="shm", check=True, lr=0.1)
    assert r.max_abs_error < 1e-5
