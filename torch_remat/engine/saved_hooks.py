"""Saved-tensor hooks for the tensors a checkpoint keeps resident.

A checkpoint keeps three kinds of tensors for backward (:class:`SavedTensorKind`):
what its SAVE regions save (``BACKWARD``), its inputs (``CHECKPOINT_INPUT``) and
the SAVE-region outputs the replay reads (``SAVE_OUTPUT``). Everything else is dropped and recomputed, so hooks that move
tensors elsewhere (offloading) are worth running only on these. torch's own
``saved_tensors_hooks`` cannot be used for that: inside a checkpoint they would see
every save, including the ones that are about to be dropped.

Which pair packs a kept tensor, highest first:

1. the checkpoint's own option (``input_saved_tensors_hooks`` for inputs, then
   ``saved_tensors_hooks``);
2. the innermost :class:`saved_tensors_hooks` context active when the pair is bound,
   unless torch hooks entered inside it are active around the checkpoint
   (``ForwardScratch.outer_hooks``): then those, unless the context was entered inside the
   checkpoint;
3. none: the tensor stays resident.

Outside checkpoints a :class:`saved_tensors_hooks` context is also on torch's hook
stack (:class:`_NativePack`), so saves there reach the pair as torch's hooks would.

The pair is bound when the tensor is saved (a SAVE region's saves), when the SAVE
region returns (its kept outputs, packed when the forward ends with the context
``capture_context()`` returned then) or when the checkpoint starts: under hooks
every tensor input is packed there, in argument order, as torch's checkpoint saves
its inputs, and one the replay does not read is unpacked with the checkpoint's
first unpack in backward (without hooks an input is held only if the replay reads
it). A checkpoint nested inside another hands its kept
tensors to the outer one (their count must match between the outer forward and its
replay), and nothing is packed during a replay.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._autograd_hooks import PackedPayload, pop_hooks, push_hooks, top_hooks
from .._compat import any_version
from .._tensors import is_parameter
from .context import _tls as _engine_tls


class SavedTensorKind(enum.Enum):
    """Why a checkpoint keeps a tensor resident."""

    BACKWARD = "backward"
    """Saved for backward inside a SAVE region (packed when it is saved)."""
    CHECKPOINT_INPUT = "checkpoint_input"
    """A tensor argument of the checkpoint (packed when the checkpoint starts)."""
    SAVE_OUTPUT = "save_output"
    """A SAVE-region output the replay reads (packed when the forward ends)."""


@dataclass(frozen=True)
class SavedTensorInfo:
    """What :func:`current_saved_tensor_info` says inside a pack hook."""

    checkpoint: str | None
    """The checkpoint's ``region_name`` (None for a save outside checkpoints)."""
    region: str | None
    """Qualified name of the SAVE region (None for a checkpoint input)."""
    kind: SavedTensorKind
    output_index: int | None = None
    """For ``SAVE_OUTPUT``: which leaf of the region's output (pytree order)."""
    input_index: int | None = None
    """For ``CHECKPOINT_INPUT``: which leaf of the checkpoint's arguments."""
    call: int | None = 0
    """Serial of the checkpoint call in this process, increasing in forward order
    (two calls of one checkpoint have different serials); None outside checkpoints."""
    is_parameter: bool = False
    """The tensor is (a view of) an ``nn.Parameter`` (it stays in memory anyway)."""
    context: Any = None
    """What ``capture_context()`` returned when the pair was bound to the tensor
    (None without ``capture_context``, and for saves outside checkpoints)."""


def _takes_context(pack: Callable) -> bool:
    """Whether ``pack`` can be called as ``pack(tensor, context)``; a pack hook of
    one argument (torch's and upstream torch-remat's shape) reads the context from
    :func:`current_saved_tensor_info` instead."""
    try:
        params = inspect.signature(pack).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = 0
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            return True
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional += 1
    return positional >= 2


class HookPair:
    """A validated ``(pack, unpack, capture_context)``."""

    __slots__ = ("pack", "unpack", "capture_context", "pass_context")

    def __init__(self, pack: Callable, unpack: Callable, capture_context: Callable | None) -> None:
        self.pack = pack
        self.unpack = unpack
        self.capture_context = capture_context
        self.pass_context = capture_context is not None and _takes_context(pack)


