"""plan_remat leaves the model as it found it (parameters, buffers the forward
rebinds, gradients, RNG), and a loaded plan applied to another model names the
blocks it lacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import recorded_replays
from torch_remat.integrations import RematPlan, plan_remat

D = torch.float64


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d, dtype=D)
        self.fc2 = nn.Linear(2 * d, d, dtype=D)
        self.register_buffer("avg", torch.zeros(d, dtype=D))

    def forward(self, x):
        # rebinds the buffer (a new tensor each step), not an in-place update
        self.avg = 0.9 * self.avg + 0.1 * x.detach().mean(0)
        return x + self.fc2(F.dropout(torch.tanh(self.fc1(x)), 0.1, self.training))


class Net(nn.Module):
    def __init__(self, n: int = 2, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _x():
    return torch.randn(4, 8, dtype=D, generator=torch.Generator().manual_seed(0))


def _state(model):
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()},
        torch.get_rng_state(),
    )


def _assert_same_state(before, after):
    for k in before[0]:
        assert torch.equal(before[0][k], after[0][k]), f"{k} changed"
    for k in before[1]:
        a, b = before[1][k], after[1][k]
        assert (a is None and b is None) or torch.equal(a, b), f"gradient of {k} changed"
    assert torch.equal(before[2], after[2]), "the CPU generator moved"


def test_buffers_the_forward_rebinds_are_back_after_planning():
    torch.manual_seed(0)
    model = Net()
    model(_x()).sum().backward()  # gradients and a non-zero running average to keep
    before = _state(model)
    with recorded_replays() as replayed:
        plan_remat(model, _x(), budget=1.0)
    # its measurements checkpointed the blocks: backward ran their forwards again
    assert sorted(set(replayed)) == ["layers.0", "layers.1"]
    _assert_same_state(before, _state(model))


def test_an_optimizer_step_fused_into_backward_leaves_no_trace():
    torch.manual_seed(0)
    model = Net()
    def sgd_step(p):
        with torch.no_grad():
            p.add_(p.grad, alpha=-0.1)
        p.grad = None

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(sgd_step)
    before = _state(model)
    with recorded_replays() as replayed:
        plan_remat(model, _x(), budget=1.0)
    # its measurements checkpointed the blocks: backward ran their forwards again
    assert sorted(set(replayed)) == ["layers.0", "layers.1"]
    _assert_same_state(before, _state(model))


class Other(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))


def test_a_loaded_plan_applied_to_a_model_without_its_blocks_names_them(tmp_path):
    model = Net()
    plan = plan_remat(model, _x(), budget=1.0)
    path = tmp_path / "plan.json"
    plan.save(path)
    with pytest.raises(ValueError, match=r"layers\.0.*layers\.1|no module 'layers"):
        RematPlan.load(path).apply(Other())
