"""Storages behind saved tensors: identity, size, and the tensors inside packed objects.

Reports count memory per *storage*, not per tensor: views and aliases of one
allocation are counted once. A storage is identified by its ``StorageImpl`` (stable
while any tensor refers to it), so two reports built while the same tensors are
alive agree.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._compat import storage_key
from .._tensors import is_parameter

__all__ = ["StorageInfo", "is_parameter", "storages_of", "tensors_in"]


class StorageInfo(NamedTuple):
    key: int  # the StorageImpl's address: same allocation, same key
    nbytes: int
    data_ptr: int
    device: torch.device


def storages_of(t: torch.Tensor) -> list[StorageInfo]:
    """The storages a tensor occupies; a wrapper subclass (e.g. DTensor) yields its
    inner tensors' storages, a storage-less tensor (meta, a FakeTensor, a
    placeholder) none."""
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
        if st.device.type == "meta":  # a FakeTensor (tracing): holds no memory
            return []
        return [StorageInfo(storage_key(st), st.nbytes(), st.data_ptr(), t.device)]
    except (RuntimeError, NotImplementedError, TypeError):
        return []


_NO_TENSORS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)
_slot_names: dict[type, tuple[str, ...]] = {}


def _slots(tp: type) -> tuple[str, ...]:
    names = _slot_names.get(tp)
    if names is None:
        found: list[str] = []
        for klass in tp.__mro__:
            slots = klass.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name not in ("__weakref__", "__dict__") and name not in found:
                    found.append(name)
        names = _slot_names[tp] = tuple(found)
    return names


def tensors_in(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensors an object packed by someone's saved-tensor hooks keeps alive.

    A tensor; tuples, lists and dicts of them (``save_on_cpu`` packs
    ``(device, tensor)``); or the tensor attributes (``__slots__`` or ``__dict__``)
    of a small wrapper object, two levels deep. A packed type can say exactly what
    it keeps by defining ``_remat_resident_tensors(self)``, returning the tensors.
    Modules and functions are never looked into.
    """
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 2 or isinstance(obj, _NO_TENSORS):
        return []
    tp = type(obj)
    resident = getattr(tp, "_remat_resident_tensors", None)
    if resident is not None:
        try:
            return [t for t in resident(obj) if isinstance(t, torch.Tensor)]
        except Exception:
            return []
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors_in(x, depth + 1)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in tensors_in(x, depth + 1)]
    if isinstance(obj, (type, torch.nn.Module)) or callable(obj):
        return []
    out = []
    for name in _slots(tp):
        out.extend(tensors_in(getattr(obj, name, None), depth + 1))
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        for value in attrs.values():
            out.extend(tensors_in(value, depth + 1))
    return out
