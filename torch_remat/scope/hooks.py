"""The saved-tensor hooks behind ``gradient_checkpoint_scope`` and their place on
PyTorch's hook stack.

PyTorch keeps default saved-tensor hooks on a per-thread stack and applies only the
innermost pair; ``saved_tensors_hooks.__exit__`` pops whatever is on top. A scope
needs a hook *after* it exits (a scope tensor saved by a later op must not be
stored), for as long as a tensor it created is alive. So:

* While the scope is open, its own hook sits on top of the stack. It claims the
  tensors of scopes made at its level and hands everything else to the hooks that
  were active around it (a user's ``save_on_cpu``, a ``remat.checkpoint``).
* After it exits, one persistent hook per thread claims scope tensors. It is kept at
  the *bottom* of the stack (inserted below every hook present, by popping and
  re-pushing them), so every ``with saved_tensors_hooks(...)`` block pops its own
  entry, and hooks a user enters later apply to what is saved inside them, as they
  would without the scope. It is removed as soon as the last scope tensor of the
  thread dies (weakref callbacks on the recorded tensors; no garbage collection
  involved). A tensor that dies in another thread defers the removal to this
  thread's next use of a scope or of the hook.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

from .. import _compat
from .._autograd_hooks import PackedPayload, VersionedTensor, in_backward, unpack_packed
from .._autograd_hooks import disabled_message as _disabled_message
from .._autograd_hooks import pop_hooks as _pop
from .._autograd_hooks import push_hooks as _push
from .._autograd_hooks import top_hooks as _top
from .ops import paused_recording, storage_key
from .record import ScopeRecord

_ANY = object()


def _kept(t: torch.Tensor) -> VersionedTensor:
    """A tensor stored as it is (not a scope tensor), refused if modified in place
    before backward reads it. Never the tensor itself: an output would form a cycle."""
    return VersionedTensor(t.detach())


class ScopeRegistry:
    """The scopes of one thread: open records, which storages they own, and whether
    the persistent hook is on this thread's hook stack."""

    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self.lock = threading.RLock()
        self.records: dict[int, ScopeRecord] = {}
        self.index: dict[int, list[tuple[ScopeRecord, int]]] = {}
        self.active: list[Any] = []
        self.pending_removal = False
        self.in_surgery = False

    # records and the storage index
    def register(self, record: ScopeRecord) -> None:
        with self.lock:
            self.records[record.rid] = record

    def index_add(self, key: int, record: ScopeRecord, sid: int) -> None:
        with self.lock:
            self.index.setdefault(key, []).append((record, sid))

    def index_remove(self, key: int, record: ScopeRecord) -> None:
        with self.lock:
            entries = self.index.get(key)
            if entries is None:
                return
            entries[:] = [e for e in entries if e[0] is not record]
            if not entries:
                del self.index[key]

    def find(self, t: torch.Tensor, marker: Any) -> tuple[ScopeRecord, int] | None:
        if not self.index:
            return None
        try:
            key = storage_key(t)
        except (RuntimeError, NotImplementedError, TypeError):
            return None  # no storage (a wrapper subclass): never a scope tensor
        with self.lock:
            entries = self.index.get(key)
            if not entries:
                return None
            for record, _ in reversed(entries):
                if marker is not _ANY and record.marker is not marker:
                    continue
                sid = record.owns(t, key)
                if sid is not None:
                    return record, sid
        return None

    def tensor_died(self, rid: int, ref: Any, sid: int, tid: int) -> None:
        if sys.is_finalizing():
            return
        with self.lock:
            record = self.records.get(rid)
            if record is None:
                return
            if record.tensor_died(ref, sid, tid) and record.exited:
                self.close(record)

    def close(self, record: ScopeRecord) -> None:
        with self.lock:
            if self.records.pop(record.rid, None) is None:
                return
            for key in list(record.sid_by_key):
                self.index_remove(key, record)
        self.maybe_remove_hook()

    # the persistent hook
    def ensure_hook(self) -> None:
        # The autograd engine runs backward under a copy of the caller's thread-local
        # state and restores it afterwards, hook stack included: a change made during
        # backward does not last, so none is made then. Presence is read from the stack
        # itself, never from a flag that such a restore would make stale.
        if in_backward():
            return
        self.pending_removal = False
        if not self._surgery(_contains, _pack_after_scope):
            self._surgery(_insert_at_bottom)

    def maybe_remove_hook(self) -> None:
        with self.lock:
            if self.records or self.active:
                return
            if threading.get_ident() != self.owner or self.in_surgery or in_backward():
                self.pending_removal = True
                return
            self.pending_removal = False
        self._surgery(_remove_entry, _pack_after_scope)

    def process_pending(self) -> None:
        if self.pending_removal:
            self.maybe_remove_hook()

    def _surgery(self, fn: Any, *args: Any) -> Any:
        self.in_surgery = True
        try:
            return _with_hooks_enabled(fn, *args)
        finally:
            self.in_surgery = False


