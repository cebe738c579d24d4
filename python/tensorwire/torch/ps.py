"""Data-parallel training in the parameter-server architecture, over tensorwire slots.

W workers each hold a replica of the model; S servers each own the variables
placed on them round-robin (variable i lives on server i mod S). One synchronous
SGD step:

1. every worker computes the gradients of its batch (forward + backward);
2. it pushes each gradient into a static slot ``grad/<var>/<worker>`` on the
   variable's server (sparse embedding gradients: indices then values into the
   dynamic slot ``sgrad/<var>/<worker>``);
3. a server sums the W gradients of a variable as they arrive, averages them,
   applies its ``torch.optim`` optimizer to its master copy and writes the new
   value straight into every worker's parameter memory: the static slot
   ``param/<var>`` on each worker, whose buffer *is* the parameter's storage;
4. the worker waits until all its parameters arrived, and takes the next step.

Modes (how the sending side holds its tensors):

``zerocopy``  parameters, ``.grad`` tensors and the servers' master copies live
              in registered memory, allocated once at setup; the backward of
              every ``nn.Linear`` writes its gradients straight there
              (:mod:`.alloc_sites`), autograd accumulates into it for other
              parameters, and every push and pull sends the block itself:
              nothing is copied.
``copy``      the same protocol, but the tensors a process sends are ordinary
              torch memory (autograd's fresh gradients, PyTorch's default),
              copied into a registered staging block before each send (the
              paper's "graph analysis turned off").
``gloo``      the same algorithm over ``torch.distributed`` (gloo) send/recv of
              autograd's fresh gradients, the RPC-style baseline.

Use :func:`train` to run everything locally (spawned processes), or
:class:`Server` / :class:`Worker` in processes you start yourself::

    server = ps.Server(rank=0, num_servers=1, num_workers=2, optimizer="sgd", lr=0.1)
    server.run()                                     # until the workers leave

    worker = ps.Worker(model, [server_address], rank=0, num_workers=2)
    for x, y in batches:
        loss = worker.step(lambda: F.cross_entropy(model(x), y))
    worker.close()
"""

from __future__ import annotations

import collections
import inspect
import json
import math
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

import tensorwire as tw

from . import alloc_sites

MODES = ("zerocopy", "copy", "gloo")
POLL_S = 0.25           # how often a waiter looks at its peers' liveness
GOODBYE_NAP_S = 1e-3  # between looks at a slot whose sender said goodbye
BYE_GRACE_S = 10.0      # after a worker's goodbye, how long a server waits for the others to finish
WAIT = "wait"           # a give-up check's answer: that worker left on purpose, keep waiting for the rest
# glibc malloc: keep big freed blocks in the heap instead of unmapping them. The
# tensors autograd allocates every step (activations, fresh gradients) then reuse
# memory that is already mapped, instead of page-faulting hundreds of MiB of fresh
# zero pages per step (3x the backward time of FCN-5 on a CPU). Set for every
# spawned role of every mode (an existing value in the environment wins).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
DEFAULT_TIMEOUT_S = 120.0  # a step (or setup) that takes longer fails


def _mean_into(acc: torch.Tensor, g: torch.Tensor, w: int) -> None:
    """acc holds the mean of w gradients; makes it the mean of w + 1 with g, in
    one pass (lerp: acc + (g - acc) / (w + 1)) instead of a scale and a sum."""
    acc.lerp_(g, 1.0 / (w + 1))


class PSError(RuntimeError):
    """The parameter-server run failed (a peer died, a model mismatch, a timeout)."""


# --------------------------------------------------------------------- variables

@dataclass(frozen=True)
class VarSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    sparse: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_json(self) -> list:
        return [self.name, list(self.shape), self.dtype, self.sparse]

    @staticmethod
    def from_json(v: list) -> "VarSpec":
        return VarSpec(v[0], tuple(int(s) for s in v[1]), v[2], bool(v[3]))


def variables(model: nn.Module) -> list[tuple[VarSpec, nn.Parameter]]:
    """The model's trainable variables in a fixed order (named_parameters), with
    ``sparse`` set for the weights of ``nn.Embedding``/``nn.EmbeddingBag`` built
    with ``sparse=True``."""
    sparse_ids = {id(m.weight) for m in model.modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if not p.is_contiguous():
            p.data = p.data.contiguous()
        dtype = str(p.dtype).replace("torch.", "")
        out.append((VarSpec(name, tuple(p.shape), dtype, id(p) in sparse_ids), p))
    return out


PLACEMENTS = ("balanced", "round-robin")


def place(nbytes: Sequence[int], num_servers: int, strategy: str = "balanced") -> list[int]:
    """Server of each variable (given their sizes in bytes, in model order).

    "round-robin" is the paper's (and TensorFlow's default): variable i on
    server i mod S. With S = 2 it puts every weight on server 0 and every bias
    on server 1, because parameters alternate weight/bias, so one server does
    nearly all the summing and updating. "balanced" (the default) gives the
    largest remaining variable to the least-loaded server, like TensorFlow's
    GreedyLoadBalancingStrategy."""
    if num_servers < 1:
        raise ValueError("need at least one server")
    if strategy == "round-robin":
        return [i % num_servers for i in range(len(nbytes))]
    if strategy != "balanced":
        raise ValueError(f"placement must be one of {PLACEMENTS}, not {strategy!r}")
    load = [0] * num_servers
    owner = [0] * len(nbytes)
    for i in sorted(range(len(nbytes)), key=lambda i: (-int(nbytes[i]), i)):
        s = min(range(num_servers), key=lambda s: (load[s], s))
        owner[i] = s
        load[s] += int(nbytes[i])
    return owner


def check_specs(reference: Sequence[VarSpec], other: Sequence[VarSpec], rank: int) -> str | None:
    """None if worker `rank`'s variables equal worker 0's, else a message naming the first difference."""
    ref = {v.name: v for v in reference}
    for i, v in enumerate(other):
        r = ref.get(v.name)
        if r is None:
            return f"worker {rank}'s model has a variable {v.name!r} that worker 0's model does not have"
        if r.shape != v.shape or r.dtype != v.dtype:
            return (f"worker {rank}'s model differs from worker 0's at variable {v.name!r}: "
                    f"{v.dtype}{list(v.shape)} vs {r.dtype}{list(r.shape)}")
        if r.sparse != v.sparse:
            return f"worker {rank}'s variable {v.name!r} is {'sparse' if v.sparse else 'dense'}, not as worker 0's"
    names = {o.name for o in other}
    missing = [v.name for v in reference if v.name not in names]
    if missing:
        return f"worker {rank}'s model lacks variable {missing[0]!r} of worker 0's model"
    for i, (a, b) in enumerate(zip(reference, other)):
        if a.name != b.name:
            return (f"worker {rank}'s model orders its variables differently from worker 0's "
                    f"(variable {i} is {b.name!r}, not {a.name!r})")
    return None


def make_optimizer(optimizer: Any, params: list[torch.Tensor], **kwargs: Any) -> torch.optim.Optimizer:
    """``optimizer`` is a callable(params) -> torch.optim.Optimizer (e.g.
    ``functools.partial(torch.optim.SGD, lr=0.1)``), an optimizer class, or a
    name: sgd, adam, adamw, adagrad, rmsprop (keyword arguments go to it)."""
    if isinstance(optimizer, str):
        names = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
                 "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop,
                 "sparseadam": torch.optim.SparseAdam}
        if optimizer.lower() not in names:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(names)}")
        cls = names[optimizer.lower()]
        if cls is torch.optim.SGD:
            kwargs.setdefault("lr", 0.01)
        return cls(params, **kwargs)
    return optimizer(params, **kwargs)


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _tensor_of_view(view: Any, spec: VarSpec) -> torch.Tensor:
    """A torch tensor over a slot's numpy view (zero copy)."""
    import numpy as np
    if spec.dtype == "bfloat16":  # numpy sees raw uint16
        return torch.from_numpy(np.asarray(view)).view(torch.bfloat16)
    return torch.from_numpy(view)


def _peer_ids(dev: tw.Device) -> set[int]:
    return {int(p["device_id"]) for p in dev.peers()}


