"""Planning: a module's forward traced with ``torch.fx``, cut into contiguous
stages, split, and every edge between stages classified static or dynamic
(see the package's doc)."""

from __future__ import annotations

import contextlib
import io
import math
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.fx.passes.split_module import split_module

from ...errors import Error


class PartitionError(Error):
    """Planning or running a partitioned module failed (bad cuts, a stage died, a timeout)."""


@dataclass(frozen=True)
class Edge:
    """A tensor that crosses stages: produced by stage `src`, read by stages `dsts`."""

    name: str
    src: int
    dsts: tuple[int, ...]
    kind: str  # "static" or "dynamic"
    shape: tuple[int, ...] | None  # the example's shape (every example's, if static)
    dtype: str

    @property
    def nbytes(self) -> int:
        if self.shape is None:
            return 0
        return math.prod(self.shape) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass
class Plan:
    """What :func:`plan` decided: the split module, each stage's nodes, the edges."""

    module: torch.fx.GraphModule  # top level: calls submod_0 .. submod_{S-1} in order
    stages: int
    nodes: list[list[str]]  # the original graph's node names per stage
    edges: list[Edge]
    param_bytes: list[int]  # per stage
    input_shapes: list[tuple[int, ...] | None]  # the example's inputs (checked each step when all edges are static)

    def stage_module(self, s: int) -> torch.fx.GraphModule:
        return getattr(self.module, f"submod_{s}")

    def describe(self) -> str:
        lines = [f"{self.stages} stages"]
        for s in range(self.stages):
            names = self.nodes[s]
            shown = ", ".join(names[:6]) + (f", ... ({len(names)} nodes)" if len(names) > 6 else "")
            lines.append(f"  stage {s}: {self.param_bytes[s] / 2**20:.2f} MiB of parameters; {shown}")
        for e in self.edges:
            shape = "?" if e.shape is None else "x".join(str(d) for d in e.shape) or "scalar"
            lines.append(
                f"  edge {e.name}: stage {e.src} -> {', '.join(map(str, e.dsts))}, {e.kind}, "
                f"{e.dtype}[{shape}] ({e.nbytes / 2**10:.1f} KiB)"
            )
        return "\n".join(lines)


def _param_bytes(gm: torch.fx.GraphModule, node: torch.fx.Node) -> int:
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return sum(p.numel() * p.element_size() for p in mod.parameters())
    if node.op == "get_attr":
        t = getattr(gm, str(node.target), None) if "." not in str(node.target) else None
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
    return 0


def _assign(gm: torch.fx.GraphModule, stages: int, cuts: Sequence[str] | None) -> dict[torch.fx.Node, int]:
    """Stage of every compute node: contiguous runs of the graph's (topological) order."""
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    if not compute:
        raise PartitionError("the module's graph has no operations to partition")
    if cuts:
        starts = []
        for c in cuts:
            idx = next(
                (
                    i
                    for i, n in enumerate(compute)
                    if n.name == c
                    or str(n.target) == c
                    or (n.op == "call_module" and str(n.target).startswith(c + "."))
                ),
                None,
            )
            if idx is None:
                known = ", ".join(sorted({str(n.target) for n in compute if n.op == "call_module"})[:12])
                raise PartitionError(f"no node or module named {c!r} to cut before (modules: {known}, ...)")
            starts.append(idx)
        if starts != sorted(starts) or len(set(starts)) != len(starts) or starts[0] == 0:
            raise PartitionError(f"cuts {list(cuts)} must name distinct nodes after the first, in graph order")
    else:
        if stages < 1:
            raise PartitionError(f"stages must be >= 1, got {stages}")
        if stages > len(compute):
            raise PartitionError(f"{stages} stages but the graph has only {len(compute)} operations")
        # balance parameter bytes; every node weighs at least 1 so a parameterless graph splits evenly.
        # Stage k starts at the node whose weight before it is closest to k shares, leaving a node
        # for every later stage.
        w = [max(_param_bytes(gm, n), 1) for n in compute]
        before = [0]
        for wi in w:
            before.append(before[-1] + wi)
        starts = []
        for k in range(1, stages):
            lo = (starts[-1] + 1) if starts else 1
            hi = len(compute) - (stages - k)
            i = min(range(lo, hi + 1), key=lambda i: (abs(before[i] - before[-1] * k / stages), i))
            starts.append(i)
    bounds = [0] + starts + [len(compute)]
    return {n: s for s in range(len(bounds) - 1) for n in compute[bounds[s] : bounds[s + 1]]}


