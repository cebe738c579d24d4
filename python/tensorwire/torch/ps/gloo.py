"""The gloo baseline: the same algorithm as Server and Worker over
torch.distributed (gloo) send/recv of autograd's fresh gradients, the
RPC-style baseline (mode ``gloo``)."""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable

import torch
from torch import nn

from .common import (
    DEFAULT_TIMEOUT_S,
    PSError,
    Stats,
    VarSpec,
    mean_into,
    torch_dtype,
    check_specs,
    make_optimizer,
    place,
    variables,
)


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


class GlooGroup:
    """Ranks 0..S-1 are the servers, S..S+W-1 the workers. Colocated (S == W),
    rank r is worker r and server r, one object shared by both roles of the
    process, and what one role sends the other goes through a mailbox."""

    def __init__(
        self,
        role: str,
        rank: int,
        num_servers: int,
        num_workers: int,
        init_method: str,
        timeout: float,
        colocated: bool = False,
    ) -> None:
        import datetime
        import torch.distributed as dist

        self.dist = dist
        self.S, self.W = num_servers, num_workers
        self.colocated = colocated
        self.mail = _Mailbox(timeout) if colocated else None
        self.global_rank = rank if colocated or role == "server" else num_servers + rank
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo",
                init_method=init_method,
                rank=self.global_rank,
                world_size=num_workers if colocated else num_servers + num_workers,
                timeout=datetime.timedelta(seconds=timeout),
            )

    def _mailbox(self) -> _Mailbox:
        assert self.mail is not None  # a colocated group's (the only one that messages itself)
        return self.mail

    def server_rank(self, s: int) -> int:
        return s

    def worker_rank(self, w: int) -> int:
        return w if self.colocated else self.S + w

    # `to`/`at`: the role ("server" or "worker") that receives; it names the
    # mailbox when the peer is this process's other role
    def isend(self, t: torch.Tensor, dst: int, tag: int, to: str) -> Any:
        if self.colocated and dst == self.global_rank:
            return self._mailbox().put((to, tag), t)
        return self.dist.isend(t, dst, tag=tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int, at: str) -> Any:
        if self.colocated and src == self.global_rank:
            return _MailRecv(self._mailbox(), (at, tag), t)
        return self.dist.irecv(t, src, tag=tag)

    def send(self, t: torch.Tensor, dst: int, tag: int, to: str) -> None:
        self.isend(t, dst, tag, to).wait()

    def recv(self, t: torch.Tensor, src: int, tag: int, at: str) -> None:
        self.irecv(t, src, tag, at).wait()

    def exchange_specs(self, specs: list[VarSpec] | None) -> list[list[VarSpec]]:
        """Every worker's variables. Colocated, the worker role gathers them (one
        collective per process) and hands them to its server."""
        if self.colocated and specs is None:
            return self._mailbox().take(("server", "specs"))
        objs: list = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(objs, [v.to_json() for v in specs] if specs is not None else None)
        out = [[VarSpec.from_json(v) for v in o] for o in objs[self.worker_rank(0) :]]
        if self.colocated:
            self._mailbox().put(("server", "specs"), out)
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


def _send_sparse(g_: GlooGroup, g: torch.Tensor, dst: int, tag: int) -> list:
    g = g.coalesce()
    idx, vals = g.indices()[0].contiguous(), g.values().contiguous()
    n = torch.tensor([idx.numel()], dtype=torch.int64)
    g_.send(n, dst, tag, "server")
    return [g_.isend(idx, dst, tag, "server"), g_.isend(vals, dst, tag, "server")]


