"""The activation-checkpointing modes compared, applied per block.

Peers: no AC, ``torch.utils.checkpoint`` (non-reentrant), selective activation
checkpointing (SAC, ``create_selective_checkpoint_contexts``) and ``remat.checkpoint``
with different region policies. Installing a mode only swaps the callables a stack
uses per block, so modes can be interleaved step by step on the same weights.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import torch_remat as remat
from benchmarks.gpt import RegionPolicy

aten = torch.ops.aten

MATMUL_OPS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
"""SAC's save list for "save the matmuls": every matmul the blocks run."""
LINEAR_OPS = (aten.mm.default, aten.addmm.default)
"""SAC's save list for "save the linear layers" (the attention bmm's are recomputed)."""


def _save(*sites: str) -> dict[str, bool]:
    """SAVE regions (``recompute=False``) at the named call sites of gpt.Block."""
    return dict.fromkeys(sites, False)


SAVE_LINEARS = RegionPolicy(
    sites=_save("qkv", "proj", "fc1", "fc2"),
    # The attention core and the residual add are replayed and read these outputs.
    keep=frozenset({"qkv", "proj"}),
)
SAVE_MATMULS = RegionPolicy(
    sites=_save("qkv", "scores", "context", "proj", "fc1", "fc2"),
    # The head split, masked_fill/softmax, the head merge and the residual add are
    # replayed and read these outputs.
    keep=frozenset({"qkv", "scores", "context", "proj"}),
)
MEGATRON = RegionPolicy(
    # Everything is SAVE except the attention core (QK^T, mask, softmax, dropout, AV);
    # naming the core as a RECOMPUTE region makes qkv, which it reads, kept.
    sites={**_save("ln1", "qkv", "proj", "ln2", "fc1", "gelu", "fc2"), "attention_core": True},
)


@dataclass(frozen=True)
class Mode:
    """One way of running every block of a stack."""

    name: str
    kind: str
    """"none", "torch" (torch.utils.checkpoint), "sac" or "remat"."""
    sac_ops: tuple[Any, ...] = ()
    policy: RegionPolicy | None = None
    description: str = ""
    rebuild: str = "free"
    """remat only: ``remat.checkpoint(rebuild=...)``."""

    def block_calls(
        self, blocks: Sequence[torch.nn.Module], *, rng: bool
    ) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """Per-block callables. ``rng``: the blocks draw random numbers (dropout)."""
        if self.kind == "none":
            return list(blocks)
        if self.kind == "torch":
            return [
                functools.partial(torch_checkpoint, b, use_reentrant=False, preserve_rng_state=rng)
                for b in blocks
            ]
        if self.kind == "sac":
            context_fn = functools.partial(create_selective_checkpoint_contexts, list(self.sac_ops))
            return [
                functools.partial(
                    torch_checkpoint,
                    b,
                    use_reentrant=False,
                    preserve_rng_state=rng,
                    context_fn=context_fn,
                )
                for b in blocks
            ]
        if self.kind == "remat":
            hooks = (remat.CPURNGStateHook(),) if rng else ()
            return [
                remat.checkpoint(
                    region_name=f"blocks.{i}", recompute_state_hooks=hooks, rebuild=self.rebuild
                )(b)
                for i, b in enumerate(blocks)
            ]
        raise ValueError(f"unknown mode kind {self.kind!r}")


NO_AC = Mode("no AC", "none", description="plain forward/backward")
TORCH_CHECKPOINT = Mode(
    "torch.utils.checkpoint", "torch", description="non-reentrant, one checkpoint per block"
)
SAC_MATMULS = Mode(
    "SAC mm/addmm/bmm", "sac", MATMUL_OPS, description="SAC per block, saving every matmul output"
)
SAC_LINEARS = Mode(
    "SAC mm/addmm",
    "sac",
    LINEAR_OPS,
    description="SAC per block, saving the linear layers' outputs",
)
REMAT_FULL = Mode("remat full", "remat", policy=RegionPolicy(), description="no regions")
REMAT_SAVE_LINEARS = Mode(
    "remat save linears",
    "remat",
    policy=SAVE_LINEARS,
    description="SAVE regions around qkv, proj, fc1, fc2",
)
REMAT_SAVE_MATMULS = Mode(
    "remat save matmuls",
    "remat",
    policy=SAVE_MATMULS,
    description="SAVE regions around the 4 linears and the 2 attention matmuls",
)
REMAT_SAVE_LINEARS_KEEP = Mode(
    "remat save linears, rebuild never",
    "remat",
    policy=SAVE_LINEARS,
    rebuild="never",
    description="as remat save linears, keeping the saves of replayed arguments",
)
REMAT_SAVE_MATMULS_KEEP = Mode(
    "remat save matmuls, rebuild never",
    "remat",
    policy=SAVE_MATMULS,
    rebuild="never",
    description="as remat save matmuls, keeping the saves of replayed arguments",
)
REMAT_MEGATRON = Mode(
    "remat Megatron-style",
    "remat",
    policy=MEGATRON,
    description="everything SAVE except the attention core",
)
REMAT_MEGATRON_REBUILD = Mode(
    "remat Megatron-style, rebuild always",
    "remat",
    policy=MEGATRON,
    rebuild="always",
    description="as Megatron-style, but the replay also runs AV to rebuild proj's input",
)


def install(stack: Any, mode: Mode, *, rng: bool) -> None:
    """Make ``stack`` (a module with ``blocks`` and ``block_calls``) run in ``mode``."""
    for b in stack.blocks:
        b.set_policy(mode.policy)
    stack.block_calls = mode.block_calls(stack.blocks, rng=rng)
