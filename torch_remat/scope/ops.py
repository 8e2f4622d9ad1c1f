"""The pieces a ``gradient_checkpoint_scope`` records: how ops name their tensor
arguments, and what the schema says about writes and randomness.

Tensors are identified by their *storage*, not by their Python object (a view taken
after the scope exited shares the storage, so it is recognised too):

* ``View(sid, dtype, size, stride, offset)`` for a storage the scope created (or an
  outside storage the scope writes to; it is snapshotted before the first write);
* ``Ext(tensor, version)`` for an outside tensor only read: checked for in-place
  changes before the replay reads it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from .. import _compat
from .._errors import RematError
from .._tensors import storage_root


class _ScopeLocal(threading.local):
    def __init__(self) -> None:
        # > 0 while this thread runs torch_remat's own ops (pack hooks, replays):
        # recording modes let them through unrecorded.
        self.paused = 0


scope_tls = _ScopeLocal()


@contextlib.contextmanager
def paused_recording():
    scope_tls.paused += 1
    try:
        yield
    finally:
        scope_tls.paused -= 1


def storage_key(t: torch.Tensor) -> int:
    return _compat.storage_key(t.untyped_storage())


def version_of(t: torch.Tensor) -> int | None:
    # Inference tensors have no version counter (and cannot be modified outside
    # inference mode): None means "nothing to check".
    return None if t.is_inference() else _compat.version_of(t)


class View:
    __slots__ = ("sid", "dtype", "size", "stride", "offset", "conj", "neg")

    def __init__(self, sid: int, t: torch.Tensor) -> None:
        self.sid = sid
        self.dtype = t.dtype
        self.size = tuple(t.shape)
        self.stride = t.stride()
        self.offset = t.storage_offset()
        # a lazy conjugate or negative view (a.conj(), a.conj().imag): the bits the
        # storage does not hold
        self.conj = t.is_conj()
        self.neg = t.is_neg()


class Ext:
    __slots__ = ("tensor", "version", "key", "checksum")

    def __init__(self, tensor: torch.Tensor, version: int, key: int) -> None:
        self.tensor = tensor
        self.version = version
        self.key = key
        # the bits of a tensor whose writes may skip its version counter, at the
        # scope's exit (ScopeRecord.finish), checked before the replay reads it
        self.checksum: Any = None


def unversioned_writes_possible(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage may change in place without a version counter moving:
    that of a parameter or buffer (an autograd leaf, or a view of one such as
    ``weight.t()``: fused optimizer steps, batch norm's running statistics, writes
    through ``.data``) or of an inference tensor (no counter)."""
    return storage_root(t).grad_fn is None


class Op:
    __slots__ = (
        "index",
        "func",
        "leaves",
        "spec",
        "reads",
        "writes",
        "new_outputs",
        "generator",
        "rng_state",
    )

    def __init__(self, index: int, func: Any) -> None:
        self.index = index
        self.func = func
        self.leaves: list[Any] = []
        self.spec: Any = None
        self.reads: set[int] = set()
        self.writes: set[int] = set()
        # (position among the flattened outputs, sid, shape, dtype) of each new storage
        self.new_outputs: list[tuple[int, int, tuple, torch.dtype]] = []
        self.generator: torch.Generator | None = None
        self.rng_state: torch.Tensor | None = None


def default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if generators is None:
        raise RematError(
            f"torch_remat: gradient_checkpoint_scope cannot replay random ops on "
            f"'{device.type}': torch.{device.type}.default_generators does not exist. "
            "Move the random op out of the scope."
        )
    index = device.index if device.index is not None else module.current_device()
    return generators[index]


# Ops that update running statistics in training mode without declaring it in their
# schema (aten::native_batch_norm has no (a!) annotation on running_mean/var).
_UNDECLARED_WRITES = {
    "aten::native_batch_norm": (5, (3, 4)),
    "aten::cudnn_batch_norm": (5, (3, 4)),
    "aten::miopen_batch_norm": (5, (3, 4)),
}


def written_args(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    undeclared = _UNDECLARED_WRITES.get(func._schema.name)
    if undeclared is not None:
        training, written = undeclared
        if len(args) > training and args[training]:
            out.extend(args[i] for i in written if isinstance(args[i], torch.Tensor))
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


# Ops that only read running statistics (eval-mode batch norm as torch's
# decompositions spell it): argument positions.
_STATS_READS = {
    "aten::_native_batch_norm_legit_no_training": (3, 4),
    "aten::_batch_norm_no_update": (3, 4),
}


def unversioned_reads(func: Any, args: tuple) -> list[torch.Tensor]:
    """The running statistics a batch norm op reads in eval mode. Any batch norm in
    training mode writes them without a version bump (see ``_UNDECLARED_WRITES``), so
    a read of them is snapshotted like a write: the replay reads their value at the
    forward, even after a training-mode forward changed them."""
    name = func._schema.name
    read = _STATS_READS.get(name)
    if read is None:
        undeclared = _UNDECLARED_WRITES.get(name)
        if undeclared is None:
            return []
        training, read = undeclared
        if len(args) > training and args[training]:
            return []  # written: written_args snapshots them
    return [args[i] for i in read if i < len(args) and isinstance(args[i], torch.Tensor)]


def unreturned_writes(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The arguments ``func`` writes without returning them (``Tensor(b!) noise`` of
    ``rrelu_with_noise``: a buffer the op fills), unlike an in-place op's ``self``,
    which it returns (``Tensor(a!) self -> Tensor(a!)``)."""
    schema = func._schema
    returned: set[str] = set()
    for r in schema.returns:
        if r.alias_info is not None:
            returned |= set(r.alias_info.before_set)
    out: list[torch.Tensor] = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write or set(info.before_set) & returned:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
    return out


def is_random(func: Any) -> bool:
    if torch.Tag.nondeterministic_seeded in func.tags:
        return True
    return any(a.name == "generator" for a in func._schema.arguments)


def check_supported(t: torch.Tensor) -> None:
    if (
        t.layout != torch.strided
        or type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
    ):
        raise RematError(
            f"torch_remat: gradient_checkpoint_scope records plain dense tensors only; an "
            f"op inside the scope used a {type(t).__name__} with layout {t.layout}. Move "
            "that op out of the scope (or use remat.checkpoint around it)."
        )
