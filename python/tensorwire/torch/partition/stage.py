"""A stage process: its part of the plan, its slots and senders, and the loops
of inference and training (:class:`_Stage`, run by :func:`stage_main`)."""

from __future__ import annotations

import json
import operator
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

import tensorwire as tw

from ...ranks.rendezvous import Aborted, Store, TorchStore, gather, publish
from .gather import gather_slots
from .graph import Edge, PartitionError, as_tuple, micro_example, plan
from .sites import place_outputs

DEPTH = 2  # static slot buffers per edge: stage k+1 reads one while stage k fills the other
KEYS = "tensorwire/partition"  # the stages' keys in the launcher's store: stage/<s> (address, device id), error


def meet(store: Store, s: int, stages: int, dev: tw.Device, timeout: float) -> list[tuple[str, int]]:
    """Publishes stage `s`'s device; every stage's (address, device id) once all did
    (PartitionError naming the stages missing after `timeout` s, or at once the words
    of a stage whose set-up failed)."""
    publish(store, f"{KEYS}/stage", s, json.dumps([dev.address, dev.id]))
    try:
        got = gather(
            store,
            f"{KEYS}/stage",
            stages,
            timeout,
            f"publish an address within {timeout:g} s",
            f"{KEYS}/error",
            "stage",
        )
    except (Aborted, tw.Timeout) as e:
        raise PartitionError(f"stage {s}: {e}") from None
    return [tuple(json.loads(a)) for a in got]


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
    losses: list = field(default_factory=list)  # training, the last stage: the loss of every step
    params: dict = field(default_factory=dict)  # training with collect: this stage's parameters and buffers


