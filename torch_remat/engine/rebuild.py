"""SAVE-region saves that the replay rebuilds instead of keeping.

A SAVE region's body is never replayed, but an argument produced by bare code or a
RECOMPUTE region is computed again before the replay reaches the region call. So a
save of the body that shares storage with such an argument (the argument, or a view
like the flattened input ``nn.Linear`` saves) is packed as a :class:`RebuiltSave`,
refilled at the region call as the same view of the replay's value. What the body
creates (its internal activations) is kept as before.

The decision is final when the forward ends (:mod:`.rebuild_decide`); until then a
candidate save holds its tensor. ``rebuild="never"`` keeps every save as a
``RegionSaved``.

Only top-level SAVE regions (called from replayed code) rebuild: a save anywhere in
their extent, nested SAVE regions included, that shares storage with one of their
arguments is refilled at that region call. Arguments that are checkpoint inputs or
SAVE outputs are kept by the checkpoint already, so saves of them alias the kept
tensor and cost nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .._compat import autograd_sequence_nr
from .._errors import CLONE_FIRST, RecomputeMismatchError, modified_in_place
from .._tensors import TensorMeta, describe_tensor
from .placeholder import Placeholder
from .records import RegionSaved
from .region_io import region_leaves


class RebuildArg:
    """One argument of a SAVE region call that the replay recomputes."""

    __slots__ = ("index", "tensor", "root", "node", "layout", "version", "checksum", "saves")

    def __init__(self, index: int, t: torch.Tensor, root: torch.Tensor, node: Any) -> None:
        self.index = index
        # Strong references only while the forward runs (the caller holds them then).
        self.tensor: torch.Tensor | None = t
        self.root: torch.Tensor | None = root  # storage_root(t)
        self.node = node
        # (shape, stride, storage offset, dtype, device, storage bytes)
        self.layout = (
            t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.untyped_storage().nbytes()
        )
        self.version = t._version
        self.checksum: Any = None
        self.saves: list[weakref.ref] = []

    def live_saves(self) -> list[RebuiltSave]:
        out = []
        for r in self.saves:
            s = r()
            if s is not None and s.kept is None:
                out.append(s)
        return out


class RegionRebuild:
    """The rebuildable arguments of one top-level SAVE region call."""

    __slots__ = ("pos", "qualname", "args", "seq")

    def __init__(self, pos: int, qualname: str, args: list[RebuildArg]) -> None:
        self.pos = pos
        self.qualname = qualname
        self.args = args
        # the autograd sequence number at the call: nodes before it ran before it
        self.seq = autograd_sequence_nr()


class RebuiltSave:
    """Packed in place of a SAVE-region save that the replay refills.

    ``pending`` holds the tensor until the forward ends; then either the save is
    rebuilt (``recomputed[gid]`` is refilled per backward, like a ``Holder``) or it
    is kept after all as ``kept`` (a ``RegionSaved``).
    """

    __slots__ = ("frame", "arg", "region", "view", "requires_grad", "version", "pending",
                 "kept", "hooks", "recomputed", "__weakref__")

    def __init__(self, frame: Any, arg: RebuildArg, region: Any, t: torch.Tensor) -> None:
        self.frame = frame
        self.arg = arg
        self.region = region
        # (shape, stride, storage offset) in the argument's storage; None when the
        # save is laid out as the argument itself
        layout = arg.layout
        shape, stride, offset = t.shape, t.stride(), t.storage_offset()
        if shape == layout[0] and stride == layout[1] and offset == layout[2]:
            self.view: tuple | None = None
        else:
            self.view = (shape, stride, offset)
        self.requires_grad = t.requires_grad
        self.version = t._version
        self.pending: torch.Tensor | None = t
        self.kept: RegionSaved | None = None
        # the hooks a kept save would get, as of the save (if it is kept after all)
        self.hooks = frame.kept_hooks.region_save(region.qualname, t) or frame.outer_hooks
        self.recomputed: dict[Any, tuple[torch.Tensor, int]] | None = None

    @property
    def meta(self) -> TensorMeta:
        shape, stride, offset, dtype, device, _ = self.arg.layout
        if self.view is not None:
            shape, stride, offset = self.view
        return TensorMeta(tuple(shape), stride, offset, dtype, device, self.requires_grad)

    def unpack(self) -> torch.Tensor:
        if self.kept is not None:
            return self.kept.unpack()
        if self.pending is not None:  # backward inside the forward: still held
            return self.pending.detach()
        return self.frame.take_recomputed(self)


def reset(frame: Any) -> None:
    """A frame's rebuild state, empty: the SAVE region running now, the rebuilt
    saves per replay position, where early stop would end without them, and the
    SAVE outputs' autograd edges (for the walk)."""
    frame.rebuild = None
    frame.rebuilds = {}
    frame.last_needed_seq = 0
    frame.output_edges = {}