class _Watch:
    """Bounded waits that fail fast when a peer this process depends on is gone."""

    def __init__(self, dev: tw.Device, timeout: float, who: str) -> None:
        self.dev, self.timeout, self.who = dev, timeout, who
        self.peers: dict[int, str] = {}  # device id -> description
        self.excused: set[int] = set()   # peers that said goodbye: their leaving is no failure
        self.partner: Callable[[], str | None] | None = None  # a colocated role's failure, if any

    def check(self, what: str) -> None:
        if self.partner is not None and (err := self.partner()):
            raise PSError(f"{self.who}: {err} while {what}")
        alive = _peer_ids(self.dev)
        for pid, desc in self.peers.items():
            if pid not in alive and pid not in self.excused:
                raise PSError(f"{self.who}: {desc} died or disconnected while {what}")

    def recv(self, slot: Any, what: str, give_up: Callable[[], str | None] | None = None) -> Any:
        """slot.recv() in slices of POLL_S, looking at the peers in between.
        The C++ wait drives the worker itself (spinning briefly after each
        arrival, then napping on its event fd) with the GIL released, and
        fails at once when the slot's sender dies; a Python poll-and-sleep
        loop left a large tcp transfer to the progress thread, one wake-up
        per socket read."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return slot.recv(min(POLL_S, max(0.0, deadline - time.monotonic())))
            except tw.Timeout:
                pass
            except tw.ConnectionError as e:  # the slot's sender died or left
                if give_up is not None:
                    reason = give_up()
                    if reason == WAIT:  # it said goodbye: the others may still be finishing
                        if time.monotonic() > deadline:
                            raise PSError(f"{self.who}: timed out after {self.timeout:.0f} s {what}") from None
                        time.sleep(GOODBYE_NAP_S)
                        continue
                    if reason is not None:
                        return reason
                self.check(what)
                raise PSError(f"{self.who}: a peer died or disconnected while {what} ({e})") from None
            if give_up is not None:
                reason = give_up()
                if reason is not None and reason != WAIT:
                    return reason
            self.check(what)
            if time.monotonic() > deadline:
                raise PSError(f"{self.who}: timed out after {self.timeout:.0f} s {what}")

    def wait(self, req: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                req.wait(POLL_S)
                return
            except tw.Timeout:
                pass
            except tw.Error as e:
                raise PSError(f"{self.who}: {what} failed: {e}") from None
            self.check(what)
            if time.monotonic() > deadline:
                raise PSError(f"{self.who}: timed out after {self.timeout:.0f} s {what}")


# --------------------------------------------------------------------- statistics

STEP_FIELDS = ("step_s", "compute_s", "push_s", "aggregate_s", "pull_s")


@dataclass
class Stats:
    """Per-step timings (seconds) and bytes of one process."""
    role: str
    rank: int
    mode: str
    steps: list[dict] = field(default_factory=list)
    bytes_copied_per_step: int = 0
    bytes_sent_per_step: int = 0
    registrations: int = 0
    extra: dict = field(default_factory=dict)

    def mean(self, key: str, skip: int = 0) -> float:
        vals = [s[key] for s in self.steps[skip:] if key in s]
        return sum(vals) / len(vals) if vals else float("nan")

    def to_dict(self, skip: int = 0) -> dict:
        keys = sorted({k for s in self.steps for k in s})
        extra = self.mean("extra_copied", skip)  # gradients autograd left outside their block, moved there
        return {"role": self.role, "rank": self.rank, "mode": self.mode, "steps": len(self.steps),
                "mean": {k: self.mean(k, skip) for k in keys},
                "bytes_copied_per_step": self.bytes_copied_per_step + (0 if math.isnan(extra) else round(extra)),
                "bytes_sent_per_step": self.bytes_sent_per_step, "registrations": self.registrations,
                **self.extra}


# --------------------------------------------------------------------- server

class Server:
    """One parameter server over tensorwire slots (modes zerocopy and copy).

    Creates its device at once (``address`` is what workers connect to);
    :meth:`run` waits for the ``num_workers`` workers, checks that their models
    agree, takes the initial values from worker 0, and serves steps until every
    worker called :meth:`Worker.close` (or raises :class:`PSError` when a worker
    dies, refuses, or a step exceeds ``timeout``)."""

    def __init__(self, rank: int = 0, num_servers: int = 1, num_workers: int = 1, optimizer: Any = "sgd",
                 mode: str = "zerocopy", transport: str = "auto", host: str = "127.0.0.1", port: int = 0,
                 timeout: float = DEFAULT_TIMEOUT_S, device_kwargs: dict | None = None,
                 placement: str = "balanced", device: tw.Device | None = None, **optimizer_kwargs: Any):
        if mode not in ("zerocopy", "copy"):
            raise ValueError(f"Server runs modes zerocopy and copy; gloo has GlooServer (got {mode!r})")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
        self.placement = placement
        self.rank, self.num_servers, self.num_workers = rank, num_servers, num_workers
        self.mode, self.timeout = mode, timeout
        self.optimizer_spec, self.optimizer_kwargs = optimizer, optimizer_kwargs
        # a device passed in is shared with a colocated Worker (and closed by its owner)
        self._own_dev = device is None
        self.dev = device or tw.Device(host=host, port=port, transport=transport, **(device_kwargs or {}))
        self.who = f"server {rank}"
        self.watch = _Watch(self.dev, timeout, self.who)
        self._hellos: dict[int, dict] = {}
        self._byes: set[int] = set()
        self._state = "wait"
        self._error = ""
        self._init_slot = self.dev.dynamic_slot("ps.init")
        self.dev.on_call("ps.hello", self._on_hello)
        self.dev.on_call("ps.bye", self._on_bye)
        self.stats = Stats("server", rank, mode)
        self.steps_done = 0

    @property
    def address(self) -> str:
        return self.dev.address

    # handlers run on the device's dispatcher thread: record and answer, never block
    def _on_hello(self, payload: bytes) -> bytes:
        msg = json.loads(payload)
        r = int(msg["rank"])
        if not 0 <= r < self.num_workers:
            return json.dumps({"state": "refused", "error": f"{self.who} expects workers 0..{self.num_workers - 1}, "
                                                            f"not rank {r}"}).encode()
        if msg.get("mode") != self.mode:
            return json.dumps({"state": "refused", "error": f"{self.who} runs mode {self.mode!r}, worker {r} "
                                                            f"asked for {msg.get('mode')!r}"}).encode()
        if msg.get("placement") != self.placement:
            return json.dumps({"state": "refused", "error": f"{self.who} places variables {self.placement!r}, "
                                                            f"worker {r} {msg.get('placement')!r}"}).encode()
        self._hellos.setdefault(r, msg)
        return json.dumps({"state": self._state, "error": self._error}).encode()

    def _on_bye(self, payload: bytes) -> bytes:
        if not self._byes:
            self._first_bye = time.monotonic()
        r = int(payload.decode())
        self._byes.add(r)
        # A worker that finished may close its device while another still
        # pulls its last parameters from us: not a failure (_give_up judges).
        if r in self._hellos:
            self.watch.excused.add(int(self._hellos[r]["device_id"]))
        return b"ok"

    def _setup(self) -> None:
        deadline = time.monotonic() + self.timeout
        while len(self._hellos) < self.num_workers:
            if time.monotonic() > deadline:
                raise PSError(f"{self.who}: only workers {sorted(self._hellos)} of {self.num_workers} "
                              f"arrived within {self.timeout:.0f} s")
            time.sleep(0.01)
        hellos = [self._hellos[r] for r in range(self.num_workers)]
        specs = [[VarSpec.from_json(v) for v in h["vars"]] for h in hellos]
        for r in range(1, self.num_workers):
            err = check_specs(specs[0], specs[r], r)
            if err:
                self._error = f"refused at setup: {err}"
                self._state = "refused"
                # let the workers poll the refusal before this device goes away
                t_end = time.monotonic() + 2.0
                while time.monotonic() < t_end:
                    time.sleep(0.05)
                raise PSError(f"{self.who}: {self._error}")
        self.workers = hellos
        for h in hellos:
            self.watch.peers[int(h["device_id"])] = f"worker {h['rank']} (pid {h['pid']}, {h['address']})"
        self.all_vars = specs[0]
        owner = place([v.nbytes for v in self.all_vars], self.num_servers, self.placement)
        self.vars = [v for v, s in zip(self.all_vars, owner) if s == self.rank]
        W = self.num_workers
        # master copies: registered memory (zerocopy) or plain torch memory (copy)
        self.blocks, self.master = [], []
        for v in self.vars:
            if self.mode == "zerocopy":
                blk = self.dev.empty(v.shape, v.dtype)
                t = torch.from_dlpack(blk)
            else:
                blk, t = None, torch.empty(v.shape, dtype=_torch_dtype(v.dtype))
            self.blocks.append(blk)
            self.master.append(nn.Parameter(t, requires_grad=True))
        self.grad_slots = [[self.dev.dynamic_slot(f"sgrad/{v.name}/{w}") if v.sparse else
                            self.dev.static_slot(f"grad/{v.name}/{w}", v.shape, v.dtype, depth=1)
                            for w in range(W)] for v in self.vars]
        self._state = "ready"
        # initial values from worker 0, in the order of this server's variables
        for v, m in zip(self.vars, self.master):
            blk = self.watch.recv(self._init_slot, f"waiting for the initial value of {v.name!r}")
            with torch.no_grad():
                m.copy_(torch.from_dlpack(blk).view(m.shape))
            del blk
        self.opt = make_optimizer(self.optimizer_spec, list(self.master), **self.optimizer_kwargs)
        path = "copy"
        self.channels = [self.dev.connect(h["address"]) for h in hellos]
        self.param_senders = [[ch.static_sender(f"param/{v.name}", path=path, timeout=self.timeout)
                               for ch in self.channels] for v in self.vars]
        self.stats.bytes_copied_per_step = 0 if self.mode == "zerocopy" else W * sum(v.nbytes for v in self.vars)
        # A colocated worker (on this very device) gets its parameters by a
        # memcpy in the sending thread: sent last, after the remote transfers
        # are under way.
        local = [w for w, h in enumerate(hellos) if int(h["device_id"]) == self.dev.id]
        self._send_order = [w for w in range(W) if w not in local] + local
        self.stats.bytes_sent_per_step = (W - len(local)) * sum(v.nbytes for v in self.vars)
        self.stats.extra["vars"] = [v.name for v in self.vars]
        self._send_params()

    def _send_params(self) -> None:
        reqs = []
        for w in self._send_order:
            for i, v in enumerate(self.vars):
                src = self.blocks[i] if self.mode == "zerocopy" else self.master[i].detach()
                reqs.append((self.param_senders[i][w].send(src, self.timeout), v.name, w))
        for req, name, w in reqs:
            try:
                self.watch.wait(req, f"sending {name!r} to worker {w}")
            except PSError:
                # A worker says goodbye only after it received every parameter
                # of its last step: its closing may fail our request (over tcp
                # the completion waits for its ack) after the bytes landed.
                if w in self._byes:
                    continue
                raise

    def _give_up(self, first: bool, w: int, what: str) -> Callable[[], str | None]:
        def check() -> str | None:
            if first and len(self._byes) == self.num_workers:
                return "done"
            if w in self._byes:
                if not first or time.monotonic() - self._first_bye > BYE_GRACE_S:
                    raise PSError(f"{self.who}: worker {w} left after {self.steps_done} steps while {what}; "
                                  f"all workers must run the same number of steps")
                return WAIT
            return None
        return check

    def _step(self) -> bool:
        """One step; False once every worker has left."""
        W = self.num_workers
        t0 = time.perf_counter()
        t_sum = 0.0
        first = True
        held: list = []  # (slot, view) whose buffer is a variable's gradient until the optimizer ran
        for i, v in enumerate(self.vars):
            m = self.master[i]
            if v.sparse:
                idx, vals = [], []
                for w in range(W):
                    what = f"waiting for worker {w}'s gradient of {v.name!r} (step {self.steps_done + 1})"
                    bi = self.watch.recv(self.grad_slots[i][w], what, self._give_up(first, w, what))
                    if isinstance(bi, str):
                        return False
                    first = False
                    bv = self.watch.recv(self.grad_slots[i][w], what)
                    ts = time.perf_counter()
                    idx.append(torch.from_dlpack(bi).clone())
                    vals.append(torch.from_dlpack(bv).clone())
                    t_sum += time.perf_counter() - ts
                ts = time.perf_counter()
                g = torch.sparse_coo_tensor(torch.cat(idx).view(1, -1), torch.cat(vals) / W, v.shape,
                                            check_invariants=False)
                m.grad = g.coalesce()
                t_sum += time.perf_counter() - ts
                continue
            for w in range(W):
                what = f"waiting for worker {w}'s gradient of {v.name!r} (step {self.steps_done + 1})"
                view = self.watch.recv(self.grad_slots[i][w], what, self._give_up(first, w, what))
                if isinstance(view, str):
                    return False
                first = False
                ts = time.perf_counter()
                g = _tensor_of_view(view, v)
                if w == 0:  # worker 0's slot buffer becomes the gradient: no copy
                    m.grad = g
                    held.append((self.grad_slots[i][0], view))
                else:
                    _mean_into(m.grad, g, w)
                    self.grad_slots[i][w].release(view)
                t_sum += time.perf_counter() - ts
        t1 = time.perf_counter()
        self.opt.step()
        for slot, view in held:  # the optimizer has read them: workers may push again
            slot.release(view)
        for i, v in enumerate(self.vars):  # no .grad left pointing at memory a worker overwrites
            if not v.sparse:
                self.master[i].grad = None
        t2 = time.perf_counter()
        self._send_params()
        t3 = time.perf_counter()
        self.steps_done += 1
        self.stats.steps.append({"wait_s": t1 - t0 - t_sum, "sum_s": t_sum, "optimizer_s": t2 - t1,
                                 "aggregate_s": t_sum + (t2 - t1), "pull_s": t3 - t2, "step_s": t3 - t0})
        return True

    def run(self, steps: int | None = None) -> Stats:
        """Serves until every worker left (or `steps` steps); returns the statistics."""
        try:
            self._setup()
            while steps is None or self.steps_done < steps:
                if not self._step():
                    break
            return self.stats
        finally:
            self.close()

    def close(self) -> None:
        if not self.dev.closed:
            # Over tcp the last parameters may still be on their way: let them
            # land before the device (and its endpoints) goes. A worker that
            # said goodbye has them all (and its endpoint is gone).
            for w, ch in enumerate(getattr(self, "channels", [])):
                if w in self._byes:
                    continue
                try:
                    ch.flush().wait(5.0)
                except tw.Error:
                    pass
            if self._own_dev:
                self.dev.close()


# --------------------------------------------------------------------- worker

class Worker:
    """One worker over tensorwire slots (modes zerocopy and copy).

    Moves the model's parameters into the static slots the servers write
    (``param/<var>``), gives every dense parameter a ``.grad`` in registered
    memory (zerocopy), meets the servers (checking its model against worker 0's)
    and loads the initial parameters from them. Then :meth:`step` runs one
    synchronous SGD step."""

    def __init__(self, model: nn.Module, servers: Sequence[str], rank: int = 0, num_workers: int = 1,
                 mode: str = "zerocopy", transport: str = "auto", host: str = "127.0.0.1",
                 timeout: float = DEFAULT_TIMEOUT_S, device_kwargs: dict | None = None,
                 placement: str = "balanced", device: tw.Device | None = None):
        if mode not in ("zerocopy", "copy"):
            raise ValueError(f"Worker runs modes zerocopy and copy; gloo has GlooWorker (got {mode!r})")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
        self.placement = placement
        self.model, self.rank, self.num_workers, self.mode, self.timeout = model, rank, num_workers, mode, timeout
        self.who = f"worker {rank}"
        # a device passed in is shared with a colocated Server (and closed by its owner)
        self._own_dev = device is None
        self.dev = device or tw.Device(host=host, transport=transport, **(device_kwargs or {}))
        self.watch = _Watch(self.dev, timeout, self.who)
        self.stats = Stats("worker", rank, mode)
        self.steps_done = 0
        self._views: list = []
        self._closed = False
        self._zeroed = False
        try:
            self._setup(list(servers))
        except BaseException:
            if self._own_dev:
                self.dev.close()
            raise

    def _setup(self, servers: list[str]) -> None:
        S = len(servers)
        self.vars = variables(self.model)
        specs = [v for v, _ in self.vars]
        self.owner = place([v.nbytes for v in specs], S, self.placement)
        # the receiving side: one static slot per variable, its buffer becomes the parameter
        self.param_slots = [self.dev.static_slot(f"param/{v.name}", v.shape, v.dtype, depth=1) for v in specs]
        # gradients (zerocopy): a registered block per dense variable, which the
        # backward of an nn.Linear writes directly (alloc_sites) and autograd
        # accumulates into for any other parameter. copy: autograd's own fresh
        # tensors (PyTorch's default zero_grad(set_to_none=True)), copied to send.
        self.grad_blocks: list = []
        for v, p in self.vars:
            p.grad = None
            self.grad_blocks.append(self.dev.empty(v.shape, v.dtype)
                                    if self.mode == "zerocopy" and not v.sparse else None)
        block_tensor = {id(p): torch.from_dlpack(blk).view(-1)
                        for (v, p), blk in zip(self.vars, self.grad_blocks) if blk is not None}
        direct = alloc_sites.install(self.model, lambda p: block_tensor.get(id(p)))
        direct_ids = {id(p) for p in direct}
        # produced in place each step (.grad unset before the backward) vs accumulated into a zeroed block
        self._fresh = [not v.sparse and (self.mode == "copy" or id(p) in direct_ids) for v, p in self.vars]
        for (v, p), blk, fresh in zip(self.vars, self.grad_blocks, self._fresh):
            if blk is not None and not fresh:
                p.grad = torch.from_dlpack(blk).view(p.shape)
                p.grad.zero_()
        self.channels = []
        for s, addr in enumerate(servers):
            try:
                ch = self.dev.connect(addr)
            except tw.Error as e:
                raise PSError(f"{self.who}: cannot reach server {s} at {addr}: {e}") from None
            self.channels.append(ch)
            self.watch.peers[int(ch.peer["device_id"])] = f"server {s} ({addr})"
        hello = json.dumps({"rank": self.rank, "device_id": self.dev.id, "address": self.dev.address,
                            "pid": os.getpid(), "mode": self.mode, "placement": self.placement,
                            "vars": [v.to_json() for v in specs]}).encode()
        pending = set(range(S))
        deadline = time.monotonic() + self.timeout
        while pending:
            for s in sorted(pending):
                try:
                    reply = json.loads(self.channels[s].call("ps.hello", hello, 10.0))
                except tw.Error as e:
                    raise PSError(f"{self.who}: server {s} ({servers[s]}) failed during setup: {e}") from None
                if reply["state"] == "refused":
                    raise PSError(f"{self.who}: server {s} {reply['error']}")
                if reply["state"] == "ready":
                    pending.discard(s)
            if pending:
                if time.monotonic() > deadline:
                    raise PSError(f"{self.who}: servers {sorted(pending)} not ready within {self.timeout:.0f} s")
                time.sleep(0.01)
        path = "register" if self.mode == "zerocopy" else "copy"
        self.senders = []
        for (v, p), s in zip(self.vars, self.owner):
            ch = self.channels[s]
            if v.sparse:
                self.senders.append(ch.dynamic_sender(f"sgrad/{v.name}/{self.rank}", path=path, timeout=self.timeout))
            else:
                self.senders.append(ch.static_sender(f"grad/{v.name}/{self.rank}", path="copy", timeout=self.timeout))
        if self.rank == 0:  # initial values: worker 0's
            for s, ch in enumerate(self.channels):
                init = ch.dynamic_sender("ps.init", path="copy", timeout=self.timeout)
                for (v, p), o in zip(self.vars, self.owner):
                    if o == s:
                        self.watch.wait(init.send(p.detach().contiguous(), self.timeout),
                                        f"sending the initial value of {v.name!r}")
        self._pull(first=True)
        # Variables of a colocated server (on this very device) are pushed by a
        # memcpy in this thread: the remote dense pushes go first, so their
        # transfers are under way meanwhile. Only those move: they never block
        # (one send per slot and step), while a sparse push (two sends to one
        # dynamic slot) waits for the server, which takes variables in their
        # order; moving anything after it could deadlock.
        local = {s for s, ch in enumerate(self.channels) if int(ch.peer["device_id"]) == self.dev.id}
        early = [i for i, ((v, _), s) in enumerate(zip(self.vars, self.owner)) if not v.sparse and s not in local]
        self._push_order = early + [i for i in range(len(self.vars)) if i not in early]
        self.stats.bytes_sent_per_step = sum(v.nbytes for (v, _), s in zip(self.vars, self.owner)
                                             if not v.sparse and s not in local)
        self.stats.bytes_copied_per_step = (0 if self.mode == "zerocopy" else
                                            sum(v.nbytes for v, _ in self.vars if not v.sparse))

    def _pull(self, first: bool = False) -> float:
        """Waits for every parameter; returns when the first arrived (perf_counter)."""
        t_first = 0.0
        views = []
        for i, ((v, p), slot) in enumerate(zip(self.vars, self.param_slots)):
            view = self.watch.recv(slot, f"waiting for parameter {v.name!r} (step {self.steps_done})")
            if i == 0:
                t_first = time.perf_counter()
            views.append(view)
            if first:
                p.data = _tensor_of_view(view, v).view(p.shape)
            elif view.ctypes.data != p.data_ptr():  # never with depth 1; kept as a safety net
                p.data = _tensor_of_view(view, v).view(p.shape)
        self._views = views
        return t_first

    def zero_grad(self) -> None:
        """Readies the gradients for the next backward: zeroes those autograd
        accumulates into (in place: their registered memory stays), drops the
        ones the backward produces afresh (sparse ones, and those its op writes
        in place, see alloc_sites)."""
        self._zero_accumulated()
        self._drop_fresh()

    def _zero_accumulated(self) -> None:
        for (v, p), fresh in zip(self.vars, self._fresh):
            if not v.sparse and not fresh and p.grad is not None:
                p.grad.zero_()

    def _drop_fresh(self) -> None:
        for (v, p), fresh in zip(self.vars, self._fresh):
            if v.sparse or fresh:
                p.grad = None

    def step(self, closure: Callable[[], torch.Tensor], die_at: int | None = None) -> float:
        """One synchronous step: ``closure()`` returns the loss of this worker's
        batch (forward only; the worker runs backward), then gradients are pushed
        and the new parameters awaited. Returns the loss as a float."""
        if self._closed:
            raise PSError(f"{self.who} is closed")
        t0 = time.perf_counter()
        if not self._zeroed:  # (else done while the servers aggregated the last step)
            self._zero_accumulated()
        self._drop_fresh()  # the fresh ones stay readable until here
        loss = closure()
        loss.backward()
        self._zeroed = False
        t1 = time.perf_counter()
        if die_at is not None and self.steps_done + 1 == die_at:  # fault injection (tests)
            os._exit(17)
        for slot in self.param_slots:  # the servers may overwrite our parameters from now on
            slot.release()
        self._views = []
        reqs, copied = [], 0
        for i in self._push_order:
            (v, p), sender = self.vars[i], self.senders[i]
            if v.sparse:
                g = p.grad.coalesce()
                reqs.append((sender.send(g.indices()[0].contiguous(), self.timeout), v.name))
                reqs.append((sender.send(g.values().contiguous(), self.timeout), v.name))
                continue
            blk = self.grad_blocks[i]
            if p.grad is None:  # the parameter took no part in this loss
                p.grad = torch.zeros_like(p) if blk is None else torch.from_dlpack(blk).view(p.shape).zero_()
            if blk is not None and p.grad.data_ptr() != blk.ptr:  # autograd put .grad elsewhere: move it
                torch.from_dlpack(blk).view(p.shape).copy_(p.grad)
                copied += v.nbytes
                p.grad = torch.from_dlpack(blk).view(p.shape)
            reqs.append((sender.send(blk if blk is not None else p.grad, self.timeout), v.name))
        for req, name in reqs:
            self.watch.wait(req, f"pushing the gradient of {name!r}")
        t2 = time.perf_counter()
        # the servers aggregate now: zero the accumulated gradients for the next step meanwhile
        self._zero_accumulated()
        self._zeroed = True
        t_first = self._pull()
        t3 = time.perf_counter()
        self.steps_done += 1
        self.stats.steps.append({"compute_s": t1 - t0, "push_s": t2 - t1, "aggregate_s": max(0.0, t_first - t2),
                                 "pull_s": t3 - max(t_first, t2), "step_s": t3 - t0, "loss": float(loss.detach()),
                                 "extra_copied": copied})
        return float(loss.detach())

    def close(self) -> None:
        """Tells the servers this worker is done, then closes the device."""
        if self._closed:
            return
        self._closed = True
        for ch in self.channels:
            try:
                ch.call("ps.bye", str(self.rank).encode(), 5.0)
            except tw.Error:
                pass
        if self._own_dev:
            self.dev.close()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------- gloo baseline

class _Mailbox:
    """What a colocated worker and server of the gloo baseline send each other
    (gloo sends to no rank from itself): a send hands over its tensor, the
    matching receive copies it into its buffer and then completes the send:
    one memcpy, as tensorwire's channel to its own device."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.cv = threading.Condition()
        self.queues: dict = collections.defaultdict(collections.deque)

    def put(self, key: tuple, obj: Any) -> "_MailDone":
        done = threading.Event()
        with self.cv:
            self.queues[key].append((obj, done))
            self.cv.notify_all()
        return _MailDone(done, self.timeout, key)

    def take(self, key: tuple, buf: torch.Tensor | None = None) -> Any:
        """The oldest object sent under `key` (copied into `buf` when given)."""
        with self.cv:
            if not self.cv.wait_for(lambda: self.queues[key], self.timeout):
                raise PSError(f"colocated role: nothing sent under {key} within {self.timeout:.0f} s")
            obj, done = self.queues[key].popleft()
        if buf is not None:
            buf.copy_(obj)
        done.set()
        return obj


class _MailDone:
    """A local send: complete once the receiver took it."""

    def __init__(self, done: Any, timeout: float, key: tuple) -> None:
        self.done, self.timeout, self.key = done, timeout, key

    def wait(self) -> None:
        if not self.done.wait(self.timeout):
            raise PSError(f"colocated role: {self.key} not received within {self.timeout:.0f} s")


class _MailRecv:
    """A local receive: takes (and copies) at wait(), like gloo's irecv completes there."""

    def __init__(self, box: _Mailbox, key: tuple, buf: torch.Tensor) -> None:
        self.box, self.key, self.buf = box, key, buf

    def wait(self) -> None:
        self.box.take(self.key, self.buf)


class _Gloo:
    """Ranks 0..S-1 are the servers, S..S+W-1 the workers. Colocated (S == W),
    rank r is worker r and server r, one object shared by both roles of the
    process, and what one role sends the other goes through a mailbox."""

    def __init__(self, role: str, rank: int, num_servers: int, num_workers: int, init_method: str,
                 timeout: float, colocated: bool = False) -> None:
        import datetime
        import torch.distributed as dist
        self.dist = dist
        self.S, self.W = num_servers, num_workers
        self.colocated = colocated
        self.mail = _Mailbox(timeout) if colocated else None
        self.global_rank = rank if colocated or role == "server" else num_servers + rank
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, rank=self.global_rank,
                                    world_size=num_workers if colocated else num_servers + num_workers,
                                    timeout=datetime.timedelta(seconds=timeout))

    def server_rank(self, s: int) -> int:
        return s

    def worker_rank(self, w: int) -> int:
        return w if self.colocated else self.S + w

    # `to`/`at`: the role ("server" or "worker") that receives; it names the
    # mailbox when the peer is this process's other role
    def isend(self, t: torch.Tensor, dst: int, tag: int, to: str) -> Any:
        if self.colocated and dst == self.global_rank:
            return self.mail.put((to, tag), t)
        return self.dist.isend(t, dst, tag=tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int, at: str) -> Any:
        if self.colocated and src == self.global_rank:
            return _MailRecv(self.mail, (at, tag), t)
        return self.dist.irecv(t, src, tag=tag)

    def send(self, t: torch.Tensor, dst: int, tag: int, to: str) -> None:
        self.isend(t, dst, tag, to).wait()

    def recv(self, t: torch.Tensor, src: int, tag: int, at: str) -> None:
        self.irecv(t, src, tag, at).wait()

    def exchange_specs(self, specs: list[VarSpec] | None) -> list[list[VarSpec]]:
        """Every worker's variables. Colocated, the worker role gathers them (one
        collective per process) and hands them to its server."""
        if self.colocated and specs is None:
            return self.mail.take(("server", "specs"))
        objs: list = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(objs, [v.to_json() for v in specs] if specs is not None else None)
        out = [[VarSpec.from_json(v) for v in o] for o in objs[self.worker_rank(0):]]
        if self.colocated:
            self.mail.put(("server", "specs"), out)
        return out

    def validate(self, all_specs: list[list[VarSpec]], who: str) -> list[VarSpec]:
        for r in range(1, self.W):
            err = check_specs(all_specs[0], all_specs[r], r)
            if err:
                raise PSError(f"{who}: refused at setup: {err}")
        return all_specs[0]

    def close(self) -> None:
        try:
            self.dist.destroy_process_group()
        except Exception:
            pass


