"""The result synchronous PS training must reproduce: plain single-process SGD
on the concatenation of the workers' batches."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .common import default_loss, make_optimizer, to_device


def reference_sgd(
    model_fn: Callable[[], nn.Module],
    data_fn: Callable[[int, int], Any],
    *,
    workers: int,
    steps: int,
    optimizer: Any = "sgd",
    loss_fn: Callable | None = None,
    seed: int = 0,
    device: str = "cpu",
    **optimizer_kwargs: Any,
) -> tuple[nn.Module, list[float]]:
    """Single-process training on the concatenation of the workers' batches (the
    result synchronous PS training must reproduce), on `device` (the model is
    built on the CPU, as the PS builds it). Returns (model, losses)."""
    torch.manual_seed(seed)
    model = model_fn().to(device)
    loss_fn = loss_fn or default_loss
    if isinstance(optimizer, str) and optimizer.lower() == "sgd":
        optimizer_kwargs.setdefault("lr", 0.01)
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad], **optimizer_kwargs)
    losses = []
    for step in range(steps):
        batches = [data_fn(w, step) for w in range(workers)]
        x = to_device(_cat([b[0] for b in batches]), device)
        y = to_device(_cat([b[1] for b in batches]), device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


def _cat(parts: list) -> Any:
    if isinstance(parts[0], (tuple, list)):
        return type(parts[0])(_cat([p[i] for p in parts]) for i in range(len(parts[0])))
    return torch.cat(parts)
