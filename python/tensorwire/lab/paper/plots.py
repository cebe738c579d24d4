"""The --plot of `tensorwire train`, `bench train` and `partition` (matplotlib,
imported here only: the commands declare it in `needs`). Each draws one PNG:
`bench train` one panel per figure that ran, `partition` what each stage did."""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable

from .runs import MODES, fmt_bytes


def _figure(panels: int, width: float = 5.0, height: float = 3.8):
    """A figure of `panels` axes, at most 3 in a row (the unused ones removed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(panels, 3)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[panels:]:
        ax.remove()
    return fig, flat[:panels]


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


def _bars(ax, groups: list[str], series: list[tuple[str, list[float]]]) -> None:
    """Grouped bars: one group per label of `groups`, one bar per (label, values) of `series`."""
    w = 0.8 / max(1, len(series))
    for i, (label, ys) in enumerate(series):
        ax.bar([j + i * w for j in range(len(groups))], ys, w, label=label)
    ax.set_xticks([j + w * (len(series) - 1) / 2 for j in range(len(groups))])
    ax.set_xticklabels(groups)
    ax.legend(fontsize=8)


# ---- tensorwire train ----


def plot_run(r, args, path: str) -> None:
    """The loss curve and the per-step split of one training run."""
    fig, (a, b) = _figure(2)
    a.plot(range(1, len(r.losses) + 1), r.losses)
    a.set_xlabel("step")
    a.set_ylabel("loss (mean over workers)")
    a.set_title(f"{args.model} {r.mode}")
    bottom = 0.0
    for k in ("compute", "push", "aggregate", "pull"):
        b.bar([r.mode], [r.split[k] * 1e3], bottom=bottom, label=k)
        bottom += r.split[k] * 1e3
    b.set_ylabel("ms per step")
    b.legend()
    _save(fig, path)


# ---- tensorwire bench train: one panel per figure ----


def _fig8(ax, out: dict, args) -> None:
    rows = out["fig8"]
    keys = sorted(
        {(r["model"], r["batch"]) for r in rows},
        key=lambda k: (args.models.index(k[0]) if k[0] in args.models else 99, k[1]),
    )
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    _bars(
        ax,
        [f"{m}\nbatch {b}" for m, b in keys],
        [
            (
                mode,
                [
                    next((r["samples_per_s"] for r in rows if (r["model"], r["batch"], r["mode"]) == (*k, mode)), 0)
                    for k in keys
                ],
            )
            for mode in modes
        ],
    )
    ax.set_yscale("log")  # the models' rates differ by orders of magnitude
    ax.set_ylabel("samples/s")
    ax.set_title(f"Figure 8: {args.workers} workers x {args.workers} servers, {args.transport}")


def _fig10(ax, out: dict, args) -> None:
    ax.set_xticks(sorted({r["workers"] for r in out["fig10"] if r["mode"] != "local"}))
    for model in args.scale_models:
        rows = [r for r in out["fig10"] if r["model"] == model]
        for mode in ("zerocopy", "gloo"):
            pts = sorted((r["workers"], r["samples_per_s"]) for r in rows if r["mode"] == mode)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{model} {mode}")
        local = [r for r in rows if r["mode"] == "local"]
        if local:
            ax.axhline(local[0]["samples_per_s"], ls="--", color="gray", label=f"{model} local")
    ax.set_xlabel("workers (= servers)")
    ax.set_ylabel("samples/s")
    ax.legend(fontsize=8)
    ax.set_title(f"Figure 10: scaling, batch {args.scale_batch}, {args.transport}")


def _fig11(ax, out: dict, args) -> None:
    models = [m for m in args.models if any(r["model"] == m for r in out["fig11"])]
    _bars(
        ax,
        models,
        [
            (
                mode,
                [
                    next((r.get("step_ms", 0) for r in out["fig11"] if r["model"] == m and r["mode"] == mode), 0)
                    for m in models
                ],
            )
            for mode in ("zerocopy", "copy")
        ],
    )
    ax.set_ylabel("mean step time (ms)")
    ax.set_title(f"Figure 11: zero copy on/off, batch {args.copy_batch}, {args.transport}")


def _convergence(ax, out: dict, args) -> None:
    for r in out["convergence"]:
        ax.plot(
            range(1, len(r["losses"]) + 1),
            r["losses"],
            label=r["run"],
            lw=2.5 if r["run"] == "single process" else 1,
            alpha=0.8,
        )
    ax.axhline(args.target_loss, ls="--", color="gray", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch)")
    ax.set_title("Convergence: mlp on digits, 2 workers x 2 servers vs one process")
    ax.legend(fontsize=8)


def _table2(ax, out: dict, args) -> None:
    from .table2 import PAPER_TABLE2, safe_ratio, table2_pairs

    pairs = table2_pairs(out)
    _bars(
        ax,
        [p[0] for p in pairs],
        [
            ("GDR off (staged via host)", [off.get("step_ms", 0) for _, off, _ in pairs]),
            ("GDR on", [on.get("step_ms", 0) for _, _, on in pairs]),
        ],
    )
    for j, (model, off, on) in enumerate(pairs):
        paper = PAPER_TABLE2.get(model)
        gain = (safe_ratio(off.get("step_ms", float("nan")), on.get("step_ms", float("nan"))) - 1) * 100
        ax.annotate(
            f"{gain:+.0f}%" + (f"\n(paper {paper[2]:g}%)" if paper else ""),
            (j + 0.2, max(off.get("step_ms", 0), on.get("step_ms", 0))),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("mean mini-batch time (ms)")
    ax.set_title(f"Table 2: GDR off vs on, batch {args.table2_batch}, {args.workers} workers, {args.transport}")
    ax.margins(y=0.2)


SWEEP_PANELS: tuple[tuple[str, Callable[[Any, dict, Any], None]], ...] = (
    ("fig8", _fig8),
    ("fig10", _fig10),
    ("fig11", _fig11),
    ("convergence", _convergence),
    ("table2", _table2),
)


def plot_sweep(out: dict, args, path: str) -> None:
    """Every figure of `bench train` that has results, one panel each, into one PNG."""
    panels = [(name, draw) for name, draw in SWEEP_PANELS if out.get(name)]
    if not panels:
        print(f"no plot: no figure of this sweep has results ({path} not written)", file=sys.stderr)
        return
    fig, axes = _figure(len(panels), width=6.0, height=4.2)
    for ax, (_, draw) in zip(axes, panels):
        draw(ax, out, args)
    _save(fig, path)


# ---- tensorwire partition ----


def plot_partition(out: dict, path: str) -> None:
    """Per stage the mean wait / compute / send per step (stacked) and the MiB it
    sent; the pipeline's samples/s beside one process's; with --train the loss."""
    stats = out["stage_stats"]
    losses = out.get("losses") or []
    fig, axes = _figure(3 if losses else 2)
    ax = axes[0]
    labels = [f"stage {st['stage']}" for st in stats]
    bottom = [0.0] * len(stats)
    for key, label in (("compute_s", "compute"), ("wait_s", "wait for inputs"), ("send_s", "send")):
        ms = [1e3 * st[key] / max(st["steps"], 1) for st in stats]
        ax.bar(labels, ms, bottom=bottom, label=label)
        bottom = [b + m for b, m in zip(bottom, ms)]
    for i, st in enumerate(stats):
        ax.annotate(
            f"{fmt_bytes(st['bytes_sent'])} sent\n{st['sends_zero_copy']} zero-copy, {st['sends_copied']} copied",
            (i, bottom[i]),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_ylabel("ms per step (mean)")
    ax.set_title(f"{out['model']}: {out['stages']} stages over {out['transport']}")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)  # below: the bars fill the top
    ax.margins(y=0.25)
    ax = axes[1]
    ax.bar(["pipeline", "one process"], [out["samples_per_s"], out["one_process_samples_per_s"]], color=["C0", "gray"])
    ax.set_ylabel("samples/s")
    ax.set_title("training" if out.get("train") else "forward passes")
    if losses:
        axes[2].plot(range(len(losses)), losses)
        axes[2].set_xlabel("step")
        axes[2].set_ylabel("loss")
        axes[2].set_title("loss (last stage)")
    _save(fig, path)
