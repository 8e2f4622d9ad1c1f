"""What a ``gradient_checkpoint_scope`` records while it is open, and which of its
tensors are still alive.

Every op run in the scope is kept as an :class:`Op` whose tensor arguments are named
by storage (see ``_scope_ops``). The tensor that brought each new storage in is
watched with a weakref: when the last one dies, no later op can save a tensor of the
scope any more and the record is closed (its persistent hook may leave the stack).
The record itself lives as long as a recipe in some autograd graph refers to it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from .._compat import autograd_sequence_nr, tree_flatten
from .._errors import RematError
from .._tensors import storage_fingerprint
from .ops import (
    Ext,
    Op,
    View,
    check_supported,
    default_generator,
    is_random,
    paused_recording,
    storage_key,
    unreturned_writes,
    unversioned_reads,
    unversioned_writes_possible,
    version_of,
    written_args,
)
from .replay import ScopeRecipe

_record_ids = itertools.count()


class ScopeRecord:
    """The ops of one ``gradient_checkpoint_scope`` and the storages it created."""

    def __init__(self, scopes: Any, marker: Any) -> None:
        self.rid = next(_record_ids)
        self.scopes = scopes  # the owning thread's ScopeRegistry
        # The checkpoint frame (or replay) the scope was entered in: a scope hook only
        # claims tensors of records made at its own level, so that a checkpoint's
        # replay sees the same saves as its forward.
        self.marker = marker
        self.ops: list[Op] = []
        self.exited = False
        self.device_types: set[str] = {"cpu"}
        self._sids = itertools.count()
        # storages the scope created that a live recorded tensor still refers to
        self.sid_by_key: dict[int, int] = {}
        self.key_by_sid: dict[int, int] = {}
        # sid -> [[weakref to a recorded tensor on it, its version at exit], ...]
        self.tracked: dict[int, list[list[Any]]] = {}
        self.tracked_ids: dict[int, weakref.ref] = {}
        self.live = 0
        # outside storages the scope writes to: key -> sid, sid -> snapshot
        self.ext_sid_by_key: dict[int, int] = {}
        self.snapshots: dict[int, torch.Tensor] = {}
        # the outside tensors written, held while the scope is open: a storage freed
        # inside the scope could come back at the same address as a new tensor's,
        # which the keys above would then take for the written one
        self.written_outside: list[torch.Tensor] = []
        self.ext_by_id: dict[int, tuple[weakref.ref, Ext]] = {}
        self.recipes: list[weakref.ref] = []
        # the autograd sequence number when the last op was recorded
        self.seq_at_last_op = autograd_sequence_nr()

    # ---------------------------------------------------------------- recording

    def record_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func.name().startswith("aten::set_"):
            raise RematError(
                "torch_remat: Tensor.set_ is not supported inside gradient_checkpoint_scope "
                "(it swaps a tensor's storage, which the replay cannot follow). Move it out "
                "of the scope."
            )
        op = Op(len(self.ops), func)
        written = written_args(func, args, kwargs)
        for t in [*written, *unversioned_reads(func, args)]:
            key = storage_key(t)
            if key not in self.sid_by_key and key not in self.ext_sid_by_key:
                self._snapshot_outside_storage(t, key)
        if is_random(func):
            op.generator, op.rng_state = self._rng_before(func, args, kwargs)
        leaves, op.spec = tree_flatten((args, kwargs))
        op.leaves = [
            self._describe_arg(x, op) if isinstance(x, torch.Tensor) else x for x in leaves
        ]
        for t in written:
            key = storage_key(t)
            op.writes.add(
                self.sid_by_key[key] if key in self.sid_by_key else self.ext_sid_by_key[key]
            )
        seq = autograd_sequence_nr()
        out = func(*args, **kwargs)
        with self.scopes.lock:  # a tensor dying in another thread edits the same maps
            self._record_outputs(op, out, args, kwargs)
        self.ops.append(op)
        if op.writes and seq != self.seq_at_last_op:
            filled = {self.sid_by_key.get(k, self.ext_sid_by_key.get(k))
                      for k in map(storage_key, unreturned_writes(func, args, kwargs))}
            if filled:
                self._saved_before_own_write(op, seq, filled)
        self.seq_at_last_op = seq
        return out

    def _saved_before_own_write(self, op: Op, seq: int, filled: set[Any]) -> None:
        # The op's autograd node (made since the last recorded op) saved arguments
        # before the op ran, and the op then filled some of them (``filled``: the
        # storages of arguments it writes and does not return, rrelu's noise):
        # autograd hands backward the filled value, so those recipes are the storage
        # after the op, not before it. An in-place op's own ``self`` (returned) is not
        # one: a save of it, or of an alias of it, before the write keeps its value
        # before the write (as a clone before the op would). A save after the op
        # before, of its output, happened at the last recorded op's sequence number
        # and keeps its value too. (Assumes no autograd node comes between a save and
        # the recorded op other than that op's own: ops run in the scope are recorded.)
        for ref in reversed(self.recipes):
            r = ref()
            if r is None:
                continue
            if r.position != op.index or r.seq != seq:
                break
            if r.sid in filled:
                r.position = op.index + 1

    def _describe_arg(self, t: torch.Tensor, op: Op) -> Any:
        check_supported(t)
        self.device_types.add(t.device.type)
        key = storage_key(t)
        sid = self.sid_by_key.get(key)
        if sid is None:
            sid = self.ext_sid_by_key.get(key)
        if sid is not None:
            op.reads.add(sid)
            return View(sid, t)
        entry = self.ext_by_id.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        # The tensor itself while the scope is open (a detach here, below autograd,
        # would not share its version counter); a detached alias once it exits.
        ext = Ext(t, version_of(t), key)
        self.ext_by_id[id(t)] = (weakref.ref(t), ext)
        return ext

    def _snapshot_outside_storage(self, t: torch.Tensor, key: int) -> None:
        # The scope writes to a tensor it did not create (e.g. BatchNorm's running
        # stats): the replay starts from a copy of the storage as it was before, so it
        # reproduces the forward's values and never touches the real tensor.
        sid = next(self._sids)
        self.ext_sid_by_key[key] = sid
        self.written_outside.append(t)
        self.snapshots[sid] = torch.empty((0,), dtype=torch.uint8, device=t.device).set_(
            t.untyped_storage().clone()
        )
        for op in self.ops:  # earlier reads of this storage now read the snapshot
            for i, leaf in enumerate(op.leaves):
                if isinstance(leaf, Ext) and leaf.key == key:
                    op.leaves[i] = View(sid, leaf.tensor)
                    op.reads.add(sid)
        for tid, (_ref, ext) in list(self.ext_by_id.items()):
            if ext.key == key:
                del self.ext_by_id[tid]

    def _rng_before(
        self, func: Any, args: tuple, kwargs: dict
    ) -> tuple[torch.Generator, torch.Tensor]:
        gen = kwargs.get("generator")
        if gen is None:
            for i, a in enumerate(func._schema.arguments):
                if a.name == "generator" and i < len(args):
                    gen = args[i]
        if gen is None:
            device = kwargs.get("device")
            if device is None:
                device = next(
                    (x.device for x in tree_flatten(args)[0] if isinstance(x, torch.Tensor)), None
                )
            device = torch.device(device) if device is not None else torch.get_default_device()
            gen = default_generator(device)
        return gen, gen.get_state()

    def _record_outputs(self, op: Op, out: Any, args: tuple, kwargs: dict) -> None:
        flat = tree_flatten(out)[0]
        input_keys = {
            storage_key(x) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)
        }
        for pos, o in enumerate(flat):
            if not isinstance(o, torch.Tensor):
                continue
            check_supported(o)
            key = storage_key(o)
            sid = self.sid_by_key.get(key)
            if sid is None:
                if key in input_keys or key in self.ext_sid_by_key:
                    continue  # a view of (or a write into) an outside tensor
                sid = next(self._sids)
                self.sid_by_key[key] = sid
                self.key_by_sid[sid] = key
                self.tracked[sid] = []
                self.scopes.index_add(key, self, sid)
                op.new_outputs.append((pos, sid, tuple(o.shape), o.dtype))
                # Only the tensor that brought the storage in is watched: views keep it
                # alive (their _base), while an alias without a base (a detach that a
                # user's pack hook stores in the graph) must not keep the scope open.
                self._track(o, sid)

    def _track(self, t: torch.Tensor, sid: int) -> None:
        ref = self.tracked_ids.get(id(t))
        if ref is not None and ref() is t:
            return
        ref = weakref.ref(t, _TrackedDeath(self.scopes, self.rid, sid, id(t)))
        self.tracked_ids[id(t)] = ref
        self.tracked[sid].append([ref, None])
        self.live += 1

    def tensor_died(self, ref: weakref.ref, sid: int, tid: int) -> bool:
        """A recorded tensor died; True when the record has no live tensor left."""
        entries = self.tracked.get(sid)
        if entries is not None:
            entries[:] = [e for e in entries if e[0] is not ref]
            if not entries:
                del self.tracked[sid]
                key = self.key_by_sid.pop(sid, None)
                if key is not None and self.sid_by_key.get(key) == sid:
                    del self.sid_by_key[key]
                    self.scopes.index_remove(key, self)
        if self.tracked_ids.get(tid) is ref:
            del self.tracked_ids[tid]
        self.live -= 1
        return self.live == 0

    def finish(self) -> None:
        """The scope exited: remember each live tensor's version, so a later in-place
        change is detected before a recipe would replay a stale value."""
        self.exited = True
        self.written_outside = []
        prints: dict[int, Any] = {}  # storage key -> fingerprint (once per storage)
        for _ref, ext in self.ext_by_id.values():
            if unversioned_writes_possible(ext.tensor):
                if ext.key not in prints:
                    with paused_recording():
                        prints[ext.key] = storage_fingerprint(ext.tensor)
                ext.checksum = prints[ext.key]
            # Detached: holding the tensor would keep its grad_fn, which may (after an
            # in-place op) hold this record's recipes: a cycle only gc could free.
            ext.tensor = ext.tensor.detach()
        for entries in self.tracked.values():
            for e in entries:
                t = e[0]()
                if t is not None:
                    e[1] = version_of(t)
        self.ext_by_id = {}

    # ------------------------------------------------------------------- packing

    def owns(self, t: torch.Tensor, key: int) -> int | None:
        """The sid of ``t``'s storage if this scope created it and ``t`` still holds
        the value the recorded ops produce; None otherwise."""
        sid = self.sid_by_key.get(key)
        if sid is None:
            return None
        entries = self.tracked.get(sid, ())
        alive = False
        for ref, version in entries:
            r = ref()
            if r is None:
                continue
            if storage_key(r) != key:
                return None  # the storage was swapped out (set_ / .data =)
            alive = True
            if self.exited and version is not None and version_of(r) != version:
                return None  # modified in place after the scope: not replayable
        return sid if alive else None

    def make_recipe(self, sid: int, t: torch.Tensor) -> ScopeRecipe:
        recipe = ScopeRecipe(self, sid, t)
        recipes = self.recipes
        if len(recipes) > 64 and len(recipes) > 2 * self.live:
            recipes[:] = [r for r in recipes if r() is not None]
        recipes.append(weakref.ref(recipe))
        return recipe


class _TrackedDeath:
    """Weakref callback for a recorded tensor. Holds ids, not the record, so that a
    record and its weakrefs never form a cycle (release must not wait for gc)."""

    __slots__ = ("scopes", "rid", "sid", "tid")

    def __init__(self, scopes: Any, rid: int, sid: int, tid: int) -> None:
        self.scopes = scopes
        self.rid = rid
        self.sid = sid
        self.tid = tid

    def __call__(self, ref: weakref.ref) -> None:
        self.scopes.tensor_died(self.rid, ref, self.sid, self.tid)
