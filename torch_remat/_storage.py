"""Storages behind saved tensors: identity, size, and the tensors inside packed objects.

Reports count memory per *storage*, not per tensor: views and aliases of one
allocation are counted once. A storage is identified by its ``StorageImpl`` (stable
while any tensor refers to it), so two reports built while the same tensors are
alive agree.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class StorageInfo(NamedTuple):
    key: int  # the StorageImpl's address: same allocation, same key
    nbytes: int
    data_ptr: int
    device: torch.device


def storages_of(t: torch.Tensor) -> list[StorageInfo]:
    """The storages a tensor occupies; a wrapper subclass (e.g. DTensor) yields its
    inner tensors' storages, a storage-less tensor (meta, placeholder) none."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        out: list[StorageInfo] = []
        try:
            names, _ = t.__tensor_flatten__()
        except Exception:
            return out
        for name in names:
            inner = getattr(t, name, None)
            if isinstance(inner, torch.Tensor):
                out.extend(storages_of(inner))
        return out
    if t.device.type == "meta":
        return []
    try:
        st = t.untyped_storage()
        return [StorageInfo(st._cdata, st.nbytes(), st.data_ptr(), t.device)]
    except (RuntimeError, NotImplementedError, TypeError):
        return []


def tensors_in(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensors inside an object packed by someone's saved-tensor hooks (a tensor, or
    tuples/lists/dicts of them, such as ``save_on_cpu``'s ``(device, tensor)``)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 3:
        return []
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors_in(x, depth + 1)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in tensors_in(x, depth + 1)]
    return []


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one: reports never count it as saved activation
    memory (the module holds it anyway)."""
    base = t._base
    return isinstance(t if base is None else base, torch.nn.Parameter)
