"""The paper's allocation-site idea for PyTorch gradients.

A tensor that will be sent should be *produced* in registered memory, not
produced elsewhere and then moved there. For a gradient that means the backward
op that computes it writes straight into a registered block:

* ``nn.Linear`` (most of the bytes of FCN-5, AlexNet and VGG-16): its forward is
  routed through :class:`_LinearInto`, whose backward computes the weight
  gradient with ``torch.mm(..., out=block)`` and the bias gradient with
  ``torch.sum(..., out=block)``. With ``.grad`` unset at backward time, autograd
  adopts that tensor as ``.grad`` as it is (no temporary, no accumulation pass,
  no zeroing pass).
* every other parameter keeps a ``.grad`` in a registered block that autograd
  accumulates into (the caller zeroes it between steps).

A module called several times in one forward (a cell unrolled over time)
overwrites its blocks on its first backward call of a backward pass and adds
into them on the later ones (autograd runs them all before it stores ``.grad``).
A pass that finds a ``.grad`` already set (a second backward without a step)
leaves the blocks alone and lets autograd accumulate, as PyTorch does.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


# The backward pass running now (a private hook of torch's autograd engine): how
# a module tells its first backward call of a pass from the later ones.
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


class _SiteState:
    """Per module: its parameters, the blocks their gradients go to, the
    backward pass that last ran it, and whether that pass writes in place."""

    __slots__ = ("mod", "weight_block", "bias_block", "task", "in_place")

    def __init__(self, mod: nn.Linear, weight_block: torch.Tensor, bias_block: torch.Tensor | None) -> None:
        self.mod, self.weight_block, self.bias_block = mod, weight_block, bias_block
        self.task, self.in_place = None, False


class _LinearInto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, state: _SiteState):
        ctx.save_for_backward(x, weight)
        ctx.state = state
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        st: _SiteState = ctx.state
        gx = gw = gb = None
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        assert _graph_task_id is not None  # install() routes no module here without it
        task = _graph_task_id()
        first = st.task != task
        if first:
            st.task = task
            # In place only if autograd will adopt the block as .grad; with a
            # .grad already there it adds the new gradient into it, so the
            # block (maybe that very .grad) must not be overwritten.
            st.in_place = st.mod.weight.grad is None and (st.mod.bias is None or st.mod.bias.grad is None)
        if ctx.needs_input_grad[0]:
            gx = g.matmul(weight)
        # The first call of a backward overwrites the blocks and hands them to
        # autograd (a fresh view each time: autograd adopts a tensor nobody else
        # holds). Later calls add into the same memory and report no gradient of
        # their own: autograd would sum them out of place, in a new tensor.
        if ctx.needs_input_grad[1]:
            wb = st.weight_block.view(weight.shape)
            if not st.in_place:
                gw = g2.t().mm(x2)
            elif first:
                gw = torch.mm(g2.t(), x2, out=wb)
            else:
                wb.addmm_(g2.t(), x2)
        if ctx.needs_input_grad[2]:
            bb = st.bias_block  # set wherever the module had a bias (install)
            if not st.in_place:
                gb = g2.sum(0)
            elif first:
                assert bb is not None
                gb = torch.sum(g2, 0, out=bb.view(-1))
            else:
                assert bb is not None
                bb.add_(g2.sum(0))
        return gx, gw, gb, None


def install(model: nn.Module, block_of: Callable[[torch.Tensor], torch.Tensor | None]) -> list[torch.Tensor]:
    """Routes every plain ``nn.Linear`` whose weight (and bias, if any) have a
    registered block (``block_of(p)``; None: not sent from a block) through
    :class:`_LinearInto`. Returns the parameters whose gradients are now
    produced in place (none where torch lacks the engine hook). A backward
    writes them in place only while their ``.grad`` is unset; with a ``.grad``
    there, autograd accumulates into it as usual."""
    params: list[torch.Tensor] = []  # nn.Parameters (torch types a module's as Tensor)
    if _graph_task_id is None:
        return params
    for mod in model.modules():
        if type(mod) is not nn.Linear:  # subclasses may change forward: leave them alone
            continue
        wb = block_of(mod.weight)
        bb = block_of(mod.bias) if mod.bias is not None else None
        if wb is None or (mod.bias is not None and bb is None) or wb.device != mod.weight.device:
            continue
        st = _SiteState(mod, wb, bb)

        def forward(inp: torch.Tensor, mod: nn.Linear = mod, st: _SiteState = st) -> torch.Tensor:
            if not torch.is_grad_enabled() or torch.is_autocast_enabled(inp.device.type):
                return F.linear(inp, mod.weight, mod.bias)
            return _LinearInto.apply(inp, mod.weight, mod.bias, st)

        setattr(mod, "forward", forward)  # an instance attribute: nn.Module.__call__ finds it first
        params += [mod.weight] + ([mod.bias] if mod.bias is not None else [])
    return params
