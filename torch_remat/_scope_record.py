"""What a ``gradient_checkpoint_scope`` records, and the replay that recreates its
tensors in backward.

Tensors are identified by their *storage*, not by their Python object: a view of a
scope tensor taken after the scope exited shares the storage, so it is recognised
too, and a recipe (:class:`ScopeRecipe`) is the storage's id plus the geometry of
the saved view. Every recorded op names its tensor arguments the same way:

* ``_View(sid, dtype, size, stride, offset)`` for a storage the scope created (or an
  outside storage the scope writes to; it is snapshotted before the first write);
* ``_Ext(tensor, version)`` for an outside tensor only read: held detached, checked
  for in-place changes before the replay reads it.

The replay runs only the ops that produce or write a storage backward needs (view
ops never run: their results are rebuilt from the geometry), with the RNG state each
random op saw restored, autocast off (recorded ops are already cast), and no grad.
A storage's replayed value is dropped as soon as no later op or recipe reads it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._errors import RecomputeMismatchError, RematError, SavedTensorModifiedError
from ._frame import _graph_task_key
from ._profiling import profiler_range

_record_ids = itertools.count()


class _ScopeLocal(threading.local):
    def __init__(self) -> None:
        # > 0 while this thread runs torch_remat's own ops (pack hooks, replays):
        # recording modes let them through unrecorded.
        self.paused = 0


scope_tls = _ScopeLocal()


@contextlib.contextmanager
def paused_recording():
    scope_tls.paused += 1
    try:
        yield
    finally:
        scope_tls.paused -= 1


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _View:
    __slots__ = ("sid", "dtype", "size", "stride", "offset")

    def __init__(self, sid: int, t: torch.Tensor) -> None:
        self.sid = sid
        self.dtype = t.dtype
        self.size = tuple(t.shape)
        self.stride = t.stride()
        self.offset = t.storage_offset()


class _Ext:
    __slots__ = ("tensor", "version", "key")

    def __init__(self, tensor: torch.Tensor, version: int, key: int) -> None:
        self.tensor = tensor
        self.version = version
        self.key = key


class _Op:
    __slots__ = (
        "index",
        "func",
        "leaves",
        "spec",
        "reads",
        "writes",
        "new_outputs",
        "generator",
        "rng_state",
    )

    def __init__(self, index: int, func: Any) -> None:
        self.index = index
        self.func = func
        self.leaves: list[Any] = []
        self.spec: Any = None
        self.reads: set[int] = set()
        self.writes: set[int] = set()
        # (position among the flattened outputs, sid, shape, dtype) of each new storage
        self.new_outputs: list[tuple[int, int, tuple, torch.dtype]] = []
        self.generator: torch.Generator | None = None
        self.rng_state: torch.Tensor | None = None


class ScopeRecipe:
    """Packed in place of a scope tensor that autograd saves: which storage, which
    view of it, and after how many recorded ops (its value at save time)."""

    __slots__ = (
        "record",
        "sid",
        "position",
        "dtype",
        "size",
        "stride",
        "offset",
        "values",
        "consumed",
        "__weakref__",
    )

    def __init__(self, record: ScopeRecord, sid: int, t: torch.Tensor) -> None:
        self.record = record
        self.sid = sid
        self.position = len(record.ops)
        self.dtype = t.dtype
        self.size = tuple(t.shape)
        self.stride = t.stride()
        self.offset = t.storage_offset()
        # graph-task key -> recomputed tensor, popped when backward unpacks it
        self.values: dict[Any, torch.Tensor] | None = None
        self.consumed: set[Any] = set()

    def unpack(self) -> torch.Tensor:
        return self.record.unpack(self)


def _view_of(base: torch.Tensor, d: Any) -> torch.Tensor:
    if base.dtype == d.dtype:
        return base.as_strided(d.size, d.stride, d.offset)
    out = torch.empty((0,), dtype=d.dtype, device=base.device)
    return out.set_(base.untyped_storage(), d.offset, d.size, d.stride)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if generators is None:
        raise RematError(
            f"torch_remat: gradient_checkpoint_scope cannot replay random ops on "
            f"'{device.type}': torch.{device.type}.default_generators does not exist. "
            "Move the random op out of the scope."
        )
    index = device.index if device.index is not None else module.current_device()
    return generators[index]


# Ops that update running statistics in training mode without declaring it in their
# schema (aten::native_batch_norm has no (a!) annotation on running_mean/var).
_UNDECLARED_WRITES = {
    "aten::native_batch_norm": (5, (3, 4)),
    "aten::cudnn_batch_norm": (5, (3, 4)),
    "aten::miopen_batch_norm": (5, (3, 4)),
}


def _written_args(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    undeclared = _UNDECLARED_WRITES.get(func._schema.name)
    if undeclared is not None:
        training, written = undeclared
        if len(args) > training and args[training]:
            out.extend(args[i] for i in written if isinstance(args[i], torch.Tensor))
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _is_random(func: Any) -> bool:
    if torch.Tag.nondeterministic_seeded in func.tags:
        return True
    return any(a.name == "generator" for a in func._schema.arguments)


class ScopeRecord:
    """The ops of one ``gradient_checkpoint_scope`` and the storages it created."""

    def __init__(self, scopes: Any, marker: Any) -> None:
        self.rid = next(_record_ids)
        self.scopes = scopes  # the owning thread's ScopeRegistry
        # The checkpoint frame (or replay) the scope was entered in: a scope hook only
        # claims tensors of records made at its own level, so that a checkpoint's
        # replay sees the same saves as its forward.
        self.marker = marker
        self.ops: list[_Op] = []
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
        self.ext_by_id: dict[int, tuple[weakref.ref, _Ext]] = {}
        self.recipes: list[weakref.ref] = []

    # ---------------------------------------------------------------- recording

    def record_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func.name().startswith("aten::set_"):
            raise RematError(
                "torch_remat: Tensor.set_ is not supported inside gradient_checkpoint_scope "
                "(it swaps a tensor's storage, which the replay cannot follow). Move it out "
                "of the scope."
            )
        op = _Op(len(self.ops), func)
        for t in _written_args(func, args, kwargs):
            key = storage_key(t)
            if key not in self.sid_by_key and key not in self.ext_sid_by_key:
                self._snapshot_outside_storage(t, key)
        if _is_random(func):
            op.generator, op.rng_state = self._rng_before(func, args, kwargs)
        leaves, op.spec = tree_flatten((args, kwargs))
        op.leaves = [
            self._describe_arg(x, op) if isinstance(x, torch.Tensor) else x for x in leaves
        ]
        for t in _written_args(func, args, kwargs):
            key = storage_key(t)
            op.writes.add(
                self.sid_by_key[key] if key in self.sid_by_key else self.ext_sid_by_key[key]
            )
        out = func(*args, **kwargs)
        self._record_outputs(op, out, args, kwargs)
        self.ops.append(op)
        return out

    def _describe_arg(self, t: torch.Tensor, op: _Op) -> Any:
        _check_supported(t)
        self.device_types.add(t.device.type)
        key = storage_key(t)
        sid = self.sid_by_key.get(key)
        if sid is None:
            sid = self.ext_sid_by_key.get(key)
        if sid is not None:
            op.reads.add(sid)
            return _View(sid, t)
        entry = self.ext_by_id.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        # The tensor itself while the scope is open (a detach here, below autograd,
        # would not share its version counter); a detached alias once it exits.
        ext = _Ext(t, t._version, key)
        self.ext_by_id[id(t)] = (weakref.ref(t), ext)
        return ext

    def _snapshot_outside_storage(self, t: torch.Tensor, key: int) -> None:
        # The scope writes to a tensor it did not create (e.g. BatchNorm's running
        # stats): the replay starts from a copy of the storage as it was before, so it
        # reproduces the forward's values and never touches the real tensor.
        sid = next(self._sids)
        self.ext_sid_by_key[key] = sid
        self.snapshots[sid] = torch.empty((0,), dtype=torch.uint8, device=t.device).set_(
            t.untyped_storage().clone()
        )
        for op in self.ops:  # earlier reads of this storage now read the snapshot
            for i, leaf in enumerate(op.leaves):
                if isinstance(leaf, _Ext) and leaf.key == key:
                    op.leaves[i] = _View(sid, leaf.tensor)
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
            gen = _default_generator(device)
        return gen, gen.get_state()

    def _record_outputs(self, op: _Op, out: Any, args: tuple, kwargs: dict) -> None:
        flat = tree_flatten(out)[0]
        input_keys = {
            storage_key(x) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)
        }
        for pos, o in enumerate(flat):
            if not isinstance(o, torch.Tensor):
                continue
            _check_supported(o)
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
        for _ref, ext in self.ext_by_id.values():
            # Detached: holding the tensor would keep its grad_fn, which may (after an
            # in-place op) hold this record's recipes: a cycle only gc could free.
            ext.tensor = ext.tensor.detach()
        for entries in self.tracked.values():
            for e in entries:
                t = e[0]()
                if t is not None:
                    e[1] = t._version
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
            if self.exited and version is not None and r._version != version:
                return None  # modified in place after the scope: not replayable
        return sid if alive else None

    def make_recipe(self, sid: int, t: torch.Tensor) -> ScopeRecipe:
        recipe = ScopeRecipe(self, sid, t)
        recipes = self.recipes
        if len(recipes) > 64 and len(recipes) > 2 * self.live:
            recipes[:] = [r for r in recipes if r() is not None]
        recipes.append(weakref.ref(recipe))
        return recipe

    # ----------------------------------------------------------------- backward

    def unpack(self, recipe: ScopeRecipe) -> torch.Tensor:
        key = _graph_task_key()
        values = recipe.values
        if values is not None and key in values:
            recipe.consumed.add(key)
            return values.pop(key)
        targets = [recipe]
        if type(key) is not object and key not in recipe.consumed:
            for ref in self.recipes:
                r = ref()
                if r is None or r is recipe or key in r.consumed:
                    continue
                if r.values is None or key not in r.values:
                    targets.append(r)
        self.replay(targets, key)
        if type(key) is not object:
            recipe.consumed.add(key)
        return recipe.values.pop(key)

    def _plan(
        self, targets: list[ScopeRecipe]
    ) -> tuple[int, list[bool], dict[int, int], dict[int, int]]:
        end = max(r.position for r in targets)
        needed = {r.sid for r in targets}
        run = [False] * end
        for i in range(end - 1, -1, -1):
            op = self.ops[i]
            if op.writes & needed or any(sid in needed for _, sid, _, _ in op.new_outputs):
                run[i] = True
                needed |= op.reads
        # state s = after s ops; a storage read by op i is needed up to state i + 1,
        # one a recipe reads at position p up to state p.
        drop_at: dict[int, int] = {}
        last_write: dict[int, int] = {}
        for i in range(end):
            if run[i]:
                for sid in self.ops[i].writes:
                    last_write[sid] = i
                for sid in self.ops[i].reads:
                    drop_at[sid] = max(drop_at.get(sid, 0), i + 1)
                for _, sid, _, _ in self.ops[i].new_outputs:
                    drop_at[sid] = max(drop_at.get(sid, 0), i + 1)
        for r in targets:
            drop_at[r.sid] = max(drop_at.get(r.sid, 0), r.position)
        return end, run, drop_at, last_write

    def replay(self, targets: list[ScopeRecipe], key: Any) -> None:
        end, run, drop_at, last_write = self._plan(targets)
        ops = self.ops
        env: dict[int, torch.Tensor] = {}
        for sid, snap in self.snapshots.items():
            if sid in drop_at:
                env[sid] = torch.empty((0,), dtype=torch.uint8, device=snap.device).set_(
                    snap.untyped_storage().clone()
                )
        by_position: dict[int, list[ScopeRecipe]] = {}
        for r in targets:
            by_position.setdefault(r.position, []).append(r)
        drops: dict[int, list[int]] = {}
        for sid, state in drop_at.items():
            drops.setdefault(state, []).append(sid)
        generators = {
            id(op.generator): op.generator
            for i, op in enumerate(ops[:end])
            if run[i] and op.generator is not None
        }
        caller_states = [(g, g.get_state()) for g in generators.values()]
        try:
            with self._replay_context():
                for state in range(end + 1):
                    for r in by_position.get(state, ()):
                        self._materialize(r, env, key, last_write)
                    for sid in drops.get(state, ()):
                        env.pop(sid, None)
                    if state == end:
                        break
                    if run[state]:
                        self._run_op(ops[state], env)
        finally:
            for g, s in caller_states:
                g.set_state(s)

    @contextlib.contextmanager
    def _replay_context(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            for dev in sorted(self.device_types):
                if torch.amp.is_autocast_available(dev):
                    stack.enter_context(torch.autocast(dev, enabled=False))
            stack.enter_context(paused_recording())
            stack.enter_context(profiler_range("remat.scope.replay"))
            yield

    def _run_op(self, op: _Op, env: dict[int, torch.Tensor]) -> None:
        leaves = []
        for leaf in op.leaves:
            if isinstance(leaf, _View):
                leaves.append(_view_of(env[leaf.sid], leaf))
            elif isinstance(leaf, _Ext):
                t = leaf.tensor
                if t._version != leaf.version:
                    raise SavedTensorModifiedError(
                        f"torch_remat: a tensor read inside gradient_checkpoint_scope (shape "
                        f"{tuple(t.shape)}, {str(t.dtype).replace('torch.', '')}) was modified "
                        f"in place after the scope read it (version {leaf.version} -> "
                        f"{t._version}), so the scope's ops cannot be replayed for backward. "
                        "Clone it before modifying it, or modify it before the scope."
                    )
                leaves.append(t)
            else:
                leaves.append(leaf)
        args, kwargs = tree_unflatten(leaves, op.spec)
        if op.generator is not None:
            op.generator.set_state(op.rng_state)
        out = op.func(*args, **kwargs)
        if op.new_outputs:
            flat = tree_flatten(out)[0]
            for pos, sid, shape, dtype in op.new_outputs:
                t = flat[pos]
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise RecomputeMismatchError(
                        f"torch_remat: replaying {op.func} (op #{op.index} of a "
                        f"gradient_checkpoint_scope) gave {tuple(t.shape)} {t.dtype}, but the "
                        f"forward gave {shape} {dtype}. The scope's ops must be deterministic "
                        "in their shapes."
                    )
                env[sid] = t

    def _materialize(self, r: ScopeRecipe, env: dict, key: Any, last_write: dict[int, int]) -> None:
        t = _view_of(env[r.sid], r)
        if last_write.get(r.sid, -1) >= r.position:
            t = t.clone()  # a later replayed op writes this storage
        if r.values is None:
            r.values = {}
        r.values[key] = t


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


def _check_supported(t: torch.Tensor) -> None:
    if (
        t.layout != torch.strided
        or type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
    ):
        raise RematError(
            f"torch_remat: gradient_checkpoint_scope records plain dense tensors only; an "
            f"op inside the scope used a {type(t).__name__} with layout {t.layout}. Move "
            "that op out of the scope (or use remat.checkpoint around it)."
        )
