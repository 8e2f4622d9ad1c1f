"""Shared test helpers: gradient comparison and small models."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import torch_remat as remat


def grads(params, inputs, fn, *, seed=0):
    """Run ``fn(*inputs)`` (a scalar loss) and return grads of params and inputs."""
    for p in params:
        p.grad = None
    for x in inputs:
        if x.requires_grad:
            x.grad = None
    torch.manual_seed(seed)
    loss = fn(*inputs)
    loss.backward()
    out = [p.grad.clone() if p.grad is not None else None for p in params]
    out += [x.grad.clone() if x.grad is not None else None for x in inputs if x.requires_grad]
    return loss.detach(), out


def assert_bitwise_equal(a, b):
    loss_a, grads_a = a
    loss_b, grads_b = b
    assert torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b)
    for i, (ga, gb) in enumerate(zip(grads_a, grads_b)):
        if ga is None or gb is None:
            assert ga is None and gb is None, f"gradient {i}: one is None"
        else:
            assert torch.equal(ga, gb), f"gradient {i} differs: max abs diff {(ga - gb).abs().max()}"


class SavedBytes:
    """Bytes of the distinct storages autograd saves while the block runs (an outer
    saved-tensor hook sees what the compiled forward hands its backward), not
    counting parameters, which are resident anyway."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.parameters:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class CounterHook:
    """A user RecomputeStateHook for state other than RNG (an int counter)."""

    def __init__(self) -> None:
        self.value = 0

    def snapshot(self):
        return self.value

    def restore(self, state):
        self.value = state


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """``save_on_cpu`` that records the shapes it offloads."""

    def __init__(self):
        super().__init__()
        self.offloaded = []
        pack = self.pack_hook

        def counting_pack(t):
            self.offloaded.append(tuple(t.shape))
            return pack(t)

        self.pack_hook = counting_pack


BLOCK_REGIONS = ("attn_norm", "qkv", "attention", "out_proj", "mlp_norm", "mlp")


class Block(nn.Module):
    """A pre-norm transformer block with every piece in its own region."""

    def __init__(self, dim=16, heads=2, dropout=0.1, dtype=torch.float64):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(dim, dtype=dtype)
        self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype)
        self.out_proj = nn.Linear(dim, dim, dtype=dtype)
        self.mlp_norm = nn.LayerNorm(dim, dtype=dtype)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim, dtype=dtype), nn.GELU(), nn.Linear(4 * dim, dim, dtype=dtype)
        )
        self.dropout = dropout
        self.save = {name: False for name in BLOCK_REGIONS}

    def attention(self, qkv):
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        probs = F.dropout(probs, self.dropout, self.training)
        return (probs @ v).transpose(1, 2).reshape(b, s, -1)

    def _r(self, fn, name):
        return remat.region(fn, name, recompute=not self.save[name])

    def forward(self, x):
        h = self._r(self.attn_norm, "attn_norm")(x)
        qkv = self._r(self.qkv, "qkv")(h)
        a = self._r(self.attention, "attention")(qkv)
        a = self._r(self.out_proj, "out_proj")(a)
        remat.recompute_needs_tensor(a)
        x = x + F.dropout(a, self.dropout, self.training)
        h = self._r(self.mlp_norm, "mlp_norm")(x)
        m = self._r(self.mlp, "mlp")(h)
        remat.recompute_needs_tensor(m)
        return x + m
