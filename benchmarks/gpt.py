"""A GPT block stack whose call sites can be made ``remat.region``\\ s.

Attention is written out as matmul + softmax (no fused SDPA), so the s² tensors
(scores, probabilities, dropout mask) exist and selective recompute has something
to save. Every call that a recompute policy may want to name goes through
``Block._site(name, fn)``: with no policy it is the plain callable, so the same code
runs under no AC, ``torch.utils.checkpoint`` and SAC.

Sites, in forward order::

    ln1 -> qkv -> attention_core[ scores -> (mask, softmax, dropout) -> context ]
        -> proj -> (+x) -> ln2 -> fc1 -> gelu -> fc2 -> (+x)

``scores`` is ``q @ k^T * scale`` and ``context`` is ``probs @ v``, each one
``bmm`` on operands already laid out per head (the head split and merge are bare
code around them), so a SAVE region at a matmul site wraps exactly the op that SAC
saves: the head-split copies are recomputed by both, not kept by one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import torch_remat as remat


@dataclass(frozen=True)
class GPTConfig:
    """Shape of one benchmark model."""

    d_model: int
    """Hidden size; the MLP is 4x wider."""
    n_heads: int
    """Attention heads; head size is ``d_model // n_heads``."""
    seq_len: int
    """Sequence length s (the causal mask is s x s)."""
    batch: int
    """Batch size of the benchmark input."""
    n_layers: int
    """Number of blocks, each its own checkpoint."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities (Megatron's attention core has it)."""


@dataclass(frozen=True)
class RegionPolicy:
    """How a ``remat.checkpoint`` block marks its call sites.

    ``sites`` maps a site name to ``recompute`` (False makes a SAVE region).
    ``keep`` lists SAVE sites whose output bare (replayed) code reads during the
    recompute; the block calls ``remat.recompute_needs_tensor`` on them. Sites not
    in ``sites`` are plain calls.
    """

    sites: dict[str, bool] = field(default_factory=dict)
    keep: frozenset[str] = frozenset()


class Block(nn.Module):
    """Pre-LN transformer block: attention with explicit softmax, then a GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.scale = 1.0 / math.sqrt(d // cfg.n_heads)
        self.dropout = cfg.attention_dropout
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)
        causal = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("causal", causal, persistent=False)
        self._wrapped: dict[str, Callable] = {}
        self._keep: frozenset[str] = frozenset()

    def set_policy(self, policy: RegionPolicy | None) -> None:
        """Wrap the named sites in ``remat.region`` (None: all plain calls)."""
        self._wrapped, self._keep = {}, frozenset()
        if policy is None:
            return
        callables = {
            "ln1": self.ln1,
            "qkv": self.qkv,
            "attention_core": self._attention_core,
            "scores": self._scores,
            "context": self._context,
            "proj": self.proj,
            "ln2": self.ln2,
            "fc1": self.fc1,
            "gelu": self.gelu,
            "fc2": self.fc2,
        }
        unknown = set(policy.sites) - set(callables)
        if unknown:
            raise ValueError(f"unknown call sites {sorted(unknown)}; known: {sorted(callables)}")
        self._wrapped = {
            name: remat.region(callables[name], name, recompute=recompute)
            for name, recompute in policy.sites.items()
        }
        self._keep = policy.keep

    def _site(self, name: str, fn: Callable) -> Callable:
        return self._wrapped.get(name, fn)

    def _kept(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name in self._keep:
            remat.recompute_needs_tensor(t)
        return t

    def _scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """(b*heads, s, head) x2 -> (b*heads, s, s)."""
        return torch.bmm(q, k.transpose(1, 2)) * self.scale

    def _context(self, probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(b*heads, s, s) @ (b*heads, s, head)."""
        return torch.bmm(probs, v)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(b, s, d) -> (b*heads, s, head), the contiguous layout bmm reads."""
        b, s, _ = t.shape
        return t.view(b, s, self.n_heads, -1).transpose(1, 2).reshape(b * self.n_heads, s, -1)

    def _attention_core(self, qkv: torch.Tensor) -> torch.Tensor:
        b, s, three_d = qkv.shape
        d = three_d // 3
        q, k, v = (self._heads(t) for t in qkv.split(d, dim=2))
        scores = self._kept("scores", self._site("scores", self._scores)(q, k))
        scores = scores.view(b, self.n_heads, s, s).masked_fill(self.causal[:s, :s], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.dropout > 0:
            probs = F.dropout(probs, self.dropout, training=self.training)
        probs = probs.view(b * self.n_heads, s, s)
        context = self._kept("context", self._site("context", self._context)(probs, v))
        return context.view(b, self.n_heads, s, -1).transpose(1, 2).reshape(b, s, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        site, kept = self._site, self._kept
        h = site("ln1", self.ln1)(x)
        qkv = kept("qkv", site("qkv", self.qkv)(h))
        a = site("attention_core", self._attention_core)(qkv)
        x = x + kept("proj", site("proj", self.proj)(a))
        h = site("ln2", self.ln2)(x)
        h = kept("fc1", site("fc1", self.fc1)(h))
        h = kept("gelu", site("gelu", self.gelu)(h))
        return x + kept("fc2", site("fc2", self.fc2)(h))


class GPTStack(nn.Module):
    """``n_layers`` blocks; how each block is called is set by a checkpoint mode."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.block_calls: list[Callable[[torch.Tensor], torch.Tensor]] = list(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for call in self.block_calls:
            x = call(x)
        return x

    def example_input(self, seed: int = 0) -> torch.Tensor:
        cfg = self.cfg
        g = torch.Generator().manual_seed(seed)
        return torch.randn(cfg.batch, cfg.seq_len, cfg.d_model, generator=g, requires_grad=True)
