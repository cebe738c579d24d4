"""`tensorwire bench train`: the paper's Figures 8, 10 and 11, and Table 2 on a
GPU, on this machine.

Every configuration is one short local `tensorwire train` run (spawned
processes, synthetic data, warm-up steps excluded). Figure 10's "local" line is
single-process training of the same model and batch with no communication.
Table 2 is the mean mini-batch time with GPUDirect (GPU memory registered and
moved as is) against staging every tensor through host memory."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from ..fabric.common import print_line
from .runs import MODES, train_once
from .table2 import PAPER_TABLE2, PAPER_TABLE2_SOURCE, safe_ratio, table2_pairs

# The issue's targets (zerocopy samples/s over the others, communication-bound models at small batch)
TARGETS = {"shm": {"gloo": 2.0, "copy": 1.15}, "tcp": {"gloo": 1.2, "copy": 1.1}}
# the floor beside Figure 8 (tensorwire.lab.paper.floor), per transport
_FLOOR_NAMES = {"tcp": "TCP floor (plain sockets, no compute)", "shm": "shm floor (one memcpy per byte, no compute)"}


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _runs(args, model: str, batch: int, n: int, variants: list[tuple[str, dict]]) -> list[dict]:
    """The best of --repeat runs of each variant (a mode and, in `over`, device and
    gdr instead of the command line's). The repeats go round the variants (a, b, a,
    b, ...): on a machine whose speed drifts, the variants compared see its phases alike."""
    best: list[dict | None] = [None] * len(variants)
    for _ in range(args.repeat):
        for i, (mode, over) in enumerate(variants):
            if (prev := best[i]) is not None and "error" in prev:  # failed once: not run again
                continue
            t0 = time.perf_counter()
            try:
                r = train_once(args, model=model, batch=batch, mode=mode, workers=n, servers=n, **over)
            except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the sweep
                _progress(f"    {model} b{batch} {_tag(mode, over)} x{n}: FAILED: " + str(e).replace("\n", "\n      "))
                best[i] = {
                    "model": model,
                    "batch": batch,
                    "mode": mode,
                    "workers": n,
                    "servers": n,
                    "error": str(e),
                    "samples_per_s": float("nan"),
                    **over,
                }
                continue
            row = {
                "model": model,
                "batch": batch,
                "mode": mode,
                "workers": n,
                "servers": n,
                "transport": "tcp" if mode == "gloo" else args.transport,
                "samples_per_s": r.samples_per_s,
                "step_ms": r.split["step"] * 1e3,
                "split_ms": {k: v * 1e3 for k, v in r.split.items()},
                "bytes_copied_per_step": r.bytes_copied_per_step,
                "bytes_sent_per_step": r.bytes_sent_per_step,
                "bytes_staged_per_step": r.bytes_staged_per_step,
                "device": r.device,
                "wall_s": time.perf_counter() - t0,
                **over,
            }
            if prev is None or row["samples_per_s"] > prev["samples_per_s"]:
                best[i] = row
    done = [b for b in best if b is not None]
    assert len(done) == len(best), "--repeat is at least 1"
    for b, (mode, over) in zip(done, variants):
        if "error" in b:
            continue
        s = b["split_ms"]
        _progress(
            f"    {model:<10} batch {batch:<3} {_tag(mode, over):<8} x{n}: {b['samples_per_s']:8.2f} samples/s  "
            f"step {b['step_ms']:.1f} ms (compute {s['compute']:.1f}, push {s['push']:.1f}, "
            f"aggregate {s['aggregate']:.1f}, pull {s['pull']:.1f})"
        )
    return done


def _tag(mode: str, over: dict) -> str:
    return mode + "".join(f" {k} {v}" for k, v in over.items())


def _local(args, model: str, batch: int) -> dict:
    """Single-process training, no communication (Figure 10's "Local"), in a
    spawned process with the same malloc settings as the training roles."""
    from ...ranks.roles import Roles
    from ...torch.ps import MALLOC_ENV

    with Roles() as roles:
        child = roles.spawn(
            f"local {model}",
            _local_child,
            args.threads,
            args.seed,
            args.lr,
            args.image_size,
            args.seq_len,
            args.steps,
            args.warmup,
            model,
            batch,
            getattr(args, "device", "cpu"),
            env_defaults=MALLOC_ENV,
        )
        step = child.recv(args.timeout * 2, "report its step time")
    _progress(f"    {model:<10} batch {batch:<3} local      : {batch / step:8.2f} samples/s")
    return {
        "model": model,
        "batch": batch,
        "mode": "local",
        "workers": 1,
        "servers": 0,
        "samples_per_s": batch / step,
        "step_ms": step * 1e3,
    }


def _local_child(conn, threads, seed, lr, image_size, seq_len, steps, warmup, model, batch, device="cpu") -> None:
    import argparse

    args = argparse.Namespace(
        threads=threads,
        seed=seed,
        lr=lr,
        image_size=image_size,
        seq_len=seq_len,
        steps=steps,
        warmup=warmup,
        device=device,
    )
    conn.send(_local_step(args, model, batch))


def _local_step(args, model: str, batch: int) -> float:
    import torch
    from . import data, models
    from ...torch.ps.common import to_device
    from ...torch.ps.memory import Memory

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    mem = Memory(getattr(args, "device", "cpu"))
    info = models.get(model)
    m = info.factory().to(mem.device)
    opt = torch.optim.SGD(m.parameters(), lr=args.lr)
    size = args.image_size or (info.image_size if mem.cuda else 0)  # as train_once
    fn = data.Synthetic(model, batch, args.seed, size, args.seq_len)
    times = []
    for step in range(args.steps):
        x, y = to_device(fn(0, step), mem.device)
        t0 = time.perf_counter()
        opt.zero_grad()  # PyTorch's default (set_to_none): autograd's fresh gradients
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        mem.sync()
        times.append(time.perf_counter() - t0)
    t = times[args.warmup :] or times
    return sum(t) / len(t)


def convergence(args) -> list[dict]:
    """The mlp on digits: 2x2 in every mode and a single process, same global batches."""
    import torch
    from ...torch import ps
    from . import data, models
    from .runs import time_to_target

    _progress("Convergence: mlp on digits")
    d = data.Digits(args.conv_batch, workers=2, seed=args.seed)
    rows = []
    torch.set_num_threads(args.threads)
    # single process on the concatenated batches, timed per step
    torch.manual_seed(args.seed)
    model = models.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=args.conv_lr)
    single, times = [], []
    for step in range(args.conv_steps):
        x, y = d.global_batch(step)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        single.append(float(loss.detach()))
    runs = [("single process", single, times)]
    for mode in MODES:
        r = ps.train(
            models.MLP,
            d,
            workers=2,
            servers=2,
            steps=args.conv_steps,
            mode=mode,
            transport=args.transport,
            lr=args.conv_lr,
            seed=args.seed,
            warmup=0,
            threads=args.threads,
            timeout=args.timeout,
        )
        wt = [ro["step_times"] for ro in r.roles if ro.get("role") == "worker"]
        runs.append((f"2x2 {mode}", r.losses, [sum(s) / len(s) for s in zip(*wt)]))
    for name, losses, st in runs:
        hit = time_to_target(losses, st, args.target_loss)
        rows.append(
            {
                "run": name,
                "losses": losses,
                "step_ms": 1e3 * sum(st) / len(st),
                "max_diff_vs_single": max(abs(a - b) for a, b in zip(losses, single)),
                "steps_to_target": None if hit is None else hit[0],
                "time_to_target_s": None if hit is None else hit[1],
            }
        )
        _progress(
            f"    {name:<16} final loss {losses[-1]:.4f}  "
            f"target {'-' if hit is None else f'step {hit[0]}, {hit[1]:.2f} s'}"
        )
    return rows


def table2(args) -> list[dict]:
    """The paper's Table 2: every model of --models, zerocopy on the GPU, GDR off then on."""
    dev = args.device if args.device.startswith("cuda") else "cuda"
    W, b = args.workers, args.table2_batch
    _progress(f"Table 2: GDR off vs on, {dev}, {W} workers x {W} servers, batch {b}, transport {args.transport}")
    return [
        row
        for model in args.models
        for row in _runs(args, model, b, W, [("zerocopy", {"device": dev, "gdr": gdr}) for gdr in ("off", "on")])
    ]


def run_sweep(args) -> int:
    from .runs import device_error
    from ...torch.ps import cuda_problem

    if "table2" in args.figures and (problem := cuda_problem("cuda")) is not None:
        print(f"tensorwire bench train: --figures table2 {problem}", file=sys.stderr)
        return 2
    if (err := device_error(args, "tensorwire bench train")) is not None:
        print(err, file=sys.stderr)
        return 2
    out: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "fig8": [],
        "fig10": [],
        "fig11": [],
        "floor": [],
        "convergence": None,
        "table2": [],
        "host": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
    }
    t0 = time.perf_counter()
    W = args.workers
    print_line(render_header(out, args))
    verdicts: list[str] = []
    if "fig8" in args.figures:
        _progress(f"Figure 8: samples/s, {W} workers x {W} servers, transport {args.transport}")
        modes = [m for m in MODES if m in args.modes]
        for line in _fig8_head(args, modes):
            print_line(line)
        for model in args.models:
            for batch in args.batches:
                out["fig8"] += _runs(args, model, batch, W, [(mode, {}) for mode in args.modes])
                line, met = _fig8_row(out, args, model, batch, modes)  # the row, as soon as its modes ran
                print_line(line)
                verdicts += met
        from . import floor

        if args.transport in floor.TRANSPORTS and args.device == "cpu":
            # the anchor of the targets: the least any implementation moves the same bytes with
            colocate = getattr(args, "colocate", False)
            name = _FLOOR_NAMES[args.transport]
            for model in args.models:
                _progress(f"    {model:<10} {name}")
                try:
                    out["floor"] += floor.bounds(model, args.batches, W, W, colocate, transport=args.transport)
                except Exception as e:  # noqa: BLE001 - the anchor failing must not lose the sweep
                    _progress(f"    {model} {args.transport} floor: FAILED: {e}")
    if "fig10" in args.figures:
        _progress("Figure 10: scaling (workers = servers)")
        for model in args.scale_models:
            out["fig10"].append(_local(args, model, args.scale_batch))
            for n in args.scale:
                out["fig10"] += _runs(args, model, args.scale_batch, n, [("zerocopy", {}), ("gloo", {})])
    if "fig11" in args.figures:
        _progress(f"Figure 11: zero copy on/off, batch {args.copy_batch}")
        for model in args.models:
            prev = [
                r
                for r in out["fig8"]
                if r["model"] == model
                and r["batch"] == args.copy_batch
                and r["mode"] in ("zerocopy", "copy")
                and r["workers"] == W
            ]
            if len(prev) == 2:  # fig8 ran both: the same runs
                out["fig11"] += sorted(prev, key=lambda r: r["mode"] != "zerocopy")
            else:
                out["fig11"] += _runs(args, model, args.copy_batch, W, [("zerocopy", {}), ("copy", {})])
    if "convergence" in args.figures:
        out["convergence"] = convergence(args)
    if "table2" in args.figures:
        out["table2"] = table2(args)
        out["paper_table2"] = {
            "source": PAPER_TABLE2_SOURCE,
            "columns": ["rdma_ms", "rdma_gdr_ms", "improvement_pct"],
            "rows": {m: list(v) for m, v in PAPER_TABLE2.items()},
        }
    out["host"]["loadavg_end"] = os.getloadavg()
    out["elapsed_s"] = time.perf_counter() - t0
    print(render_rest(out, args, verdicts))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    if args.plot:
        from .plots import plot_sweep

        plot_sweep(out, args, args.plot)
    return 0


