"""The replay that recreates a ``gradient_checkpoint_scope``'s tensors in backward.

It runs only the ops that produce or write a storage backward needs (view ops never
run: their results are rebuilt from the recorded geometry), with the RNG state each
random op saw restored (and the caller's restored afterwards), autocast off (the
recorded ops are already cast) and no grad. A storage's replayed value is dropped as
soon as no later op or recipe reads it. One replay per backward (graph task) fills
every recipe of the scope that is still alive, like a checkpoint's recompute.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from .._autograd_hooks import graph_task_key as _graph_task_key
from .._autograd_hooks import when_backward_ends
from .._compat import autograd_sequence_nr, neg_view, tree_flatten, tree_unflatten, version_of
from .._errors import RecomputeMismatchError, modified_in_place
from .._tensors import describe_tensor, storage_fingerprint
from ..engine.context import profiler_range
from .ops import Ext, Op, View, paused_recording


class ScopeRecipe:
    """Packed in place of a scope tensor that autograd saves: which storage, which
    view of it, and after how many recorded ops (its value at save time)."""

    __slots__ = (
        "record",
        "sid",
        "position",
        "seq",
        "dtype",
        "size",
        "stride",
        "offset",
        "conj",
        "neg",
        "values",
        "consumed",
        "__weakref__",
    )

    def __init__(self, record: Any, sid: int, t: torch.Tensor) -> None:
        self.record = record
        self.sid = sid
        self.position = len(record.ops)
        # the autograd sequence number at the save: tells a save an op's autograd
        # makes before running it from one after the op before (ScopeRecord.record_op)
        self.seq = autograd_sequence_nr()
        self.dtype = t.dtype
        self.size = tuple(t.shape)
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.conj = t.is_conj()
        self.neg = t.is_neg()
        # graph-task key -> recomputed tensor, popped when backward unpacks it
        self.values: dict[Any, torch.Tensor] | None = None
        self.consumed: set[Any] = set()

    def unpack(self) -> torch.Tensor:
        return unpack_recipe(self.record, self)


def view_of(base: torch.Tensor, d: Any) -> torch.Tensor:
    """The view ``d`` (a :class:`View` or a recipe) of the storage of ``base``, with
    the conjugate and negative bits ``d`` had."""
    if base.dtype == d.dtype:
        out = base.as_strided(d.size, d.stride, d.offset)
    else:
        out = torch.empty((0,), dtype=d.dtype, device=base.device)
        out = out.set_(base.untyped_storage(), d.offset, d.size, d.stride)
    if out.is_conj() is not d.conj:
        out = out.conj()  # (toggles the bit: a view)
    if out.is_neg() is not d.neg:
        out = neg_view(out)
    return out


def unpack_recipe(record: Any, recipe: ScopeRecipe) -> torch.Tensor:
    key = _graph_task_key()
    values = recipe.values
    if values is not None and key in values:
        recipe.consumed.add(key)
        return values.pop(key)
    targets = [recipe]
    if type(key) is not object and key not in recipe.consumed:
        for ref in record.recipes:
            r = ref()
            if r is None or r is recipe or key in r.consumed:
                continue
            if r.values is None or key not in r.values:
                targets.append(r)
    replay(record, targets, key)
    if type(key) is not object:
        recipe.consumed.add(key)
        # When this backward ends, free what the replay recreated for it but it did
        # not unpack (autograd.grad(..., inputs=subset, retain_graph=True)).
        when_backward_ends(key, functools.partial(_forget, targets, key))
    return recipe.values.pop(key)


def _forget(targets: list[ScopeRecipe], key: Any) -> None:
    for r in targets:
        if r.values is not None:
            r.values.pop(key, None)
        r.consumed.discard(key)


def _plan(
    record: Any, targets: list[ScopeRecipe]
) -> tuple[int, list[bool], dict[int, int], dict[int, int]]:
    end = max(r.position for r in targets)
    needed = {r.sid for r in targets}
    run = [False] * end
    for i in range(end - 1, -1, -1):
        op = record.ops[i]
        if op.writes & needed or any(sid in needed for _, sid, _, _ in op.new_outputs):
            run[i] = True
            needed |= op.reads
    # state s = after s ops; a storage read by op i is needed up to state i + 1,
    # one a recipe reads at position p up to state p.
    drop_at: dict[int, int] = {}
    last_write: dict[int, int] = {}
    for i in range(end):
        if run[i]:
            for sid in record.ops[i].writes:
                last_write[sid] = i
            for sid in record.ops[i].reads:
                drop_at[sid] = max(drop_at.get(sid, 0), i + 1)
            for _, sid, _, _ in record.ops[i].new_outputs:
                drop_at[sid] = max(drop_at.get(sid, 0), i + 1)
    for r in targets:
        drop_at[r.sid] = max(drop_at.get(r.sid, 0), r.position)
    return end, run, drop_at, last_write


def replay(record: Any, targets: list[ScopeRecipe], key: Any) -> None:
    end, run, drop_at, last_write = _plan(record, targets)
    ops = record.ops
    env: dict[int, torch.Tensor] = {}
    checked: set[int] = set()  # (the outside storages whose bytes were checked)
    for sid, snap in record.snapshots.items():
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
        with _replay_context(record):
            for state in range(end + 1):
                for r in by_position.get(state, ()):
                    _materialize(r, env, key, last_write)
                for sid in drops.get(state, ()):
                    env.pop(sid, None)
                if state == end:
                    break
                if run[state]:
                    _run_op(ops[state], env, checked)
    finally:
        for g, s in caller_states:
            g.set_state(s)


@contextlib.contextmanager
def _replay_context(record: Any):
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        for dev in sorted(record.device_types):
            if torch.amp.is_autocast_available(dev):
                stack.enter_context(torch.autocast(dev, enabled=False))
        stack.enter_context(paused_recording())
        stack.enter_context(profiler_range("remat.scope.replay"))
        yield


def _run_op(op: Op, env: dict[int, torch.Tensor], checked: set[int]) -> None:
    leaves = []
    for leaf in op.leaves:
        if isinstance(leaf, View):
            leaves.append(view_of(env[leaf.sid], leaf))
        elif isinstance(leaf, Ext):
            t = leaf.tensor
            if leaf.version is not None and version_of(t) != leaf.version:
                raise modified_in_place(
                    "a tensor read inside gradient_checkpoint_scope "
                    f"({describe_tensor(t.shape, t.dtype)})",
                    "after the scope read it, so the scope's ops cannot be replayed for backward",
                    "Clone it before modifying it, or modify it before the scope.",
                    (leaf.version, version_of(t)),
                )
            if leaf.checksum is not None and leaf.key not in checked:
                if storage_fingerprint(t) != leaf.checksum:
                    raise modified_in_place(
                        "a tensor read inside gradient_checkpoint_scope "
                        f"({describe_tensor(t.shape, t.dtype)})",
                        "after the scope read it, without a version bump (a fused "
                        "optimizer's step, a batch norm's running statistics, a write "
                        "through .data or under inference_mode), so the scope's ops cannot "
                        "be replayed for backward",
                        "Run the step after backward, or compute what reads the tensor "
                        "outside the scope.",
                    )
                checked.add(leaf.key)
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


def _materialize(r: ScopeRecipe, env: dict, key: Any, last_write: dict[int, int]) -> None:
    t = view_of(env[r.sid], r)
    if last_write.get(r.sid, -1) >= r.position:
        t = t.clone()  # a later replayed op writes this storage
    if r.values is None:
        r.values = {}
    r.values[key] = t
