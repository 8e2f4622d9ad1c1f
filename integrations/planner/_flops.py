"""FLOP formulas for ops ``FlopCounterMode`` has none for, so that a recompute's
FLOPs do not depend on which kernel the planning machine dispatches to.

On CPU ``scaled_dot_product_attention`` runs ``_scaled_dot_product_flash_attention_for_cpu``,
which torch's counter does not know (it counts 0), while the CUDA kernels of the same
call (flash, memory-efficient, cuDNN) are counted as their two matmuls. The CPU kernel
is counted the same way here: planned on CPU for a GPU, attention's recompute is seen.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import sdpa_flop_count


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    # As torch counts the CUDA kernels: QK^T and the product with V, a causal mask
    # not discounted; grouped-query attention's K and V count as broadcast.
    return sdpa_flop_count(query.shape, key.shape, value.shape)


EXTRA_FORMULAS = {
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa,
}
"""Per aten op (by name), ``formula(*args, **kwargs) -> FLOPs`` (tensors, not shapes)."""


def flops(func: Any, args: tuple, kwargs: dict, out: Any, registry: dict) -> int:
    """FLOPs of one op: torch's formula (``registry``), else one of ours, else 0."""
    formula = registry.get(func.overloadpacket)
    if formula is not None:
        return int(formula(*args, **kwargs, out_val=out))
    extra = EXTRA_FORMULAS.get(func.overloadpacket.__name__)
    return 0 if extra is None else int(extra(*args, **kwargs))
