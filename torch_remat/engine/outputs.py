"""Flattening a SAVE region's outputs into what the recompute can hand back."""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .._tensors import CONSTANT_TYPES
from .records import Constant


def flatten_region_outputs(out: Any, region: str, checkpoint: str) -> tuple[list[Any], Any]:
    """Return ``(leaves, spec)``; tensors stay tensors, other leaves become Constants.

    ``spec`` is None when the region returned a single tensor.
    """
    if isinstance(out, torch.Tensor):
        return [out], None
    leaves, spec = tree_flatten(out)
    result: list[Any] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            result.append(leaf)
        elif isinstance(leaf, CONSTANT_TYPES) or isinstance(leaf, enum.Enum):
            result.append(Constant(leaf))
        else:
            raise TypeError(
                f"torch_remat: SAVE region '{region}' of checkpoint '{checkpoint}' returned "
                f"an object of type {type(leaf).__qualname__} (output leaf {i}). The "
                "region is skipped during recompute, so torch_remat must hand its "
                "outputs back itself: return tensors, containers torch.utils._pytree "
                "understands (tuple, list, dict, namedtuple), or plain constants. Register "
                f"{type(leaf).__qualname__} with torch.utils._pytree.register_pytree_node, "
                "or return its tensors."
            )
    return result, spec
