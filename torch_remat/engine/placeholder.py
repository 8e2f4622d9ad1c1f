"""Placeholders: stand-ins for tensors that a recompute may not read.

During a recompute, a skipped SAVE region returns its outputs. Outputs that were
not kept are returned as placeholders: tensors with the right shape, strides, dtype,
device and ``requires_grad`` but no storage. Metadata queries and view ops work on
them (a view of a placeholder is a placeholder), and so do the factories that take
only their argument's shape, dtype and device (``torch.zeros_like``, the mask
dropout makes with ``empty_like``), so replayed code that only reshapes or slices the
output, or makes a tensor like it, runs unchanged. Any op that reads data raises
:class:`~torch_remat.PlaceholderReadError` naming where the tensor came from.

Placeholders are a tensor subclass, not a dispatch mode: only ops that touch a
placeholder go through Python, and placeholders exist only during a recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _compat
from .._errors import PlaceholderReadError
from .context import current_pass

tree_map = _compat.tree_map


@dataclass(frozen=True)
class PlaceholderOrigin:
    """Where a placeholder comes from, for error messages."""

    checkpoint: str
    # "output" of a SAVE region, "input" of the checkpoint, or "argument" of a SAVE
    # region its body wrote in place
    kind: str
    index: int
    region: str | None = None
    # the later SAVE region whose body wrote this output in place (its value as the
    # region returned it is gone)
    written_by: str | None = None

    def describe(self) -> str:
        if self.kind == "input":
            return f"checkpoint input {self.index}"
        if self.kind == "argument":
            return f"argument {self.index} of SAVE region '{self.region}' (as its body wrote it in place)"
        if self.written_by is not None:
            return (
                f"output {self.index} of SAVE region '{self.region}' (which SAVE region "
                f"'{self.written_by}' then wrote in place)"
            )
        return f"output {self.index} of SAVE region '{self.region}'"

    def advice(self) -> str:
        if self.written_by is not None:
            return (
                "The replay skips both bodies, and the value the first returned was "
                "overwritten in forward, so nothing holds it. Write a copy in "
                f"'{self.written_by}' (t = t.clone() before the in-place op), or make "
                "one of the two regions recompute=True."
            )
        if self.kind == "input":
            return (
                "It was not kept because, as far as autograd could see, only SAVE "
                "regions consumed it in forward (a read through a non-differentiable "
                "op, or under no_grad, is invisible to autograd). Call "
                "remat.recompute_needs_tensor(t) on that input inside the "
                "checkpointed function."
            )
        return (
            "SAVE region bodies are not replayed, and an output is only kept when a "
            "later remat.region consumes it, when it is saved for backward, or when "
            "remat.recompute_needs_tensor(t) is called on it. Call "
            "remat.recompute_needs_tensor(t) on that output after the region returns "
            "and before the bare op that reads it."
        )


def _storage_numel(shape, stride, offset: int) -> int:
    if any(s == 0 for s in shape):
        return offset
    return offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride))


def _as_meta(t: torch.Tensor) -> torch.Tensor:
    shape, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
    base = torch.empty(_storage_numel(shape, stride, offset), dtype=t.dtype, device="meta")
    return base.as_strided(shape, stride, offset)


class Placeholder(torch.Tensor):
    """A storage-less tensor standing in for a value that was not kept."""

    _origin: PlaceholderOrigin

    @staticmethod
    def __new__(
        cls,
        shape,
        stride,
        storage_offset: int,
        dtype: torch.dtype,
        device: torch.device,
        requires_grad: bool,
        origin: PlaceholderOrigin,
    ) -> Placeholder:
        out = _compat.make_wrapper_subclass(
            cls,
            shape,
            strides=stride,
            storage_offset=storage_offset,
            dtype=dtype,
            device=device,
            requires_grad=requires_grad,
        )
        out._origin = origin
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Ahead of autograd, whose own refusal of an in-place op on a leaf that
        # requires grad would name neither the checkpoint nor the region.
        if args and isinstance(args[0], Placeholder) and _writes_in_place(func):
            _settle_stop()
            raise PlaceholderReadError(in_place_message(args[0]._origin, func))
        return _compat.disabled_torch_function_impl(func, types, args, kwargs or {})

    def __repr__(self, *, tensor_contents=None) -> str:  # never reads data
        return (
            f"Placeholder(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, for {self._origin.describe()} of checkpoint "
            f"'{self._origin.checkpoint}')"
        )

    # Raw data access does not go through dispatch: a wrapper subclass would answer
    # with a null pointer (data_ptr() == 0) that a custom kernel then reads.
    def _refuse(self, what: str):
        _settle_stop()
        raise PlaceholderReadError(read_error_message(self._origin, what))

    def data_ptr(self) -> int:
        self._refuse("data_ptr()")

    def untyped_storage(self):
        self._refuse("untyped_storage()")

    def storage(self):
        self._refuse("storage()")

    def numpy(self, *, force: bool = False):
        self._refuse("numpy()")

    def __array__(self, dtype=None, copy=None):
        self._refuse("__array__()")

    def tolist(self):
        self._refuse("tolist()")

    def item(self):
        self._refuse("item()")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        origin = _first_origin(args, kwargs)
        if func.is_view:
            device = _first_device(args, kwargs)
            meta_out = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            return tree_map(
                lambda m: _from_meta(m, device, origin) if isinstance(m, torch.Tensor) else m,
                meta_out,
            )
        if func.overloadpacket in _READ_NO_DATA and args and isinstance(args[0], Placeholder):
            # A factory that reads only its first argument's shape, dtype, device and
            # layout (dropout's empty_like for its mask, zeros_like for an
            # accumulator) runs on a real uninitialized stand-in of the same strides:
            # the same result. Not where it reads another placeholder's value
            # (randint_like(x, high) with a tensor high: named below) or writes an
            # out= argument.
            others = [x for x in _compat.tree_leaves((args[1:], kwargs)) if isinstance(x, Placeholder)]
            if others:
                origin = others[0]._origin
            elif not func._overloadname.endswith("out"):
                p = args[0]
                stand_in = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)
                return func(stand_in, *args[1:], **kwargs)
        _settle_stop()
        raise PlaceholderReadError(read_error_message(origin, f"the op {func}"))


_aten = torch.ops.aten
# ops whose result depends on their tensor argument's metadata only
_READ_NO_DATA = frozenset({
    _aten.empty_like, _aten.zeros_like, _aten.ones_like, _aten.full_like, _aten.rand_like,
    _aten.randn_like, _aten.randint_like, _aten.new_empty, _aten.new_empty_strided,
    _aten.new_zeros, _aten.new_ones, _aten.new_full,
})


def _settle_stop() -> None:
    """A replay waiting to stop (``ReplayPass.settle_stop``) stops here, before a read
    of an output nothing kept: the op it waited for has run, and nothing after it
    is needed."""
    settle = getattr(current_pass(), "settle_stop", None)
    if settle is not None:
        settle()


def read_error_message(origin: PlaceholderOrigin, reader: str) -> str:
    return (
        f"torch_remat: during the recompute of checkpoint '{origin.checkpoint}', "
        f"{reader} read {origin.describe()}, which was not kept. "
        f"{origin.advice()}"
    )


_NOT_WRITES = frozenset({"requires_grad_", "detach_", "retain_grad", "share_memory_"})
_IN_PLACE_OPERATORS = frozenset(
    {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
     "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__"}
)


def _writes_in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return name not in _NOT_WRITES
    return name in _IN_PLACE_OPERATORS


def in_place_message(origin: PlaceholderOrigin, func) -> str:
    op = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
    if origin.kind == "input":
        fix = (
            "Clone the input before updating it (x = x.clone()), or update it "
            "outside the checkpoint."
        )
    else:
        fix = (
            "Do the in-place update inside the region (and return the updated tensor), "
            "or use an out-of-place op after the region (a = a + b rather than a.add_(b))."
        )
    return (
        f"torch_remat: during the recompute of checkpoint '{origin.checkpoint}', "
        f"replayed code updated {origin.describe()} in place ({op}). It was not kept, "
        "and its value before the update cannot be recreated: SAVE region bodies are "
        f"not replayed, and a kept tensor must not change after the forward used it. {fix}"
    )


def _first_origin(args, kwargs) -> PlaceholderOrigin:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, Placeholder):
            return a._origin
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, Placeholder):
                    return b._origin
    raise AssertionError("Placeholder.__torch_dispatch__ called without a placeholder")


def _first_device(args, kwargs) -> torch.device:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    raise AssertionError("no tensor argument")


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return _as_meta(x)
    return x


def _from_meta(m: torch.Tensor, device: torch.device, origin: PlaceholderOrigin) -> Placeholder:
    return Placeholder(
        m.shape, m.stride(), m.storage_offset(), m.dtype, device, False, origin
    )


def make_placeholder(meta, origin: PlaceholderOrigin) -> Placeholder:
    """Build a placeholder from a recorded ``TensorMeta``."""
    return Placeholder(
        meta.shape,
        meta.stride,
        meta.storage_offset,
        meta.dtype,
        meta.device,
        meta.requires_grad,
        origin,
    )


def is_placeholder(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is (a view of) a placeholder: during a replay, the stand-in
    for a skipped SAVE region's output that was not kept. It has the output's shape,
    strides, dtype and device, so metadata and view ops work on it, but any op that
    reads its data raises :class:`~torch_remat.PlaceholderReadError`. Check it before
    reading data in code that runs in the replay; outside a replay it is always
    False."""
    return isinstance(tensor, Placeholder)
