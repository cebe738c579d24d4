"""Graph partitioning: a module's forward split into pipeline stages, one
process per stage, every tensor that crosses stages moved over tensorwire
slots (the paper's graph analysis, §3.3-3.4, for a PyTorch forward).

:func:`plan` traces the module with ``torch.fx``, cuts its nodes into contiguous
stages (balanced by parameter bytes, or before the nodes you name), splits it
with ``torch.fx.passes.split_module`` and classifies every edge between stages
by shape propagation: **static** when its shape and dtype are known before
execution (the same under every example input given), **dynamic** otherwise.
:func:`run` then starts one process per stage. Before the first step each
stage pre-allocates a static slot (depth 2) in registered memory for each
static edge it receives and a dynamic slot for each dynamic one; its senders
attach to them (the slots' attach calls are the only control traffic, the
addresses exchange). A stage's node whose output crosses a static edge is
rewritten to write that output into a registered block (the allocation site:
``nn.Linear`` and ReLU), so that send copies nothing; any other output crossing
stages is copied into the pool first, and the statistics say which ran. Each
step a stage polls its incoming slots in turn and re-polls the ones not ready
(polling-async), runs its part, and sends its outputs.

    from tensorwire.torch import partition
    p = partition.plan(model, (x,), stages=2)          # or cuts=["classifier.1"]
    print(p.describe())
    result = partition.run(model_fn, inputs_fn, stages=2, steps=20, check=True)
    trained = partition.train(model_fn, data_fn, stages=2, steps=20, lr=0.01, check=True)

:func:`train` trains instead: the gradients of the activations go back over
slots of the same kinds, every stage steps its own optimizer, optionally over
GPipe micro-batches (docs/partition.md). Every stage process builds the model
with ``model_fn()`` after ``torch.manual_seed(seed)``, so the weights must be a
function of that seed (or loaded from a file).

The package, one job per file: ``graph.py`` plans (traces, cuts, splits,
classifies the edges); ``sites.py`` rewrites a stage's nodes to write into
registered blocks; ``stage.py`` is a stage process and ``gather.py`` its wait
for the incoming slots; ``launch.py`` spawns the stage processes and collects
their results; ``pipeline.py`` holds :func:`run` and :func:`train`.
"""

from .graph import Edge, PartitionError, Plan, micro_example, plan
from .pipeline import PipelineResult, run, train
from .sites import place_outputs
from .stage import StageStats

__all__ = [
    "plan",
    "run",
    "train",
    "micro_example",
    "Plan",
    "Edge",
    "PipelineResult",
    "StageStats",
    "PartitionError",
    "place_outputs",
]
