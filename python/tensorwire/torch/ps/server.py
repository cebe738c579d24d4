"""The parameter server over tensorwire slots (modes zerocopy and copy), on the
CPU or a GPU (ps.memory: the same steps, the memory kind a parameter)."""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import torch
from torch import nn

import tensorwire as tw

from .common import (
    BYE_GRACE_S,
    DEFAULT_TIMEOUT_S,
    PLACEMENTS,
    PSError,
    Stats,
    VarSpec,
    Wait,
    mean_into,
    Watch,
    check_specs,
    make_optimizer,
    place,
    server_lanes,
)
from .memory import Memory


class Server:
    """One parameter server over tensorwire slots (modes zerocopy and copy).

    Creates its device at once (``address`` is what workers connect to);
    :meth:`run` waits for the ``num_workers`` workers, checks that their models
    agree, takes the initial values from worker 0, and serves steps until every
    worker called :meth:`Worker.close` (or raises :class:`PSError` when a worker
    dies, refuses, or a step exceeds ``timeout``).

    ``compute``: "cpu" (default), "cuda" or "cuda:N": where the master copies
    live and the optimizer runs; ``gdr`` (GPU only, default on): gradient slots
    and master copies in registered GPU memory, or (False) in host memory with
    copies to and from the GPU (see ps.memory)."""

    def __init__(
        self,
        rank: int = 0,
        num_servers: int = 1,
        num_workers: int = 1,
        optimizer: Any = "sgd",
        mode: str = "zerocopy",
        transport: str = "auto",
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = DEFAULT_TIMEOUT_S,
        device_kwargs: dict | None = None,
        placement: str = "balanced",
        device: tw.Device | None = None,
        compute: str = "cpu",
        gdr: bool | None = None,
        **optimizer_kwargs: Any,
    ):
        if mode not in ("zerocopy", "copy"):
            raise ValueError(f"Server runs modes zerocopy and copy; gloo has GlooServer (got {mode!r})")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
        self.placement = placement
        self.rank, self.num_servers, self.num_workers = rank, num_servers, num_workers
        self.mode, self.timeout = mode, timeout
        self.mem = Memory(compute, gdr)
        self.optimizer_spec, self.optimizer_kwargs = optimizer, optimizer_kwargs
        # a device passed in is shared with a colocated Worker (and closed by its owner)
        self._own_dev = device is None
        self.dev = device or tw.Device(
            host=host, port=port, transport=transport, **{"workers": server_lanes(num_workers), **(device_kwargs or {})}
        )
        self.who = f"server {rank}"
        self.watch = Watch(self.dev, timeout, self.who)
        self._hellos: dict[int, dict] = {}
        self._byes: set[int] = set()
        self._state = "wait"
        self._error = ""
        self._init_slot = self.dev.dynamic_slot("ps.init")
        self.dev.on_call("ps.hello", self._on_hello)
        self.dev.on_call("ps.bye", self._on_bye)
        self.stats = Stats("server", rank, mode)
        self.steps_done = 0
        self._staged = 0  # sparse bytes staged this step (GDR off)

    @property
    def address(self) -> str:
        return self.dev.address

    # handlers run on the device's dispatcher thread: record and answer, never block
    def _on_hello(self, payload: bytes) -> bytes:
        msg = json.loads(payload)
        r = int(msg["rank"])
        if not 0 <= r < self.num_workers:
            return json.dumps(
                {"state": "refused", "error": f"{self.who} expects workers 0..{self.num_workers - 1}, not rank {r}"}
            ).encode()
        if msg.get("mode") != self.mode:
            return json.dumps(
                {
                    "state": "refused",
                    "error": f"{self.who} runs mode {self.mode!r}, worker {r} asked for {msg.get('mode')!r}",
                }
            ).encode()
        if msg.get("placement") != self.placement:
            return json.dumps(
                {
                    "state": "refused",
                    "error": f"{self.who} places variables {self.placement!r}, worker {r} {msg.get('placement')!r}",
                }
            ).encode()
        msg["rank"] = r  # checked above; the lane of this worker's channels (server_lanes)
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
        self.watch.alarm()  # a wait for this worker's gradient asks _give_up again
        return b"ok"

    def _setup(self) -> None:
        deadline = time.monotonic() + self.timeout
        while len(self._hellos) < self.num_workers:
            if time.monotonic() > deadline:
                raise PSError(
                    f"{self.who}: only workers {sorted(self._hellos)} of {self.num_workers} "
                    f"arrived within {self.timeout:.0f} s"
                )
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
        # the channels to the workers: their parameters go out on them, and every wait watches them
        self.channels = [self.dev.connect(h["address"], lane=h["rank"]) for h in hellos]  # (server_lanes)
        for h, ch in zip(hellos, self.channels):
            self.watch.add(int(h["device_id"]), f"worker {h['rank']} (pid {h['pid']}, {h['address']})", ch)
        self.all_vars = specs[0]
        owner = place([v.nbytes for v in self.all_vars], self.num_servers, self.placement)
        self.vars = [v for v, s in zip(self.all_vars, owner) if s == self.rank]
        W = self.num_workers
        # master copies: registered memory (zerocopy) or plain torch memory (copy);
        # staged (GDR off): plain GPU memory, sent from a host block it is copied into
        mem = self.mem
        self.blocks, self.master = [], []
        for v in self.vars:
            if self.mode == "zerocopy" and not mem.staged:
                blk = mem.block(self.dev, v)
                t = torch.from_dlpack(blk)
            else:
                blk, t = (mem.block(self.dev, v) if mem.staged else None), mem.empty(v)
            self.blocks.append(blk)
            self.master.append(nn.Parameter(t, requires_grad=True))
        self._wire = [None if b is None or not mem.staged else torch.from_dlpack(b).view(-1) for b in self.blocks]
        # staged: the GPU copies of worker 0's gradient (it becomes .grad) and of the others' (summed in)
        self._land = [mem.empty(v) if mem.staged and not v.sparse else None for v in self.vars]
        self._scratch = [mem.empty(v) if mem.staged and not v.sparse and W > 1 else None for v in self.vars]
        self.grad_slots = [
            [
                mem.dynamic_slot(self.dev, f"sgrad/{v.name}/{w}")
                if v.sparse
                else mem.static_slot(self.dev, f"grad/{v.name}/{w}", v, depth=1)
                for w in range(W)
            ]
            for v in self.vars
        ]
        self._state = "ready"
        # initial values from worker 0, in the order of this server's variables
        for v, m in zip(self.vars, self.master):
            blk = self.watch.recv(self._init_slot, f"waiting for the initial value of {v.name!r}")
            with torch.no_grad():
                m.copy_(torch.from_dlpack(blk).view(m.shape))
            del blk
        self.opt = make_optimizer(self.optimizer_spec, list(self.master), **self.optimizer_kwargs)
        path = "copy"
        self.param_senders = [
            [ch.static_sender(f"param/{v.name}", path=path, timeout=self.timeout) for ch in self.channels]
            for v in self.vars
        ]
        self.stats.bytes_copied_per_step = (
            0 if self.mode == "zerocopy" or mem.staged else W * sum(v.nbytes for v in self.vars)
        )
        if mem.staged:  # parameters out once each, every worker's dense gradients in (sparse: per step)
            self.stats.bytes_staged_per_step = sum(v.nbytes for v in self.vars) + W * sum(
                v.nbytes for v in self.vars if not v.sparse
            )
        # A colocated worker (on this very device) gets its parameters by a
        # memcpy in the sending thread: sent last, after the remote transfers
        # are under way.
        local = [w for w, h in enumerate(hellos) if int(h["device_id"]) == self.dev.id]
        self._send_order = [w for w in range(W) if w not in local] + local
        self.stats.bytes_sent_per_step = (W - len(local)) * sum(v.nbytes for v in self.vars)
        self.stats.extra["vars"] = [v.name for v in self.vars]
        self.stats.extra["device"] = mem.label
        mem.sync()  # the initial values are in the master copies before they are sent
        self._send_params()

    def _send_params(self) -> None:
        reqs = []
        for k, w in enumerate(self._send_order):
            for i, v in enumerate(self.vars):
                wire = self._wire[i]
                if k == 0 and wire is not None:  # staged: into its host block, once for all workers
                    wire.copy_(self.master[i].detach().view(-1))
                src = self.blocks[i] if self.blocks[i] is not None else self.master[i].detach()
                what = f"sending {v.name!r} to worker {w}"
                reqs.append((self.watch.send(self.param_senders[i][w], src, what), what, w))
        for req, what, w in reqs:
            try:
                self.watch.wait(req, what)
            except PSError:
                # A worker says goodbye only after it received every parameter
                # of its last step: its closing may fail our request (over tcp
                # the completion waits for its ack) after the bytes landed.
                if w in self._byes:
                    continue
                raise

    def _give_up(self, first: bool, w: int, what: str) -> Callable[[], str | Wait | None]:
        def check() -> str | Wait | None:
            if first and len(self._byes) == self.num_workers:
                return "done"
            if w in self._byes:
                if not first or time.monotonic() - self._first_bye > BYE_GRACE_S:
                    raise PSError(
                        f"{self.who}: worker {w} left after {self.steps_done} steps while {what}; "
                        f"all workers must run the same number of steps"
                    )
                return Wait(self._first_bye + BYE_GRACE_S)
            return None

        return check

    def _waiting_for(self, i: int, w: int) -> str:
        return f"waiting for worker {w}'s gradient of {self.vars[i].name!r} (step {self.steps_done + 1})"

    def _recv_gradient(self, i: int, w: int, first: bool) -> Any:
        """Worker w's next gradient of variable i (a sparse one's indices), or
        None once every worker has left (_give_up judges)."""
        what = self._waiting_for(i, w)
        got = self.watch.recv(self.grad_slots[i][w], what, self._give_up(first, w, what))
        return None if isinstance(got, str) else got

    def _step(self) -> bool:
        """One step; False once every worker has left."""
        W = self.num_workers
        t0 = time.perf_counter()
        t_sum = 0.0
        first = True
        mem = self.mem
        # (slot, view) whose buffer the optimizer still reads (worker 0's, the
        # gradient itself), or on a GPU that queued kernels still read: released
        # once the optimizer ran (and the GPU finished)
        held: list = []
        keep: list = []  # GPU: received sparse blocks that queued copies still read
        for i, v in enumerate(self.vars):
            m = self.master[i]
            if v.sparse:
                idx, vals = [], []
                for w in range(W):
                    bi = self._recv_gradient(i, w, first)
                    if bi is None:
                        return False
                    first = False
                    bv = self.watch.recv(self.grad_slots[i][w], self._waiting_for(i, w))
                    ts = time.perf_counter()
                    idx.append(mem.to_compute(torch.from_dlpack(bi)))
                    vals.append(mem.to_compute(torch.from_dlpack(bv)))
                    if mem.defer:
                        keep += [bi, bv]
                    elif mem.staged:
                        self._staged += bi.nbytes + bv.nbytes
                    t_sum += time.perf_counter() - ts
                ts = time.perf_counter()
                g = torch.sparse_coo_tensor(
                    torch.cat(idx).view(1, -1), torch.cat(vals) / W, v.shape, check_invariants=False
                )
                m.grad = g.coalesce()
                t_sum += time.perf_counter() - ts
                continue
            for w in range(W):
                view = self._recv_gradient(i, w, first)
                if view is None:
                    return False
                first = False
                ts = time.perf_counter()
                g = mem.tensor(view, v)
                if mem.staged:  # a blocking copy to the GPU: the slot's buffer is free again at once
                    buf = self._land[i] if w == 0 else self._scratch[i]
                    assert buf is not None  # a staged dense variable has both
                    g = buf.copy_(g.view(m.shape))
                if w == 0:  # worker 0's slot buffer (staged: its GPU copy) becomes the gradient: no copy
                    m.grad = grad = g
                else:
                    mean_into(grad, g, w)
                if (w == 0 and not mem.staged) or mem.defer:
                    held.append((self.grad_slots[i][w], view))
                else:
                    self.grad_slots[i][w].release(view)
                t_sum += time.perf_counter() - ts
        t1 = time.perf_counter()
        self.opt.step()
        mem.sync()  # the update is done: the gradients were read, the new values may be sent
        for slot, view in held:  # the optimizer has read them: workers may push again
            slot.release(view)
        keep.clear()
        for i, v in enumerate(self.vars):  # no .grad left pointing at memory a worker overwrites
            if not v.sparse:
                self.master[i].grad = None
        t2 = time.perf_counter()
        self._send_params()
        t3 = time.perf_counter()
        self.steps_done += 1
        self.stats.steps.append(
            {
                "wait_s": t1 - t0 - t_sum,
                "sum_s": t_sum,
                "optimizer_s": t2 - t1,
                "aggregate_s": t_sum + (t2 - t1),
                "pull_s": t3 - t2,
                "step_s": t3 - t0,
                **({"extra_staged": self._staged} if mem.staged else {}),
            }
        )
        self._staged = 0
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