def _send_sparse(g_: _Gloo, g: torch.Tensor, dst: int, tag: int) -> list:
    g = g.coalesce()
    idx, vals = g.indices()[0].contiguous(), g.values().contiguous()
    n = torch.tensor([idx.numel()], dtype=torch.int64)
    g_.send(n, dst, tag, "server")
    return [g_.isend(idx, dst, tag, "server"), g_.isend(vals, dst, tag, "server")]


def _recv_sparse(g_: _Gloo, spec: VarSpec, src: int, tag: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = torch.zeros(1, dtype=torch.int64)
    g_.recv(n, src, tag, "server")
    idx = torch.empty(int(n), dtype=torch.int64)
    vals = torch.empty((int(n),) + spec.shape[1:], dtype=_torch_dtype(spec.dtype))
    g_.recv(idx, src, tag, "server")
    g_.recv(vals, src, tag, "server")
    return idx, vals


class GlooServer:
    """The parameter server of the gloo baseline: the same algorithm as
    :class:`Server`, every tensor moved by torch.distributed send/recv."""

    def __init__(self, rank: int, num_servers: int, num_workers: int, init_method: str, optimizer: Any = "sgd",
                 timeout: float = DEFAULT_TIMEOUT_S, placement: str = "balanced", group: _Gloo | None = None,
                 **optimizer_kwargs: Any) -> None:
        self.rank, self.W = rank, num_workers
        self.who = f"server {rank}"
        self._own_group = group is None  # a group passed in is shared with a colocated GlooWorker
        self.g = group or _Gloo("server", rank, num_servers, num_workers, init_method, timeout)
        self.stats = Stats("server", rank, "gloo")
        specs = self.g.validate(self.g.exchange_specs(None), self.who)
        owner = place([v.nbytes for v in specs], num_servers, placement)
        self.tags = [i for i, s in enumerate(owner) if s == rank]
        self.vars = [specs[i] for i in self.tags]
        self.master = [nn.Parameter(torch.empty(v.shape, dtype=_torch_dtype(v.dtype))) for v in self.vars]
        for v, m, tag in zip(self.vars, self.master, self.tags):
            self.g.recv(m.data, self.g.worker_rank(0), tag, "server")  # initial values from worker 0
        self.opt = make_optimizer(optimizer, list(self.master), **optimizer_kwargs)
        self.bufs = [[torch.empty(v.shape, dtype=_torch_dtype(v.dtype)) if not v.sparse else None
                      for _ in range(num_workers)] for v in self.vars]
        remote = num_workers - (1 if self.g.colocated else 0)  # a colocated worker is served by memcpy
        self.stats.bytes_sent_per_step = remote * sum(v.nbytes for v in self.vars)
        self.stats.extra["vars"] = [v.name for v in self.vars]
        self._send_params()

    def _send_params(self) -> None:
        reqs = [self.g.isend(m.detach(), self.g.worker_rank(w), tag, "worker")
                for m, tag in zip(self.master, self.tags) for w in range(self.W)]
        for r in reqs:
            r.wait()

    def step(self) -> None:
        g, W = self.g, self.W
        t0 = time.perf_counter()
        dense = [g.irecv(self.bufs[i][w], g.worker_rank(w), tag, "server")
                 for i, (v, tag) in enumerate(zip(self.vars, self.tags)) if not v.sparse for w in range(W)]
        sparse = {}
        for i, (v, tag) in enumerate(zip(self.vars, self.tags)):
            if v.sparse:
                sparse[i] = [_recv_sparse(g, v, g.worker_rank(w), tag) for w in range(W)]
        for r in dense:
            r.wait()
        t1 = time.perf_counter()
        for i, (v, m) in enumerate(zip(self.vars, self.master)):
            if v.sparse:
                idx = torch.cat([p[0] for p in sparse[i]]).view(1, -1)
                vals = torch.cat([p[1] for p in sparse[i]]) / W
                m.grad = torch.sparse_coo_tensor(idx, vals, v.shape, check_invariants=False).coalesce()
            else:  # the same in-place mean as Server: the first receive buffer becomes the gradient
                m.grad = self.bufs[i][0]
                for w in range(1, W):
                    _mean_into(m.grad, self.bufs[i][w], w)
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        self._send_params()
        t4 = time.perf_counter()
        self.stats.steps.append({"wait_s": t1 - t0, "sum_s": t2 - t1, "optimizer_s": t3 - t2,
                                 "aggregate_s": t3 - t1, "pull_s": t4 - t3, "step_s": t4 - t0})

    def run(self, steps: int) -> Stats:
        try:
            for _ in range(steps):
                self.step()
            return self.stats
        finally:
            if self._own_group:
                self.g.close()


class GlooWorker:
    """A worker of the gloo baseline (same interface as :class:`Worker`)."""

    def __init__(self, model: nn.Module, rank: int, num_servers: int, num_workers: int, init_method: str,
                 timeout: float = DEFAULT_TIMEOUT_S, placement: str = "balanced", group: _Gloo | None = None) -> None:
        self.model, self.rank = model, rank
        self.who = f"worker {rank}"
        self._own_group = group is None  # a group passed in is shared with a colocated GlooServer
        self.g = group or _Gloo("worker", rank, num_servers, num_workers, init_method, timeout)
        self.stats = Stats("worker", rank, "gloo")
        self.steps_done = 0
        self.vars = variables(model)
        specs = [v for v, _ in self.vars]
        self.g.validate(self.g.exchange_specs(specs), self.who)
        self.owner = place([v.nbytes for v in specs], num_servers, placement)
        g = self.g
        if rank == 0:
            for i, ((v, p), s) in enumerate(zip(self.vars, self.owner)):
                g.send(p.detach().contiguous(), g.server_rank(s), i, "server")
        for _, p in self.vars:  # autograd's fresh gradients (PyTorch's default), as Worker's copy mode
            p.grad = None
        self._pull()
        local = rank if g.colocated else -1  # a colocated server's variables are pushed by memcpy
        self.stats.bytes_sent_per_step = sum(v.nbytes for (v, _), s in zip(self.vars, self.owner)
                                             if not v.sparse and s != local)

    def _pull(self) -> float:
        g = self.g
        reqs = [g.irecv(p.data, g.server_rank(s), i, "worker")
                for i, ((v, p), s) in enumerate(zip(self.vars, self.owner))]
        reqs[0].wait()
        t_first = time.perf_counter()
        for r in reqs[1:]:
            r.wait()
        return t_first

    def step(self, closure: Callable[[], torch.Tensor], die_at: int | None = None) -> float:
        g = self.g
        t0 = time.perf_counter()
        for _, p in self.vars:
            p.grad = None
        loss = closure()
        loss.backward()
        t1 = time.perf_counter()
        if die_at is not None and self.steps_done + 1 == die_at:
            os._exit(17)
        reqs = []
        for i, ((v, p), s) in enumerate(zip(self.vars, self.owner)):
            if p.grad is None and not v.sparse:  # the parameter took no part in this loss
                p.grad = torch.zeros_like(p)
            if v.sparse:
                reqs += _send_sparse(g, p.grad, g.server_rank(s), i)
            else:
                reqs.append(g.isend(p.grad, g.server_rank(s), i, "server"))
        for r in reqs:
            r.wait()
        t2 = time.perf_counter()
        t_first = self._pull()
        t3 = time.perf_counter()
        self.steps_done += 1
        self.stats.steps.append({"compute_s": t1 - t0, "push_s": t2 - t1, "aggregate_s": max(0.0, t_first - t2),
                                 "pull_s": t3 - max(t_first, t2), "step_s": t3 - t0, "loss": float(loss.detach())})
        return float(loss.detach())

    def close(self) -> None:
        if self._own_group:
            self.g.close()


# --------------------------------------------------------------------- local launcher

@dataclass
class TrainConfig:
    """Everything a spawned role needs (picklable)."""
    model_fn: Callable[..., nn.Module]
    data_fn: Callable[[int, int], Any]          # (worker rank, step) -> (inputs, target)
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    workers: int = 2
    servers: int = 2
    steps: int = 50
    mode: str = "zerocopy"
    transport: str = "auto"
    optimizer: Any = "sgd"
    optimizer_kwargs: dict = field(default_factory=lambda: {"lr": 0.01})
    seed: int = 0
    warmup: int = 2
    timeout: float = DEFAULT_TIMEOUT_S
    threads: int = 1
    collect_params: bool = False
    progress: bool = False
    die: tuple[int, int] | None = None           # (worker rank, step): that worker exits there (tests)
    model_fn_takes_rank: bool = False
    placement: str = "balanced"                  # see place()
    colocate: bool = False                       # process r runs worker r and server r (the paper's layout)


def _default_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def _build_model(cfg: TrainConfig, rank: int) -> nn.Module:
    with _BUILD_LOCK:  # the global RNG: roles run as threads must not interleave their draws
        torch.manual_seed(cfg.seed)
        return cfg.model_fn(rank) if cfg.model_fn_takes_rank else cfg.model_fn()


_BUILD_LOCK = threading.Lock()


def _samples(x: Any) -> int:
    while isinstance(x, (tuple, list)):
        x = x[0]
    return int(x.shape[0])


def _worker_loop(cfg: TrainConfig, rank: int, worker: Any, model: nn.Module) -> dict:
    loss_fn = cfg.loss_fn or _default_loss
    die_at = cfg.die[1] if cfg.die is not None and cfg.die[0] == rank else None
    losses, t_start, samples = [], None, 0
    t_begin = time.perf_counter()
    for step in range(cfg.steps):
        if step == cfg.warmup:
            t_start = time.perf_counter()
        x, y = cfg.data_fn(rank, step)
        losses.append(worker.step(lambda: loss_fn(model(x), y), die_at=die_at))
        if step >= cfg.warmup:
            samples += _samples(x)
        if cfg.progress and rank == 0:
            el = time.perf_counter() - t_begin
            print(f"\r  step {step + 1}/{cfg.steps}  loss {losses[-1]:.4f}  {el:.1f} s", end="", file=sys.stderr,
                  flush=True)
    t_end = time.perf_counter()
    if cfg.progress and rank == 0:
        print(file=sys.stderr)
    out = {"losses": losses, "elapsed_s": t_end - (t_start or t_begin), "samples": samples,
           "step_times": [st["step_s"] for st in worker.stats.steps],
           "total_s": t_end - t_begin, "stats": worker.stats.to_dict(skip=cfg.warmup)}
    if cfg.collect_params:
        # numpy, not torch: torch pickles tensors through shared memory that dies with this process
        out["params"] = {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}
    return out


def _colocated(cfg: TrainConfig, rank: int, conn: Any, init_method: str | None) -> dict:
    """Worker `rank` (this thread) and server `rank` (a second thread) in one
    process, sharing one device (or gloo process group): what the worker and
    its own server exchange never crosses the transport."""
    box: dict = {}
    if cfg.mode == "gloo":
        group = _Gloo("both", rank, cfg.servers, cfg.workers, init_method, cfg.timeout, colocated=True)

        def serve() -> None:
            srv = GlooServer(rank, cfg.servers, cfg.workers, init_method, cfg.optimizer, cfg.timeout,
                             cfg.placement, group=group, **cfg.optimizer_kwargs)
            box["stats"] = srv.run(cfg.steps).to_dict(skip=cfg.warmup)
    else:
        dev = tw.Device(transport=cfg.transport)
        srv = Server(rank, cfg.servers, cfg.workers, cfg.optimizer, cfg.mode, cfg.transport, timeout=cfg.timeout,
                     placement=cfg.placement, device=dev, **cfg.optimizer_kwargs)
        conn.send({"address": srv.address})
        if not conn.poll(60):
            raise PSError(f"worker and server {rank}: no server addresses from the launcher within 60 s")
        addresses = conn.recv()["addresses"]

        def serve() -> None:
            box["stats"] = srv.run().to_dict(skip=cfg.warmup)

    def serve_and_report() -> None:
        try:
            serve()
        except BaseException as e:  # noqa: BLE001 - reported by the worker's thread
            box["error"] = str(e) if isinstance(e, PSError) else f"{type(e).__name__}: {e}"

    t = threading.Thread(target=serve_and_report, name=f"tensorwire-ps-server{rank}", daemon=True)
    t.start()
    model = _build_model(cfg, rank)
    if cfg.mode == "gloo":
        w: Any = GlooWorker(model, rank, cfg.servers, cfg.workers, init_method, cfg.timeout, cfg.placement,
                            group=group)
    else:
        w = Worker(model, addresses, rank, cfg.workers, cfg.mode, cfg.transport, timeout=cfg.timeout,
                   placement=cfg.placement, device=dev)
        w.watch.partner = lambda: box.get("error") and f"its colocated server failed: {box['error']}"
    try:
        result = _worker_loop(cfg, rank, w, model)
    finally:
        w.close()
    t.join(cfg.timeout)
    if "error" in box or t.is_alive():
        raise PSError(f"server {rank}: {box.get('error', f'did not finish within {cfg.timeout:.0f} s')}")
    if cfg.mode == "gloo":
        group.close()
    else:
        dev.close()
    return {"worker": result, "server": {"stats": box["stats"]}}


def _role_main(conn: Any, role: str, rank: int, cfg: TrainConfig, addresses: list[str] | None,
               init_method: str | None) -> None:
    """Entry point of a spawned process: runs one role, sends its result (or error) back."""
    torch.set_num_threads(cfg.threads)
    try:
        if role == "coloc":
            result = _colocated(cfg, rank, conn, init_method)
        elif cfg.mode == "gloo":
            if role == "server":
                srv = GlooServer(rank, cfg.servers, cfg.workers, init_method, cfg.optimizer, cfg.timeout,
                                 cfg.placement, **cfg.optimizer_kwargs)
                result = {"stats": srv.run(cfg.steps).to_dict(skip=cfg.warmup)}
            else:
                model = _build_model(cfg, rank)
                w = GlooWorker(model, rank, cfg.servers, cfg.workers, init_method, cfg.timeout, cfg.placement)
                try:
                    result = _worker_loop(cfg, rank, w, model)
                finally:
                    w.close()
        elif role == "server":
            srv = Server(rank, cfg.servers, cfg.workers, cfg.optimizer, cfg.mode, cfg.transport,
                         timeout=cfg.timeout, placement=cfg.placement, **cfg.optimizer_kwargs)
            conn.send({"address": srv.address})
            result = {"stats": srv.run().to_dict(skip=cfg.warmup)}
        else:
            model = _build_model(cfg, rank)
            w = Worker(model, addresses, rank, cfg.workers, cfg.mode, cfg.transport, timeout=cfg.timeout,
                       placement=cfg.placement)
            try:
                result = _worker_loop(cfg, rank, w, model)
            finally:
                w.close()
        conn.send({"result": result})
    except BaseException as e:  # noqa: BLE001 - reported to the launcher
        msg = str(e) if isinstance(e, PSError) else f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        try:
            conn.send({"error": msg})
        except Exception:
            pass
        if role == "coloc":  # the other role's thread may sit in a wait: leave without joining it
            sys.stderr.flush()
            os._exit(1)
        sys.exit(1)


@dataclass
class TrainResult:
    mode: str
    workers: int
    servers: int
    steps: int
    samples_per_s: float
    split: dict                 # mean seconds per step: compute, push, aggregate, pull, step
    losses: list[float]         # per step: the mean of the workers' losses (= the loss of the global batch)
    worker_losses: list[list[float]]
    bytes_copied_per_step: int  # all processes together
    bytes_sent_per_step: int
    roles: list[dict]
    params: dict | None = None
    wall_s: float = 0.0
    colocate: bool = False

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("mode", "workers", "servers", "steps", "samples_per_s", "split",
                                           "losses", "bytes_copied_per_step", "bytes_sent_per_step", "wall_s",
                                           "colocate")}
        d["roles"] = self.roles
        return d


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    """A role in a spawned process, and what it reported through its pipe."""

    def __init__(self, ctx, role: str, rank: int, cfg: TrainConfig, addresses, init_method) -> None:
        self.role, self.rank = role, rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_role_main, args=(child, role, rank, cfg, addresses, init_method),
                                daemon=True, name=f"tensorwire-ps-{role}{rank}")
        self.proc.start()
        child.close()
        self.result: dict | None = None
        self.error: str | None = None
        self.address: str | None = None

    @property
    def name(self) -> str:
        return f"worker and server {self.rank}" if self.role == "coloc" else f"{self.role} {self.rank}"

    def poll(self) -> None:
        """Reads whatever the process reported."""
        try:
            while self.conn.poll(0):
                msg = self.conn.recv()
                if "address" in msg:
                    self.address = msg["address"]
                elif "result" in msg:
                    self.result = msg["result"]
                elif "error" in msg:
                    self.error = msg["error"]
        except (EOFError, OSError):
            pass
        except Exception as e:  # noqa: BLE001 - an unreadable report is a failure of that role
            self.error = f"unreadable report: {type(e).__name__}: {e}"

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None or not self.proc.is_alive()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)


