"""The backward half of a checkpoint call: unpacking holders and the recompute.

:class:`CheckpointFrame` (``frame.py``) inherits it. When backward unpacks a
:class:`Holder`, the frame replays its function under a :class:`ReplayScope`
(``replay.py``) that refills the holders in order, then hands each tensor to the
backward that asked for it, and frees what that backward did not use when it ends.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_unflatten

from .. import _compat
from .._autograd_hooks import pop_hooks, push_hooks
from .._errors import (
    CLONE_FIRST,
    RecomputeMismatchError,
    RematError,
    _StopRecompute,
    modified_in_place,
)
from .._tensors import describe_tensor
from .active import note_exception
from .module_state import restore as restore_module_state
from .naming import prefixes_set_to
from .profiling import profiler_range
from .rebuild import RebuiltSave, count_to_refill, describe_rebuilt, forget_rebuilt
from .records import Holder, describe_region, release_traceback
from .replay import ReplayScope, replay_unpack
from .rng_guard import check_position
from .state import _tls

_graph_exec_group = _compat.get_graph_exec_group
_graph_task_id = _compat.current_graph_task_id


def _forget(frame_ref: weakref.ref, key: Any) -> None:
    frame = frame_ref()
    if frame is not None:
        frame.forget(key)


_CUDA_AVAILABLE: list[bool] = []


def _cuda_available() -> bool:
    # Asked once per process (a Python call per checkpoint otherwise), at the first
    # checkpoint rather than at import: CUDA_VISIBLE_DEVICES may be set in between.
    if _CUDA_AVAILABLE:
        return _CUDA_AVAILABLE[0]
    available = torch.cuda.is_available()
    if not torch.compiler.is_compiling():
        _CUDA_AVAILABLE.append(available)
    return available


def _autocast_devices(leaves: Sequence[Any]) -> list[str]:
    devices = ["cpu", "cuda"] if _cuda_available() else ["cpu"]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            dt = x.device.type
            if dt not in devices and dt != "meta":
                devices.append(dt)
    return devices


def autocast_state(leaves: Sequence[Any]) -> list[tuple[str, bool, torch.dtype]]:
    """Autocast settings of every device the arguments live on (and CPU, CUDA)."""
    return [
        (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        for dev in _autocast_devices(leaves)
    ]


class FrameBackward:
    """Methods of :class:`CheckpointFrame` that run in backward."""


    def unpack_holder(self, holder: Holder) -> torch.Tensor:
        static = holder.static
        if static is not None:
            if static._version != holder.static_version:
                raise self._modified_error(holder.index, holder.static_version, static._version)
            return static
        return self.take_recomputed(holder)

    def take_recomputed(self, holder: Holder | RebuiltSave) -> torch.Tensor:
        """The tensor the recompute refilled for this backward, recomputing first."""
        # graph_task_key(), inlined: this runs for every tensor backward unpacks
        key = _graph_exec_group()
        if key is None:
            key = _graph_task_id()
            if key == -1:
                key = object()
        rec = holder.recomputed
        if rec is None or key not in rec:
            if key in self.recomputed_keys:
                raise RematError(
                    f"torch_remat: a tensor saved inside checkpoint '{self.name}' was "
                    "unpacked twice in the same backward. If a custom autograd Function "
                    "reads ctx.saved_tensors more than once, read it once and reuse it."
                )
            self.recompute(key)
            rec = holder.recomputed
        t, version = rec.pop(key)
        if type(key) is object:
            self.forget(key)  # unpacked outside a backward: nothing else will use them
        if t._version != version:
            if isinstance(holder, Holder):
                raise self._modified_error(holder.index, version, t._version)
            raise modified_in_place(describe_rebuilt(holder), "after it was saved", CLONE_FIRST,
                                    (version, t._version))
        return t

    def forget(self, key: Any) -> None:
        """Drop the tensors refilled for ``key`` that nothing unpacked (a backward
        that reached only part of the graph, e.g. ``autograd.grad(..., inputs=...)``
        with ``retain_graph=True``)."""
        for ref in self.holders:
            h = ref()
            if h is not None and h.recomputed:
                h.recomputed.pop(key, None)
        if self.rebuilds:
            forget_rebuilt(self, key)
        self.recomputed_keys.discard(key)

    def _modified_error(self, index: int, old: int, new: int) -> RematError:
        return modified_in_place(
            self.describe_holder(index), "after it was saved", CLONE_FIRST, (old, new)
        )

    def describe_holder(self, index: int) -> str:
        """``tensor #3 saved for backward by region 'attn' of checkpoint 'layers.0'
        (shape (2, 4), float32)``."""
        shape, dtype, _, region, _ = self.holder_meta[index]
        return (
            f"tensor #{index} saved for backward by {describe_region(region)} of checkpoint "
            f"'{self.name}' ({describe_tensor(shape, dtype)})"
        )

    def replay_args(self) -> tuple[tuple, dict]:
        leaves = list(self.leaves)
        for s in self.inputs:
            leaves[s.index] = s.replay_value(self.name)
        for i, j in self.arg_aliases:
            leaves[i] = leaves[j]
        if self.spec is None:
            return tuple(leaves), {}
        return tree_unflatten(leaves, self.spec)

    def _autocast_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for dev, enabled, dtype in self.autocast:
            if torch.is_autocast_enabled(dev) != enabled or (
                enabled and torch.get_autocast_dtype(dev) != dtype
            ):
                stack.enter_context(
                    torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache)
                )
        return stack

    def recompute(self, key: Any) -> None:
        if not self.forward_done:
            raise RematError(
                f"torch_remat: backward reached tensors saved inside checkpoint "
                f"'{self.name}' while its forward was still running (autograd.grad or "
                "backward called inside the checkpointed function). This is not "
                "supported; compute such gradients outside remat.checkpoint."
            )
        needed = 0
        for ref in self.holders:
            h = ref()
            if h is not None and h.static is None and (h.recomputed is None or key not in h.recomputed):
                needed += 1
        if self.rebuilds:
            needed += count_to_refill(self, key)
        scope = ReplayScope(self, key, needed)
        args, kwargs = self.replay_args()
        hooks = self.state_hooks
        rng = self.rng_use
        caller_rng = rng.caller_states() if rng is not None else []
        caller_states = [h.snapshot() for h in hooks]
        for h, s in zip(hooks, self.entry_states):
            h.restore(s)
        unrestored = rng.unrestored() if rng is not None else []
        module_undo = []
        if self.module_state is not None:
            try:
                module_undo = self.module_state.install(self.name)
            except BaseException:
                for h, s in zip(hooks, caller_states):
                    h.restore(s)
                raise
        rng_error = None
        tls = _tls
        tls.stack.append(scope)
        tls.recompute_depth += 1
        observers = self.observers.all
        for observer in observers:
            observer.replay_started(self)
        try:
            push_hooks(scope.pack, replay_unpack)
            try:
                with torch.enable_grad(), self._autocast_context(), profiler_range(
                    "remat.recompute:", self.name
                ), prefixes_set_to(self.name_prefixes):
                    self.fn(*args, **kwargs)
                if self.rng_checks:
                    check_position(self.name, hooks, self.rng_checks, self.rng_end, "the end of its function")
            except _StopRecompute:
                pass
            except Exception as e:
                note_exception(e)
                raise
            finally:
                pop_hooks()
        finally:
            tls.stack.pop()
            tls.recompute_depth -= 1
            restore_module_state(module_undo)
            for record in self.replay_regions:
                release_traceback(record.raised)
            for h, s in zip(hooks, caller_states):
                h.restore(s)
            if rng is not None:
                rng_error = rng.finish(self.name, unrestored, caller_rng)
            for observer in observers:
                observer.replay_ended(self)
        if rng_error is not None:
            raise rng_error
        if scope.filled < needed:
            raise RecomputeMismatchError(
                f"torch_remat: the recompute of checkpoint '{self.name}' saved "
                f"{scope.counter} tensors for backward, but its forward saved "
                f"{len(self.holders)} outside SAVE regions, so {needed - scope.filled} "
                "needed tensor(s) were never recreated. "
                + scope.region_sequences()
                + " The replay must take the same path as the forward."
            )
        if type(key) is not object:
            self.recomputed_keys.add(key)
        if type(key) is int:
            # At the end of this backward, free what it refilled but did not use.
            _compat.queue_backward_callback(functools.partial(_forget, weakref.ref(self), key))
