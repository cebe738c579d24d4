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
"""

from __future__ import annotations

import contextlib
import io
import math
import multiprocessing as mp
import operator
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.fx.passes.split_module import split_module

import tensorwire as tw

POLL_S = 0.25                    # how often a waiting stage checks its peers' liveness
MIN_SLEEP_S, MAX_SLEEP_S = 20e-6, 1e-3
DEPTH = 2                        # static slot buffers per edge: stage k+1 reads one while stage k fills the other


class PartitionError(RuntimeError):
    """Planning or running a partitioned module failed (bad cuts, a stage died, a timeout)."""


# --------------------------------------------------------------------- planning

@dataclass(frozen=True)
class Edge:
    """A tensor that crosses stages: produced by stage `src`, read by stages `dsts`."""
    name: str
    src: int
    dsts: tuple[int, ...]
    kind: str                       # "static" or "dynamic"
    shape: tuple[int, ...] | None   # the example's shape (every example's, if static)
    dtype: str

    @property
    def nbytes(self) -> int:
        if self.shape is None:
            return 0
        return math.prod(self.shape) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass
class Plan:
    """What :func:`plan` decided: the split module, each stage's nodes, the edges."""
    module: torch.fx.GraphModule    # top level: calls submod_0 .. submod_{S-1} in order
    stages: int
    nodes: list[list[str]]          # the original graph's node names per stage
    edges: list[Edge]
    param_bytes: list[int]          # per stage
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
            lines.append(f"  edge {e.name}: stage {e.src} -> {', '.join(map(str, e.dsts))}, {e.kind}, "
                         f"{e.dtype}[{shape}] ({e.nbytes / 2**10:.1f} KiB)")
        return "\n".join(lines)


def _param_bytes(gm: torch.fx.GraphModule, node: torch.fx.Node) -> int:
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
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
            idx = next((i for i, n in enumerate(compute) if n.name == c or str(n.target) == c
                        or (n.op == "call_module" and str(n.target).startswith(c + "."))), None)
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
    return {n: s for s in range(len(bounds) - 1) for n in compute[bounds[s]:bounds[s + 1]]}


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
        return _producer(node.args[0])
    return None


def plan(model: nn.Module, example_inputs: tuple, stages: int = 2, *, cuts: Sequence[str] | None = None,
         other_inputs: Sequence[tuple] = ()) -> Plan:
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
            while e.__cause__ is not None:  # ShapeProp wraps the model's own error
                e = e.__cause__
            raise PartitionError(f"the model fails on the example inputs: {str(e).splitlines()[0]}") from None
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
                raise PartitionError(f"value {a.name!r} crosses from stage {src} to {dst} but is not a tensor; "
                                     f"only tensors may cross stages: cut elsewhere")
            static = all(o[a.name] == meta for o in others)
            old = edges.get(a.name)
            dsts = (old.dsts if old else ()) + (dst,)
            edges[a.name] = Edge(a.name, src, dsts, "static" if static else "dynamic",
                                 meta[0], meta[1])
    inputs = [_meta_of(n) for n in top.graph.nodes if n.op == "placeholder"]
    return Plan(top, S, names, list(edges.values()), pbytes, [m[0] if m else None for m in inputs])


# --------------------------------------------------------------------- allocation sites

