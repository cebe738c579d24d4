"""What every part of the parameter server shares: the constants, the error,
the variables and their placement, the optimizer by name, the bounded waits on
peers, and the per-step statistics."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

import tensorwire as tw

MODES = ("zerocopy", "copy", "gloo")
BYE_GRACE_S = 10.0  # after a worker's goodbye, how long a server waits for the others to finish
# glibc malloc: keep big freed blocks in the heap instead of unmapping them. The
# tensors autograd allocates every step (activations, fresh gradients) then reuse
# memory that is already mapped, instead of page-faulting hundreds of MiB of fresh
# zero pages per step (3x the backward time of FCN-5 on a CPU). Set for every
# spawned role of every mode (an existing value in the environment wins).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
DEFAULT_TIMEOUT_S = 120.0  # a step (or setup) that takes longer fails


def server_lanes(num_workers: int) -> int:
    """UCX workers of a server's device: one per worker process, up to the
    cores. Worker r's channels to and from every server are lane r, so a
    server receives the pushes of different workers, and sends them their
    parameters, on different UCX workers (each its own progress thread) in
    parallel instead of one after the other. Over tcp one thread's socket
    copies were the server's limit (VGG-16, 2 x 2, bench/results/ps_lanes.txt)."""
    return max(1, min(num_workers, os.cpu_count() or 1))


def mean_into(acc: torch.Tensor, g: torch.Tensor, w: int) -> None:
    """acc holds the mean of w gradients; makes it the mean of w + 1 with g, in
    one pass (lerp: acc + (g - acc) / (w + 1)) instead of a scale and a sum."""
    acc.lerp_(g, 1.0 / (w + 1))


class PSError(tw.Error):
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
    sparse_ids = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
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
            return (
                f"worker {rank}'s model differs from worker 0's at variable {v.name!r}: "
                f"{v.dtype}{list(v.shape)} vs {r.dtype}{list(r.shape)}"
            )
        if r.sparse != v.sparse:
            return f"worker {rank}'s variable {v.name!r} is {'sparse' if v.sparse else 'dense'}, not as worker 0's"
    names = {o.name for o in other}
    missing = [v.name for v in reference if v.name not in names]
    if missing:
        return f"worker {rank}'s model lacks variable {missing[0]!r} of worker 0's model"
    for i, (a, b) in enumerate(zip(reference, other)):
        if a.name != b.name:
            return (
                f"worker {rank}'s model orders its variables differently from worker 0's "
                f"(variable {i} is {b.name!r}, not {a.name!r})"
            )
    return None


def make_optimizer(optimizer: Any, params: Sequence[torch.Tensor], **kwargs: Any) -> torch.optim.Optimizer:
    """``optimizer`` is a callable(params) -> torch.optim.Optimizer (e.g.
    ``functools.partial(torch.optim.SGD, lr=0.1)``), an optimizer class, or a
    name: sgd, adam, adamw, adagrad, rmsprop (keyword arguments go to it)."""
    if isinstance(optimizer, str):
        names = {
            "sgd": torch.optim.SGD,
            "adam": torch.optim.Adam,
            "adamw": torch.optim.AdamW,
            "adagrad": torch.optim.Adagrad,
            "rmsprop": torch.optim.RMSprop,
            "sparseadam": torch.optim.SparseAdam,
        }
        if optimizer.lower() not in names:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(names)}")
        cls = names[optimizer.lower()]
        if cls is torch.optim.SGD:
            kwargs.setdefault("lr", 0.01)
        return cls(params, **kwargs)
    return optimizer(params, **kwargs)


def default_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def tensor_of_view(view: Any, spec: VarSpec) -> torch.Tensor:
    """A torch tensor over a slot's numpy view (zero copy)."""
    import numpy as np

    if spec.dtype == "bfloat16":  # numpy sees raw uint16
        return torch.from_numpy(np.asarray(view)).view(torch.bfloat16)
    return torch.from_numpy(view)


def to_device(x: Any, device: str | torch.device) -> Any:
    """x (a tensor, or a tuple/list of them, nested) on `device`."""
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(t, device) for t in x)
    return x.to(device)


# --------------------------------------------------------------------- waiting on peers


def _peer_ids(dev: tw.Device) -> set[int]:
    return {int(p["device_id"]) for p in dev.peers()}


@dataclass(frozen=True)
class Wait:
    """A give-up check's answer: that worker left on purpose; keep waiting for
    the rest until ``until`` (time.monotonic()), when the check is asked again."""

    until: float