def as_hook_pair(value: Any, what: str) -> HookPair | None:
    """``None``; a ``(pack, unpack)`` or ``(pack, unpack, capture_context)`` tuple; or
    an object with ``pack_hook`` and ``unpack_hook`` (and optionally
    ``capture_context``) such as :class:`saved_tensors_hooks` or an offloader."""
    if value is None:
        return None
    if isinstance(value, HookPair):
        return value
    if isinstance(value, (tuple, list)) and len(value) in (2, 3):
        pack, unpack, capture = (*value, None)[:3]
    elif hasattr(value, "pack_hook") and hasattr(value, "unpack_hook"):
        pack, unpack = value.pack_hook, value.unpack_hook
        capture = getattr(value, "capture_context", None)
    else:
        raise TypeError(
            f"{what} must be None, a (pack, unpack) or (pack, unpack, capture_context) "
            f"tuple, or an object with pack_hook and unpack_hook; got {type(value).__name__}."
        )
    for name, fn in (("pack", pack), ("unpack", unpack)):
        if not callable(fn):
            raise TypeError(f"{what}: the {name} hook must be callable, got {type(fn).__name__}.")
    if capture is not None and not callable(capture):
        raise TypeError(f"{what}: capture_context must be callable or None.")
    return HookPair(pack, unpack, capture)


class _HookState(threading.local):
    def __init__(self) -> None:
        self.stack: list[HookPair] = []
        self.info: SavedTensorInfo | None = None


_state = _HookState()
_calls = itertools.count()


def hooks_context_active() -> bool:
    """True inside a :class:`saved_tensors_hooks` block (this thread)."""
    return bool(_state.stack)


def next_call_serial() -> int:
    return next(_calls)


class _NativePack:
    """The pack hook a :class:`saved_tensors_hooks` block entered outside
    checkpoints adds to torch's hook stack: for the saves torch_remat does not
    mediate, as ``torch.autograd.graph.saved_tensors_hooks`` would (the tensor as
    autograd gives it, kind ``BACKWARD``, no context, ``capture_context`` not
    called). Inside a checkpoint the checkpoint's own hooks are on top of it."""

    __slots__ = ("pair",)

    def __init__(self, pair: HookPair) -> None:
        self.pair = pair

    def __call__(self, t: torch.Tensor) -> Any:
        info = SavedTensorInfo(
            None, None, SavedTensorKind.BACKWARD, call=None, is_parameter=is_parameter(t)
        )
        previous = _state.info
        _state.info = info
        try:
            return self.pair.pack(t, None) if self.pair.pass_context else self.pair.pack(t)
        finally:
            _state.info = previous


def remat_machinery(hooks: Any) -> bool:
    # The hooks of a checkpoint forward, a replay or a gradient_checkpoint_scope.
    if hooks is None or isinstance(hooks[0], _NativePack):
        return False
    module = getattr(hooks[0], "__module__", None) or ""
    return module.startswith(("torch_remat.engine.", "torch_remat.scope."))


def torch_hooks_around(hooks: Any) -> Any:
    """torch's hooks active where a checkpoint starts, as the checkpoint sees them:
    None when they are those of a :class:`saved_tensors_hooks` block (then the
    block's pair packs what the checkpoint keeps)."""
    return None if hooks is not None and isinstance(hooks[0], _NativePack) else hooks