class _LinearOut(nn.Module):
    """nn.Linear writing into a fixed (registered) tensor: y = x W^T + b with
    out=. Forward only: out= takes no part in autograd, so it runs without."""

    def __init__(self, linear: nn.Linear, out: torch.Tensor) -> None:
        super().__init__()
        self.linear, self.out = linear, out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.linear.weight, self.linear.bias
        out2 = self.out.view(-1, self.out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            if b is None:
                torch.mm(x2, w.t(), out=out2)
            else:
                torch.addmm(b, x2, w.t(), out=out2)
        return self.out


class _ReluOut(nn.Module):
    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.clamp_min(x, 0, out=self.out)


def _is_relu(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    if n.op == "call_module":
        return isinstance(gm.get_submodule(n.target), nn.ReLU)
    return n.op == "call_function" and n.target in (torch.relu, torch.nn.functional.relu)


def place_outputs(sub: torch.fx.GraphModule, outputs: dict[int, torch.Tensor]) -> set[int]:
    """Rewrites the nodes that produce output positions ``outputs`` (index in
    the submodule's return value -> registered tensor of its shape) to write
    there. Returns the positions rewritten (nn.Linear, ReLU); the others are
    copied at send time."""
    out_node = next(n for n in sub.graph.nodes if n.op == "output")
    ret = out_node.args[0]
    rets = list(ret) if isinstance(ret, (tuple, list)) else [ret]
    done: set[int] = set()
    for i, buf in outputs.items():
        n = rets[i]
        if not isinstance(n, torch.fx.Node) or sum(1 for r in rets if r is n) > 1:
            continue  # the same value twice: one buffer cannot serve two positions
        if n.op == "call_module" and isinstance(sub.get_submodule(n.target), nn.Linear):
            lin = sub.get_submodule(n.target)
            if lin.weight.dtype != buf.dtype or lin.out_features != buf.shape[-1]:
                continue
            name = f"tw_out_{i}"
            sub.add_submodule(name, _LinearOut(lin, buf))
        elif _is_relu(sub, n) and len(n.args) >= 1 and not n.kwargs.get("inplace", False):
            name = f"tw_out_{i}"
            sub.add_submodule(name, _ReluOut(buf))
            n.args = n.args[:1]
        else:
            continue
        n.op, n.target, n.kwargs = "call_module", name, {}
        done.add(i)
    if done:
        sub.recompile()
    return done


# --------------------------------------------------------------------- a stage process

@dataclass
class StageStats:
    stage: int
    steps: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    send_s: float = 0.0
    bytes_sent: int = 0
    sends_zero_copy: int = 0
    sends_copied: int = 0
    t_start: float = 0.0
    t_end: float = 0.0
    outputs: list = field(default_factory=list)  # per step: {output index: numpy} of the outputs this stage produced
    losses: list = field(default_factory=list)   # training, the last stage: the loss of every step
    params: dict = field(default_factory=dict)   # training with collect: this stage's parameters and buffers


def _gather(dev: tw.Device, pending: dict[str, Any], peers: dict[int, str], seen: set[int], timeout: float,
            who: str, step: int) -> dict[str, Any]:
    """Polls every incoming slot, re-polling those not ready (polling-async)
    with a back-off sleep; fails fast when a peer stage is gone."""
    got: dict[str, Any] = {}
    start = time.monotonic()
    next_check, delay = start + POLL_S, MIN_SLEEP_S
    while pending:
        progressed = False
        for name in list(pending):
            try:
                out = pending[name].poll()
            except tw.ConnectionError as e:
                raise PartitionError(f"{who}: the stage sending {name!r} died or left (step {step}): {e}") from None
            if out is not None:
                got[name] = out
                del pending[name]
                progressed = True
        if not pending:
            break
        if progressed:
            delay = MIN_SLEEP_S
            continue
        time.sleep(delay)
        delay = min(2 * delay, MAX_SLEEP_S)
        now = time.monotonic()
        if now >= next_check:
            next_check = now + POLL_S
            alive = {int(p["device_id"]) for p in dev.peers()}
            # a peer counts once it connected (producers attach when they are ready); one that was
            # never seen is the launcher's to judge (it watches every process)
            dead = [d for i, d in peers.items() if i in seen and i not in alive]
            seen.update(i for i in peers if i in alive)
            if dead:
                raise PartitionError(f"{who}: {dead[0]} died or disconnected while waiting for "
                                     f"{', '.join(sorted(pending))} (step {step})")
            if now - start > timeout:
                raise PartitionError(f"{who}: timed out after {timeout:.0f} s waiting for "
                                     f"{', '.join(sorted(pending))} (step {step})")
    return got


def _as_tuple(x: Any) -> tuple:
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


def _slot_tensor(v: Any, e: Edge) -> torch.Tensor:
    """A received value as a torch tensor: a static slot's numpy view or a dynamic slot's block."""
    if e.kind != "static":
        return torch.from_dlpack(v)
    t = torch.from_numpy(v)
    return t.view(torch.bfloat16) if e.dtype == "bfloat16" else t  # numpy holds bfloat16 as raw uint16


class _Split:
    """Time per phase of a step: lap(phase) books the time since the last lap to it."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.spent = {"wait": 0.0, "compute": 0.0, "send": 0.0}

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.spent[phase] += now - self.last
        self.last = now


class _Stage:
    """One stage process: its part of the plan, its slots and senders (set up
    by the constructor, which also meets the launcher and the other stages),
    and the loops of inference and training."""

    def __init__(self, conn: Any, s: int, cfg: dict) -> None:
        self.conn, self.s, self.cfg = conn, s, cfg
        self.who = f"stage {s}"
        self.train = cfg.get("train")
        torch.set_num_threads(cfg["threads"])
        torch.manual_seed(cfg["seed"])
        self.model = cfg["model_fn"]()
        self.model.train(bool(self.train))
        self.data_fn = cfg["inputs_fn"]
        self.micro = self.train["micro_batches"] if self.train else 1
        p = self.plan = plan(self.model, self._example(0), cfg["stages"], cuts=cfg["cuts"],
                             other_inputs=[self._example(i) for i in cfg["probe_steps"]])
        self.sub = p.stage_module(s)
        self.call = next(n for n in p.module.graph.nodes if n.op == "call_module" and n.target == f"submod_{s}")
        self.placeholders = [n.name for n in p.module.graph.nodes if n.op == "placeholder"]
        out_node = next(n for n in p.module.graph.nodes if n.op == "output")
        ret = out_node.args[0]
        self.finals = list(ret) if isinstance(ret, (tuple, list)) else [ret]
        self.incoming = [e for e in p.edges if s in e.dsts]
        self.outgoing = [e for e in p.edges if e.src == s]
        # where each value this stage produces sits in the submodule's return value
        self.rets = [(u.name, u.args[1]) for u in self.call.users
                     if u.op == "call_function" and u.target is operator.getitem]
        self.single = not self.rets
        self.index = dict(self.rets) if self.rets else {self.call.name: 0}
        self.loss_stage = bool(self.train) and any(isinstance(f, torch.fx.Node) and f.name in self.index
                                                   for f in self.finals)
        if self.train and (len(self.finals) != 1 or (self.loss_stage and s != p.stages - 1)):
            raise PartitionError("training needs one model output, made by the last stage")
        self.dev = tw.Device(transport=cfg["transport"])
        dev = self.dev
        # forward: a slot per edge read here; training: a slot per (edge, reader) for the gradients coming back
        self.slots = {e.name: self._slot(f"pp/{e.name}", e) for e in self.incoming}
        self.gslots = ({(e.name, t): self._slot(f"pg/{e.name}/{t}", e) for e in self.outgoing for t in e.dsts}
                       if self.train else {})
        conn.send(("address", dev.address, dev.id))
        msg = conn.recv()
        if msg[0] != "addresses":
            raise SystemExit(0)
        addresses = msg[1]
        to = {t for e in self.outgoing for t in e.dsts} | ({e.src for e in self.incoming} if self.train else set())
        self.peers = {addresses[t][1]: f"stage {t} ({addresses[t][0]})"
                      for t in to | {e.src for e in self.incoming}}
        self.seen: set[int] = set()
        channels = {t: dev.connect(addresses[t][0]) for t in to}
        self.senders = {(e.name, t): self._sender(channels[t], f"pp/{e.name}", e)
                        for e in self.outgoing for t in e.dsts}
        self.gsenders = ({e.name: self._sender(channels[e.src], f"pg/{e.name}/{s}", e) for e in self.incoming}
                         if self.train else {})
        self.stats = StageStats(s)

    def _model_inputs(self, item: Any) -> tuple:
        return _as_tuple(item[0]) if self.train else _as_tuple(item)

    def _example(self, step: int) -> tuple:
        """What the plan propagates: a step's inputs, or its first micro-batch."""
        return micro_example(self._model_inputs(self.data_fn(step)), self.micro)

    def _slot(self, name: str, e: Edge) -> Any:
        # a stage holds every micro-batch's activations until its backward
        return (self.dev.static_slot(name, e.shape, e.dtype, depth=max(DEPTH, self.micro)) if e.kind == "static"
                else self.dev.dynamic_slot(name))

    def _sender(self, ch: Any, name: str, e: Edge) -> Any:
        t = self.cfg["timeout"]
        return (ch.static_sender(name, path="copy", timeout=t) if e.kind == "static"
                else ch.dynamic_sender(name, path="copy", timeout=t))

    def _gather(self, slots: dict, step: int) -> dict:
        return _gather(self.dev, dict(slots), self.peers, self.seen, self.cfg["timeout"], self.who, step)

    def _inputs(self, step: int, micro: int = 1) -> tuple[dict, Any]:
        """(placeholder name -> tensor, target) of a step, when this stage reads them
        (``micro`` micro-batches: the plan's example is the first of them)."""
        needs = any(a.op == "placeholder" for a in self.call.all_input_nodes)
        if not needs and not self.loss_stage:
            return {}, None
        item = self.data_fn(step)
        x = self._model_inputs(item)
        if all(e.kind == "static" for e in self.plan.edges):
            for i, (t, shp) in enumerate(zip(x, self.plan.input_shapes)):
                if shp is not None and micro > 1 and t.shape[0] % micro == 0:
                    shp = (shp[0] * micro,) + tuple(shp[1:])
                if shp is not None and tuple(t.shape) != shp:
                    raise PartitionError(f"{self.who}: input {i} of step {step} has shape {tuple(t.shape)}, the "
                                         f"plan's example {shp}; probe that shape too (plan(other_inputs=...), "
                                         f"run(probe_steps=...), several --batch sizes) so that the edges "
                                         f"whose shapes follow it go dynamic")
        return dict(zip(self.placeholders, x)), (item[1] if self.train else None)

    def _send(self, senders: list, value: torch.Tensor, block: Any = None) -> list:
        reqs = [sd.send(block if block is not None else value.contiguous(), self.cfg["timeout"]) for sd in senders]
        self.stats.sends_zero_copy += len(senders) if block is not None else 0
        self.stats.sends_copied += 0 if block is not None else len(senders)
        self.stats.bytes_sent += len(senders) * value.numel() * value.element_size()
        return reqs

    def _wait(self, reqs: list) -> None:
        for r in reqs:
            r.wait(self.cfg["timeout"])

    def _collect(self, out: Any, outs: list) -> None:
        env_out = {self.call.name: out} if self.single else {n: outs[i] for n, i in self.rets}
        self.stats.outputs.append({j: env_out[f.name].detach().clone().numpy() for j, f in enumerate(self.finals)
                                   if isinstance(f, torch.fx.Node) and f.name in env_out})

    def _book(self, step: int, clock: _Split) -> None:
        if step >= self.cfg["warmup"]:
            self.stats.steps += 1
            self.stats.wait_s += clock.spent["wait"]
            self.stats.compute_s += clock.spent["compute"]
            self.stats.send_s += clock.spent["send"]

    def infer(self) -> None:
        """Forward passes; static outputs written in place into registered blocks (allocation sites)."""
        cfg = self.cfg
        blocks = {e.name: self.dev.empty(e.shape, e.dtype) for e in self.outgoing if e.kind == "static"}
        in_place = place_outputs(self.sub, {self.index[n]: torch.from_dlpack(b) for n, b in blocks.items()})
        for step in range(cfg["steps"]):
            self._step_start(step)
            clock = _Split()
            values = self._gather(self.slots, step)
            clock.lap("wait")
            env, _ = self._inputs(step)
            held = []
            for e in self.incoming:
                env[e.name] = _slot_tensor(values[e.name], e)
                if e.kind == "static":
                    held.append((self.slots[e.name], values[e.name]))
            with torch.no_grad():
                out = self.sub(*[env[a.name] for a in self.call.args])
            clock.lap("compute")
            outs = [out] if self.single else list(out)
            reqs = []
            for e in self.outgoing:
                zero = e.name in blocks and self.index[e.name] in in_place
                reqs += self._send([self.senders[(e.name, t)] for t in e.dsts], outs[self.index[e.name]],
                                   blocks[e.name] if zero else None)
            # the next step rewrites the registered outputs, and an output may be a view of a slot
            # buffer read here: the sends must be done before either
            self._wait(reqs)
            if cfg["collect"]:
                self._collect(out, outs)
            for slot, v in held:
                slot.release(v)
            clock.lap("send")
            self._book(step, clock)

    def fit(self) -> None:
        """Training steps: forward, the gradients of the activations back, an optimizer step per stage."""
        from .. import ps
        cfg, tr = self.cfg, self.train
        params = list(self.sub.parameters())
        opt = ps.make_optimizer(tr["optimizer"], params, **tr["kwargs"]) if params else None
        loss_fn = tr["loss_fn"]
        M = tr["micro_batches"]
        for step in range(cfg["steps"]):
            self._step_start(step)
            clock = _Split()
            env_all, target = self._inputs(step, micro=M)
            parts = {k: torch.tensor_split(v, M) for k, v in env_all.items()}
            targets = torch.tensor_split(target, M) if self.loss_stage else None
            total = sum(len(t) for t in targets) if targets else 0
            held, fwd, reqs = [], [], []
            # GPipe's fill: every micro-batch forward, each sent on at once (the next stage starts on it)
            for m in range(M):
                values = self._gather(self.slots, step)
                clock.lap("wait")
                env, leaves = {k: v[m] for k, v in parts.items()}, {}
                for e in self.incoming:
                    t = _slot_tensor(values[e.name], e)
                    if e.kind == "static":  # held until the step ends: backward reads it; FIFO releases
                        held.append((self.slots[e.name], values[e.name]))
                    # a leaf whose .grad is what goes back to the producer
                    leaves[e.name] = env[e.name] = t.detach().requires_grad_(t.is_floating_point())
                out = self.sub(*[env[a.name] for a in self.call.args])
                outs = [out] if self.single else list(out)
                fwd.append((leaves, out, outs))
                clock.lap("compute")
                for e in self.outgoing:
                    reqs += self._send([self.senders[(e.name, t)] for t in e.dsts],
                                       outs[self.index[e.name]].detach())
                clock.lap("send")
            self._wait(reqs)
            clock.lap("send")
            # the drain: backward in reverse order, gradients accumulating into the parameters
            reqs, step_loss = [], 0.0
            for m in reversed(range(M)):
                leaves, out, outs = fwd[m]
                roots, grads = [], []
                if self.loss_stage:
                    # mean-reduced losses: each micro-batch weighs its share, so the sum is the batch's loss
                    loss = loss_fn(out if self.single else outs[0], targets[m]) * (len(targets[m]) / total)
                    roots.append(loss)
                    grads.append(None)
                    step_loss += float(loss.detach())
                gheld = []
                if self.gslots:
                    clock.lap("compute")
                    back = self._gather(self.gslots, step)
                    clock.lap("wait")
                    for e in self.outgoing:
                        v = outs[self.index[e.name]]
                        gs = [_slot_tensor(back[(e.name, t)], e) for t in e.dsts]
                        gheld += [(self.gslots[(e.name, t)], back[(e.name, t)]) for t in e.dsts
                                  if e.kind == "static"]
                        if v.requires_grad:
                            roots.append(v)
                            grads.append(gs[0] if len(gs) == 1 else torch.stack(gs).sum(0))
                if roots:
                    torch.autograd.backward(roots, grads)
                for slot, v in gheld:
                    slot.release(v)
                clock.lap("compute")
                for e in self.incoming:
                    g = leaves[e.name].grad
                    reqs += self._send([self.gsenders[e.name]],
                                       g if g is not None else torch.zeros_like(leaves[e.name]))
                clock.lap("send")
            if self.loss_stage:
                self.stats.losses.append(step_loss)
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            clock.lap("compute")
            self._wait(reqs)
            for slot, v in held:
                slot.release(v)
            clock.lap("send")
            self._book(step, clock)
        if cfg["collect"]:  # the trained parameters and buffers (batch-norm statistics), as the model names them
            mine = {id(t) for t in params} | {id(t) for t in self.sub.buffers()}
            state = list(self.model.named_parameters()) + list(self.model.named_buffers())
            self.stats.params = {n: t.detach().clone().numpy() for n, t in state if id(t) in mine}

    def _step_start(self, step: int) -> None:
        if step == self.cfg["die_at"]:  # fault injection (tests)
            os._exit(17)
        if step == self.cfg["warmup"]:
            self.stats.t_start = time.monotonic()

    def finish(self) -> None:
        self.stats.t_end = time.monotonic()
        self.conn.send(("result", self.stats))
        self.conn.recv()  # "exit": every stage is done, no slot is read any more


def _stage_main(conn: Any, s: int, cfg: dict) -> None:
    st = None
    try:
        st = _Stage(conn, s, cfg)
        st.fit() if st.train else st.infer()
        st.finish()
    except SystemExit:
        pass
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which fails the run
        msg = str(e) if isinstance(e, (PartitionError, tw.Error)) else f"{type(e).__name__}: {e}\n" \
                                                                         f"{traceback.format_exc()}"
        try:
            conn.send(("error", msg if msg.startswith("stage") else f"stage {s}: {msg}", time.monotonic()))
        except (OSError, EOFError):
            pass
    finally:
        if st is not None:
            st.dev.close()


# --------------------------------------------------------------------- launcher

@dataclass(frozen=True)
class ModelInputs:
    """``inputs_fn`` for the models of tensorwire.torch.models: step -> (x,),
    synthetic as in training; the batch cycles through ``batches`` (more than
    one size: the edges' shapes change from step to step)."""
    model: str
    batches: tuple[int, ...] = (8,)
    seed: int = 0
    image_size: int = 0   # CNNs: 0 is the model's default for CPU runs (as tensorwire train)

    def batch(self, step: int) -> tuple:
        from .. import data
        return data.Synthetic(self.model, self.batches[step % len(self.batches)], self.seed,
                              image_size=self.image_size)(0, step)

    def __call__(self, step: int) -> tuple:
        return _as_tuple(self.batch(step)[0])


@dataclass(frozen=True)
class ModelData(ModelInputs):
    """``data_fn`` for :func:`train`: step -> (inputs, target), synthetic."""

    def __call__(self, step: int) -> tuple:
        return self.batch(step)


@dataclass
class PipelineResult:
    stages: int
    steps: int                       # timed steps (warm-up excluded)
    steps_per_s: float
    plan: str                        # Plan.describe()
    edges: list[dict]
    stage_stats: list[StageStats]
    outputs: list | None             # per step, the model's outputs (numpy), with collect / check
    max_abs_error: float | None      # check: against the same run in one process (outputs; training:
                                     # the final parameters and the losses)
    losses: list | None = None       # training: the loss of every step

    def to_dict(self) -> dict:
        return {"stages": self.stages, "steps": self.steps, "steps_per_s": self.steps_per_s, "edges": self.edges,
                "max_abs_error": self.max_abs_error, "losses": self.losses,
                "stage_stats": [{k: v for k, v in vars(st).items() if k not in ("outputs", "params")}
                                for st in self.stage_stats]}


def run(model_fn: Callable[[], nn.Module], inputs_fn: Callable[[int], Any], *, stages: int = 2,
        cuts: Sequence[str] | None = None, steps: int = 10, warmup: int = 1, transport: str = "auto",
        seed: int = 0, probe_steps: Sequence[int] = (), collect: bool = False, check: bool = False,
        timeout: float = 60.0, threads: int = 1, die: tuple[int, int] | None = None) -> PipelineResult:
    """Runs ``steps`` forward passes of ``model_fn()`` on ``inputs_fn(step)``
    split into stages, one local process each (see the module's doc).
    ``probe_steps``: steps whose inputs also enter the plan's shape analysis
    (edges whose shapes differ between them go dynamic). ``check``: compare
    with the model run in this process. ``die=(stage, step)``: that stage
    exits at that step (tests)."""
    torch.manual_seed(seed)
    p = plan(model_fn().eval(), _as_tuple(inputs_fn(0)), stages, cuts=cuts,
             other_inputs=[_as_tuple(inputs_fn(i)) for i in probe_steps])
    cfg = _config(model_fn, inputs_fn, stages, cuts, steps, warmup, transport, seed, probe_steps,
                  collect or check, timeout, threads)
    st = _launch(p.stages, cfg, die)
    outputs = err = None
    if collect or check:
        merged = [{j: o for x in st for j, o in x.outputs[i].items()} for i in range(steps)]
        outputs = [[m[j] for j in sorted(m)] for m in merged]
    if check:
        torch.manual_seed(seed)
        ref = model_fn().eval()
        err = 0.0
        with torch.no_grad():
            for i in range(steps):
                want = ref(*_as_tuple(inputs_fn(i)))
                want = list(want) if isinstance(want, (tuple, list)) else [want]
                for w_, g in zip(want, outputs[i]):
                    err = max(err, float((w_ - torch.from_numpy(g)).abs().max()) if w_.numel() else 0.0)
    return _result(p, st, outputs, err)


def train(model_fn: Callable[[], nn.Module], data_fn: Callable[[int], Any], *, stages: int = 2,
          cuts: Sequence[str] | None = None, steps: int = 10, warmup: int = 1, transport: str = "auto",
          seed: int = 0, probe_steps: Sequence[int] = (), optimizer: Any = "sgd",
          loss_fn: Callable | None = None, micro_batches: int = 1, check: bool = False, timeout: float = 60.0,
          threads: int = 1, die: tuple[int, int] | None = None, **optimizer_kwargs: Any) -> PipelineResult:
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
    p = plan(model_fn(), micro_example(_as_tuple(data_fn(0)[0]), micro_batches), stages, cuts=cuts,
             other_inputs=[micro_example(_as_tuple(data_fn(i)[0]), micro_batches) for i in probe_steps])
    owners: dict[int, set[int]] = {}
    for s in range(p.stages):
        for prm in p.stage_module(s).parameters():
            owners.setdefault(id(prm), set()).add(s)
    shared = [sorted(v) for v in owners.values() if len(v) > 1]
    if shared:
        raise PartitionError(f"a parameter is used by stages {shared[0]}: weights shared across stages "
                             f"cannot be trained apart; cut elsewhere")
    cfg = _config(model_fn, data_fn, stages, cuts, steps, warmup, transport, seed, probe_steps, check, timeout,
                  threads)
    cfg["train"] = {"optimizer": optimizer, "kwargs": optimizer_kwargs, "micro_batches": micro_batches,
                    "loss_fn": loss_fn or torch.nn.functional.cross_entropy}
    st = _launch(p.stages, cfg, die)
    err = None
    if check:
        torch.manual_seed(seed)
        ref = model_fn()
        opt = ps.make_optimizer(optimizer, [q for q in ref.parameters() if q.requires_grad], **optimizer_kwargs)
        fn = cfg["train"]["loss_fn"]
        losses = []
        for i in range(steps):
            x, y = data_fn(i)
            loss = fn(ref(*_as_tuple(x)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        got = {n: a for x in st for n, a in x.params.items()}
        state = list(ref.named_parameters()) + list(ref.named_buffers())
        err = max(float((q.detach().double() - torch.from_numpy(got[n]).double()).abs().max()) for n, q in state)
        err = max([err] + [abs(a - b) for a, b in zip(losses, st[-1].losses)])
    return _result(p, st, None, err)


def _config(model_fn, inputs_fn, stages, cuts, steps, warmup, transport, seed, probe_steps, collect, timeout,
            threads) -> dict:
    if steps < 1 or warmup < 0 or warmup >= steps:
        raise ValueError(f"need steps >= 1 and 0 <= warmup < steps (got steps={steps}, warmup={warmup})")
    return {"model_fn": model_fn, "inputs_fn": inputs_fn, "stages": stages, "cuts": list(cuts) if cuts else None,
            "steps": steps, "warmup": warmup, "transport": transport, "seed": seed,
            "probe_steps": list(probe_steps), "collect": collect, "timeout": timeout, "threads": threads}


def _launch(stages: int, cfg: dict, die: tuple[int, int] | None) -> list[StageStats]:
    """Spawns the stage processes, hands them each other's addresses, and
    returns their statistics; the first failure of any stage fails the run."""
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    timeout = cfg["timeout"]
    for s in range(stages):
        a, b = ctx.Pipe()
        c = dict(cfg, die_at=die[1] if die and die[0] == s else None)
        pr = ctx.Process(target=_stage_main, args=(b, s, c), name=f"tw-stage-{s}", daemon=True)
        pr.start()
        b.close()  # the child's end: its exit then reads as EOF here
        procs.append(pr)
        conns.append(a)
    try:
        addresses = [_expect(conns[s], procs[s], s, "address", timeout)[1:] for s in range(stages)]
        for c in conns:
            c.send(("addresses", addresses))
        results: dict[int, StageStats] = {}
        deadline = time.monotonic() + timeout * cfg["steps"] + 60
        while len(results) < stages:
            for s in range(stages):
                if s in results:
                    continue
                if conns[s].poll(0.05):
                    try:
                        msg = conns[s].recv()
                    except (EOFError, OSError):
                        procs[s].join(1)
                        raise PartitionError(f"stage {s} exited (code {procs[s].exitcode}) before its result") \
                            from None
                    if msg[0] == "error":
                        raise PartitionError(_root_cause(procs, conns, s, msg))
                    results[s] = msg[1]
                elif not procs[s].is_alive():
                    raise PartitionError(f"stage {s} exited with code {procs[s].exitcode} at no result")
            if time.monotonic() > deadline:
                raise PartitionError("the pipeline did not finish in time")
        for c in conns:
            c.send(("exit",))
        for pr in procs:
            pr.join(10)
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.kill()
                pr.join(5)
    return [results[s] for s in range(stages)]


def _root_cause(procs: list, conns: list, s: int, msg: tuple) -> str:
    """The first failure: of the errors the stages report within a second of
    this one, the earliest (a stage that fails makes its peers fail next), led
    by the death of a stage if one died (that is then usually why)."""
    errors = [(msg[2], msg[1])]
    deadline = time.monotonic() + 1.0
    dead: list = []
    while time.monotonic() < deadline:
        for t, c in enumerate(conns):
            try:
                if t != s and c.poll(0):
                    m = c.recv()
                    if m[0] == "error":
                        errors.append((m[2], m[1]))
            except (EOFError, OSError):
                pass
        dead = [(t, pr.exitcode) for t, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
        if dead:
            break
        time.sleep(0.05)
    first = min(errors)[1]
    return f"stage {dead[0][0]} exited with code {dead[0][1]}; then {first}" if dead else first


def _result(p: Plan, st: list[StageStats], outputs: list | None, err: float | None) -> PipelineResult:
    n = st[0].steps
    wall = max(x.t_end for x in st) - min(x.t_start for x in st)
    return PipelineResult(p.stages, n, n / wall if wall > 0 else float("nan"), p.describe(),
                          [{"name": e.name, "src": e.src, "dsts": list(e.dsts), "kind": e.kind,
                            "shape": list(e.shape) if e.shape else None, "dtype": e.dtype, "bytes": e.nbytes}
                           for e in p.edges], st, outputs, err, st[-1].losses or None)


def _expect(conn: Any, proc: Any, s: int, kind: str, timeout: float) -> tuple:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.05):
        if not proc.is_alive():
            raise PartitionError(f"stage {s} exited with code {proc.exitcode} during setup")
        if time.monotonic() > deadline:
            raise PartitionError(f"stage {s} did not start within {timeout:.0f} s")
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        proc.join(1)
        raise PartitionError(f"stage {s} exited (code {proc.exitcode}) during setup") from None
    if msg[0] == "error":
        raise PartitionError(msg[1])
    if msg[0] != kind:
        raise PartitionError(f"stage {s}: unexpected {msg[0]!r} during setup")
    return msg


__all__ = ["plan", "run", "train", "ModelInputs", "ModelData", "micro_example", "Plan", "Edge", "PipelineResult", "StageStats", "PartitionError", "place_outputs"]