def abandon(frame: Any) -> None:
    """The forward raised: saves still pending let go of their tensors (a save that
    is an output of the node holding it would form a cycle through autograd nodes,
    which the garbage collector cannot see), then :func:`reset`."""
    for s in rebuilt_saves(frame):
        s.pending = None
    reset(frame)


def open_rebuild(frame: Any, qualname: str, leaves: Sequence[Any]) -> RegionRebuild | None:
    """Start the call of a top-level SAVE region (the last of ``frame.replay_regions``;
    ``leaves``: its arguments, flattened by ``region_leaves``).

    Its rebuildable arguments are those replayed code produced: created by a recorded
    op of this checkpoint's forward, strided (a sparse or jagged nested tensor has no
    storage view to refill; its saves are kept), and neither a checkpoint input, a
    SAVE output (those are kept anyway) nor a parameter."""
    if frame.rebuild_policy == "never":
        return None
    found = None
    by_root, start = frame.sources.by_root, frame.start_seq
    i = -1
    for x in leaves:
        i += 1
        if not isinstance(x, torch.Tensor):
            continue
        node = x.grad_fn  # None for parameters and other leaves
        if node is None or node._sequence_nr() < start:
            continue
        if x.layout is not torch.strided:
            continue  # sparse, jagged nested: no storage view to rebuild from; kept
        base = x._base
        root = x if base is None else base
        if type(root) is not torch.Tensor and isinstance(root, torch.nn.Parameter):
            continue  # (a view of) a parameter: is_parameter(x)
        entry = by_root.get(id(root)) if by_root else None  # SourceIndex.lookup
        if entry is not None and entry[0]() is root:
            continue  # a checkpoint input or SAVE output (or a view of one)
        if found is None:
            found = []
        found.append(RebuildArg(i, x, root, node))
    if found is None:
        return None
    frame.rebuild = RegionRebuild(len(frame.replay_regions) - 1, qualname, found)
    return frame.rebuild


def close_rebuild(frame: Any, rebuild: RegionRebuild, ok: bool) -> None:
    """The region body returned (``ok``) or raised. Keep its candidates' records."""
    frame.rebuild = None
    if not ok:
        # The replay re-raises the body's error at this call; nothing to refill.
        for arg in rebuild.args:
            keep_all(frame, arg)
    used = []
    for arg in rebuild.args:
        if arg.saves and ok:
            if frame.bitwise_check:
                from .determinism import checksum

                arg.checksum = checksum(arg.tensor)
            used.append(arg)
        arg.tensor = arg.root = None
    if used:
        rebuild.args = used
        frame.rebuilds[rebuild.pos] = rebuild


def keep_all(frame: Any, arg: RebuildArg) -> None:
    for saved in arg.live_saves():
        # detached: the pending tensor may be an output of the node holding the save
        t, saved.pending = saved.pending.detach(), None
        region = saved.region
        kept = RegionSaved(region, f"saved.{len(region.saved)}", t, saved.hooks)
        if kept.tensor is not None:
            kept.version = saved.version  # an in-place change since the save is an error
        region.saved.append(weakref.ref(kept))
        saved.kept = kept
        for observer in frame.observers.kept:
            observer.tensor_kept(frame, kept, t)


def rebuilt_saves(frame: Any) -> list[RebuiltSave]:
    """The saves of ``frame`` the replay rebuilds, with those of the SAVE region
    running now (still held until the forward ends)."""
    rebuilds = list(frame.rebuilds.values())
    if frame.rebuild is not None:
        rebuilds.append(frame.rebuild)
    out: list[RebuiltSave] = []
    for r in rebuilds:
        for a in r.args:
            out.extend(a.live_saves())
    return out


def count_to_refill(frame: Any, key: Any) -> int:
    """How many rebuilt saves of ``frame`` the replay for ``key`` must refill (the
    count of :func:`rebuilt_saves` not refilled yet, without building the list)."""
    n = 0
    for r in frame.rebuilds.values():
        for a in r.args:
            for ref in a.saves:
                s = ref()
                if s is not None and s.kept is None and (s.recomputed is None or key not in s.recomputed):
                    n += 1
    return n