class _LocalConn:
    """The pipe end of a role run in a thread (launcher="threads")."""

    def __init__(self) -> None:
        import queue
        self.q: Any = queue.Queue()

    def send(self, msg: Any) -> None:
        self.q.put(msg)

    def poll(self, timeout: float = 0) -> bool:
        return not self.q.empty()

    def recv(self) -> Any:
        return self.q.get()


class _ThreadRun:
    """A thread that looks like a multiprocessing.Process to _Proc."""

    def __init__(self, target: Callable, args: tuple) -> None:
        self.exitcode: int | None = None

        def body() -> None:
            try:
                target(*args)
                self.exitcode = 0
            except SystemExit as e:
                self.exitcode = int(e.code or 0)

        self.t = threading.Thread(target=body, daemon=True, name=f"tensorwire-ps-{args[1]}{args[2]}")
        self.t.start()

    def is_alive(self) -> bool:
        return self.t.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.t.join(timeout)

    def kill(self) -> None:  # a thread cannot be killed; its waits are bounded by the timeout
        pass


class _ThreadProc(_Proc):
    def __init__(self, role: str, rank: int, cfg: TrainConfig, addresses, init_method) -> None:
        self.role, self.rank = role, rank
        self.conn = _LocalConn()
        self.proc = _ThreadRun(_role_main, (self.conn, role, rank, cfg, addresses, init_method))
        self.result = self.error = self.address = None