def _meta_of(node: torch.fx.Node) -> tuple[tuple[int, ...], str] | None:
    m = node.meta.get("tensor_meta")
    if m is None or not hasattr(m, "shape"):
        return None
    return tuple(int(d) for d in m.shape), str(m.dtype).replace("torch.", "")


def _producer(node: torch.fx.Node) -> torch.fx.Node | None:
    """The submod call a top-level value comes from (directly or through getitem)."""
    if node.op == "call_module" and str(node.target).startswith("submod_"):
        return node
    if node.op == "call_function" and node.target is operator.getitem:
        src = node.args[0]
        return _producer(src) if isinstance(src, torch.fx.Node) else None
    return None


def plan(
    model: nn.Module,
    example_inputs: tuple,
    stages: int = 2,
    *,
    cuts: Sequence[str] | None = None,
    other_inputs: Sequence[tuple] = (),
) -> Plan:
    """Partitions ``model``'s forward into stages (``len(cuts) + 1`` when cuts are
    given: each names the node or module a new stage begins with). Edges whose
    shape and dtype are equal under ``example_inputs`` and every tuple in
    ``other_inputs`` are static; the others dynamic."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception as e:  # noqa: BLE001 - fx raises many kinds for untraceable code
        raise PartitionError(f"torch.fx cannot trace the model: {e}") from None
    stage_of = _assign(gm, stages, cuts)
    S = max(stage_of.values()) + 1
    names = [[n.name for n in gm.graph.nodes if stage_of.get(n) == s] for s in range(S)]
    pbytes = [sum(_param_bytes(gm, n) for n in gm.graph.nodes if stage_of.get(n) == s) for s in range(S)]
    top = split_module(gm, model, lambda n: stage_of[n], keep_original_order=True)
    subs = [n for n in top.graph.nodes if n.op == "call_module"]
    if [str(n.target) for n in subs] != [f"submod_{s}" for s in range(S)]:
        raise PartitionError("split_module reordered the stages; cut the graph at other nodes")

    def shapes(inputs: tuple) -> dict[str, tuple | None]:
        # in eval mode: the probe must not move batch-norm statistics (the modules are the model's own)
        training = model.training
        top.eval()
        try:
            # ShapeProp prints the traceback of a failing node itself; the error below says it in one line
            with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
                ShapeProp(top).propagate(*inputs)
        except Exception as e:  # noqa: BLE001 - whatever the model raises on these inputs
            err: BaseException = e
            while err.__cause__ is not None:  # ShapeProp wraps the model's own error
                err = err.__cause__
            raise PartitionError(f"the model fails on the example inputs: {str(err).splitlines()[0]}") from None
        finally:
            top.train(training)
        return {n.name: _meta_of(n) for n in top.graph.nodes}

    first = shapes(example_inputs)
    others = [shapes(o if isinstance(o, tuple) else (o,)) for o in other_inputs]
    if others:  # leave the metadata of the example in place
        shapes(example_inputs)
    edges: dict[str, Edge] = {}
    for dst, call in enumerate(subs):
        for a in call.all_input_nodes:
            prod = _producer(a)
            if prod is None:
                continue  # a model input: the stage computes it from inputs_fn
            src = int(str(prod.target).split("_")[1])
            meta = first[a.name]
            if meta is None:
                raise PartitionError(
                    f"value {a.name!r} crosses from stage {src} to {dst} but is not a tensor; "
                    f"only tensors may cross stages: cut elsewhere"
                )
            static = all(o[a.name] == meta for o in others)
            old = edges.get(a.name)
            dsts = (old.dsts if old else ()) + (dst,)
            edges[a.name] = Edge(a.name, src, dsts, "static" if static else "dynamic", meta[0], meta[1])
    inputs = [_meta_of(n) for n in top.graph.nodes if n.op == "placeholder"]
    return Plan(top, S, names, list(edges.values()), pbytes, [m[0] if m else None for m in inputs])


def as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def micro_example(x: tuple, micro: int) -> tuple:
    """The first of `micro` micro-batches of the inputs x (split along dim 0):
    what a plan for training with micro-batches propagates."""
    if micro == 1:
        return x
    for t in x:
        if t.shape[0] % micro:
            raise PartitionError(f"a batch of {t.shape[0]} does not split into {micro} equal micro-batches")
    return tuple(torch.tensor_split(t, micro)[0] for t in x)
