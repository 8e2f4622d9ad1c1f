"""``remat.gradient_checkpoint_scope``: "what not to store" instead of checkpoint's
"what to store"."""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from .._autograd_hooks import disabled_message as _disabled_message
from .._autograd_hooks import push_hooks as _push_hooks
from .._autograd_hooks import top_hooks as _top_hooks
from .._autograd_hooks import unpack_packed
from .._compat import TorchDispatchMode
from .._errors import RematError
from ..engine.context import current_pass
from .hooks import ScopeHook, registry, remove_hook
from .ops import scope_tls
from .record import ScopeRecord

_JOINED = object()


class _RecordingMode(TorchDispatchMode):
    """Records every aten op run while the scope is open (in this thread)."""

    def __init__(self, record: ScopeRecord) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if scope_tls.paused:
            return func(*args, **kwargs)
        return self.record.record_op(func, args, kwargs)


class _OpenScope:
    __slots__ = ("record", "hook", "mode", "marker")

    def __init__(
        self, record: ScopeRecord, hook: ScopeHook, mode: _RecordingMode, marker: Any
    ) -> None:
        self.record = record
        self.hook = hook
        self.mode = mode
        self.marker = marker


# Dynamo's error under fullgraph=True when compiled code opens a scope.
_COMPILE_REASON = (
    "torch_remat: gradient_checkpoint_scope runs eagerly only: its saved-tensor hook and "
    "the dispatch mode that records the block cannot be traced by torch.compile. Without "
    "fullgraph=True the scope runs as a graph break; with it, open the scope outside the "
    "compiled function, or use remat.checkpoint, which compiles to torch's checkpoint."
)


class gradient_checkpoint_scope:
    """Context manager: tensors created inside are not stored for backward.

    Every op run inside the block is recorded. When autograd saves a tensor the
    block created, whether the saving op runs inside the block or after it, only a
    recipe is stored; the first time backward needs such a tensor, the recorded ops
    that produce it are replayed (with the RNG state each random op saw, and without
    autocast, since the recorded ops are already cast) and gradients are bitwise
    those of running without the scope::

        with remat.gradient_checkpoint_scope():
            x = a + b          # x is not stored ...
        y = x * c              # ... although this op saves it: a + b is replayed

    What is kept: the tensors the block *reads* (its inputs, held until backward
    no longer needs the block), and tensors a user's own saved-tensor hook, entered
    after the block, packs (PyTorch applies only the innermost hooks).

    Nesting a scope directly inside another joins the outer one. Inside a
    ``remat.checkpoint`` it does nothing in recomputed code (the checkpoint stores
    nothing there anyway) and works inside a SAVE region (what the scope creates
    there is recomputed instead of kept). Around a checkpoint, what the checkpoint's
    SAVE regions save of the scope's tensors is recomputed by the scope.
    Under ``torch.no_grad()`` the block just runs. Errors: ``RematError`` if
    saved-tensor hooks are disabled (the message carries the reason given to
    ``disable_saved_tensors_hooks``), or for an op the replay cannot follow
    (``Tensor.set_``, tensor subclasses, sparse layouts). A tensor modified in place
    after the scope is stored as usual when saved; a tensor the scope *read* and that
    is modified in place afterwards raises ``SavedTensorModifiedError`` in backward.
    """

    def __init__(self) -> None:
        self._open: list[Any] = []

    @_compat.disable_dynamo_saying(_COMPILE_REASON)
    def __enter__(self) -> gradient_checkpoint_scope:
        if not torch.is_grad_enabled():
            self._open.append(None)
            return self
        scopes = registry()
        scopes.process_pending()
        marker = current_pass()
        if scopes.active and scopes.active[-1].marker is marker:
            self._open.append(_JOINED)  # directly nested: the outer scope records it all
            return self
        if marker is not None and not marker.in_save_region:
            # Code a remat.checkpoint recomputes (outside its SAVE regions, or its
            # replay): nothing there is stored anyway, and a scope would only keep
            # its inputs alive for a second replay.
            self._open.append(_JOINED)
            return self
        message = _disabled_message()
        if message is not None:
            raise RematError(
                "torch_remat: gradient_checkpoint_scope needs saved-tensor hooks, but they "
                "are disabled here (torch.autograd.graph.disable_saved_tensors_hooks) with "
                f"the message: {message} Run the block without the scope in this context."
            )
        record = ScopeRecord(scopes, marker)
        hook = ScopeHook(scopes, marker, _top_hooks(False))
        mode = _RecordingMode(record)
        _push_hooks(hook, unpack_packed)
        try:
            mode.__enter__()
        except BaseException:
            remove_hook(scopes, hook)
            raise
        scopes.register(record)
        entry = _OpenScope(record, hook, mode, marker)
        scopes.active.append(entry)
        self._open.append(entry)
        return self

    @_compat.disable_dynamo_saying(_COMPILE_REASON)
    def __exit__(self, exc_type, exc, tb) -> bool:
        entry = self._open.pop()
        if entry is None or entry is _JOINED:
            return False
        scopes = registry()
        entry.mode.__exit__(exc_type, exc, tb)
        found = remove_hook(scopes, entry.hook)
        record = entry.record
        with scopes.lock:
            record.finish()
        scopes.active.remove(entry)
        if record.live:
            scopes.ensure_hook()
        else:
            scopes.close(record)
        scopes.maybe_remove_hook()
        if not found and exc_type is None:
            raise RematError(
                "torch_remat: the saved-tensor hook of a gradient_checkpoint_scope was "
                "removed from the hook stack by someone else while the scope was open "
                "(an unbalanced torch._C._autograd._pop_saved_tensors_default_hooks?). "
                "Tensors saved after that point were stored normally."
            )
        return False
