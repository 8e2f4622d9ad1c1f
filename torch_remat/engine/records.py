"""What a checkpoint's forward leaves behind for backward: holders for tensors the
recompute refills, records of tensors saved inside SAVE regions, and one record
per region call."""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch

from .._errors import modified_in_place
from .._tensors import TensorMeta, is_parameter
from .active import forget_exception_site
from .saved_hooks import PackedVersion


class Holder:
    """Packed in place of a tensor saved outside SAVE regions.

    The tensor itself is not kept: the recompute refills ``recomputed[gid]`` for the
    backward (graph task) ``gid`` that needs it, and unpacking removes it again so
    recomputed tensors die as soon as backward has used them. A holder is *static*
    when the saved tensor is one the checkpoint keeps anyway (an input or a kept
    SAVE output); then it holds that tensor and never triggers a recompute.
    """

    __slots__ = ("frame", "index", "static", "static_version", "recomputed", "__weakref__")

    def __init__(self, frame: Any, index: int) -> None:
        self.frame = frame
        self.index = index
        self.static: torch.Tensor | None = None
        self.static_version = 0
        self.recomputed: dict[Any, tuple[torch.Tensor, int]] | None = None

    def unpack(self) -> torch.Tensor:
        return self.frame.unpack_holder(self)


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
        "__weakref__",
    )

    def __init__(self, region: RegionRecord, name: str, t: torch.Tensor, outer_hooks) -> None:
        self.region = region
        self.name = name
        self.meta = TensorMeta.of(t)
        self.site: str | None = None
        # For reports: which region output shares this storage (set when the region
        # returns), and whether this is (a view of) a parameter, which reports skip.
        self.output_index: int | None = None
        self.parameter = is_parameter(t)
        self.witness = None
        if outer_hooks is None:
            d = t.detach()
            self.tensor = d
            self.version = d._version
            self.packed = None
            self.unpack_fn = None
        else:
            # Hooks decide where a SAVE region's tensors live: remat's (a pair that
            # takes the tensor detached, third item True) or the user's torch hooks
            # (e.g. save_on_cpu) around the checkpoint.
            pack_fn, self.unpack_fn = outer_hooks[0], outer_hooks[1]
            d = t.detach() if len(outer_hooks) > 2 else t
            self.tensor = None
            self.version = t._version
            self.packed = pack_fn(d)
            self.witness = PackedVersion(self.version, t) if d is t else PackedVersion(self.version, t, d)

    def unpack(self) -> torch.Tensor:
        if self.unpack_fn is not None:
            t = self.unpack_fn(self.packed)
            moved = self.witness.moved(t)
            if moved is not None:
                raise self._modified(moved)
            return t
        t = self.tensor
        if t._version != self.version:
            raise self._modified(t._version)
        return t

    def _modified(self, version: int) -> Exception:
        return modified_in_place(
            f"the tensor '{self.name}' ({self.meta.describe()}) saved for backward by "
            f"SAVE region '{self.region.qualname}' of checkpoint '{self.region.checkpoint}'",
            "after it was saved",
            "Clone the tensor before modifying it, or modify a copy.",
            (self.version, version),
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
        "pending_keep",
        "raised",
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
        # roots passed to recompute_needs_tensor inside this SAVE region's body
        self.pending_keep: list[weakref.ref] = []
        # the exception a SAVE region's body raised in forward (re-raised in replay)
        self.raised: BaseException | None = None

    @property
    def kind(self) -> str:
        return "recompute" if self.recompute else "save"

    def live_saved(self) -> list[RegionSaved]:
        out = []
        for ref in self.saved:
            r = ref()
            if r is not None:
                out.append(r)
        return out
