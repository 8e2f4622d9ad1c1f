"""What a checkpoint's forward leaves behind for backward.

* :class:`Holder`: packed in place of a tensor saved outside SAVE regions; the
  replay refills it for the backward that needs it.
* :class:`RegionSaved`: a tensor saved for backward inside a SAVE region, kept.
* :class:`RegionRecord`: one region call (name, kind, outputs, state snapshots).
* :class:`TensorSource`: a tensor the replay may read but cannot recreate, a
  checkpoint input or a SAVE-region output. During the forward a source is only
  *observed* (weakly); it is *kept* when the rules of producer responsibility say the
  replay needs it: a later ``remat.region`` consumes it (or a view of it); code
  outside SAVE regions saves it (or a view of it) for backward;
  ``remat.recompute_needs_tensor`` is called on it; for checkpoint inputs only:
  anything other than SAVE regions consumes it.

When the forward finishes, kept sources are packed by the hooks bound to them
(``saved_hooks.py``: a checkpoint option or ``remat.saved_tensors_hooks``), or else
stored as autograd ``SavedTensor``\\ s while the user's own torch
``saved_tensors_hooks`` (offloading) are active, so that those apply to them. With no
hooks at all a kept tensor is held as it is (a ``VersionedTensor``, the same in-place
check for a third of the cost).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import _compat
from .._autograd_hooks import VersionedTensor
from .._compat import (
    INFERENCE_VERSION,
    any_version,
    make_saved_tensor,
    neg_view,
    top_saved_tensors_hooks,
    version_of,
)
from .._compat import view_base as _view_base
from .._errors import RematError, modified_in_place
from .._tensors import (
    TensorMeta,
    held_anyway,
    is_parameter,
    same_storage,
    storage_ptr,
    storage_root,
)
from .context import forget_exception_site
from .placeholder import PlaceholderOrigin, make_placeholder
from .saved_hooks import DeferredPack, PackedVersion, SavedTensorKind


class Recreated:
    """What the replays of one checkpoint call recreated for one backward: the one
    store of recreated tensors, per backward (graph task key, see
    :func:`~torch_remat._autograd_hooks.graph_task_key`), until that backward unpacks
    them. Slots: a :class:`Holder`'s index, a ``rebuild.RebuiltSave``'s (negative)
    slot. Its methods are the only writers of ``tensors``; the frame owns the stores
    (``CheckpointFrame.recreated``) and drops a backward's store when it ends."""

    __slots__ = ("tensors",)

    def __init__(self) -> None:
        self.tensors: dict[int, tuple[torch.Tensor, int]] = {}

    def __contains__(self, slot: int) -> bool:
        return slot in self.tensors

    def put(self, slot: int, t: torch.Tensor) -> None:
        """Hold ``t`` (detached by the caller) with its version now, which the
        unpack checks."""
        self.tensors[slot] = (t, version_of(t))

    def take(self, slot: int) -> tuple[torch.Tensor, int]:
        """The tensor recreated for ``slot`` and its version then, no longer held."""
        return self.tensors.pop(slot)


class Holder:
    """Packed in place of a tensor saved outside SAVE regions.

    The tensor itself is not kept: the replay puts it in the frame's store for the
    backward that needs it (:class:`Recreated`, slot ``index``), and unpacking
    takes it out again so recomputed tensors die as soon as backward has used them. A holder is *kept*
    when the saved tensor is one the checkpoint keeps anyway (an input or a kept
    SAVE output); then it holds that tensor and never triggers a recompute.
    """

    __slots__ = ("frame", "index", "kept", "__weakref__")

    def __init__(self, frame: CheckpointFrame, index: int) -> None:
        self.frame = frame
        self.index = index
        self.kept: VersionedTensor | None = None

    def unpack(self) -> torch.Tensor:
        if self.kept is None:  # (the common case, one call less: frame.take_refill)
            return self.frame.take_refill(self)
        return self.frame.unpack_holder(self)

    def keep_value(self, d: torch.Tensor) -> None:
        """Hold ``d``, a tensor the checkpoint keeps anyway: no replay needs to refill it."""
        self.kept = VersionedTensor(d)

    def drop_kept(self) -> None:
        """What it held is not kept after all (a SAVE output updated in place after
        its region returned, whose body the replay runs again): the replay refills it."""
        self.kept = None

    def _remat_resident_tensors(self) -> list[torch.Tensor]:
        """What the reports count for a save packed as this holder (by an outer
        checkpoint, when it is the save of a nested one): the kept tensor, or
        nothing; the replay recreates a dropped one."""
        return [] if self.kept is None else [self.kept.data]