def _static_shape(e: Edge) -> tuple[int, ...]:
    """A static edge's shape (one for every example; only a dynamic edge may have none)."""
    assert e.shape is not None, e
    return e.shape


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
    by the constructor, which also meets the other stages in the store),
    and the loops of inference and training."""

    def __init__(self, conn: Any, s: int, cfg: dict, store: Store) -> None:
        self.conn, self.s, self.cfg = conn, s, cfg
        self.who = f"stage {s}"
        self.train = cfg.get("train")
        torch.set_num_threads(cfg["threads"])
        torch.manual_seed(cfg["seed"])
        self.model = cfg["model_fn"]()
        self.model.train(bool(self.train))
        self.data_fn = cfg["inputs_fn"]
        self.micro = self.train["micro_batches"] if self.train else 1
        p = self.plan = plan(
            self.model,
            self._example(0),
            cfg["stages"],
            cuts=cfg["cuts"],
            other_inputs=[self._example(i) for i in cfg["probe_steps"]],
        )
        self.sub = p.stage_module(s)
        self.call = next(n for n in p.module.graph.nodes if n.op == "call_module" and n.target == f"submod_{s}")
        self.placeholders = [n.name for n in p.module.graph.nodes if n.op == "placeholder"]
        out_node = next(n for n in p.module.graph.nodes if n.op == "output")
        ret = out_node.args[0]
        self.finals = list(ret) if isinstance(ret, (tuple, list)) else [ret]
        self.incoming = [e for e in p.edges if s in e.dsts]
        self.outgoing = [e for e in p.edges if e.src == s]
        # where each value this stage produces sits in the submodule's return value
        self.rets = [
            (u.name, u.args[1]) for u in self.call.users if u.op == "call_function" and u.target is operator.getitem
        ]
        self.single = not self.rets
        self.index = dict(self.rets) if self.rets else {self.call.name: 0}
        self.loss_stage = bool(self.train) and any(
            isinstance(f, torch.fx.Node) and f.name in self.index for f in self.finals
        )
        if self.train and (len(self.finals) != 1 or (self.loss_stage and s != p.stages - 1)):
            raise PartitionError("training needs one model output, made by the last stage")
        self.dev = tw.Device(transport=cfg["transport"])
        dev = self.dev
        # forward: a slot per edge read here; training: a slot per (edge, reader) for the gradients coming back
        self.slots = {e.name: self._slot(f"pp/{e.name}", e) for e in self.incoming}
        self.gslots = (
            {(e.name, t): self._slot(f"pg/{e.name}/{t}", e) for e in self.outgoing for t in e.dsts}
            if self.train
            else {}
        )
        addresses = meet(store, s, cfg["stages"], dev, cfg["timeout"])
        to = {t for e in self.outgoing for t in e.dsts} | ({e.src for e in self.incoming} if self.train else set())
        self.peers = {addresses[t][1]: f"stage {t} ({addresses[t][0]})" for t in to | {e.src for e in self.incoming}}
        self.seen: set[int] = set()
        channels = {t: dev.connect(addresses[t][0]) for t in to}
        self.watched = list(channels.values())  # every gather fails as soon as one of these stages is gone
        self.senders = {
            (e.name, t): self._sender(channels[t], f"pp/{e.name}", e) for e in self.outgoing for t in e.dsts
        }
        self.gsenders = (
            {e.name: self._sender(channels[e.src], f"pg/{e.name}/{s}", e) for e in self.incoming} if self.train else {}
        )
        self.stats = StageStats(s)

    def _model_inputs(self, item: Any) -> tuple:
        return as_tuple(item[0]) if self.train else as_tuple(item)

    def _example(self, step: int) -> tuple:
        """What the plan propagates: a step's inputs, or its first micro-batch."""
        return micro_example(self._model_inputs(self.data_fn(step)), self.micro)

    def _slot(self, name: str, e: Edge) -> Any:
        # a stage holds every micro-batch's activations until its backward
        return (
            self.dev.static_slot(name, _static_shape(e), e.dtype, depth=max(DEPTH, self.micro))
            if e.kind == "static"
            else self.dev.dynamic_slot(name)
        )

    def _sender(self, ch: Any, name: str, e: Edge) -> Any:
        t = self.cfg["timeout"]
        return (
            ch.static_sender(name, path="copy", timeout=t)
            if e.kind == "static"
            else ch.dynamic_sender(name, path="copy", timeout=t)
        )

    def _gather(self, slots: dict, step: int) -> dict:
        return gather_slots(
            self.dev, dict(slots), self.watched, self.peers, self.seen, self.cfg["timeout"], self.who, step
        )

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
                    raise PartitionError(
                        f"{self.who}: input {i} of step {step} has shape {tuple(t.shape)}, the "
                        f"plan's example {shp}; probe that shape too (plan(other_inputs=...), "
                        f"run(probe_steps=...), several --batch sizes) so that the edges "
                        f"whose shapes follow it go dynamic"
                    )
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
        self.stats.outputs.append(
            {
                j: env_out[f.name].detach().clone().numpy()
                for j, f in enumerate(self.finals)
                if isinstance(f, torch.fx.Node) and f.name in env_out
            }
        )

    def _book(self, step: int, clock: _Split) -> None:
        if step >= self.cfg["warmup"]:
            self.stats.steps += 1
            self.stats.wait_s += clock.spent["wait"]
            self.stats.compute_s += clock.spent["compute"]
            self.stats.send_s += clock.spent["send"]

    def infer(self) -> None:
        """Forward passes; static outputs written in place into registered blocks (allocation sites)."""
        cfg = self.cfg
        blocks = {e.name: self.dev.empty(_static_shape(e), e.dtype) for e in self.outgoing if e.kind == "static"}
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
                reqs += self._send(
                    [self.senders[(e.name, t)] for t in e.dsts],
                    outs[self.index[e.name]],
                    blocks[e.name] if zero else None,
                )
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
        assert tr is not None  # fit runs the stages of a training plan (stage_main)
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
                    reqs += self._send([self.senders[(e.name, t)] for t in e.dsts], outs[self.index[e.name]].detach())
                clock.lap("send")
            self._wait(reqs)
            clock.lap("send")
            # the drain: backward in reverse order, gradients accumulating into the parameters
            reqs, step_loss = [], 0.0
            for m in reversed(range(M)):
                leaves, out, outs = fwd[m]
                roots: list[torch.Tensor] = []
                grads: list[torch.Tensor | None] = []
                if self.loss_stage:
                    assert targets is not None
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
                        gheld += [(self.gslots[(e.name, t)], back[(e.name, t)]) for t in e.dsts if e.kind == "static"]
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
                    reqs += self._send(
                        [self.gsenders[e.name]], g if g is not None else torch.zeros_like(leaves[e.name])
                    )
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


def stage_main(conn: Any, s: int, cfg: dict) -> None:
    st = store = None
    try:
        store = TorchStore.connect(cfg["store"], cfg["timeout"])
        st = _Stage(conn, s, cfg, store)
        st.fit() if st.train else st.infer()
        st.finish()
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which fails the run
        msg = (
            str(e)
            if isinstance(e, (PartitionError, tw.Error))
            else f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        )
        if st is None and store is not None:  # set-up: the stages waiting for this one learn why at once
            try:
                store.set(f"{KEYS}/error", f"stage {s}: {msg}")
            except tw.Error:
                pass
        try:
            conn.send(("error", msg if msg.startswith("stage") else f"stage {s}: {msg}", time.monotonic()))
        except (OSError, EOFError):
            pass
    finally:
        if st is not None:
            st.dev.close()
