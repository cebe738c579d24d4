"""The local launcher: train() runs every role in a spawned process (or a
thread), supervises them and sums up their reports; the role mains are what
each of those processes runs. Servers publish their addresses in the run's
store and workers find them there (tensorwire.ranks.rendezvous: a TCPStore this
process hosts, or under torchrun the job's own, launch_env): the same keys
in both launches, and the role pipes carry only results and errors."""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

import tensorwire as tw

from ...progress import Progress
from ...ranks.launch import free_port
from ...ranks.rendezvous import Aborted, Store, TorchStore, gather, publish
from ...ranks.roles import RoleError, Roles
from .common import DEFAULT_TIMEOUT_S, MALLOC_ENV, MODES, PLACEMENTS, PSError, default_loss, server_lanes, to_device
from .gloo import GlooGroup, GlooServer, GlooWorker
from .memory import Memory, cuda_problem
from .server import Server
from .worker import Worker


@dataclass
class TrainConfig:
    """Everything a spawned role needs (picklable)."""

    model_fn: Callable[..., nn.Module]
    data_fn: Callable[[int, int], Any]  # (worker rank, step) -> (inputs, target)
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
    die: tuple[int, int] | None = None  # (worker rank, step): that worker exits there (tests)
    model_fn_takes_rank: bool = False
    placement: str = "balanced"  # see place()
    colocate: bool = False  # process r runs worker r and server r (the paper's layout)
    device: str = "cpu"  # where every role computes: cpu, cuda, cuda:N (ps.memory)
    gdr: bool | None = None  # GPU memory moved directly (default) or staged via host


def _build_model(cfg: TrainConfig, rank: int) -> nn.Module:
    with _BUILD_LOCK:  # the global RNG: roles run as threads must not interleave their draws
        torch.manual_seed(cfg.seed)
        return cfg.model_fn(rank) if cfg.model_fn_takes_rank else cfg.model_fn()


_BUILD_LOCK = threading.Lock()