def _recv_sparse(g_: GlooGroup, spec: VarSpec, src: int, tag: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = torch.zeros(1, dtype=torch.int64)
    g_.recv(n, src, tag, "server")
    idx = torch.empty(int(n), dtype=torch.int64)
    vals = torch.empty((int(n),) + spec.shape[1:], dtype=torch_dtype(spec.dtype))
    g_.recv(idx, src, tag, "server")
    g_.recv(vals, src, tag, "server")
    return idx, vals


class GlooServer:
    """The parameter server of the gloo baseline: the same algorithm as
    :class:`Server`, every tensor moved by torch.distributed send/recv."""

    def __init__(
        self,
        rank: int,
        num_servers: int,
        num_workers: int,
        init_method: str,
        optimizer: Any = "sgd",
        timeout: float = DEFAULT_TIMEOUT_S,
        placement: str = "balanced",
        group: GlooGroup | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        self.rank, self.W = rank, num_workers
        self.who = f"server {rank}"
        self._own_group = group is None  # a group passed in is shared with a colocated GlooWorker
        self.g = group or GlooGroup("server", rank, num_servers, num_workers, init_method, timeout)
        self.stats = Stats("server", rank, "gloo")
        specs = self.g.validate(self.g.exchange_specs(None), self.who)
        owner = place([v.nbytes for v in specs], num_servers, placement)
        self.tags = [i for i, s in enumerate(owner) if s == rank]
        self.vars = [specs[i] for i in self.tags]
        self.master = [nn.Parameter(torch.empty(v.shape, dtype=torch_dtype(v.dtype))) for v in self.vars]
        for v, m, tag in zip(self.vars, self.master, self.tags):
            self.g.recv(m.data, self.g.worker_rank(0), tag, "server")  # initial values from worker 0
        self.opt = make_optimizer(optimizer, list(self.master), **optimizer_kwargs)
        # a dense variable's receive buffer per worker (a sparse one's arrive in fresh tensors)
        self.bufs = [
            [torch.empty(v.shape, dtype=torch_dtype(v.dtype)) for _ in range(num_workers)] if not v.sparse else []
            for v in self.vars
        ]
        remote = num_workers - (1 if self.g.colocated else 0)  # a colocated worker is served by memcpy
        self.stats.bytes_sent_per_step = remote * sum(v.nbytes for v in self.vars)
        self.stats.extra["vars"] = [v.name for v in self.vars]
        self._send_params()

    def _send_params(self) -> None:
        reqs = [
            self.g.isend(m.detach(), self.g.worker_rank(w), tag, "worker")
            for m, tag in zip(self.master, self.tags)
            for w in range(self.W)
        ]
        for r in reqs:
            r.wait()

    def step(self) -> None:
        g, W = self.g, self.W
        t0 = time.perf_counter()
        dense = [
            g.irecv(self.bufs[i][w], g.worker_rank(w), tag, "server")
            for i, (v, tag) in enumerate(zip(self.vars, self.tags))
            if not v.sparse
            for w in range(W)
        ]
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
                m.grad = grad = self.bufs[i][0]
                for w in range(1, W):
                    mean_into(grad, self.bufs[i][w], w)
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        self._send_params()
        t4 = time.perf_counter()
        self.stats.steps.append(
            {
                "wait_s": t1 - t0,
                "sum_s": t2 - t1,
                "optimizer_s": t3 - t2,
                "aggregate_s": t3 - t1,
                "pull_s": t4 - t3,
                "step_s": t4 - t0,
            }
        )

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

    def __init__(
        self,
        model: nn.Module,
        rank: int,
        num_servers: int,
        num_workers: int,
        init_method: str,
        timeout: float = DEFAULT_TIMEOUT_S,
        placement: str = "balanced",
        group: GlooGroup | None = None,
    ) -> None:
        self.model, self.rank = model, rank
        self.who = f"worker {rank}"
        self._own_group = group is None  # a group passed in is shared with a colocated GlooServer
        self.g = group or GlooGroup("worker", rank, num_servers, num_workers, init_method, timeout)
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
        self.stats.bytes_sent_per_step = sum(
            v.nbytes for (v, _), s in zip(self.vars, self.owner) if not v.sparse and s != local
        )

    def _pull(self) -> float:
        g = self.g
        reqs = [
            g.irecv(p.data, g.server_rank(s), i, "worker") for i, ((v, p), s) in enumerate(zip(self.vars, self.owner))
        ]
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
            grad = p.grad
            if grad is None and not v.sparse:  # the parameter took no part in this loss
                p.grad = grad = torch.zeros_like(p)
            if grad is None:
                raise PSError(
                    f"the sparse parameter {v.name!r} took no part in this loss, so it has no gradient to push"
                )
            if v.sparse:
                reqs += _send_sparse(g, grad, g.server_rank(s), i)
            else:
                reqs.append(g.isend(grad, g.server_rank(s), i, "server"))
        for r in reqs:
            r.wait()
        t2 = time.perf_counter()
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
            }
        )
        return float(loss.detach())

    def close(self) -> None:
        if self._own_group:
            self.g.close()