class Watch:
    """Bounded waits that fail fast when a peer this process depends on is gone.

    Each wait is one C++ wait (tw.wait_any, the GIL released) over the awaited
    slot or request and the channels to the watched peers: a peer's failure
    fails it within the device's liveness bound, and the wait drives the
    worker itself (spinning briefly after each arrival, then napping on its
    event fd). What only Python sees (a worker's goodbye, a colocated role's
    failure) sets the watch's alarm word (alarm()), which the wait watches
    too, so nothing is polled in slices."""

    def __init__(self, dev: tw.Device, timeout: float, who: str) -> None:
        self.dev, self.timeout, self.who = dev, timeout, who
        self.peers: dict[int, str] = {}  # device id -> description
        self.channels: dict[int, Any] = {}  # device id -> a channel to it, watched by every wait
        self.excused: set[int] = set()  # peers that said goodbye: their leaving is no failure
        self.partner: Callable[[], str | None] | None = None  # a colocated role's failure, if any
        self._alarm_block = dev.empty(1, "uint64")
        self._alarm = memoryview(self._alarm_block).cast("B").cast("Q")
        self._alarm[0] = 0

    def add(self, device_id: int, description: str, channel: Any = None) -> None:
        """Watches peer `device_id` (named `description` in errors), through
        `channel` in every wait when one is given."""
        self.peers[device_id] = description
        if channel is not None:
            self.channels[device_id] = channel

    def alarm(self) -> None:
        """Wakes a wait to look at the give-up check and the partner again (any thread)."""
        self._alarm[0] = 1

    def check(self, what: str) -> None:
        if self.partner is not None and (err := self.partner()):
            raise PSError(f"{self.who}: {err} while {what}")
        alive = _peer_ids(self.dev)
        for pid, desc in self.peers.items():
            if pid not in alive and pid not in self.excused:
                raise PSError(f"{self.who}: {desc} died or disconnected while {what}")

    def _forget_gone(self) -> bool:
        """Stops watching the channels of excused peers that are gone; whether any were."""
        alive = _peer_ids(self.dev)
        gone = [pid for pid in self.channels if pid not in alive and pid in self.excused]
        for pid in gone:
            del self.channels[pid]
        return bool(gone)

    def _wait(self, items: list, until: float, alarmed: bool) -> int | None:
        """tw.wait_any over `items`, the watched channels and (`alarmed`) the
        alarm word, until `until`: the index of the ready item, or None when
        the alarm rang. Timeout and the channels' failures propagate."""
        extra = list(self.channels.values())
        if alarmed:
            extra.append(tw.Word(self._alarm_block, 0, 1))
        k = tw.wait_any(items + extra, timeout=max(0.0, until - time.monotonic()))
        return k if k < len(items) else None

    def recv(self, slot: Any, what: str, give_up: Callable[[], "str | Wait | None"] | None = None) -> Any:
        """slot.recv() as one bounded wait that fails when a watched peer does.
        `give_up` (asked first, and again when the alarm rings or the slot's
        sender left): None to wait on, a reason (returned instead of a
        tensor), or Wait(until) to wait for the alarm only, until then."""
        deadline = time.monotonic() + self.timeout
        alarmed = give_up is not None or self.partner is not None
        while True:
            self._alarm[0] = 0  # before looking: an event after this rings again
            if self.partner is not None:
                self.check(what)
            reason = give_up() if give_up is not None else None
            if reason is not None and not isinstance(reason, Wait):
                return reason
            until = deadline if reason is None else min(deadline, reason.until)
            try:
                if self._wait([] if reason is not None else [slot], until, alarmed) is not None:
                    return slot.recv(timeout=0)  # ready: at once
            except tw.Timeout:
                if time.monotonic() < deadline:
                    continue  # a Wait's time is up: the check says what now
                raise PSError(f"{self.who}: timed out after {self.timeout:.0f} s {what}") from None
            except tw.ConnectionError as e:  # the slot's sender, or a watched peer, died or left
                if give_up is not None and reason is None:
                    reason = give_up()
                    if isinstance(reason, Wait):  # it said goodbye: the others may still be finishing
                        continue
                    if reason is not None:
                        return reason
                self.check(what)
                if self._forget_gone():
                    continue
                raise PSError(f"{self.who}: a peer died or disconnected while {what} ({e})") from None

    def send(self, sender: Any, tensor: Any, what: str) -> Any:
        """sender.send(tensor): its request, or a PSError naming a peer that died."""
        try:
            return sender.send(tensor, self.timeout)
        except tw.Error as e:
            self.check(what)
            raise PSError(f"{self.who}: {what} failed: {e}") from None

    def wait(self, req: Any, what: str) -> None:
        """req.wait() as one bounded wait that fails when a watched peer does."""
        deadline = time.monotonic() + self.timeout
        alarmed = self.partner is not None
        while True:
            self._alarm[0] = 0
            if alarmed:
                self.check(what)
            try:
                if self._wait([req], deadline, alarmed) is not None:
                    req.wait(0)  # completed: returns, or raises its failure at once
                    return
            except tw.Timeout:
                raise PSError(f"{self.who}: timed out after {self.timeout:.0f} s {what}") from None
            except tw.Error as e:
                self.check(what)
                if isinstance(e, tw.ConnectionError) and self._forget_gone():
                    continue
                raise PSError(f"{self.who}: {what} failed: {e}") from None


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
    bytes_staged_per_step: int = 0  # GDR off: copied between the GPU and host memory (ps.memory)
    registrations: int = 0
    extra: dict = field(default_factory=dict)

    def mean(self, key: str, skip: int = 0) -> float:
        vals = [s[key] for s in self.steps[skip:] if key in s]
        return sum(vals) / len(vals) if vals else float("nan")

    def to_dict(self, skip: int = 0) -> dict:
        keys = sorted({k for s in self.steps for k in s})
        extra = self.mean("extra_copied", skip)  # gradients autograd left outside their block, moved there
        staged = self.mean("extra_staged", skip)  # sparse gradients staged (GDR off): their size varies
        return {
            "role": self.role,
            "rank": self.rank,
            "mode": self.mode,
            "steps": len(self.steps),
            "mean": {k: self.mean(k, skip) for k in keys},
            "bytes_copied_per_step": self.bytes_copied_per_step + (0 if math.isnan(extra) else round(extra)),
            "bytes_sent_per_step": self.bytes_sent_per_step,
            "registrations": self.registrations,
            "bytes_staged_per_step": self.bytes_staged_per_step + (0 if math.isnan(staged) else round(staged)),
            **self.extra,
        }
