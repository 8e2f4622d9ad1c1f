"""Build once, call many: a checkpointed function validates its options once, and
its calls share the FLOP-walk memo and what they learnt about the module's buffers.
Counts are deterministic (Python calls under cProfile, aten ops under a dispatch
mode), never times."""

from __future__ import annotations

import cProfile
import pstats

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torch_remat as remat
from torch_remat.engine import rebuild
from torch_remat.integrations import RematConfig, apply_remat
from torch_remat.integrations.rng import default_rng_state_hooks

D = torch.float64


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d, dtype=D)
        self.down = nn.Linear(4 * d, d, dtype=D)
        self.register_buffer("scale", torch.ones(64, 64, dtype=D))  # nothing writes it

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x * self.scale[0, 0])))


class Counting(Block):
    """A block that writes its buffer in place on some steps only."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.write = False

    def forward(self, x):
        if self.write:
            self.steps.add_(1)
        return super().forward(x)


def stack(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(n)])


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def calls_per_step(model: nn.Module, x: torch.Tensor, steps: int = 5) -> float:
    for _ in range(2):
        step(model, x)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step(model, x)
    profile.disable()
    return pstats.Stats(profile).total_calls / steps


def by_hand(model: nn.Sequential) -> nn.Sequential:
    for i, block in enumerate(model):
        block.forward = remat.checkpoint(
            region_name=str(i), recompute_state_hooks=default_rng_state_hooks()
        )(block.forward)
    return model


def test_apply_remat_costs_what_wrapping_each_block_once_by_hand_costs():
    x = torch.randn(8, 16, dtype=D, requires_grad=True)
    applied = stack()
    apply_remat(applied, check_fn=lambda m: isinstance(m, Block))
    ratio = calls_per_step(applied, x) / calls_per_step(by_hand(stack()), x)
    assert ratio <= 1.05, ratio


def test_the_flop_walk_runs_once_per_block_over_many_steps(monkeypatch):
    walks = []
    real = rebuild._first_flop_node
    monkeypatch.setattr(rebuild, "_first_flop_node", lambda *a: walks.append(1) or real(*a))
    model = stack()
    apply_remat(
        model,
        check_fn=lambda m: isinstance(m, Block),
        remat=RematConfig(save_modules=lambda m: isinstance(m, nn.Linear) and m.out_features == 16),
    )
    x = torch.randn(8, 16, dtype=D, requires_grad=True)
    for _ in range(5):
        step(model, x)
    assert 0 < len(walks) <= 4, len(walks)


class _Clones(TorchDispatchMode):
    def __init__(self, storage: int) -> None:
        super().__init__()
        self.storage = storage
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.clone.default and args[0].untyped_storage().data_ptr() == self.storage:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_buffer_nothing_writes_is_copied_on_the_first_step_only():
    model = stack(2)
    apply_remat(model, check_fn=lambda m: isinstance(m, Block))
    x = torch.randn(8, 16, dtype=D, requires_grad=True)
    counter = _Clones(model[0].scale.untyped_storage().data_ptr())
    with counter:
        step(model, x)
    assert counter.count == 1
    counter.count = 0
    with counter:
        for _ in range(4):
            step(model, x)
    assert counter.count == 0


def test_a_buffer_written_after_steps_that_did_not_write_it_raises_naming_it_then_is_copied():
    torch.manual_seed(0)
    block = nn.Sequential(Counting())
    apply_remat(block, check_fn=lambda m: isinstance(m, Counting))
    x = torch.randn(8, 16, dtype=D, requires_grad=True)
    step(block, x)
    step(block, x)
    block[0].write = True
    with pytest.raises(remat.SavedTensorModifiedError, match=r"buffer '0.steps'.*checkpoint '0'"):
        block(x)
    # the next call copies the buffer again, and replays exactly
    ref = nn.Sequential(Counting())
    ref.load_state_dict(block.state_dict())
    ref[0].write = True
    out = block(x)
    expected = ref(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    assert torch.equal(block[0].steps, ref[0].steps)