def train(model_fn: Callable[..., nn.Module], data_fn: Callable[[int, int], Any], *, workers: int = 2,
          servers: int = 2, steps: int = 50, mode: str = "zerocopy", transport: str = "auto",
          optimizer: Any = "sgd", loss_fn: Callable | None = None, seed: int = 0, warmup: int = 2,
          timeout: float = DEFAULT_TIMEOUT_S, threads: int = 1, collect_params: bool = False,
          progress: bool = False, die: tuple[int, int] | None = None, launcher: str = "processes",
          placement: str = "balanced", colocate: bool = False, **optimizer_kwargs: Any) -> TrainResult:
    """Trains locally with `servers` server processes and `workers` worker
    processes (spawned), and returns the statistics.

    Args:
        model_fn: builds the model (called under ``torch.manual_seed(seed)`` in
            every worker; worker 0's initial values are used). If it takes a
            parameter named ``rank`` it gets the worker's rank.
        data_fn: ``data_fn(rank, step) -> (inputs, target)``: worker ``rank``'s
            batch at ``step`` (a module-level function or functools.partial).
        loss_fn: ``loss_fn(output, target)``; default cross-entropy.
        optimizer: a name (sgd, adam, adamw, adagrad, rmsprop) with keyword
            arguments (``lr=...``), or a callable(params) -> optimizer.
        mode: zerocopy, copy or gloo. transport: tcp, shm or auto (not gloo).
        warmup: steps left out of samples/s and the per-step means.
        collect_params: return worker 0's final parameters (``result.params``).
        launcher: "processes" (spawned, the default) or "threads" (every role in
            a thread of this process, each with its own device: quick for small
            models and tests; not for gloo, and timings then share one GIL).
        placement: "balanced" (the default: by size, largest first to the
            least-loaded server) or "round-robin" (the paper's); see place().
        colocate: one process per worker that also runs the server of the same
            rank (the paper's layout; needs servers == workers): a worker's
            share of the variables stays in its process (a memcpy), every mode alike.
    Raises:
        PSError naming the role that failed first, when any role fails; all
        processes have exited by then.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
    if workers < 1 or servers < 1:
        raise ValueError("need at least one worker and one server")
    if colocate and servers != workers:
        raise ValueError(f"colocate runs worker r and server r in process r: needs servers == workers "
                         f"(got {servers} servers, {workers} workers)")
    if colocate and launcher != "processes":
        raise ValueError("colocate needs launcher='processes'")
    if "lr" not in optimizer_kwargs and isinstance(optimizer, str) and optimizer.lower() == "sgd":
        optimizer_kwargs["lr"] = 0.01
    try:
        takes_rank = "rank" in inspect.signature(model_fn).parameters
    except (TypeError, ValueError):
        takes_rank = False
    cfg = TrainConfig(model_fn, data_fn, loss_fn, workers, servers, steps, mode, transport, optimizer,
                      dict(optimizer_kwargs), seed, min(warmup, max(0, steps - 1)), timeout, threads,
                      collect_params, progress, die, takes_rank, placement, colocate)
    import multiprocessing as mp
    if launcher not in ("processes", "threads"):
        raise ValueError(f"launcher must be processes or threads, not {launcher!r}")
    if launcher == "threads":
        if mode == "gloo" or die is not None:
            raise ValueError("launcher='threads' runs modes zerocopy and copy without fault injection")
        cfg.threads = torch.get_num_threads()

        def _Proc(ctx, role, rank, cfg, addresses, init_method):  # noqa: N802 - same call as the class
            return _ThreadProc(role, rank, cfg, addresses, init_method)
    else:
        _Proc = _ProcClass
    ctx = mp.get_context("spawn")
    procs: list = []
    t0 = time.perf_counter()
    saved_env = {k: os.environ.get(k) for k in MALLOC_ENV}
    if launcher == "processes":
        for k, v in MALLOC_ENV.items():  # read by glibc when each role starts
            os.environ.setdefault(k, v)
    try:
        init_method = None
        addresses = None
        if colocate:
            if mode == "gloo":
                init_method = f"tcp://127.0.0.1:{_free_port()}"
            procs = [_Proc(ctx, "coloc", r, cfg, None, init_method) for r in range(workers)]
            if mode != "gloo":
                _await_addresses(procs)
                for p in procs:
                    p.conn.send({"addresses": [q.address for q in procs]})
            _supervise(procs, timeout)
        elif mode == "gloo":
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            procs = [_Proc(ctx, "server", s, cfg, None, init_method) for s in range(servers)]
        else:
            procs = [_Proc(ctx, "server", s, cfg, None, None) for s in range(servers)]
            addresses = _await_addresses(procs)
        if not colocate:
            procs += [_Proc(ctx, "worker", w, cfg, addresses, init_method) for w in range(workers)]
            _supervise(procs, timeout)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for p in procs:
            p.kill()
    errors = [(p, p.error or f"exited with code {p.proc.exitcode} without a report")
              for p in procs if p.result is None]
    if errors:
        first = errors[0]
        detail = "\n".join(f"  {p.name}: {e.strip()}" for p, e in errors)
        raise PSError(f"training failed ({first[0].name} first):\n{detail}")
    return _summarise(cfg, procs, time.perf_counter() - t0)


_ProcClass = _Proc


def _await_addresses(procs: list[_Proc]) -> list[str]:
    """The servers' device addresses, as each process reports its own."""
    deadline = time.monotonic() + 60
    while any(p.address is None for p in procs):
        for p in procs:
            p.poll()
            if p.error or (not p.proc.is_alive() and p.address is None):
                raise PSError(f"{p.name} failed to start: {p.error or f'exit {p.proc.exitcode}'}")
        if time.monotonic() > deadline:
            raise PSError("servers did not start within 60 s")
        time.sleep(0.01)
    return [p.address for p in procs]


