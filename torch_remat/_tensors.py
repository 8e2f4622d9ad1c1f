"""Small records describing tensors without holding them."""

from __future__ import annotations

from typing import NamedTuple

import torch


class TensorMeta(NamedTuple):
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        return cls(
            tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad
        )

    def describe(self) -> str:
        return f"shape {self.shape}, {str(self.dtype).replace('torch.', '')}"


def storage_root(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns ``t``'s storage as far as autograd views go."""
    base = t._base
    return t if base is None else base


# Leaves a SAVE region may return besides tensors: replayed as the same value.
CONSTANT_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.Size,
    torch.memory_format,
    torch.layout,
)
