"""One role per process under torchrun / mpirun (`tensorwire train` with RANK and
WORLD_SIZE, or OMPI_COMM_WORLD_RANK/SIZE, set): ranks 0..S-1 serve, S..S+W-1
train. Server addresses meet in the job's TCPStore at MASTER_ADDR:MASTER_PORT
(tensorwire.ranks.rendezvous.torchrun_store: torchrun's own where it hosts one),
under the keys of the local launch (ps.launch)."""

from __future__ import annotations

import json
import os
import sys

from ...ranks.rendezvous import torchrun_store


def run_role(args, rank: int, world: int) -> int:
    import torch
    from ...torch import ps
    from . import models
    from .runs import data_fn_of, gdr_of, opt_kwargs
    from ...torch.ps.launch import worker_loop, abort_setup, publish_server, server_addresses

    S, W = args.servers, args.workers
    if world != S + W:
        print(f"tensorwire train: WORLD_SIZE is {world}, but --servers {S} + --workers {W} = {S + W}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    role, r = ("server", rank) if rank < S else ("worker", rank - S)
    info = models.get(args.model)
    dev, gdr = getattr(args, "device", "cpu"), gdr_of(getattr(args, "gdr", None))
    if dev != "cpu" and not args.image_size:  # as train_once: the paper's input size on a GPU
        args.image_size = info.image_size
    data_fn = data_fn_of(args)
    if args.mode == "gloo":
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", "29500"))
        init = "env://" if "MASTER_ADDR" in os.environ and "RANK" in os.environ else f"tcp://{host}:{port}"
        if role == "server":
            gsrv = ps.GlooServer(r, S, W, init, args.optimizer, args.timeout, args.placement, **opt_kwargs(args))
            stats = gsrv.run(args.steps)
            print(json.dumps({"role": role, "rank": r, "stats": stats.to_dict(args.warmup)}))
            return 0
        torch.manual_seed(args.seed)
        model = info.factory()
        worker: ps.Worker | ps.GlooWorker = ps.GlooWorker(model, r, S, W, init, args.timeout, args.placement)
    else:
        store = torchrun_store(rank, args.timeout)
        if role == "server":
            try:
                srv = ps.Server(
                    r,
                    S,
                    W,
                    args.optimizer,
                    args.mode,
                    args.transport,
                    host=_my_host(),
                    timeout=args.timeout,
                    placement=args.placement,
                    compute=dev,
                    gdr=gdr,
                    **opt_kwargs(args),
                )
            except BaseException as e:
                abort_setup(store, f"server {r}: {type(e).__name__}: {e}")
                raise
            publish_server(store, r, srv.address)
            stats = srv.run()
            print(json.dumps({"role": role, "rank": r, "stats": stats.to_dict(args.warmup)}))
            return 0
        addresses = server_addresses(store, S, args.timeout)
        torch.manual_seed(args.seed)
        model = info.factory()
        worker = ps.Worker(
            model,
            addresses,
            r,
            W,
            args.mode,
            args.transport,
            host=_my_host(),
            timeout=args.timeout,
            placement=args.placement,
            compute=dev,
            gdr=gdr,
        )
    cfg = ps.TrainConfig(
        info.factory,
        data_fn,
        None,
        W,
        S,
        args.steps,
        args.mode,
        args.transport,
        args.optimizer,
        opt_kwargs(args),
        args.seed,
        args.warmup,
        args.timeout,
        args.threads,
        progress=bool(args.progress) and r == 0,
        device=dev,
        gdr=gdr,
    )
    try:
        result = worker_loop(cfg, r, worker, model)
    finally:
        worker.close()
    st = result["stats"]["mean"]
    print(
        json.dumps(
            {
                "role": role,
                "rank": r,
                "samples_per_s": result["samples"] / result["elapsed_s"],
                "split": {k: st.get(k + "_s") for k in ("compute", "push", "aggregate", "pull", "step")},
                "loss_first": result["losses"][0],
                "loss_last": result["losses"][-1],
            }
        )
    )
    return 0


def _my_host() -> str:
    """The address peers reach this process at: TENSORWIRE_HOST, else 127.0.0.1
    when everything runs on one machine (MASTER_ADDR local), else this host's IP."""
    if "TENSORWIRE_HOST" in os.environ:
        return os.environ["TENSORWIRE_HOST"]
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, 9))
        return s.getsockname()[0]