def _supervise(procs: list[_Proc], timeout: float) -> None:
    """Waits for every role; once one failed, gives the others a grace period
    to fail on their own (they detect dead peers), then kills them."""
    grace_end = None
    while True:
        for p in procs:
            p.poll()
        failed = [p for p in procs if p.finished and p.result is None]
        if all(p.finished for p in procs):
            for p in procs:
                p.proc.join(5)
                p.poll()
            return
        if failed and grace_end is None:
            grace_end = time.monotonic() + 10.0
        if grace_end is not None and time.monotonic() > grace_end:
            for p in procs:
                p.poll()
                if not p.finished:
                    p.error = "killed by the launcher after another role failed"
                    p.kill()
            return
        time.sleep(0.02)


def _summarise(cfg: TrainConfig, procs: list[_Proc], wall: float) -> TrainResult:
    # every role's report, by rank (a colocated process reports both of its roles)
    wk_by_rank: dict[int, dict] = {}
    sv_by_rank: dict[int, dict] = {}
    for p in procs:
        if p.role == "coloc":
            wk_by_rank[p.rank], sv_by_rank[p.rank] = p.result["worker"], p.result["server"]
        else:
            (wk_by_rank if p.role == "worker" else sv_by_rank)[p.rank] = p.result
    wk = [wk_by_rank[r] for r in sorted(wk_by_rank)]
    sv = [sv_by_rank[r] for r in sorted(sv_by_rank)]
    samples = sum(r["samples"] for r in wk)
    elapsed = max(r["elapsed_s"] for r in wk)
    split = {}
    for k in ("compute_s", "push_s", "aggregate_s", "pull_s", "step_s"):
        vals = [r["stats"]["mean"].get(k, float("nan")) for r in wk]
        split[k.replace("_s", "")] = sum(vals) / len(vals)
    for k in ("wait_s", "sum_s", "optimizer_s", "pull_s"):
        vals = [r["stats"]["mean"].get(k, float("nan")) for r in sv]
        split["server_" + k.replace("_s", "")] = sum(vals) / len(vals) if vals else float("nan")
    copied = sum(r["stats"]["bytes_copied_per_step"] for r in wk + sv)
    sent = sum(r["stats"]["bytes_sent_per_step"] for r in wk + sv)
    roles = [dict(r["stats"], losses=r["losses"], step_times=r["step_times"]) for r in wk] + \
        [r["stats"] for r in sv]
    mean_losses = [sum(ls) / len(ls) for ls in zip(*(r["losses"] for r in wk))]
    return TrainResult(cfg.mode, cfg.workers, cfg.servers, cfg.steps,
                       samples / elapsed if elapsed > 0 else float("nan"), split, mean_losses,
                       [r["losses"] for r in wk], copied, sent, roles,
                       _params_of(wk[0].get("params")), wall, cfg.colocate)