def render_header(out: dict, args) -> str:
    placement = getattr(args, "placement", "balanced")
    layout = "colocated worker+server processes" if getattr(args, "colocate", False) else "separate processes"
    return (
        f"tensorwire bench train: transport {args.transport} (gloo: tcp), placement {placement}, {layout}, "
        f"{args.steps} steps per run ({args.warmup} warm-up), {args.threads} torch thread(s) per process, best "
        f"of {args.repeat}; host {out['host']['cpus']} CPUs, load average at start "
        f"{out['host']['loadavg_start'][0]:.1f}"
    )


def _fig8_head(args, modes: list[str]) -> list[str]:
    hdr = f"{'model':<11}{'batch':>6}" + "".join(f"{m:>11}" for m in modes)
    if "zerocopy" in modes:
        hdr += "".join(f"{'zc/' + m:>10}" for m in modes if m != "zerocopy")
    return ["", f"Figure 8: samples/s, {args.workers} workers x {args.workers} servers", hdr]


def _fig8_row(out: dict, args, model: str, batch: int, modes: list[str]) -> tuple[str, list[str]]:
    """Figure 8's row of (model, batch), and its lines of the targets (the smallest batch's)."""
    rows = {r["mode"]: r for r in out["fig8"] if r["model"] == model and r["batch"] == batch}
    line = f"{model:<11}{batch:>6}" + "".join(
        f"{rows[m]['samples_per_s']:>11.2f}" if m in rows else f"{'-':>11}" for m in modes
    )
    verdicts = []
    if "zerocopy" in rows:
        zc = rows["zerocopy"]["samples_per_s"]
        for m in modes:
            if m != "zerocopy":
                ratio = safe_ratio(zc, rows[m]["samples_per_s"]) if m in rows else float("nan")
                line += f"{ratio:>9.2f}x"
                target = TARGETS.get(args.transport, {}).get(m)
                if target is not None and batch == min(args.batches):
                    verdicts.append(
                        f"  {model} batch {batch}: zerocopy/{m} = {ratio:.2f}x "
                        f"(target >= {target}x): {'met' if ratio >= target else 'NOT met'}"
                    )
    return line, verdicts


