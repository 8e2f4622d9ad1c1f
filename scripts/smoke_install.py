"""Smoke test of an installed torch_remat, run from outside the repository.

    python scripts/smoke_install.py

Imports ``torch_remat`` and ``torch_remat.integrations``, then runs the README's
usage example (a block checkpointed with ``remat.checkpoint``, its attention and MoE
kept as SAVE regions) forward and backward and checks its gradients against the same
block without remat, bitwise. A dropout block is replayed exactly with
``remat.CPURNGStateHook()`` and refused without it. Needs torch only: the CI step
of ``.ci/run`` runs it in a fresh environment holding ``torch`` and this package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import torch_remat as remat
import torch_remat.integrations  # noqa: F401  (imports without accelerate or transformers)
from torch_remat.integrations import apply_remat as apply_activation_checkpointing  # noqa: F401


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention, self.moe = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, hidden_states):
        x = self.attention_norm(hidden_states)
        attn = remat.region(self.attention, "attention", recompute=False)(x)
        remat.recompute_needs_tensor(attn)  # the residual add below reads it in the replay
        hidden_states = hidden_states + attn

        x = F.dropout(self.ffn_norm(hidden_states), self.dropout, self.training)
        moe = remat.region(self.moe, "moe", recompute=False)(x)
        remat.recompute_needs_tensor(moe)
        return hidden_states + moe


def gradients(block: nn.Module, hidden_states: torch.Tensor, run) -> list[torch.Tensor]:
    block.zero_grad(set_to_none=True)
    x = hidden_states.detach().requires_grad_()
    torch.manual_seed(1)
    run(x).square().sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())]


def main() -> None:
    torch.manual_seed(0)
    block = Block(16).double()
    hidden_states = torch.randn(4, 16, dtype=torch.float64)
    plain = gradients(block, hidden_states, block)
    output = gradients(block, hidden_states, remat.checkpoint(region_name="layers.0")(block))
    assert all(torch.equal(a, b) for a, b in zip(plain, output)), "gradients differ under remat"

    noisy = Block(16, dropout=0.5).double()
    plain = gradients(noisy, hidden_states, noisy)
    hooked = remat.checkpoint(region_name="layers.1", recompute_state_hooks=(remat.CPURNGStateHook(),))
    output = gradients(noisy, hidden_states, hooked(noisy))
    assert all(torch.equal(a, b) for a, b in zip(plain, output)), "dropout replay differs"
    try:
        gradients(noisy, hidden_states, remat.checkpoint(region_name="layers.2")(noisy))
    except remat.RecomputeMismatchError as e:
        assert "layers.2" in str(e) and "CPURNGStateHook" in str(e), str(e)
    else:
        raise AssertionError("a dropout replay without CPURNGStateHook was not refused")
    print(f"torch_remat {remat.__version__} (torch {torch.__version__}) from {remat.__file__}: "
          f"checkpoint, SAVE regions and backward ok", flush=True)


if __name__ == "__main__":
    main()