class saved_tensors_hooks:
    """Run ``pack_hook``/``unpack_hook`` on the tensors checkpoints keep resident.

    The shape of ``torch.autograd.graph.saved_tensors_hooks``, but inside
    checkpoints the hooks see only what remat keeps for backward: saves inside SAVE
    regions, kept SAVE-region outputs and the checkpoint's inputs, never a tensor
    that will be recomputed, and never during a replay. ``pack_hook(tensor)``
    receives a detached tensor there (an identity hook creates no reference cycle)
    and returns any object; ``unpack_hook(packed)`` returns the tensor. With
    ``capture_context``, ``capture_context()`` is called when the pair is bound to
    the tensor: at the save for SAVE-region saves, when the region returned for its
    kept outputs (packed when the forward ends), when the checkpoint started for its
    inputs (packed then); its result is ``current_saved_tensor_info().context``
    and, for a ``pack_hook`` of two arguments, the second argument. Inside
    ``pack_hook``, :func:`current_saved_tensor_info` describes the tensor. The pair is bound when the tensor is saved: leaving the block before
    backward does not change which ``unpack_hook`` runs.

    Outside checkpoints the pair applies as torch's own hooks do (it is added to
    torch's hook stack): every save there reaches ``pack_hook`` as autograd gives
    it, with kind ``BACKWARD`` and no context (``capture_context`` is not called),
    so one pair covers a whole model. ``nn.Parameter`` objects saved for backward
    reach ``pack_hook`` as themselves, inside checkpoints too. ``pack_hook`` may
    take one argument and read the context as ``current_saved_tensor_info().context``.
    Per thread; nested blocks, and torch's ``saved_tensors_hooks`` entered inside
    this block: the innermost wins.
    """

    def __init__(
        self,
        pack_hook: Callable[..., Any],
        unpack_hook: Callable[[Any], torch.Tensor],
        capture_context: Callable[[], Any] | None = None,
    ) -> None:
        pair = as_hook_pair((pack_hook, unpack_hook, capture_context), "remat.saved_tensors_hooks")
        assert pair is not None
        self._pair = pair
        self.pack_hook = pack_hook
        self.unpack_hook = unpack_hook
        self.capture_context = capture_context

    def __enter__(self) -> saved_tensors_hooks:
        # Inside a checkpoint forward (or a scope) its own hooks see every save and
        # hand the kept ones to the pair; elsewhere the pair is torch's hook too.
        # (Not while Dynamo traces: a compiled graph calls no hook, and a compiled
        # checkpoint inside the block refuses it by name, compiled.py.)
        native = not torch.compiler.is_compiling() and not remat_machinery(top_hooks(False))
        if native:
            push_hooks(_NativePack(self._pair), self._pair.unpack)
        self._native = native
        _state.stack.append(self._pair)
        return self

    def __exit__(self, *exc: Any) -> None:
        _state.stack.remove(self._pair)
        if self._native:
            pop_hooks()


def current_saved_tensor_info() -> SavedTensorInfo | None:
    """Inside a pack hook run by torch_remat, what the tensor is; None elsewhere."""
    return _state.info


def _context_hooks(min_depth: int = 0) -> HookPair | None:
    """The innermost block's pair, if it is one of the blocks past ``min_depth``."""
    if _engine_tls.recompute_depth:
        return None
    stack = _state.stack
    return stack[-1] if len(stack) > min_depth else None


def pack_with(
    pair: HookPair,
    t: torch.Tensor,
    info: SavedTensorInfo,
    context: Any = None,
    deferred: bool = False,
    detached: bool = False,
) -> Any:
    """Call ``pair``'s pack hook on ``t`` detached (an ``nn.Parameter`` as is; ``t``
    itself if ``detached``), with ``info`` current."""
    if pair.capture_context is not None:
        if not deferred:
            context = pair.capture_context()
        info = dataclasses.replace(info, context=context)
    previous = _state.info
    _state.info = info
    try:
        d = t if detached or isinstance(t, torch.nn.Parameter) else t.detach()
        return pair.pack(d, context) if pair.pass_context else pair.pack(d)
    finally:
        _state.info = previous