_local = threading.local()


def registry() -> ScopeRegistry:
    r = getattr(_local, "registry", None)
    if r is None:
        r = _local.registry = ScopeRegistry()
    return r


def _pack_after_scope(t: torch.Tensor) -> Any:
    """The persistent hook (bottom of the stack): claims any live scope tensor."""
    scopes = registry()
    with paused_recording():
        hit = scopes.find(t, _ANY)
        packed = hit[0].make_recipe(hit[1], t) if hit is not None else _kept(t)
    scopes.process_pending()
    return packed


# Nothing is below it: torch's checkpoint sees no user hooks there.
_compat.mark_internal_pack_hook(_pack_after_scope)


class ScopeHook:
    """The hook on top of the stack while a scope is open."""

    def __init__(self, scopes: ScopeRegistry, marker: Any, outer: tuple[Any, Any] | None) -> None:
        self.scopes = scopes
        self.marker = marker
        self.outer = outer

    def pack(self, t: torch.Tensor) -> Any:
        with paused_recording():
            hit = self.scopes.find(t, self.marker)
            if hit is not None:
                return hit[0].make_recipe(hit[1], t)
            if self.outer is not None:
                pack, unpack = self.outer
                return PackedPayload(pack(t), unpack)
            return _kept(t)

    # The hook object itself is pushed (and found again by identity): for torch's
    # checkpoint, the user's hooks under it are those it hands the rest to.
    __call__ = pack


_compat.mark_internal_pack_hook(ScopeHook, "outer")


# ---------------------------------------------------------------- stack surgery


def _with_hooks_enabled(fn: Any, *args: Any) -> Any:
    # Pushing is refused while hooks are disabled, so a pop-and-re-push would lose
    # entries: enable them for the surgery and restore the user's message after.
    message = _disabled_message()
    if message is None:
        return fn(*args)
    _compat.enable_saved_tensors_hooks()
    try:
        return fn(*args)
    finally:
        _compat.disable_saved_tensors_hooks(message, False)


def hook_stack() -> list[tuple[Any, Any]]:
    """This thread's default saved-tensor hooks, bottom first (for tests/reports)."""

    def read() -> list[tuple[Any, Any]]:
        popped = _pop_all()
        _push_all(popped)
        return popped

    return registry()._surgery(read)


def _pop_all() -> list[tuple[Any, Any]]:
    popped = []
    while True:
        top = _top(True)
        if top is None:
            break
        popped.append(top)
        _pop()
    popped.reverse()
    return popped


def _push_all(entries: list[tuple[Any, Any]]) -> None:
    for pack, unpack in entries:
        _push(pack, unpack)


def _contains(pack_fn: Any) -> bool:
    entries = _pop_all()
    _push_all(entries)
    return any(pack is pack_fn for pack, _ in entries)


def _insert_at_bottom() -> None:
    entries = _pop_all()
    _push(_pack_after_scope, unpack_packed)
    _push_all(entries)


def _remove_entry(pack_fn: Any) -> bool:
    """Remove the entry whose pack hook is ``pack_fn`` wherever it is; the order of
    the others is kept, so each owner still pops its own entry."""
    above = []
    found = False
    while True:
        top = _top(True)
        if top is None:
            break
        _pop()
        if top[0] is pack_fn:
            found = True
            break
        above.append(top)
    above.reverse()
    _push_all(above)
    return found


def remove_hook(scopes: ScopeRegistry, pack_fn: Any) -> bool:
    return scopes._surgery(_remove_entry, pack_fn)