tree_flatten = _compat.tree_flatten

if TYPE_CHECKING:
    from .frame import CheckpointFrame


class RegionSaved:
    """Packed in place of a tensor saved for backward inside a SAVE region."""

    __slots__ = (
        "region",
        "name",
        "tensor",
        "version",
        "packed",
        "unpack_fn",
        "meta",
        "site",
        "output_index",
        "parameter",
        "witness",
        "unread",
        "__weakref__",
    )

    def __init__(
        self, region: RegionRecord, name: str, t: torch.Tensor, outer_hooks, unread: list | None = None
    ) -> None:
        self.region = region
        self.name = name
        self.meta = TensorMeta.of(t)
        self.site: str | None = None
        # For reports: which region output shares this storage (set when the region
        # returns), and whether this is (a view of) a parameter or a requires-grad
        # leaf, which reports skip.
        self.output_index: int | None = None
        self.witness = None
        # the checkpoint's inputs packed at its start that its replay does not read
        # (CheckpointFrame.unread_inputs): unpacked once, with the first save unpacked
        self.unread = unread
        if outer_hooks is None:
            d = t.detach()
            self.tensor = d
            self.version = version_of(d)
            self.packed = None
            self.unpack_fn = None
        else:
            # Hooks decide where a SAVE region's tensors live: remat's (a pair that
            # takes the tensor detached, third item True) or the user's torch hooks
            # (e.g. save_on_cpu) around the checkpoint.
            pack_fn, self.unpack_fn = outer_hooks[0], outer_hooks[1]
            # (an nn.Parameter reaches remat's hooks as itself, as autograd saves it)
            d = t.detach() if len(outer_hooks) > 2 and not isinstance(t, torch.nn.Parameter) else t
            self.tensor = None
            self.version = version_of(t)
            self.packed = pack_fn(d)
            self.witness = PackedVersion(self.version, t) if d is t else PackedVersion(self.version, t, d)
        # a leaf's copy made by pack hooks (save_on_cpu) is memory of its own
        # (held_anyway first: it is False for most saves, and covers parameters)
        self.parameter = held_anyway(t) and (
            self.packed is None or is_parameter(t) or same_storage(self.packed, t)
        )


    def label(self, name: str) -> None:
        """Name this save (``save_for_backward`` naming a tensor)."""
        self.name = name

    def located_at(self, site: str | None) -> None:
        """The user's source line that made this save (``record_save_sites``)."""
        self.site = site

    def link_output(self, index: int) -> None:
        """This save shares its storage with output ``index`` of its region."""
        self.output_index = index

    def expect_version(self, version: int) -> None:
        """The version the save had when made (a rebuilt save kept after all)."""
        self.version = version
    def unpack(self) -> torch.Tensor:
        if self.unpack_fn is not None:
            if self.unread:
                unpack_unread(self.unread)
            t = self.unpack_fn(self.packed)
            moved = self.witness.moved(t)
            if moved is not None:
                raise self._modified(moved)
            return t
        t = self.tensor
        if version_of(t) != self.version:
            raise self._modified(version_of(t))
        return t

    def _modified(self, version: int) -> Exception:
        return modified_in_place(
            f"the tensor '{self.name}' ({self.meta.describe()}) saved for backward by "
            f"SAVE region '{self.region.qualname}' of checkpoint '{self.region.checkpoint}'",
            "after it was saved",
            "Clone the tensor before modifying it, or modify a copy.",
            (self.version, version),
        )


def unpack_unread(unread: list) -> None:
    """Unpack (and drop) the payloads of checkpoint inputs that hooks packed and the
    replay does not read, ``(index, meta, payload, held_anyway)`` each: the hooks see an unpack
    for every pack, as with torch's checkpoint, when backward first reaches the
    checkpoint."""
    while unread:
        try:
            unread.pop()[2].unpack()
        except RuntimeError as e:
            # torch's own hooks check the version: an input modified after the forward
            # that nothing reads again is not an error
            if "modified by an inplace operation" not in str(e):
                raise


