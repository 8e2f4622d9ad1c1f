"""Names for tensors saved inside SAVE regions.

By default a tensor saved inside a SAVE region is called ``saved.<i>`` in reports.
``remat.save_for_backward(ctx, lse=lse, probs=probs)`` saves through
``ctx.save_for_backward`` and names the tensors, so reports say ``lse`` and
``probs``. Autograd packs a custom Function's saved tensors only after its
``forward`` returns, so the names wait on the frame until the pack hook sees a
tensor with the same storage, offset, shape, stride and dtype.

Also here: linking saved tensors to the region's outputs (``y (output at idx 0)``),
done once when a SAVE region returns, while its outputs are still alive.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .._compat import storage_key
from ..engine.context import current_pass
from ..engine.observers import CheckpointObserver
from .storage import tensors_in

if TYPE_CHECKING:
    from ..engine.frame import CheckpointFrame
    from ..engine.records import RegionRecord, RegionSaved


def _tensor_key(t: torch.Tensor) -> tuple:
    try:
        st = storage_key(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        st = id(t)
    return (st, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class SaveNamer(CheckpointObserver):
    """Subscribed to one checkpoint while ``save_for_backward`` names are pending:
    renames each tensor its SAVE regions keep that matches a pending name."""

    def __init__(self) -> None:
        self.pending: dict[tuple, list[str]] = {}

    def add_names(self, named: dict[str, torch.Tensor]) -> None:
        for name, t in named.items():
            self.pending.setdefault(_tensor_key(t), []).append(name)

    def tensor_kept(
        self, frame: CheckpointFrame | None, saved: RegionSaved, tensor: torch.Tensor
    ) -> None:
        pending = self.pending
        if pending:
            key = _tensor_key(tensor)
            names = pending.get(key)
            if names:
                saved.label(names.pop(0))
                if not names:
                    del pending[key]


def _namer_of(frame: CheckpointFrame) -> SaveNamer:
    for observer in frame.observers.kept:
        if isinstance(observer, SaveNamer):
            return observer
    namer = SaveNamer()
    frame.subscribe(namer)
    return namer


def save_for_backward(
    ctx: Any, *tensors: torch.Tensor | None, **named: torch.Tensor | None
) -> None:
    """``ctx.save_for_backward`` that also names the tensors in torch_remat's reports.

    Inside a custom ``torch.autograd.Function.forward``::

        remat.save_for_backward(ctx, lse=lse, probs=probs)
        ...
        lse, probs = ctx.saved_tensors  # in backward: positional first, then named

    Positional tensors are saved first (and keep their default names), then the
    named ones in keyword order. Upstream torch-remat's form, one mapping of names
    to tensors (``remat.save_for_backward(ctx, {"lse": lse, "probs": probs})``), is
    the same as the keywords. Inside a SAVE region of a checkpoint the names
    appear in ``print_current_memory_report`` and ``print_saved_tensors_report``;
    anywhere else this is exactly ``ctx.save_for_backward(*tensors, *named.values())``.
    """
    if len(tensors) == 1 and isinstance(tensors[0], Mapping):
        if named:
            raise TypeError(
                "remat.save_for_backward: pass names either as one mapping "
                "(save_for_backward(ctx, {'lse': lse})) or as keywords, not both."
            )
        named = dict(tensors[0])
        tensors = ()
    ctx.save_for_backward(*tensors, *named.values())
    active = current_pass()
    if active is None or not active.in_save_region:
        return
    live = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
    if live:
        _namer_of(active.frame).add_names(live)


def link_saved_outputs(record: RegionRecord) -> None:
    """Mark each tensor a SAVE region saved that shares storage with one of the
    region's outputs, so reports can say ``(output at idx i)`` after the forward.
    (Saved parameters are left out: reports do not list them.)"""
    # Runs where every SAVE region returns: plain loops, no list built for nothing.
    candidates = None
    for ref in record.saved:
        saved = ref()
        if saved is not None and not saved.parameter:
            if candidates is None:
                candidates = [saved]
            else:
                candidates.append(saved)
    if candidates is None:
        return
    outputs: dict[int, int] = {}
    for src in record.outputs:
        ref = getattr(src, "ref", None)  # (a Constant has none)
        out = ref() if callable(ref) else None
        if out is None:
            continue
        try:
            outputs.setdefault(storage_key(out.untyped_storage()), src.index)
        except (RuntimeError, NotImplementedError):
            continue
    if not outputs:
        return
    for saved in candidates:
        # packed by the user's own hooks when .tensor is None: look inside
        tensors = (saved.tensor,) if saved.tensor is not None else tensors_in(saved.packed)
        for t in tensors:
            try:
                index = outputs.get(storage_key(t.untyped_storage()))
            except (RuntimeError, NotImplementedError):
                continue
            if index is not None:
                saved.link_output(index)
                break
