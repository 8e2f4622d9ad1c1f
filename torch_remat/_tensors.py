"""Small records describing tensors without holding them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ._compat import storage_key, view_base

_new_tuple = tuple.__new__


class TensorMeta(NamedTuple):
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        # (tuple.__new__ directly: a NamedTuple's own __new__ is a Python function,
        # and this runs for every tensor a SAVE region saves or returns)
        return _new_tuple(
            cls, (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)
        )

    def describe(self) -> str:
        return describe_tensor(self.shape, self.dtype)


def format_dtype(dtype: torch.dtype) -> str:
    """``float32``, not ``torch.float32``."""
    return str(dtype).replace("torch.", "")


def format_shape(shape: Sequence[int]) -> str:
    return str(tuple(int(s) for s in shape))


def describe_tensor(shape: Sequence[int], dtype: torch.dtype) -> str:
    """``shape (3, 4), float32``: how every message names a tensor's layout."""
    return f"shape {format_shape(shape)}, {format_dtype(dtype)}"


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one: the module holds it anyway, so reports never
    count it as saved activation memory."""
    base = view_base(t)
    root = t if base is None else base
    # type() first: Parameter's isinstance check runs Python code
    return type(root) is not torch.Tensor and isinstance(root, torch.nn.Parameter)


def held_anyway(t: torch.Tensor) -> bool:
    """(A view of) a parameter, or of a leaf that requires grad: the module or
    autograd (its AccumulateGrad node) holds it anyway, so reports never bill it to
    a checkpoint."""
    base = view_base(t)
    root = t if base is None else base
    if root.requires_grad and root.is_leaf:
        return True
    return type(root) is not torch.Tensor and isinstance(root, torch.nn.Parameter)


def storage_ptr(t: object) -> int | None:
    """A key equal for two tensors exactly when they share one storage (None: not a
    tensor with a storage). The storage object's identity, not its data pointer:
    fake and meta tensors have storages but no memory (and torch warns when a fake
    tensor's data pointer is read)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return storage_key(t.untyped_storage()) or None
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (a subclass)
        return None


def same_storage(a: object, b: torch.Tensor) -> bool:
    """True if ``a`` is a tensor in the memory of ``b``'s storage."""
    ptr = storage_ptr(a)
    return ptr is not None and ptr == storage_ptr(b)


def storage_root(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns ``t``'s storage as far as autograd views go."""
    base = view_base(t)
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


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_CHECKSUM_CHUNK = 1 << 20
"""Elements summed at a time: the int64 temporaries of the sums stay at 16 MiB (a
tensor that is not contiguous, complex or bool is first copied into one that is)."""


def _sums(words: torch.Tensor) -> torch.Tensor:
    """(sum, position-weighted sum) of the 1-D integer tensor ``words``, in int64
    arithmetic (wrapping), summed in chunks on its device."""
    acc = torch.zeros(2, dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHECKSUM_CHUNK):
        part = words[start : start + _CHECKSUM_CHUNK].to(torch.int64)
        pos = torch.arange(start + 1, start + 1 + part.numel(), device=part.device, dtype=torch.int64)
        acc[0] += part.sum()
        acc[1] += (part * pos).sum()
    return acc


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """Order-sensitive checksum of a tensor's bits: (sum, position-weighted sum),
    in int64 arithmetic (wrapping), summed in chunks on the tensor's device."""
    with torch.no_grad():
        x = t.detach()
        if hasattr(x, "to_local"):  # a DTensor: this rank's shard is what it replays
            x = x.to_local()
        if x.is_complex():
            x = torch.view_as_real(x)
        if x.dtype == torch.bool:
            x = x.to(torch.uint8)
        total, weighted = _sums(x.contiguous().reshape(-1).view(_INT_OF_SIZE[x.element_size()])).tolist()
        return total, weighted


_WORDS_PER_BLOCK = 8  # 64 bytes


def storage_fingerprint(t: torch.Tensor) -> Any:
    """Something equal for two looks at ``t``'s storage only if none of its bytes
    changed between them (up to a sum collision), read in place whatever view ``t``
    is: the wrapping sum of the storage's 64-bit words and the sum of its 64-byte
    blocks' word sums weighted by the blocks' positions (a change moves the first; a
    move of words between blocks the second), the trailing bytes apart. About
    2.7 GB/s on CPU here (a CRC-32 of the bytes: 1 GB/s); on a device, summed there.
    None for a tensor without data (``meta``)."""
    if t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    with torch.no_grad():
        raw = torch.empty((0,), dtype=torch.uint8, device=t.device).set_(storage)
        whole = nbytes - nbytes % (8 * _WORDS_PER_BLOCK)
        blocks = raw[:whole].view(torch.int64).view(-1, _WORDS_PER_BLOCK).sum(1)
        total, weighted = _sums(blocks).tolist()
        return nbytes, total, weighted, int(_sums(raw[whole:])[1])