def qualified_name(region_stack: Sequence[RegionRecord], name: str) -> str:
    """The name a region called ``name`` gets inside the regions of ``region_stack``
    (``outer.inner``): the one rule the forward, the replay and a compiled trace
    follow (the latter through :func:`nested_name`)."""
    return f"{region_stack[-1].qualname}.{name}" if region_stack else name


def nested_name(outer: str | None, name: str) -> str:
    """:func:`qualified_name` given the enclosing region's qualified name."""
    return f"{outer}.{name}" if outer else name


def refuse_recompute_inside_save(qualname: str, outer: str) -> ValueError:
    """The error for a RECOMPUTE region nested in a SAVE region (whose body is never
    replayed, eagerly or in a compiled graph)."""
    return ValueError(
        f"torch_remat: region '{qualname}' asks to be recomputed, but it is nested "
        f"inside SAVE region '{outer}' whose body is never replayed (its activations "
        "are all kept). Make the outer region recompute=True, or the inner one "
        "recompute=False."
    )


def describe_region(qualname: str | None) -> str:
    """How messages name where a tensor was saved: ``region 'attn'``, or ``code
    outside regions``."""
    return f"region '{qualname}'" if qualname else "code outside regions"


def detached_copy(e: BaseException) -> BaseException:
    """A copy of ``e`` without traceback, cause or context, which would keep the
    frames it was raised through (and their tensors) alive; ``e`` itself if it
    cannot be copied (:func:`release_traceback` then drops its traceback)."""
    try:
        copied = copy.copy(e)
    except Exception:
        try:  # an exception whose __reduce__ refuses: copy its parts by hand
            copied = type(e).__new__(type(e), *e.args)
            copied.__dict__.update(e.__dict__)
            copied.args = e.args
        except Exception:
            return e
    copied.__cause__ = copied.__context__ = None
    forget_exception_site(copied)  # raised again in the replay, which records its own
    return copied.with_traceback(None)


def release_traceback(e: BaseException | None) -> None:
    """Drop what a stored exception that could not be copied has accumulated while
    raised (the frames of the forward or of a replay)."""
    if e is not None:
        e.__traceback__ = None
        e.__context__ = None


