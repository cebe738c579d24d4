"""Gradients produced in place (tensorwire.torch.alloc_sites): an nn.Linear's
backward writes its weight and bias gradients straight into the given blocks,
autograd adopts them as .grad, and the values equal plain autograd's, also for a
module called several times in one forward, across steps and after a forward
whose graph was dropped; onto an existing .grad it accumulates like autograd."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from tensorwire.torch import alloc_sites  # noqa: E402

pytestmark = pytest.mark.torch


class Unrolled(nn.Module):
    """One Linear used 3 times per forward (a cell unrolled over time), one not a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3, bias=False)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        h = x
        for _ in range(3):
            h = torch.tanh(self.cell(h)) * self.scale
        return self.head(h)


def _twins():
    torch.manual_seed(0)
    a = Unrolled()
    b = Unrolled()
    b.load_state_dict(a.state_dict())
    return a, b


def test_linear_gradients_land_in_their_blocks_and_equal_autograd():
    model, ref = _twins()
    blocks = {id(p): torch.full((p.numel(),), float("nan")) for n, p in model.named_parameters() if n != "scale"}
    params = alloc_sites.install(model, lambda p: blocks.get(id(p)))
    assert {id(p) for p in params} == set(blocks)  # every Linear parameter, not `scale`
    for step in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        for p in model.parameters():
            p.grad = None
        if step == 1:
            model(x).sum()  # a forward whose graph is dropped: the next backward pass still starts afresh
        model(x).square().sum().backward()
        for p in ref.parameters():
            p.grad = None
        ref(x).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"{name} at step {step}")
            if name != "scale":
                assert p.grad.data_ptr() == blocks[id(p)].data_ptr(), f"{name}: .grad is not its block"
        with torch.no_grad():  # a plain optimizer step on both keeps them in lockstep
            for p, q in zip(model.parameters(), ref.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad


def test_a_parameter_without_a_block_and_no_grad_forward_are_left_alone():
    model, _ = _twins()
    blocks = {id(model.cell.weight): torch.empty(64)}  # the cell's bias has none: the cell is skipped
    assert alloc_sites.install(model, lambda p: blocks.get(id(p))) == []
    head_only = {id(model.head.weight): torch.empty(24)}
    params = alloc_sites.install(model, lambda p: head_only.get(id(p)))
    assert [id(p) for p in params] == [id(model.head.weight)]
    with torch.no_grad():
        out = model(torch.randn(2, 8))
    assert out.shape == (2, 3) and out.grad_fn is None


def test_a_backward_onto_an_existing_grad_accumulates_like_autograd():
    """Two backward passes without unsetting .grad: the second adds into the
    first (PyTorch's rule), even though .grad is the block itself."""
    model, ref = _twins()
    blocks = {id(p): torch.empty(p.numel()) for n, p in model.named_parameters() if n != "scale"}
    alloc_sites.install(model, lambda p: blocks.get(id(p)))
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    for m in (model, ref):
        m(x1).square().sum().backward()
        m(x2).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
