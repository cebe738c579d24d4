"""The worker over tensorwire slots (modes zerocopy and copy), on the CPU or a
GPU (ps.memory: the same steps, the memory kind a parameter)."""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Sequence

import torch
from torch import nn

import tensorwire as tw

from .. import alloc_sites
from .common import DEFAULT_TIMEOUT_S, PLACEMENTS, PSError, Stats, Watch, place, variables
from .memory import Memory
from ...slots import DynamicSender, StaticSender


class Worker:
    """One worker over tensorwire slots (modes zerocopy and copy).

    Moves the model's parameters into the static slots the servers write
    (``param/<var>``), gives every dense parameter a ``.grad`` in registered
    memory (zerocopy), meets the servers (checking its model against worker 0's)
    and loads the initial parameters from them. Then :meth:`step` runs one
    synchronous SGD step.

    ``compute`` "cuda" (or "cuda:N") moves the model to that GPU (the caller
    puts its batches there): with ``gdr`` on (the default) parameters and
    gradients are registered GPU memory the servers write and read directly;
    off, they are plain GPU memory copied to and from host blocks (ps.memory)."""

    def __init__(
        self,
        model: nn.Module,
        servers: Sequence[str],
        rank: int = 0,
        num_workers: int = 1,
        mode: str = "zerocopy",
        transport: str = "auto",
        host: str = "127.0.0.1",
        timeout: float = DEFAULT_TIMEOUT_S,
        device_kwargs: dict | None = None,
        placement: str = "balanced",
        device: tw.Device | None = None,
        compute: str = "cpu",
        gdr: bool | None = None,
    ):
        if mode not in ("zerocopy", "copy"):
            raise ValueError(f"Worker runs modes zerocopy and copy; gloo has GlooWorker (got {mode!r})")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
        self.placement = placement
        self.model, self.rank, self.num_workers, self.mode, self.timeout = model, rank, num_workers, mode, timeout
        self.mem = Memory(compute, gdr)
        self.who = f"worker {rank}"
        # a device passed in is shared with a colocated Server (and closed by its owner)
        self._own_dev = device is None
        self.dev = device or tw.Device(host=host, transport=transport, **(device_kwargs or {}))
        self.watch = Watch(self.dev, timeout, self.who)
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
        mem = self.mem
        if mem.cuda:  # (worker 0 sends the servers the initial values from a host copy: setup only)
            self.model.to(mem.device)
        self.vars = variables(self.model)
        specs = [v for v, _ in self.vars]
        self.owner = place([v.nbytes for v in specs], S, self.placement)
        # the receiving side: one static slot per variable, its buffer becomes
        # the parameter (staged: the parameter is copied from it)
        self.param_slots = [mem.static_slot(self.dev, f"param/{v.name}", v, depth=1) for v in specs]
        # gradients (zerocopy): a registered block per dense variable, which the
        # backward of an nn.Linear writes directly (alloc_sites) and autograd
        # accumulates into for any other parameter. copy: autograd's own fresh
        # tensors (PyTorch's default zero_grad(set_to_none=True)), copied to send.
        # Staged (GDR off), the block is host memory every dense gradient is
        # copied into before it is sent; zerocopy then keeps a GPU tensor per
        # gradient for the backward to write (home).
        self.grad_blocks: list = []
        self._home: list = []  # where the backward puts the gradient, when that is fixed
        for v, p in self.vars:
            p.grad = None
            blk = mem.block(self.dev, v) if not v.sparse and (self.mode == "zerocopy" or mem.staged) else None
            self.grad_blocks.append(blk)
            home = None
            if blk is not None and self.mode == "zerocopy":
                home = mem.empty(v).view(-1) if mem.staged else torch.from_dlpack(blk).view(-1)
            self._home.append(home)
        self._wire = [None if b is None or not mem.staged else torch.from_dlpack(b).view(-1) for b in self.grad_blocks]
        block_tensor = {id(p): home for (v, p), home in zip(self.vars, self._home) if home is not None}
        direct = alloc_sites.install(self.model, lambda p: block_tensor.get(id(p)))
        direct_ids = {id(p) for p in direct}
        # produced in place each step (.grad unset before the backward) vs accumulated into a zeroed block
        self._fresh = [not v.sparse and (self.mode == "copy" or id(p) in direct_ids) for v, p in self.vars]
        for (v, p), home, fresh in zip(self.vars, self._home, self._fresh):
            if home is not None and not fresh:
                p.grad = home.view(p.shape)
                p.grad.zero_()
        self.channels = []
        for s, addr in enumerate(servers):
            try:
                ch = self.dev.connect(addr, lane=self.rank)  # the server's lane for this worker (server_lanes)
            except tw.Error as e:
                raise PSError(f"{self.who}: cannot reach server {s} at {addr}: {e}") from None
            self.channels.append(ch)
            self.watch.add(int(ch.peer["device_id"]), f"server {s} ({addr})", ch)
        hello = json.dumps(
            {
                "rank": self.rank,
                "device_id": self.dev.id,
                "address": self.dev.address,
                "pid": os.getpid(),
                "mode": self.mode,
                "placement": self.placement,
                "vars": [v.to_json() for v in specs],
            }
        ).encode()
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
        self.senders: list[DynamicSender | StaticSender] = []
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
                        self.watch.wait(
                            init.send(p.detach().cpu().contiguous(), self.timeout),
                            f"sending the initial value of {v.name!r}",
                        )
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
        self.stats.bytes_sent_per_step = sum(
            v.nbytes for (v, _), s in zip(self.vars, self.owner) if not v.sparse and s not in local
        )
        self.stats.bytes_copied_per_step = (
            0 if self.mode == "zerocopy" or mem.staged else sum(v.nbytes for v, _ in self.vars if not v.sparse)
        )
        if mem.staged:  # dense gradients out, every parameter in (sparse gradients: per step)
            self.stats.bytes_staged_per_step = sum(v.nbytes for v, _ in self.vars if not v.sparse) + sum(
                v.nbytes for v, _ in self.vars
            )
        self.stats.extra["device"] = mem.label

    def _pull(self, first: bool = False) -> float:
        """Waits for every parameter; returns when the first arrived (perf_counter)."""
        t_first = 0.0
        views = []
        for i, ((v, p), slot) in enumerate(zip(self.vars, self.param_slots)):
            view = self.watch.recv(slot, f"waiting for parameter {v.name!r} (step {self.steps_done})")
            if i == 0:
                t_first = time.perf_counter()
            views.append(view)
            if self.mem.staged:  # GDR off: a blocking copy into the parameter's GPU memory
                p.data.copy_(self.mem.tensor(view, v).view(p.shape))
            elif first or self.mem.ptr(view) != p.data_ptr():  # later: never with depth 1; a safety net
                p.data = self.mem.tensor(view, v).view(p.shape)
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
        # On a GPU: the gradients are complete (the stream contract of a send),
        # and no kernel reads the parameters any more when their slots are released.
        self.mem.sync()
        self._zeroed = False
        t1 = time.perf_counter()
        if die_at is not None and self.steps_done + 1 == die_at:  # fault injection (tests)
            os._exit(17)
        for slot in self.param_slots:  # the servers may overwrite our parameters from now on
            slot.release()
        self._views = []
        reqs, copied, staged = [], 0, 0
        mem = self.mem
        for i in self._push_order:
            (v, p), sender = self.vars[i], self.senders[i]
            if v.sparse:
                if p.grad is None:  # as a dense one's below, but no block holds a zero sparse gradient
                    raise PSError(
                        f"{self.who}: the sparse parameter {v.name!r} took no part in this loss, "
                        f"so it has no gradient to push"
                    )
                g = p.grad.coalesce()
                idx, vals = mem.outgoing(g.indices()[0].contiguous()), mem.outgoing(g.values().contiguous())
                staged += (idx.nbytes + vals.nbytes) if mem.staged else 0
                what = f"pushing the gradient of {v.name!r}"
                reqs.append((self.watch.send(sender, idx, what), what))
                reqs.append((self.watch.send(sender, vals, what), what))
                continue
            blk, home = self.grad_blocks[i], self._home[i]
            fixed = p.grad is None or (home is not None and p.grad.data_ptr() != home.data_ptr())
            if p.grad is None:  # the parameter took no part in this loss
                p.grad = torch.zeros_like(p) if home is None else home.view(p.shape).zero_()
            if home is not None and p.grad.data_ptr() != home.data_ptr():  # autograd put .grad elsewhere: move it
                home.view(p.shape).copy_(p.grad)
                copied += v.nbytes
                p.grad = home.view(p.shape)
            wire = self._wire[i]
            if wire is not None:  # GDR off: a blocking copy into its host block
                wire.copy_(p.grad.reshape(-1))
            elif fixed:  # on a GPU the kernels just queued finish before the bytes move
                mem.sync()
            what = f"pushing the gradient of {v.name!r}"
            reqs.append((self.watch.send(sender, blk if blk is not None else p.grad, what), what))
        for req, what in reqs:
            self.watch.wait(req, what)
        t2 = time.perf_counter()
        # the servers aggregate now: zero the accumulated gradients for the next step meanwhile
        self._zero_accumulated()
        self._zeroed = True
        t_first = self._pull()
        t3 = time.perf_counter()
        self.steps_done += 1
        self.stats.steps.append(
            {
                "compute_s": t1 - t0,
                "push_s": t2 - t1,
                "aggregate_s": max(0.0, t_first - t2),
                "pull_s": t3 - max(t_first, t2),
                "step_s": t3 - t0,
                "loss": float(loss.detach()),
                "extra_copied": copied,
                **({"extra_staged": staged} if mem.staged else {}),
            }
        )
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