class Constant:
    """A non-tensor leaf of a SAVE region's output, replayed as the same value."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class ArgumentOutput:
    """An output leaf of a SAVE region that is one of the region's tensor arguments
    itself (``return x, y``): no source of its own (what it holds is the argument's,
    kept or replayed as the argument is); the replay hands back its own argument at
    that position, so code after the region sees the same object twice, as in the
    forward."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class RegionRecord:
    """One call of ``remat.region`` during a checkpoint's forward."""

    __slots__ = (
        "checkpoint",
        "name",
        "qualname",
        "recompute",
        "saved",
        "outputs",
        "output_spec",
        "exit_states",
        "rng_entry",
        "host_exit",
        "attributes_exit",
        "written",
        "pending_keep",
        "raised",
        "modes_exit",
        "rerun",
    )

    def __init__(self, checkpoint: str | None, name: str, qualname: str, recompute: bool) -> None:
        self.checkpoint = checkpoint
        self.name = name
        self.qualname = qualname
        self.recompute = recompute
        self.saved: list[weakref.ref] = []
        self.outputs: list[Any] = []
        self.output_spec = None
        self.exit_states: list[Any] = []
        self.rng_entry: list[Any] | None = None  # generator fingerprints at the call (rng_guard)
        # a SAVE region's: the state of Python's random and NumPy's generator when it
        # returned, if they moved since the previous look (rng.host_rng_state)
        self.host_exit: tuple[Any, ...] | None = None
        # a SAVE region's: module attributes rebound since the previous SAVE region
        # returned (ModuleState.attributes_rebound), set by the replay where it skips
        self.attributes_exit: list[tuple[Any, Any, Any]] | None = None
        # a SAVE region's arguments its body wrote in place: (position, the source of
        # the value it left, the version it left), written into the replay's arguments
        self.written: list[tuple[int, TensorSource, int]] = []
        # roots passed to recompute_needs_tensor inside this SAVE region's body
        self.pending_keep: list[weakref.ref] = []
        # the exception a SAVE region's body raised in forward (re-raised in replay)
        self.raised: BaseException | None = None
        # a SAVE region's: (grad mode, default dtype) its body left switched, else None
        self.modes_exit: tuple[bool, torch.dtype] | None = None
        # a SAVE region whose output the forward's code updated in place after it
        # returned: the replay runs its body again for the values it returned
        self.rerun = False

    @property
    def kind(self) -> str:
        return "recompute" if self.recompute else "save"

    def entered(self, rng_entry: list[Any] | None) -> None:
        """A SAVE region's body starts: the generators' fingerprints then."""
        self.rng_entry = rng_entry

    def returned(
        self,
        exit_states: list[Any],
        host_exit: tuple[Any, ...] | None,
        attributes_exit: list[tuple[Any, Any, Any]] | None,
        raised: BaseException | None = None,
    ) -> None:
        """A SAVE region's body returned (or raised ``raised``): the state the
        replay sets where it skips the body."""
        self.raised = raised
        self.exit_states = exit_states
        self.host_exit = host_exit
        self.attributes_exit = attributes_exit

    def add_saved(self, saved: RegionSaved) -> None:
        self.saved.append(weakref.ref(saved))

    def replay_body(self) -> None:
        """The forward's code updated an output of this SAVE region in place after it
        returned (``out += residual``): the value it returned is gone, so the replay
        runs the body again where it would skip it (its saves stay those of the
        forward)."""
        self.rerun = True

    def needs_kept(self, root: torch.Tensor) -> None:
        """``recompute_needs_tensor(root)`` was called inside this SAVE region."""
        self.pending_keep.append(weakref.ref(root))

    def take_pending_keep(self) -> list[torch.Tensor | None]:
        """The roots :meth:`needs_kept` named (None for one freed since), forgotten."""
        pending = [r() for r in self.pending_keep]
        self.pending_keep = []
        return pending

    def outputs_recorded(self, spec: Any, outputs: list[Any]) -> None:
        """The region returned ``outputs`` (a TensorSource per tensor) in the
        container ``spec`` describes."""
        self.output_spec = spec
        self.outputs.extend(outputs)

    def wrote_argument(self, position: int, source: TensorSource, version: int) -> None:
        self.written.append((position, source, version))

    def live_saved(self) -> list[RegionSaved]:
        out = []
        for ref in self.saved:
            r = ref()
            if r is not None:
                out.append(r)
        return out


def region_leaves(args: tuple, kwargs: dict) -> Sequence[Any]:
    """A region call's arguments as one flat list, the same in forward and replay."""
    if not kwargs:
        for a in args:
            if isinstance(a, (list, tuple, dict)):
                break
        else:
            return args
    return tree_flatten((args, kwargs))[0]



INPUT = "input"
OUTPUT = "output"
ARGUMENT = "argument"  # an argument a SAVE region's body wrote in place, as it left it


