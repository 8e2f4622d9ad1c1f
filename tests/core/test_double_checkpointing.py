"""torch's apply_activation_checkpointing applied after apply_remat checkpoints every
block twice (each runs three times per step): refused, naming both."""

import pytest
import torch
from helpers import recorded_replays
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.utils.checkpoint import checkpoint

import torch_remat as remat
from torch_remat.integrations import apply_remat, remat_module_names


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        return self.fc(x).tanh()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def test_torch_wrappers_applied_after_apply_remat_are_refused_in_forward():
    model = _model()
    apply_remat(model, check_fn=lambda m: isinstance(m, Block))
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(remat.RematError, match=r"checkpoint '0'.*torch\.utils\.checkpoint"):
        model(x)


def test_remat_module_names_refuses_a_remat_block_inside_a_torch_wrapper():
    model = _model()
    apply_remat(model, check_fn=lambda m: isinstance(m, Block))
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    with pytest.raises(ValueError, match=r"'0\._checkpoint_wrapped_module'.*CheckpointWrapper '0'"):
        remat_module_names(model)


def test_a_remat_checkpoint_inside_torch_checkpoint_is_refused():
    fn = remat.checkpoint(region_name="inner")(lambda t: t.sin())
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(remat.RematError, match="checkpoint 'inner'"):
        checkpoint(fn, x, use_reentrant=False)


def test_torch_checkpoint_inside_a_remat_checkpoint_still_works():
    def body(t):
        return checkpoint(torch.sin, t, use_reentrant=False).exp()

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with recorded_replays() as replayed:
        remat.checkpoint(region_name="outer")(body)(x).sum().backward()
    assert replayed == ["outer"]  # exp's result is recomputed
    assert torch.equal(x.grad, (x.detach().sin().exp() * x.detach().cos()))
