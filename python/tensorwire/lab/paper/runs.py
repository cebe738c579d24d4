"""A training run from the command line's options: what `tensorwire train`, `bench
train`, the torchrun role (launch_env) and the plots share. Cheap to import:
torch and the runtime are imported inside the functions."""

from __future__ import annotations

import argparse

MODES = ("zerocopy", "copy", "gloo")


def data_fn_of(args):
    from . import data

    if args.data == "digits":
        if args.model != "mlp":
            raise SystemExit("tensorwire train: --data digits trains --model mlp (64 inputs, 10 classes)")
        return data.Digits(args.batch, args.workers, args.seed)
    return data.Synthetic(args.model, args.batch, args.seed, args.image_size, args.seq_len)


def device_error(args, prog: str) -> str | None:
    """The usage error of --device/--gdr (exit 2), or None. Checked before any work."""
    from ...torch.ps import cuda_problem

    dev = getattr(args, "device", "cpu")
    if getattr(args, "gdr", None) is not None and not dev.startswith("cuda"):
        return f"{prog}: --gdr selects how GPU memory moves: it needs --device cuda"
    if dev.startswith("cuda") and getattr(args, "mode", None) == "gloo":
        return f"{prog}: --mode gloo runs on the CPU; --device cuda runs zerocopy and copy"
    problem = cuda_problem(dev)
    if problem is not None:
        return f"{prog}: --device {dev} {problem}" if problem.startswith("needs") else f"{prog}: {problem}"
    return None


def gdr_of(text: str | None) -> bool | None:
    return None if text is None else text == "on"


def opt_kwargs(args) -> dict:
    kw = {"lr": args.lr}
    if args.optimizer in ("sgd", "rmsprop") and args.momentum:
        kw["momentum"] = args.momentum
    return kw


def train_once(
    args,
    model: str | None = None,
    batch: int | None = None,
    mode: str | None = None,
    workers: int | None = None,
    servers: int | None = None,
    progress: bool = False,
    device: str | None = None,
    gdr: str | None = None,
):
    """One local run with the options of `args` (overridable); returns a ps.TrainResult."""
    from ...torch import ps
    from . import models

    a = argparse.Namespace(**vars(args))
    for k, v in (
        ("model", model),
        ("batch", batch),
        ("mode", mode),
        ("workers", workers),
        ("servers", servers),
        ("device", device),
        ("gdr", gdr),
    ):
        if v is not None:
            setattr(a, k, v)
    if not hasattr(a, "data"):
        a.data = "synthetic"
    info = models.get(a.model)
    dev = getattr(a, "device", "cpu")
    if dev != "cpu" and not a.image_size:  # a GPU affords the paper's input size
        a.image_size = info.image_size
    loss_fn = None
    return ps.train(
        info.factory,
        data_fn_of(a),
        workers=a.workers,
        servers=a.servers,
        steps=a.steps,
        mode=a.mode,
        transport=a.transport,
        optimizer=a.optimizer,
        loss_fn=loss_fn,
        seed=a.seed,
        warmup=a.warmup,
        timeout=a.timeout,
        threads=a.threads,
        progress=progress,
        placement=a.placement,
        colocate=getattr(a, "colocate", False),
        device=dev,
        gdr=gdr_of(getattr(a, "gdr", None)),
        **opt_kwargs(a),
    )


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def time_to_target(losses: list[float], step_s: list[float], target: float, window: int = 10):
    """(step, seconds) at which the running mean of `window` losses first fell below target; None if never."""
    t = 0.0
    for i, dt in enumerate(step_s[: len(losses)]):
        t += dt
        lo = max(0, i + 1 - window)
        if i + 1 >= min(window, len(losses)) and sum(losses[lo : i + 1]) / (i + 1 - lo) < target:
            return i + 1, t
    return None


def render_result(r, args) -> str:
    s = r.split
    ms = {k: v * 1e3 for k, v in s.items()}
    lines = [
        f"model {args.model}  mode {r.mode}  transport {'tcp (gloo)' if r.mode == 'gloo' else args.transport}  "
        f"{r.workers} workers x {r.servers} servers{' (colocated)' if r.colocate else ''}  batch {args.batch}/worker  "
        f"steps {r.steps} ({args.warmup} warm-up)"
        + ("" if r.device == "cpu" else f"  device {r.device} (GDR {'on' if r.gdr else 'off'})"),
        f"samples/s        {r.samples_per_s:10.1f}",
        f"per step (ms)    compute {ms['compute']:.2f} | push {ms['push']:.2f} | aggregate {ms['aggregate']:.2f} | "
        f"pull {ms['pull']:.2f} | step {ms['step']:.2f}",
        f"servers (ms)     wait for grads {ms['server_wait']:.2f} | sum {ms['server_sum']:.2f} | "
        f"optimizer {ms['server_optimizer']:.2f} | send params {ms['server_pull']:.2f}",
        f"bytes per step   copied {fmt_bytes(r.bytes_copied_per_step)} | sent {fmt_bytes(r.bytes_sent_per_step)}"
        + (f" | staged GPU<->host {fmt_bytes(r.bytes_staged_per_step)}" if r.bytes_staged_per_step else ""),
        f"loss             first {r.losses[0]:.4f}  last {r.losses[-1]:.4f}  (mean over the workers)",
    ]
    return "\n".join(lines)


def mean_step_times(r) -> list[float]:
    return [sum(st) / len(st) for st in zip(*(ro["step_times"] for ro in r.roles if ro.get("role") == "worker"))]