def render_rest(out: dict, args, verdicts: list[str]) -> str:
    """What follows Figure 8's rows (printed as they were measured): the per-step
    split and the targets, then every other figure, then the time taken."""
    lines = []
    tr = args.transport
    if out["fig8"]:
        lines.append("")
        lines.append(
            "per-step split (ms, mean over workers): compute / push / aggregate / pull = step; bytes copied per step"
        )
        for r in out["fig8"]:
            if "split_ms" in r:
                s = r["split_ms"]
                lines.append(
                    f"  {r['model']:<10} b{r['batch']:<3} {r['mode']:<8} {s['compute']:8.1f} "
                    f"{s['push']:8.1f} {s['aggregate']:8.1f} {s['pull']:8.1f} = {s['step']:8.1f}   "
                    f"{r['bytes_copied_per_step'] / 2**20:8.1f} MiB"
                )
        if verdicts:
            lines += ["", f"targets ({tr}, smallest batch per model):"] + verdicts
    if out.get("floor"):
        target = TARGETS.get(tr, {}).get("gloo", 1.0)
        ran_gloo = any(r["mode"] == "gloo" for r in out["fig8"])
        lines += [
            "",
            f"{_FLOOR_NAMES[tr]} (tensorwire.lab.paper.floor): a step's bytes moved in the same",
            "pattern with nothing else; with each worker's compute and each server's aggregation measured",
            f"alone that bounds samples/s over {tr} here (sequential: compute, communication, aggregation",
            "one after the other; overlapped: limited by the CPU all of them need);",
            "each mode's samples/s"
            + (f", and {target}x gloo's," if ran_gloo else "")
            + " in percent of the sequential bound",
            f"{'model':<11}{'batch':>6}{'MiB/step':>10}{'floor ms':>10}{'agg ms':>8}{'bound seq':>11}"
            f"{'bound ovl':>11}"
            + "".join(f"{m + ' %':>12}" for m in MODES if any(r["mode"] == m for r in out["fig8"]))
            + (f"{f'{target}x gloo %':>13}" if ran_gloo else ""),
        ]
        for b in out["floor"]:
            rows = {r["mode"]: r for r in out["fig8"] if r["model"] == b["model"] and r["batch"] == b["batch"]}
            line = (
                f"{b['model']:<11}{b['batch']:>6}{b['mib_per_step']:>10.1f}{b['floor_ms']:>10.1f}"
                f"{b.get('aggregate_ms', float('nan')):>8.1f}{b['sequential']:>11.2f}{b['overlapped']:>11.2f}"
            )
            for m in MODES:
                if any(r["mode"] == m for r in out["fig8"]):
                    v = rows.get(m, {}).get("samples_per_s", float("nan"))
                    line += f"{100 * v / b['sequential']:>11.0f}%"
            if ran_gloo:
                g = rows.get("gloo", {}).get("samples_per_s", float("nan"))
                line += f"{100 * target * g / b['sequential']:>12.0f}%"
            lines.append(line)
        beyond = [
            f"{b['model']} batch {b['batch']}"
            for b in out["floor"]
            if any(
                r["mode"] == "gloo"
                and r["model"] == b["model"]
                and r["batch"] == b["batch"]
                and target * r["samples_per_s"] > max(b["sequential"], b["overlapped"])
                for r in out["fig8"]
            )
        ]
        if beyond:
            lines.append(
                f"{target}x gloo is above both bounds for {', '.join(beyond)}: beyond any synchronous PS "
                f"moving these bytes over {tr} on this machine"
            )
    if out["fig10"]:
        lines += ["", f"Figure 10: samples/s vs workers (= servers), batch {args.scale_batch}"]
        for model in args.scale_models:
            scaled = [r for r in out["fig10"] if r["model"] == model]
            local = [r for r in scaled if r["mode"] == "local"]
            if local:
                lines.append(f"  {model}: local (1 process, no communication) {local[0]['samples_per_s']:.2f}")
            for mode in ("zerocopy", "gloo"):
                pts = [(r["workers"], r["samples_per_s"]) for r in scaled if r["mode"] == mode]
                lines.append(f"  {model} {mode:<8}: " + "  ".join(f"{n}w {v:.2f}" for n, v in pts))
    if out["fig11"]:
        lines += ["", f"Figure 11: mean step time (ms), zero copy on/off, batch {args.copy_batch}"]
        lines.append(f"{'model':<11}{'zerocopy':>10}{'copy':>10}{'gain':>8}")
        for model in args.models:
            rows = {r["mode"]: r for r in out["fig11"] if r["model"] == model}
            if "zerocopy" in rows and "copy" in rows and "step_ms" in rows["zerocopy"] and "step_ms" in rows["copy"]:
                zc, cp = rows["zerocopy"]["step_ms"], rows["copy"]["step_ms"]
                lines.append(f"{model:<11}{zc:>10.1f}{cp:>10.1f}{(cp / zc - 1) * 100:>7.0f}%")
    c = out.get("convergence")
    if c:
        lines += [
            "",
            f"Convergence: mlp on scikit-learn digits (1797 images), 2 workers x 2 servers, batch "
            f"{args.conv_batch}/worker, SGD lr {args.conv_lr}, {args.conv_steps} steps; target: running "
            f"mean of 10 losses < {args.target_loss}",
        ]
        lines.append(
            f"{'run':<16}{'final loss':>11}{'max |dloss| vs 1 proc':>23}{'steps to target':>17}"
            f"{'time to target (s)':>20}{'step (ms)':>11}"
        )
        for r in c:
            st = "-" if r["steps_to_target"] is None else str(r["steps_to_target"])
            tt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f}"
            lines.append(
                f"{r['run']:<16}{r['losses'][-1]:>11.4f}{r['max_diff_vs_single']:>23.2e}{st:>17}{tt:>20}"
                f"{r['step_ms']:>11.2f}"
            )
        lines.append("(time to target: the sum of the measured step times up to that step; process start-up excluded)")
    if out.get("table2"):
        lines += ["", render_table2(out, args)]
    lines.append("")
    lines.append(f"elapsed {out['elapsed_s']:.0f} s; load average at end {out['host']['loadavg_end'][0]:.1f}")
    return "\n".join(lines)