def forget_rebuilt(frame: Any, key: Any) -> None:
    for s in rebuilt_saves(frame):
        if s.recomputed:
            s.recomputed.pop(key, None)


def refill(scope: Any, rebuild: RegionRebuild, args: tuple, kwargs: dict) -> None:
    """The replay reached ``rebuild``'s region call: refill its saves from the
    replay's arguments, after checking they are laid out as in the forward."""
    frame, key = scope.frame, scope.key
    leaves = region_leaves(args, kwargs)
    filled = 0
    for arg in rebuild.args:
        d = None
        for ref in arg.saves:
            s = ref()
            if s is None or s.kept is not None:
                continue
            rec = s.recomputed
            if rec is None:
                s.recomputed = rec = {}
            elif key in rec:
                continue
            if d is None:
                x = leaves[arg.index] if arg.index < len(leaves) else None
                layout = arg.layout
                if not (  # as in the forward (_same_layout, inlined) and not modified
                    type(x) is torch.Tensor
                    and x._version == arg.version
                    and arg.checksum is None
                    and x.shape == layout[0]
                    and x.stride() == layout[1]
                    and x.storage_offset() == layout[2]
                    and x.dtype is layout[3]
                    and x.device == layout[4]
                    and x.untyped_storage().nbytes() == layout[5]
                ):
                    _check_argument(frame, rebuild, arg, x)  # raises why, or passes the slow checks
                d = x.detach()
            view = s.view
            t = d if view is None else d.as_strided(*view)  # the argument, or a view of it
            rec[key] = (t, t._version)
            filled += 1
    scope.filled += filled


def _where(frame: Any, rebuild: RegionRebuild, arg: RebuildArg) -> str:
    return f"argument {arg.index} of SAVE region '{rebuild.qualname}' in checkpoint '{frame.name}'"


def _same_layout(x: torch.Tensor, layout: tuple) -> bool:
    """Is ``x`` laid out as ``RebuildArg.layout`` records the forward's argument?"""
    return (
        x.shape == layout[0]
        and x.stride() == layout[1]
        and x.storage_offset() == layout[2]
        and x.dtype is layout[3]
        and x.device == layout[4]
        and x.untyped_storage().nbytes() == layout[5]
    )


def _check_argument(frame: Any, rebuild: RegionRebuild, arg: RebuildArg, x: Any) -> None:
    if not (
        isinstance(x, torch.Tensor) and not isinstance(x, Placeholder) and _same_layout(x, arg.layout)
    ):
        where = _where(frame, rebuild, arg)
        shape, stride, offset, dtype, device, nbytes = arg.layout
        got = (
            f"{describe_tensor(x.shape, x.dtype)}, stride {x.stride()}, storage offset "
            f"{x.storage_offset()} on {x.device} ({x.untyped_storage().nbytes()} storage "
            "bytes)"
            if isinstance(x, torch.Tensor) and not isinstance(x, Placeholder)
            else ("a placeholder" if isinstance(x, Placeholder) else type(x).__name__)
        )
        raise RecomputeMismatchError(
            f"torch_remat: {where} is {got} in the recompute but was "
            f"{describe_tensor(shape, dtype)}, stride {stride}, storage offset {offset} on "
            f"{device} ({nbytes} storage bytes) in the forward. The region's saves of "
            "that argument are rebuilt from the replay's value, which must be laid out "
            "as in the forward: the replay must compute the same tensors as the forward."
        )
    if x._version != arg.version:
        raise modified_in_place(
            _where(frame, rebuild, arg), "after the forward passed it to the region", CLONE_FIRST,
            (arg.version, x._version),
        )
    if arg.checksum is not None:
        from .determinism import checksum

        if checksum(x) != arg.checksum:
            raise RecomputeMismatchError(
                f"torch_remat: determinism check failed: {_where(frame, rebuild, arg)} has "
                "different bits in "
                "the recompute than in the forward. Something the replay depends on "
                "changed: usually RNG state (dropout) that needs a "
                "recompute_state_hooks entry, or a non-deterministic kernel."
            )


def describe_rebuilt(saved: RebuiltSave) -> str:
    """How messages name a rebuilt save."""
    region = saved.region
    return (
        f"the tensor ({saved.meta.describe()}) saved for backward by SAVE region "
        f"'{region.qualname}' of checkpoint '{region.checkpoint}', rebuilt from argument "
        f"{saved.arg.index}"
    )