def _keys() -> str:
    """Where the servers' addresses meet in the run's store: one run and attempt
    of a torchrun job (a restart never reads the last attempt's), "run/0" otherwise."""
    return (
        f"tensorwire/ps/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    )


def publish_server(store: Store, rank: int, address: str) -> None:
    publish(store, f"{_keys()}/server", rank, address)


def server_addresses(store: Store, servers: int, timeout: float) -> list[str]:
    """Every server's address, once all published theirs (PSError naming the
    missing ones after `timeout` s, or as soon as a role said setup failed)."""
    try:
        return [
            a.decode()
            for a in gather(
                store,
                f"{_keys()}/server",
                servers,
                timeout,
                f"publish an address within {timeout:g} s",
                f"{_keys()}/error",
                "server",
            )
        ]
    except (Aborted, tw.Timeout) as e:
        raise PSError(str(e)) from None


def abort_setup(store: Store | None, why: str) -> None:
    """Tells the roles still waiting for addresses that this one failed (as far as the store is reachable)."""
    if store is not None:
        try:
            store.set(f"{_keys()}/error", why)
        except tw.Error:
            pass


def _samples(x: Any) -> int:
    while isinstance(x, (tuple, list)):
        x = x[0]
    return int(x.shape[0])


def worker_loop(cfg: TrainConfig, rank: int, worker: Any, model: nn.Module) -> dict:
    loss_fn = cfg.loss_fn or default_loss
    die_at = cfg.die[1] if cfg.die is not None and cfg.die[0] == rank else None
    losses, t_start, samples = [], None, 0
    bar = Progress(cfg.steps, "train", cfg.progress and rank == 0)
    t_begin = time.perf_counter()
    for step in range(cfg.steps):
        if step == cfg.warmup:
            t_start = time.perf_counter()
        x, y = cfg.data_fn(rank, step)
        if cfg.device != "cpu":  # the batch is on the GPU before the step starts (data loading is not timed)
            x, y = to_device(x, cfg.device), to_device(y, cfg.device)
        losses.append(worker.step(lambda: loss_fn(model(x), y), die_at=die_at))
        if step >= cfg.warmup:
            samples += _samples(x)
        bar.step(f"loss {losses[-1]:.4f}")
    t_end = time.perf_counter()
    out = {
        "losses": losses,
        "elapsed_s": t_end - (t_start or t_begin),
        "samples": samples,
        "step_times": [st["step_s"] for st in worker.stats.steps],
        "total_s": t_end - t_begin,
        "stats": worker.stats.to_dict(skip=cfg.warmup),
    }
    if cfg.collect_params:
        # numpy, not torch: torch pickles tensors through shared memory that dies with this process
        out["params"] = {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}
    return out


def _colocated(cfg: TrainConfig, rank: int, store: Store | None, init_method: str | None) -> dict:
    """Worker `rank` (this thread) and server `rank` (a second thread) in one
    process, sharing one device (or gloo process group): what the worker and
    its own server exchange never crosses the transport."""
    box: dict = {}
    if cfg.mode == "gloo":
        assert init_method is not None  # gloo's rendezvous (the launcher's, in gloo mode)
        group = GlooGroup("both", rank, cfg.servers, cfg.workers, init_method, cfg.timeout, colocated=True)

        def serve() -> None:
            srv = GlooServer(
                rank,
                cfg.servers,
                cfg.workers,
                init_method,
                cfg.optimizer,
                cfg.timeout,
                cfg.placement,
                group=group,
                **cfg.optimizer_kwargs,
            )
            box["stats"] = srv.run(cfg.steps).to_dict(skip=cfg.warmup)
    else:
        assert store is not None  # where the servers publish their addresses (the launcher's, but for gloo)
        dev = tw.Device(transport=cfg.transport, workers=server_lanes(cfg.workers))
        srv = Server(
            rank,
            cfg.servers,
            cfg.workers,
            cfg.optimizer,
            cfg.mode,
            cfg.transport,
            timeout=cfg.timeout,
            placement=cfg.placement,
            device=dev,
            compute=cfg.device,
            gdr=cfg.gdr,
            **cfg.optimizer_kwargs,
        )
        publish_server(store, rank, srv.address)
        addresses = server_addresses(store, cfg.servers, cfg.timeout)

        def serve() -> None:
            box["stats"] = srv.run().to_dict(skip=cfg.warmup)

    def serve_and_report() -> None:
        try:
            serve()
        except BaseException as e:  # noqa: BLE001 - reported by the worker's thread
            box["error"] = str(e) if isinstance(e, PSError) else f"{type(e).__name__}: {e}"
            if "watch" in box:  # wakes the worker's wait (before it exists, its first wait looks)
                box["watch"].alarm()

    t = threading.Thread(target=serve_and_report, name=f"tensorwire-ps-server{rank}", daemon=True)
    t.start()
    model = _build_model(cfg, rank)
    if cfg.mode == "gloo":
        assert init_method is not None
        w: Any = GlooWorker(model, rank, cfg.servers, cfg.workers, init_method, cfg.timeout, cfg.placement, group=group)
    else:
        w = Worker(
            model,
            addresses,
            rank,
            cfg.workers,
            cfg.mode,
            cfg.transport,
            timeout=cfg.timeout,
            placement=cfg.placement,
            device=dev,
            compute=cfg.device,
            gdr=cfg.gdr,
        )
        w.watch.partner = lambda: box.get("error") and f"its colocated server failed: {box['error']}"
        box["watch"] = w.watch
    try:
        result = worker_loop(cfg, rank, w, model)
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


def _role_main(
    conn: Any, role: str, rank: int, cfg: TrainConfig, store_address: str | None, init_method: str | None
) -> None:
    """Entry point of a spawned process: runs one role, sends its result (or error)
    back. `store_address`: the launcher's TCPStore (not for gloo)."""
    torch.set_num_threads(cfg.threads)
    store = None
    try:
        store = TorchStore.connect(store_address, cfg.timeout) if store_address else None
        if role == "coloc":
            result = _colocated(cfg, rank, store, init_method)
        elif cfg.mode == "gloo":
            assert init_method is not None  # gloo's rendezvous (the launcher's, in gloo mode)
            if role == "server":
                gsrv = GlooServer(
                    rank,
                    cfg.servers,
                    cfg.workers,
                    init_method,
                    cfg.optimizer,
                    cfg.timeout,
                    cfg.placement,
                    **cfg.optimizer_kwargs,
                )
                result = {"stats": gsrv.run(cfg.steps).to_dict(skip=cfg.warmup)}
            else:
                model = _build_model(cfg, rank)
                gw = GlooWorker(model, rank, cfg.servers, cfg.workers, init_method, cfg.timeout, cfg.placement)
                try:
                    result = worker_loop(cfg, rank, gw, model)
                finally:
                    gw.close()
        elif store is None:
            raise PSError(f"{role} {rank}: no store to meet the servers in (only gloo runs without one)")
        elif role == "server":
            srv = Server(
                rank,
                cfg.servers,
                cfg.workers,
                cfg.optimizer,
                cfg.mode,
                cfg.transport,
                timeout=cfg.timeout,
                placement=cfg.placement,
                compute=cfg.device,
                gdr=cfg.gdr,
                **cfg.optimizer_kwargs,
            )
            publish_server(store, rank, srv.address)
            result = {"stats": srv.run().to_dict(skip=cfg.warmup)}
        else:
            addresses = server_addresses(store, cfg.servers, cfg.timeout)
            model = _build_model(cfg, rank)
            w = Worker(
                model,
                addresses,
                rank,
                cfg.workers,
                cfg.mode,
                cfg.transport,
                timeout=cfg.timeout,
                placement=cfg.placement,
                compute=cfg.device,
                gdr=cfg.gdr,
            )
            try:
                result = worker_loop(cfg, rank, w, model)
            finally:
                w.close()
        conn.send(("result", result))
    except BaseException as e:  # noqa: BLE001 - reported to the launcher
        msg = str(e) if isinstance(e, PSError) else f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        abort_setup(store, f"{'worker and server' if role == 'coloc' else role} {rank}: {msg}")
        try:
            conn.send(("error", msg))
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
    split: dict  # mean seconds per step: compute, push, aggregate, pull, step
    losses: list[float]  # per step: the mean of the workers' losses (= the loss of the global batch)
    worker_losses: list[list[float]]
    bytes_copied_per_step: int  # all processes together
    bytes_sent_per_step: int
    roles: list[dict]
    params: dict | None = None
    wall_s: float = 0.0
    colocate: bool = False
    device: str = "cpu"
    gdr: bool | None = None
    bytes_staged_per_step: int = 0  # GDR off: between the GPUs and host memory, all processes together

    def to_dict(self) -> dict:
        d = {
            k: getattr(self, k)
            for k in (
                "mode",
                "workers",
                "servers",
                "steps",
                "samples_per_s",
                "split",
                "losses",
                "bytes_copied_per_step",
                "bytes_sent_per_step",
                "wall_s",
                "colocate",
                "device",
                "gdr",
                "bytes_staged_per_step",
            )
        }
        d["roles"] = self.roles
        return d


def train(
    model_fn: Callable[..., nn.Module],
    data_fn: Callable[[int, int], Any],
    *,
    workers: int = 2,
    servers: int = 2,
    steps: int = 50,
    mode: str = "zerocopy",
    transport: str = "auto",
    optimizer: Any = "sgd",
    loss_fn: Callable | None = None,
    seed: int = 0,
    warmup: int = 2,
    timeout: float = DEFAULT_TIMEOUT_S,
    threads: int = 1,
    collect_params: bool = False,
    progress: bool = False,
    die: tuple[int, int] | None = None,
    launcher: str = "processes",
    placement: str = "balanced",
    colocate: bool = False,
    device: str = "cpu",
    gdr: bool | None = None,
    **optimizer_kwargs: Any,
) -> TrainResult:
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
        device: where every role computes and keeps its tensors: "cpu" (the
            default), "cuda" or "cuda:N" (all roles on that GPU; modes zerocopy
            and copy). gdr: with a GPU, True (the default) registers GPU memory
            and moves it directly; False stages every tensor that moves through
            host memory (the paper's "GDR off"). On the CPU, False runs that
            staging path with CPU compute tensors (tests). See ps.memory.
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
        raise ValueError(
            f"colocate runs worker r and server r in process r: needs servers == workers "
            f"(got {servers} servers, {workers} workers)"
        )
    if colocate and launcher != "processes":
        raise ValueError("colocate needs launcher='processes'")
    mem = Memory(device, gdr)  # checks the pair (touches no GPU)
    if mem.cuda and mode == "gloo":
        raise ValueError("mode gloo runs on the CPU; device cuda runs modes zerocopy and copy")
    if mem.cuda and (problem := cuda_problem(device)):
        raise PSError(f"device {device} {problem}" if problem.startswith("needs") else problem)
    if "lr" not in optimizer_kwargs and isinstance(optimizer, str) and optimizer.lower() == "sgd":
        optimizer_kwargs["lr"] = 0.01
    try:
        takes_rank = "rank" in inspect.signature(model_fn).parameters
    except (TypeError, ValueError):
        takes_rank = False
    cfg = TrainConfig(
        model_fn,
        data_fn,
        loss_fn,
        workers,
        servers,
        steps,
        mode,
        transport,
        optimizer,
        dict(optimizer_kwargs),
        seed,
        min(warmup, max(0, steps - 1)),
        timeout,
        threads,
        collect_params,
        progress,
        die,
        takes_rank,
        placement,
        colocate,
        device,
        gdr,
    )
    if launcher not in ("processes", "threads"):
        raise ValueError(f"launcher must be processes or threads, not {launcher!r}")
    if launcher == "threads":
        if mode == "gloo" or die is not None:
            raise ValueError("launcher='threads' runs modes zerocopy and copy without fault injection")
        cfg.threads = torch.get_num_threads()
    t0 = time.perf_counter()
    # where servers publish their addresses (gloo meets in its own process group)
    store = None if mode == "gloo" else TorchStore.host("127.0.0.1", 0, timeout)
    with Roles() as roles:

        def start(role: str, rank: int) -> None:
            name = f"worker and server {rank}" if role == "coloc" else f"{role} {rank}"
            args = (_role_main, role, rank, cfg, store and store.address, init_method)
            if launcher == "threads":
                roles.thread(name, *args)
            else:  # MALLOC_ENV: read by glibc when each role starts
                roles.spawn(name, *args, env_defaults=MALLOC_ENV)
            kinds.append((role, rank))

        kinds: list[tuple[str, int]] = []
        init_method = f"tcp://127.0.0.1:{free_port()}" if mode == "gloo" else None
        try:
            if colocate:
                for r in range(workers):
                    start("coloc", r)
            else:
                for s in range(servers):
                    start("server", s)
                for w in range(workers):
                    start("worker", w)
            roles.supervise(linger=FAILURE_GRACE_S)
        except RoleError as e:
            if e.first is None:
                raise PSError(str(e)) from None
            detail = "\n".join(f"  {r.name}: {(r.failure() or 'no report').strip()}" for r in roles if not r.has_result)
            raise PSError(f"training failed ({e.first.name} first):\n{detail}") from None
        roles.stop(wait=5)
    return _summarise(cfg, [(k, r, role.result) for (k, r), role in zip(kinds, roles)], time.perf_counter() - t0)


# Once a role failed, how long the others may take to fail on their own
# (they notice the dead peer and say so) before the launcher kills them.
FAILURE_GRACE_S = 10.0


def _summarise(cfg: TrainConfig, reports: list[tuple[str, int, dict]], wall: float) -> TrainResult:
    # every role's report, by rank (a colocated process reports both of its roles)
    wk_by_rank: dict[int, dict] = {}
    sv_by_rank: dict[int, dict] = {}
    for role, rank, result in reports:
        if role == "coloc":
            wk_by_rank[rank], sv_by_rank[rank] = result["worker"], result["server"]
        else:
            (wk_by_rank if role == "worker" else sv_by_rank)[rank] = result
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
    roles = [dict(r["stats"], losses=r["losses"], step_times=r["step_times"]) for r in wk] + [r["stats"] for r in sv]
    mean_losses = [sum(ls) / len(ls) for ls in zip(*(r["losses"] for r in wk))]
    return TrainResult(
        cfg.mode,
        cfg.workers,
        cfg.servers,
        cfg.steps,
        samples / elapsed if elapsed > 0 else float("nan"),
        split,
        mean_losses,
        [r["losses"] for r in wk],
        copied,
        sent,
        roles,
        _params_of(wk[0].get("params")),
        wall,
        cfg.colocate,
        cfg.device,
        Memory(cfg.device, cfg.gdr).gdr,
        sum(r["stats"]["bytes_staged_per_step"] for r in wk + sv),
    )


def _params_of(arrays: dict | None) -> dict | None:
    return None if arrays is None else {n: torch.from_numpy(a) for n, a in arrays.items()}