def render_table2(out: dict, args) -> str:
    rows = out["table2"]
    dev = rows[0].get("device", "cuda")
    lines = [
        f"Table 2: mean mini-batch time (ms), GDR off vs on: {dev}, zerocopy, {args.workers} workers x "
        f"{args.workers} servers, batch {args.table2_batch}/worker, transport {args.transport}",
        f"{'model':<11}{'GDR off':>9}{'GDR on':>9}{'off/on':>8}{'improv.':>9}   |{'paper: RDMA':>12}"
        f"{'RDMA+GDR':>10}{'improv.':>9}",
    ]
    for model, off, on in table2_pairs(out):
        r = safe_ratio(off.get("step_ms", float("nan")), on.get("step_ms", float("nan")))
        p = PAPER_TABLE2.get(model)
        paper = f"{p[0]:>12.1f}{p[1]:>10.1f}{p[2]:>8g}%" if p else f"{'-':>12}{'-':>10}{'-':>9}"
        lines.append(
            f"{model:<11}{off.get('step_ms', float('nan')):>9.1f}{on.get('step_ms', float('nan')):>9.1f}"
            f"{r:>7.2f}x{(r - 1) * 100:>8.0f}%   |{paper}"
        )
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['model']} GDR {r['gdr']}: FAILED: {r['error'].splitlines()[0]}")
    lines.append(
        "improv. = GDR off / GDR on - 1, as the paper's column. GDR off stages every tensor that moves "
        "through host memory (GPU->host copy, host transfer, host->GPU copy); GDR on moves registered "
        "GPU memory as is."
    )
    lines.append(
        f"paper: {PAPER_TABLE2_SOURCE}: RDMA vs RDMA+GDR, mini-batch time (ms); its cluster: 8 servers with "
        f"2 P100 GPUs and 100 Gb/s InfiniBand each, TensorFlow r1.2"
    )
    return "\n".join(lines)