class PackedVersion:
    """The version of a tensor handed to pack hooks, checked against what the unpack
    hook hands back.

    Hooks may hand the tensor back as it is (an identity hook, an offloader that has
    not moved it yet, ``save_on_cpu`` on CPU), so an in-place update after the pack
    would reach backward unnoticed. The tensor objects given here (the saved tensor
    and the detached alias the hook received) share one version counter; while one
    of them is alive, has a moved version and shares its storage with the unpacked
    tensor, backward would read the updated value. A copy the hook made keeps the
    value it copied. Only weak references: a hook that moved the tensor away frees
    it."""

    __slots__ = ("version", "refs")

    def __init__(self, version: int, *tensors: torch.Tensor) -> None:
        self.version = version
        self.refs = [weakref.ref(t) for t in tensors]

    def moved(self, unpacked: torch.Tensor) -> int | None:
        """The new version if ``unpacked`` is (a view of) a tensor updated in place
        since the pack, else None."""
        for ref in self.refs:
            t = ref()
            if t is not None and any_version(t) != self.version:
                if unpacked is t or _same_storage(unpacked, t):
                    return any_version(t)
        return None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        p = a.untyped_storage().data_ptr()
        return p != 0 and p == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (meta, sparse, subclasses)
        return False


class DeferredPack:
    """A pair bound to a kept input or output, to be run when the forward ends."""

    __slots__ = ("pair", "context", "checkpoint", "call")

    def __init__(self, pair: HookPair, checkpoint: str, call: int) -> None:
        self.pair = pair
        self.context = pair.capture_context() if pair.capture_context is not None else None
        self.checkpoint = checkpoint
        self.call = call

    def pack(self, t: torch.Tensor, kind: SavedTensorKind, region: str | None, index: int) -> PackedPayload:
        is_output = kind is SavedTensorKind.SAVE_OUTPUT
        info = SavedTensorInfo(
            self.checkpoint,
            region,
            kind,
            output_index=index if is_output else None,
            input_index=None if is_output else index,
            call=self.call,
            is_parameter=is_parameter(t),
        )
        return PackedPayload(pack_with(self.pair, t, info, self.context, True, True), self.pair.unpack)


def _is_engine_hook(hooks: Any) -> bool:
    # A CheckpointFrame or a ReplayPass, each its own pack hook (the active-pass protocol).
    owner = hooks[0]
    return hasattr(owner, "run_region") and hasattr(owner, "phase")


class KeptTensorHooks:
    """Which pair packs each tensor one checkpoint call keeps (see the module doc)."""

    __slots__ = ("checkpoint", "call", "option", "nested", "min_depth", "inputs")

    def __init__(
        self,
        checkpoint: str,
        call: int,
        option: HookPair | None,
        input_option: HookPair | None,
        outer_hooks: Any,
    ) -> None:
        self.checkpoint = checkpoint
        self.call = call
        self.option = option
        self.nested = outer_hooks is not None and _is_engine_hook(outer_hooks)
        # torch's hooks entered inside the blocks open at the start win over them
        # (innermost wins); blocks entered inside the checkpoint win over those.
        foreign = outer_hooks is not None and not self.nested
        self.min_depth = len(_state.stack) if foreign else 0
        self.inputs = self._bind(input_option or option)

    def _bind(self, option: HookPair | None) -> DeferredPack | None:
        if self.nested or (option is None and not _state.stack):
            return None
        pair = option or _context_hooks(self.min_depth)
        return None if pair is None else DeferredPack(pair, self.checkpoint, self.call)

    def bind_outputs(self) -> DeferredPack | None:
        """The pair for a SAVE region's outputs, bound as the region returns."""
        return self._bind(self.option)

    def region_save(self, region: str, t: torch.Tensor) -> tuple[Callable, Callable, bool] | None:
        """``(pack_fn, unpack_fn, True)`` for a tensor a SAVE region saves now, or
        None (then the user's torch hooks around the checkpoint, if any, apply);
        ``pack_fn`` takes the tensor detached."""
        if self.nested:
            return None
        pair = self.option
        if pair is None:
            if not _state.stack:  # no block open: the common case, decided without a call
                return None
            pair = _context_hooks(self.min_depth)
            if pair is None:
                return None
        info = SavedTensorInfo(
            self.checkpoint, region, SavedTensorKind.BACKWARD, call=self.call,
            is_parameter=is_parameter(t),
        )
        # the context as of the save, also for a rebuild candidate packed only when
        # the forward ends (kept after all)
        context = pair.capture_context() if pair.capture_context is not None else None
        return (lambda d: pack_with(pair, d, info, context, True, True)), pair.unpack, True
