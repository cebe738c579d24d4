"""Allocation sites: the nodes of a stage whose outputs cross a static edge,
rewritten to write into registered blocks (``nn.Linear`` and ReLU), so that
sending those outputs copies nothing."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn


class _LinearOut(nn.Module):
    """nn.Linear writing into a fixed (registered) tensor: y = x W^T + b with
    out=. Forward only: out= takes no part in autograd, so it runs without."""

    def __init__(self, linear: nn.Linear, out: torch.Tensor) -> None:
        super().__init__()
        self.linear, self.out = linear, out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.linear.weight, self.linear.bias
        out2 = self.out.view(-1, self.out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            if b is None:
                torch.mm(x2, w.t(), out=out2)
            else:
                torch.addmm(b, x2, w.t(), out=out2)
        return self.out


class _ReluOut(nn.Module):
    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.clamp_min(x, 0, out=self.out)


def _is_relu(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    if n.op == "call_module":
        return isinstance(gm.get_submodule(str(n.target)), nn.ReLU)
    return n.op == "call_function" and n.target in (torch.relu, torch.nn.functional.relu)


def place_outputs(sub: torch.fx.GraphModule, outputs: dict[int, torch.Tensor]) -> set[int]:
    """Rewrites the nodes that produce output positions ``outputs`` (index in
    the submodule's return value -> registered tensor of its shape) to write
    there. Returns the positions rewritten (nn.Linear, ReLU); the others are
    copied at send time."""
    out_node = next(n for n in sub.graph.nodes if n.op == "output")
    ret = out_node.args[0]
    rets = list(ret) if isinstance(ret, (tuple, list)) else [ret]
    done: set[int] = set()
    for i, buf in outputs.items():
        n = rets[i]
        if not isinstance(n, torch.fx.Node) or sum(1 for r in rets if r is n) > 1:
            continue  # the same value twice: one buffer cannot serve two positions
        lin = sub.get_submodule(str(n.target)) if n.op == "call_module" else None
        if isinstance(lin, nn.Linear):
            if lin.weight.dtype != buf.dtype or lin.out_features != buf.shape[-1]:
                continue
            name = f"tw_out_{i}"
            sub.add_submodule(name, _LinearOut(lin, buf))
        elif _is_relu(sub, n) and len(n.args) >= 1 and not n.kwargs.get("inplace", False):
            name = f"tw_out_{i}"
            sub.add_submodule(name, _ReluOut(buf))
            n.args = n.args[:1]
        else:
            continue
        n.op, n.target, n.kwargs = "call_module", name, {}
        done.add(i)
    if done:
        sub.recompile()
    return done
