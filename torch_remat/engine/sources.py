"""Tensors a recompute may need that it cannot recreate: checkpoint inputs and the
outputs of SAVE regions.

Each such tensor is a :class:`TensorSource`. During the forward a source is only
*observed* (weakly); it is *kept* when the rules of producer responsibility say the
recompute needs it:

* a later ``remat.region`` consumes it (or a view of it);
* code outside SAVE regions saves it (or a view of it) for backward;
* ``remat.recompute_needs_tensor`` is called on it;
* for checkpoint inputs only: anything other than SAVE regions consumes it.

When the forward finishes, kept sources are packed by the hooks bound to them
(``saved_hooks.py``: a checkpoint option or ``remat.saved_tensors_hooks``), or else
stored as autograd ``SavedTensor``\\ s while the user's own torch
``saved_tensors_hooks`` (offloading) are active, so that those apply to them. With no
hooks at all a kept tensor is held as it is (:class:`KeptTensor`, the same in-place
check for a third of the cost).
"""

from __future__ import annotations

import weakref

import torch

from .._compat import make_saved_tensor, neg_view, top_saved_tensors_hooks
from .._errors import RematError, modified_in_place
from .._tensors import TensorMeta, storage_root
from .placeholder import PlaceholderOrigin, make_placeholder
from .saved_hooks import PackedVersion, SavedTensorKind

INPUT = "input"
OUTPUT = "output"