class TensorSource:
    __slots__ = (
        "kind",
        "index",
        "region",
        "meta",
        "ref",
        "kept_tensor",
        "kept_is_root",
        "version",
        "keep",
        "save_consumed",
        "saved",
        "hooks",
        "witness",
        "bits",
        "held_anyway",
        "written_by",
        "attributes",
    )

    def __init__(
        self, kind: str, index: int, t: torch.Tensor, region: str | None = None, hooks: Any = None
    ) -> None:
        self.kind = kind
        # an input the module or autograd holds anyway (where its storage is): reports
        # do not bill what the checkpoint keeps of it in that storage
        self.held_anyway = storage_ptr(t) if kind == INPUT and held_anyway(t) else None
        self.index = index
        # The region's qualified name; not the RegionRecord, which refers back to its
        # sources (a cycle would delay freeing kept tensors to the garbage collector).
        self.region = region
        self.meta = TensorMeta.of(t)
        # Python attributes set on an input (x.scale = 2.0), or by a SAVE region's body
        # on its output: the replay's copy carries them as the forward saw them (a
        # subclass's are its own)
        self.attributes = None
        if type(t) in _PLAIN_TENSOR_TYPES:
            if kind == INPUT:
                self.attributes = _python_attributes(t)
            elif kind == OUTPUT and t.__dict__:  # (a SAVE body is never traced by Dynamo)
                d = t.__dict__
                self.attributes = d.copy(), [(k, v, any_version(v)) for k, v in d.items() if isinstance(v, torch.Tensor)]
        # Inputs are referenced strongly until the forward ends (the caller holds
        # them anyway); outputs weakly, so observing them costs no memory.
        self.ref = t if kind == INPUT else weakref.ref(t)
        self.kept_tensor: torch.Tensor | None = None
        self.kept_is_root = False
        self.version = version_of(t) if kind != INPUT else any_version(t)
        self.keep = False
        self.save_consumed = False
        self.saved = None
        self.hooks = hooks  # a saved_hooks.DeferredPack bound to this source, or None
        self.witness: PackedVersion | None = None  # set when hooks pack it
        # complex outputs: (is_conj, is_neg), which a storage root held in their place
        # lacks (public ops give a real tensor a negative bit only as the .imag of a
        # conjugate: a dtype view of a complex root, refused in replay_value)
        self.bits = (t.is_conj(), t.is_neg()) if kind != INPUT and t.dtype.is_complex else None
        self.written_by: str | None = None  # see overwrite

    def describe(self, checkpoint: str) -> str:
        return self.origin(checkpoint).describe()

    def origin(self, checkpoint: str) -> PlaceholderOrigin:
        return PlaceholderOrigin(checkpoint, self.kind, self.index, self.region, self.written_by)

    def release(self) -> None:
        """The forward raised: let go of the tensor."""
        self.ref = self.kept_tensor = None

    def mark_needed(self) -> None:
        """An input the replay reads: kept."""
        self.keep = True

    def keep_if_modified(self) -> None:
        """No replay will read this input: kept only if it was modified in place
        (storing it then reports the modification)."""
        self.keep = any_version(self.ref) != self.version

    def consumed_by_save(self) -> None:
        """An input handed to a SAVE region (kept only if replayed code reads it)."""
        self.save_consumed = True

    def drop_saved(self) -> None:
        """An unread input: its packed copy is unpacked elsewhere (unread_inputs)."""
        self.saved = self.witness = None

    def mark_kept(self, alias: torch.Tensor) -> None:
        """Keep this source; ``alias`` is any tensor sharing its storage."""
        self.keep = True
        if self.kind != INPUT and self.kept_tensor is None:
            t = self.ref()
            if t is not None:
                self.kept_tensor = t
            else:
                self.kept_tensor = storage_root(alias)
                self.kept_is_root = True

    def updated_after_return(self) -> bool:
        """A SAVE output the forward's code updated in place after its region
        returned (not by a later SAVE region: :meth:`overwrite`), at the forward's end."""
        if self.kind != OUTPUT or self.written_by is not None:
            return False
        t = self.kept_tensor if self.kept_tensor is not None else self.ref()
        # (a kept storage root shares the output's version counter)
        return t is not None and any_version(t) != self.version

    def not_kept(self) -> None:
        """Hold nothing of this output: its region's body runs again in the replay."""
        self.keep = False
        self.kept_tensor = None
        self.kept_is_root = False

    def overwrite(self, by: str) -> None:
        """A later SAVE region ``by`` wrote this output in place: its value as the
        region returned it is gone, so it is not kept (the replay gets a placeholder
        whose reads say so)."""
        self.written_by = by
        self.keep = False
        self.kept_tensor = None
        self.kept_is_root = False

    def pack_at_entry(self, hooks: DeferredPack | None) -> None:
        """Under saved-tensor hooks a checkpoint input is packed when the checkpoint
        starts, by ``hooks`` or else by torch's hooks active there, as torch's own
        checkpoint saves its inputs: the hooks see every input, in argument order,
        before anything the function saves. (Without hooks an input is held only if
        the replay reads it, see :meth:`store`.)"""
        t = self.ref
        d = t if isinstance(t, torch.nn.Parameter) else t.detach()
        if hooks is not None:
            self.saved = hooks.pack(d, SavedTensorKind.CHECKPOINT_INPUT, None, self.index)
        else:
            self.saved = make_saved_tensor(d, is_output=False)
        self.witness = PackedVersion(self.version, t) if d is t else PackedVersion(self.version, t, d)

    def store(self, checkpoint: str) -> None:
        """End of forward: turn a kept source into a SavedTensor; forget the rest."""
        if self.kind == INPUT:
            t, self.ref = self.ref, None
        else:
            t, self.kept_tensor, self.ref = self.kept_tensor, None, None
        if not self.keep:
            return
        if any_version(t) != self.version:
            raise self._modified_error(checkpoint)
        if self.saved is not None:
            return  # an input packed when the checkpoint started
        if self.hooks is not None:
            kind = SavedTensorKind.CHECKPOINT_INPUT if self.kind == INPUT else SavedTensorKind.SAVE_OUTPUT
            d = t.detach()
            self.saved = self.hooks.pack(d, kind, self.region, self.index)
            self.hooks = None  # drop the captured context with the binding
            self.witness = PackedVersion(self.version, t, d)
        elif top_saved_tensors_hooks(False) is None:
            self.saved = VersionedTensor(t.detach())
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
        # (an output updated after its region returned is not kept: the replay runs
        # the region's body again, CheckpointFrame._replay_bodies_of)
        return modified_in_place(
            what, "after the region returned", "Clone it before modifying it."
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
        if self.attributes:
            self._check_attributes(checkpoint)
        if self.saved is None:
            t = make_placeholder(meta, self.origin(checkpoint))
            if self.attributes:
                t.__dict__.update(self.attributes[0])
            return t
        saved = self.saved
        if type(saved) is VersionedTensor:
            if not saved.intact():
                raise self._modified_before_replay(checkpoint)
            t = saved.data
        else:
            try:
                t = saved.unpack()
            except RuntimeError as e:
                if "modified by an inplace operation" not in str(e):
                    raise
                raise self._modified_before_replay(checkpoint) from e
        # Hooks may hand back the tensor itself: its version says if it was updated.
        if self.witness is not None and self.witness.moved(t) is not None:
            raise self._modified_before_replay(checkpoint)
        t = t.detach()
        if self.kept_is_root and (tuple(t.shape), t.stride(), t.storage_offset()) != (
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
        if self.kept_is_root and self.bits is not None:
            conj, neg = self.bits
            if t.is_conj() is not conj:
                t = t.conj()
            if t.is_neg() is not neg:
                t = neg_view(t)
        # A copy made by the user's own hooks (offloading) starts at version 0; give
        # it the version the forward saw, which the replay's in-place check expects.
        for _ in range(self.version - version_of(t) if self.version != INFERENCE_VERSION else 0):
            torch.autograd.graph.increment_version(t)
        if meta.requires_grad:
            t.requires_grad_()
        if self.attributes:
            t.__dict__.update(self.attributes[0])
        return t

    def _check_attributes(self, checkpoint: str) -> None:
        """Refuse a tensor among the input's Python attributes (``x.mask``) updated in
        place since the forward: the replay would read the new values."""
        for key, tensor, version in self.attributes[1]:
            if any_version(tensor) != version:
                raise modified_in_place(
                    f"tensor attribute '{key}' of {self.describe(checkpoint)} of checkpoint '{checkpoint}'",
                    "after the forward, before backward recomputed the checkpoint",
                    "Don't modify tensors that backward still needs; clone them first.",
                )


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _python_attributes(t: torch.Tensor) -> tuple[dict[str, Any], list[tuple[str, Any, int]]] | None:
    """A copy of the Python attributes set on ``t`` and the versions of the tensors
    among them (None: none; not read while Dynamo traces, where a tensor's
    ``__dict__`` is not a value)."""
    if torch.compiler.is_compiling():
        return None
    d = t.__dict__
    if not d:
        return None
    return d.copy(), [(k, v, any_version(v)) for k, v in d.items() if isinstance(v, torch.Tensor)]


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

    def drop(self, t: torch.Tensor, source: TensorSource) -> None:
        """Forget ``source``, which shares storage with ``t``."""
        entry = self.by_root.get(id(storage_root(t)))
        if entry is not None:
            entry[1][:] = [s for s in entry[1] if s is not source]

    def lookup(self, t: torch.Tensor) -> list[TensorSource] | None:
        # (storage_root, written out: this runs at every save of every forward)
        base = _view_base(t)
        root = t if base is None else base
        entry = self.by_root.get(id(root))
        if entry is None or entry[0]() is not root:
            return None
        return entry[1]

