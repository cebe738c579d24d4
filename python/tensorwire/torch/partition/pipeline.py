"""Running and training a partitioned model: :func:`run` and :func:`train`
(plan, launch the stages, compare with one process) and their result. The
inputs for the paper's models (tensorwire.lab.paper.data.ModelInputs) are the lab's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .graph import PartitionError, Plan, as_tuple, micro_example, plan
from .launch import launch_stages
from .stage import StageStats


@dataclass
class PipelineResult:
    stages: int
    steps: int  # timed steps (warm-up excluded)
    steps_per_s: float
    plan: str  # Plan.describe()
    edges: list[dict]
    stage_stats: list[StageStats]
    outputs: list | None  # per step, the model's outputs (numpy), with collect / check
    max_abs_error: float | None  # check: against the same run in one process (outputs; training:
    # the final parameters and the losses)
    losses: list | None = None  # training: the loss of every step

    def to_dict(self) -> dict:
        return {
            "stages": self.stages,
            "steps": self.steps,
            "steps_per_s": self.steps_per_s,
            "edges": self.edges,
            "max_abs_error": self.max_abs_error,
            "losses": self.losses,
            "stage_stats": [
                {k: v for k, v in vars(st).items() if k not in ("outputs", "params")} for st in self.stage_stats
            ],
        }


def run(
    model_fn: Callable[[], nn.Module],
    inputs_fn: Callable[[int], Any],
    *,
    stages: int = 2,
    cuts: Sequence[str] | None = None,
    steps: int = 10,
    warmup: int = 1,
    transport: str = "auto",
    seed: int = 0,
    probe_steps: Sequence[int] = (),
    collect: bool = False,
    check: bool = False,
    timeout: float = 60.0,
    threads: int = 1,
    die: tuple[int, int] | None = None,
) -> PipelineResult:
    """Runs ``steps`` forward passes of ``model_fn()`` on ``inputs_fn(step)``
    split into stages, one local process each (see the module's doc).
    ``probe_steps``: steps whose inputs also enter the plan's shape analysis
    (edges whose shapes differ between them go dynamic). ``check``: compare
    with the model run in this process. ``die=(stage, step)``: that stage
    exits at that step (tests)."""
    torch.manual_seed(seed)
    p = plan(
        model_fn().eval(),
        as_tuple(inputs_fn(0)),
        stages,
        cuts=cuts,
        other_inputs=[as_tuple(inputs_fn(i)) for i in probe_steps],
    )
    cfg = _config(
        model_fn,
        inputs_fn,
        stages,
        cuts,
        steps,
        warmup,
        transport,
        seed,
        probe_steps,
        collect or check,
        timeout,
        threads,
    )
    st = launch_stages(p.stages, cfg, die)
    outputs = err = None
    if collect or check:
        merged = [{j: o for x in st for j, o in x.outputs[i].items()} for i in range(steps)]
        outputs = [[m[j] for j in sorted(m)] for m in merged]
    if check:
        assert outputs is not None
        torch.manual_seed(seed)
        ref = model_fn().eval()
        err = 0.0
        with torch.no_grad():
            for i in range(steps):
                want = ref(*as_tuple(inputs_fn(i)))
                want = list(want) if isinstance(want, (tuple, list)) else [want]
                for w_, g in zip(want, outputs[i]):
                    err = max(err, float((w_ - torch.from_numpy(g)).abs().max()) if w_.numel() else 0.0)
    return _result(p, st, outputs, err)


def train(
    model_fn: Callable[[], nn.Module],
    data_fn: Callable[[int], Any],
    *,
    stages: int = 2,
    cuts: Sequence[str] | None = None,
    steps: int = 10,
    warmup: int = 1,
    transport: str = "auto",
    seed: int = 0,
    probe_steps: Sequence[int] = (),
    optimizer: Any = "sgd",
    loss_fn: Callable | None = None,
    micro_batches: int = 1,
    check: bool = False,
    timeout: float = 60.0,
    threads: int = 1,
    die: tuple[int, int] | None = None,
    **optimizer_kwargs: Any,
) -> PipelineResult:
    """Trains ``model_fn()`` split into stages on ``data_fn(step) -> (inputs,
    target)``: each step every stage runs its forward and sends its
    activations on; the last stage takes ``loss_fn(output, target)``
    (default cross-entropy); the gradients of the activations go back over
    slots of the same kind, every stage runs its backward and its own
    optimizer (``ps.make_optimizer``) on its own parameters.
    ``micro_batches`` M > 1 splits every batch into M equal parts run as
    GPipe does (every part's forward, each sent on at once, then every part's
    backward in reverse, the gradients accumulating, one optimizer step): the
    stages then work at once instead of in turns; the loss must be a mean
    over the batch. ``check``: compare the losses and the final
    parameters with the same SGD in one process (models with dropout draw
    other masks there)."""
    from .. import ps

    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    torch.manual_seed(seed)
    p = plan(
        model_fn(),
        micro_example(as_tuple(data_fn(0)[0]), micro_batches),
        stages,
        cuts=cuts,
        other_inputs=[micro_example(as_tuple(data_fn(i)[0]), micro_batches) for i in probe_steps],
    )
    owners: dict[int, set[int]] = {}
    for s in range(p.stages):
        for prm in p.stage_module(s).parameters():
            owners.setdefault(id(prm), set()).add(s)
    shared = [sorted(v) for v in owners.values() if len(v) > 1]
    if shared:
        raise PartitionError(
            f"a parameter is used by stages {shared[0]}: weights shared across stages "
            f"cannot be trained apart; cut elsewhere"
        )
    cfg = _config(model_fn, data_fn, stages, cuts, steps, warmup, transport, seed, probe_steps, check, timeout, threads)
    cfg["train"] = {
        "optimizer": optimizer,
        "kwargs": optimizer_kwargs,
        "micro_batches": micro_batches,
        "loss_fn": loss_fn or torch.nn.functional.cross_entropy,
    }
    st = launch_stages(p.stages, cfg, die)
    err = None
    if check:
        torch.manual_seed(seed)
        ref = model_fn()
        opt = ps.make_optimizer(optimizer, [q for q in ref.parameters() if q.requires_grad], **optimizer_kwargs)
        fn = cfg["train"]["loss_fn"]
        losses = []
        for i in range(steps):
            x, y = data_fn(i)
            loss = fn(ref(*as_tuple(x)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        got = {n: a for x in st for n, a in x.params.items()}
        state = list(ref.named_parameters()) + list(ref.named_buffers())
        err = max(float((q.detach().double() - torch.from_numpy(got[n]).double()).abs().max()) for n, q in state)
        err = max([err] + [abs(a - b) for a, b in zip(losses, st[-1].losses)])
    return _result(p, st, None, err)


def _config(
    model_fn, inputs_fn, stages, cuts, steps, warmup, transport, seed, probe_steps, collect, timeout, threads
) -> dict:
    if steps < 1 or warmup < 0 or warmup >= steps:
        raise ValueError(f"need steps >= 1 and 0 <= warmup < steps (got steps={steps}, warmup={warmup})")
    return {
        "model_fn": model_fn,
        "inputs_fn": inputs_fn,
        "stages": stages,
        "cuts": list(cuts) if cuts else None,
        "steps": steps,
        "warmup": warmup,
        "transport": transport,
        "seed": seed,
        "probe_steps": list(probe_steps),
        "collect": collect,
        "timeout": timeout,
        "threads": threads,
    }


def _result(p: Plan, st: list[StageStats], outputs: list | None, err: float | None) -> PipelineResult:
    n = st[0].steps
    wall = max(x.t_end for x in st) - min(x.t_start for x in st)
    return PipelineResult(
        p.stages,
        n,
        n / wall if wall > 0 else float("nan"),
        p.describe(),
        [
            {
                "name": e.name,
                "src": e.src,
                "dsts": list(e.dsts),
                "kind": e.kind,
                "shape": list(e.shape) if e.shape else None,
                "dtype": e.dtype,
                "bytes": e.nbytes,
            }
            for e in p.edges
        ],
        st,
        outputs,
        err,
        st[-1].losses or None,
    )
