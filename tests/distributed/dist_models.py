"""Tiny models shared by the distributed tests (dims 16-32, float64 where possible)."""

from __future__ import annotations

import torch
from torch import nn


class MLPBlock(nn.Module):
    """Pre-norm residual MLP block: x + drop(down(tanh(up(norm(x)))))."""

    def __init__(self, dim: int = 16, hidden: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.tanh(self.up(self.norm(x)))))


class TinyNet(nn.Module):
    """embed -> depth x MLPBlock -> head."""

    def __init__(
        self, dim: int = 16, hidden: int = 32, depth: int = 2, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(MLPBlock(dim, hidden, dropout) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def tiny_net(seed: int = 0, dtype: torch.dtype = torch.float64, **kwargs) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(**kwargs).to(dtype)


def param_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> gradient, as a plain tensor (DTensor gradients gathered in full)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = None if g is None else g.detach().clone()
    return out


def assert_grads_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for name in a:
        ga, gb = a[name], b[name]
        if ga is None or gb is None:
            assert ga is None and gb is None, f"{name}: one gradient is None"
        else:
            assert torch.equal(ga, gb), f"{name}: max abs diff {(ga - gb).abs().max().item()}"


def sequence_parallel_plan(depth: int = 2) -> dict:
    """TP plan for TinyNet on [batch, seq, dim] inputs whose sequence is split over
    the TP ranks: blocks run on DTensors sharded on the sequence (SequenceParallel
    LayerNorm, Colwise up, Rowwise down), so dropout draws on a DTensor; the embed
    runs on each rank's slice and the head on the gathered sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {
        "layers.0": PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Shard(1), use_local_output=False
        ),
        "head": PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True
        ),
    }
    for i in range(depth):
        plan[f"layers.{i}.norm"] = SequenceParallel()
        plan[f"layers.{i}.up"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"layers.{i}.down"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan
