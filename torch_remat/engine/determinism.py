"""Opt-in check that a recompute reproduces the forward bit for bit.

With ``remat.checkpoint(..., determinism_check="bitwise")`` every tensor the forward
drops (saved outside SAVE regions) gets a checksum of its bits; the recompute
compares the tensor it recreates against it. The default check compares only shape,
dtype and device, which cannot see, for example, dropout replayed without its RNG
state hook.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import RecomputeMismatchError
from .._tensors import format_dtype

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """Order-sensitive checksum of a tensor's bits: (sum, position-weighted sum)."""
    with torch.no_grad():
        x = t.detach()
        if hasattr(x, "to_local"):  # a DTensor: this rank's shard is what it replays
            x = x.to_local()
        if x.is_complex():
            x = torch.view_as_real(x)
        if x.dtype == torch.bool:
            x = x.to(torch.uint8)
        x = x.contiguous().reshape(-1)
        bits = x.view(_INT_OF_SIZE[x.element_size()]).to(torch.int64)
        pos = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
        return int(bits.sum()), int((bits * pos).sum())


def check_bitwise(frame: Any, index: int, t: torch.Tensor, region: str | None) -> None:
    if checksum(t) == frame.holder_checksums[index]:
        return
    where = f"region '{region}'" if region else "code outside regions"
    raise RecomputeMismatchError(
        f"torch_remat: determinism check failed for checkpoint '{frame.name}': tensor "
        f"#{index} saved for backward by {where} ({tuple(t.shape)}, "
        f"{format_dtype(t.dtype)}) has different bits in the recompute than "
        "in the forward. Something the replay depends on changed: usually RNG state "
        "(dropout) that needs a recompute_state_hooks entry, or a non-deterministic "
        "kernel."
    )