def _params_of(arrays: dict | None) -> dict | None:
    return None if arrays is None else {n: torch.from_numpy(a) for n, a in arrays.items()}


def reference_sgd(model_fn: Callable[[], nn.Module], data_fn: Callable[[int, int], Any], *, workers: int,
                  steps: int, optimizer: Any = "sgd", loss_fn: Callable | None = None, seed: int = 0,
                  **optimizer_kwargs: Any) -> tuple[nn.Module, list[float]]:
    """Single-process training on the concatenation of the workers' batches (the
    result synchronous PS training must reproduce). Returns (model, losses)."""
    torch.manual_seed(seed)
    model = model_fn()
    loss_fn = loss_fn or _default_loss
    if isinstance(optimizer, str) and optimizer.lower() == "sgd":
        optimizer_kwargs.setdefault("lr", 0.01)
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad], **optimizer_kwargs)
    losses = []
    for step in range(steps):
        batches = [data_fn(w, step) for w in range(workers)]
        x = _cat([b[0] for b in batches])
        y = _cat([b[1] for b in batches])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


def _cat(parts: list) -> Any:
    if isinstance(parts[0], (tuple, list)):
        return type(parts[0])(_cat([p[i] for p in parts]) for i in range(len(parts[0])))
    return torch.cat(parts)


__all__ = ["Server", "Worker", "GlooServer", "GlooWorker", "train", "TrainResult", "PSError", "VarSpec",
           "variables", "place", "PLACEMENTS", "check_specs", "make_optimizer", "reference_sgd", "MODES"]