class KeptTensor:
    """A kept tensor held as it is, with its version (an autograd ``SavedTensor``
    without hooks, minus the autograd bookkeeping). ``unpack`` returns None once the
    tensor was modified in place."""

    __slots__ = ("data", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.data = t  # the name SavedTensor uses: the reports look for tensors in it
        self.version = t._version

    def unpack(self) -> torch.Tensor | None:
        t = self.data
        return t if t._version == self.version else None


class TensorSource:
    __slots__ = (
        "kind",
        "index",
        "region",
        "meta",
        "ref",
        "hold",
        "hold_is_root",
        "version",
        "keep",
        "save_consumed",
        "saved",
        "hooks",
        "witness",
        "bits",
    )

    def __init__(self, kind: str, index: int, t: torch.Tensor, region: str | None = None) -> None:
        self.kind = kind
        self.index = index
        # The region's qualified name; not the RegionRecord, which refers back to its
        # sources (a cycle would delay freeing kept tensors to the garbage collector).
        self.region = region
        self.meta = TensorMeta.of(t)
        # Inputs are referenced strongly until the forward ends (the caller holds
        # them anyway); outputs weakly, so observing them costs no memory.
        self.ref = t if kind == INPUT else weakref.ref(t)
        self.hold: torch.Tensor | None = None
        self.hold_is_root = False
        self.version = t._version
        self.keep = False
        self.save_consumed = False
        self.saved = None
        self.hooks = None  # a saved_hooks.DeferredPack bound to this source, or None
        self.witness: PackedVersion | None = None  # set when hooks pack it
        # complex outputs: (is_conj, is_neg), which a storage root held in their place
        # lacks (public ops give a real tensor a negative bit only as the .imag of a
        # conjugate: a dtype view of a complex root, refused in replay_value)
        self.bits = (t.is_conj(), t.is_neg()) if kind != INPUT and t.dtype.is_complex else None

    def describe(self, checkpoint: str) -> str:
        return PlaceholderOrigin(checkpoint, self.kind, self.index, self.region).describe()

    def mark_kept(self, alias: torch.Tensor) -> None:
        """Keep this source; ``alias`` is any tensor sharing its storage."""
        self.keep = True
        if self.kind == OUTPUT and self.hold is None:
            t = self.ref()
            if t is not None:
                self.hold = t
            else:
                self.hold = storage_root(alias)
                self.hold_is_root = True

    def store(self, checkpoint: str) -> None:
        """End of forward: turn a kept source into a SavedTensor; forget the rest."""
        if self.kind == INPUT:
            t, self.ref = self.ref, None
        else:
            t, self.hold, self.ref = self.hold, None, None
        if not self.keep:
            return
        if t._version != self.version:
            raise self._modified_error(checkpoint)
        if self.hooks is not None:
            kind = SavedTensorKind.CHECKPOINT_INPUT if self.kind == INPUT else SavedTensorKind.SAVE_OUTPUT
            d = t.detach()
            self.saved = self.hooks.pack(d, kind, self.region, self.index)
            self.hooks = None  # drop the captured context with the binding
            self.witness = PackedVersion(self.version, t, d)
        elif top_saved_tensors_hooks(False) is None:
            self.saved = KeptTensor(t.detach())
        else:
            d = t.detach()
            self.saved = make_saved_tensor(d, is_output=False)
            self.witness = PackedVersion(self.version, t, d)

    def _modified_error(self, checkpoint: str) -> Exception:
        what = f"{self.describe(checkpoint)} of checkpoint '{checkpoint}'"
        if self.kind == INPUT:
            return modified_in_place(
                what,
                "by the checkpointed function",
                "The recompute would replay that in-place op on the already modified "
                "input. Clone the input before modifying it (x = x.clone()) or modify "
                "it outside the checkpoint.",
            )
        return modified_in_place(
            what,
            "after the region returned",
            "torch_remat keeps that output for the recompute, which would then see the "
            "modified value. Clone it before modifying it, or do the in-place op "
            "inside the region.",
        )

    def _modified_before_replay(self, checkpoint: str) -> Exception:
        return modified_in_place(
            f"{self.describe(checkpoint)} of checkpoint '{checkpoint}'",
            "after the forward, before backward recomputed the checkpoint",
            "Don't modify tensors that backward still needs; clone them first.",
        )

    def replay_value(self, checkpoint: str) -> torch.Tensor:
        """The value the recompute sees: the kept tensor, or a placeholder."""
        meta = self.meta
        if self.saved is None:
            origin = PlaceholderOrigin(checkpoint, self.kind, self.index, self.region)
            return make_placeholder(meta, origin)
        try:
            t = self.saved.unpack()
        except RuntimeError as e:
            if "modified by an inplace operation" not in str(e):
                raise
            raise self._modified_before_replay(checkpoint) from e
        if t is None:  # a KeptTensor modified in place
            raise self._modified_before_replay(checkpoint)
        # Hooks may hand back the tensor itself: its version says if it was updated.
        if self.witness is not None and self.witness.moved(t) is not None:
            raise self._modified_before_replay(checkpoint)
        t = t.detach()
        if self.hold_is_root and (tuple(t.shape), t.stride(), t.storage_offset()) != (
            meta.shape,
            meta.stride,
            meta.storage_offset,
        ):
            if t.dtype != meta.dtype:
                raise RematError(
                    f"torch_remat: {self.describe(checkpoint)} of checkpoint "
                    f"'{checkpoint}' is a dtype view whose tensor object no longer "
                    "exists; return it from the region as its own tensor (e.g. "
                    ".clone()) instead."
                )
            t = t.as_strided(meta.shape, meta.stride, meta.storage_offset)
        if self.hold_is_root and self.bits is not None:
            conj, neg = self.bits
            if t.is_conj() is not conj:
                t = t.conj()
            if t.is_neg() is not neg:
                t = neg_view(t)
        # A copy made by the user's own hooks (offloading) starts at version 0; give
        # it the version the forward saw, which the replay's in-place check expects.
        for _ in range(self.version - t._version):
            torch.autograd.graph.increment_version(t)
        if meta.requires_grad:
            t.requires_grad_()
        return t


class SourceIndex:
    """Find the sources that share storage with a tensor (the tensor or a view)."""

    __slots__ = ("by_root",)

    def __init__(self) -> None:
        self.by_root: dict[int, tuple[weakref.ref, list[TensorSource]]] = {}

    def __bool__(self) -> bool:
        return bool(self.by_root)

    def add(self, t: torch.Tensor, source: TensorSource) -> None:
        root = storage_root(t)
        key = id(root)
        entry = self.by_root.get(key)
        if entry is not None and entry[0]() is root:
            entry[1].append(source)
        else:
            self.by_root[key] = (weakref.ref(root), [source])

    def lookup(self, t: torch.Tensor) -> list[TensorSource] | None:
        root = storage_root(t)
        entry = self.by_root.get(id(root))
        if entry is None or entry[0]() is not root:
            return None
        return entry[1]
