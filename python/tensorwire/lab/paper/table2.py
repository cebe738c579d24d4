"""The paper's Table 2 (GDR off vs on) and how a sweep's table2 runs pair up
against it: shared by bench train's text (bench_train.py) and its plot (plots.py)."""

from __future__ import annotations

import math

# The paper's Table 2 (8 workers; P100 GPUs, 100 Gb/s InfiniBand, TensorFlow r1.2): mean
# mini-batch time in ms with RDMA (GPU tensors staged through host memory),
# with RDMA + GPUDirect, and the improvement (RDMA / RDMA+GDR - 1) in percent.
PAPER_TABLE2 = {
    "alexnet": (178.5, 135.2, 32),
    "fcn5": (157.0, 101.9, 54),
    "vgg16": (690.1, 610.4, 13),
    "inception3": (172.5, 171.9, 0.4),
    "lstm": (84.4, 68.1, 24),
    "gru": (62.3, 52.6, 19),
}
PAPER_TABLE2_SOURCE = (
    '"RPC Considered Harmful: Fast Distributed Deep Learning on RDMA", section 5 '
    '"GPUDirect Support", Table 2 (8 workers)'
)


def table2_pairs(out: dict) -> list[tuple[str, dict, dict]]:
    rows = out.get("table2") or []
    pairs = []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["gdr"]: r for r in rows if r["model"] == model}
        if "off" in by and "on" in by:
            pairs.append((model, by["off"], by["on"]))
    return pairs


def safe_ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")
