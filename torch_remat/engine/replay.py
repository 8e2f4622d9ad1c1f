"""The scope active while backward recomputes a checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_unflatten

from .._errors import (
    CLONE_FIRST,
    PlaceholderReadError,
    RecomputeMismatchError,
    RematError,
    _StopRecompute,
    modified_in_place,
)
from .active import note_exception
from .placeholder import Placeholder, read_error_message
from .profiling import profiler_range
from .rebuild import refill
from .records import RegionRecord, describe_region, detached_copy
from .rng_guard import check_position
from .sources import TensorSource
from .state import RECOMPUTE

# Packed for tensors saved during a replay; the replay's own graph is never run.
_REPLAYED = object()


def replay_unpack(packed: Any) -> torch.Tensor:
    raise RematError(
        "torch_remat: backward was run through the graph built while recomputing a "
        "checkpoint (autograd.grad or backward inside the checkpointed function). This "
        "is not supported."
    )


class ReplayScope:
    """Refills a frame's holders for one backward (graph task) ``key``.

    While it runs it is the active scope (see :class:`~torch_remat.engine.state.ActiveScope`).
    """

    phase = RECOMPUTE
    in_save_region = False

    def __init__(self, frame: Any, key: Any, needed: int) -> None:
        self.frame = frame
        self.key = key
        self.needed = needed
        self.counter = 0
        self.filled = 0
        self.region_pos = 0
        self.region_stack: list[RegionRecord] = []
        self.seen_regions: list[tuple[str, bool]] = []  # (qualname, recompute)

    def pack(self, t: torch.Tensor) -> Any:
        i = self.counter
        self.counter = i + 1
        frame = self.frame
        if i >= len(frame.holders):
            raise RecomputeMismatchError(
                f"torch_remat: the recompute of checkpoint '{frame.name}' saved more "
                f"tensors for backward than its forward did ({len(frame.holders)} outside "
                f"SAVE regions). {self.region_sequences()} The replay must take the same "
                "path as the forward."
            )
        holder = frame.holders[i]()
        if holder is None or holder.static is not None:
            return _REPLAYED
        rec = holder.recomputed
        if rec is not None and self.key in rec:
            return _REPLAYED
        if isinstance(t, Placeholder):
            raise PlaceholderReadError(
                read_error_message(t._origin, "code outside SAVE regions saved for backward a tensor that")
            )
        shape, dtype, device, region, version = frame.holder_meta[i]
        if t._version != version:
            # The replay recreates fresh tensors with the versions the forward saw;
            # a differing version means a tensor both passes share (a closure tensor,
            # a buffer) was modified in place after the forward saved it.
            raise modified_in_place(
                frame.describe_holder(i),
                f"after the forward saved it: it was at version {version} when the "
                f"forward saved it and is at version {t._version} in the recompute",
                CLONE_FIRST,
            )
        if frame.check_metadata and (t.shape != shape or t.dtype != dtype or t.device != device):
            raise RecomputeMismatchError(
                f"torch_remat: tensor #{i} saved for backward by {describe_region(region)} of "
                f"checkpoint '{frame.name}' was {tuple(shape)} {dtype} on {device} in forward but "
                f"{tuple(t.shape)} {t.dtype} on {t.device} in the recompute. "
                f"{self.region_sequences()} The replay must compute the same values as "
                "the forward; state it depends on (RNG, counters) must be restored with "
                "recompute_state_hooks."
            )
        if frame.bitwise_check:
            from .determinism import check_bitwise

            check_bitwise(frame, i, t, region)
        d = t.detach()
        if rec is None:
            holder.recomputed = rec = {}
        rec[self.key] = (d, d._version)
        self.filled += 1
        if self.filled == self.needed and frame.early_stop:
            last = frame.rng_last_holder
            if frame.rng_checks and last is not None and last[0] == i:
                check_position(frame.name, frame.state_hooks, frame.rng_checks, last[1],
                               f"the tensor #{i} it stops at")
            raise _StopRecompute
        return _REPLAYED

    def qualify(self, name: str) -> str:
        stack = self.region_stack
        return f"{stack[-1].qualname}.{name}" if stack else name

    def region_sequences(self) -> str:
        fwd = ", ".join(f"{r.qualname} ({r.kind})" for r in self.frame.replay_regions)
        rec = ", ".join(f"{q} ({'recompute' if r else 'save'})" for q, r in self.seen_regions)
        return f"Regions in forward: [{fwd}]; regions in the recompute so far: [{rec}]."

    def run_region(self, fn: Callable[..., Any], name: str, recompute: bool, args, kwargs) -> Any:
        frame = self.frame
        qualname = self.qualify(name)
        self.seen_regions.append((qualname, recompute))
        pos = self.region_pos
        expected = frame.replay_regions[pos] if pos < len(frame.replay_regions) else None
        if expected is None or expected.qualname != qualname or expected.recompute != recompute:
            raise RecomputeMismatchError(
                f"torch_remat: the recompute of checkpoint '{frame.name}' took a different "
                f"path than its forward. {self.region_sequences()} Replayed code must call "
                "the same regions in the same order: make control flow depend only on the "
                "inputs and on state restored by recompute_state_hooks, and use "
                "remat.is_recomputing() only to skip side effects."
            )
        self.region_pos = pos + 1
        if not recompute:
            if frame.rng_checks and expected.rng_entry is not None:
                check_position(frame.name, frame.state_hooks, frame.rng_checks, expected.rng_entry,
                               f"SAVE region '{qualname}'")
            for hook, state in zip(frame.state_hooks, expected.exit_states):
                hook.restore(state)
            updated = frame.region_buffers.get(pos)
            if updated:
                frame.module_state.skip_region(updated)
            if expected.raised is not None:
                # A fresh copy each time: the stored one would collect this
                # replay's traceback, and with it the replay's tensors.
                raise detached_copy(expected.raised)
            rebuild = frame.rebuilds.get(pos)
            if rebuild is not None:
                refill(self, rebuild, args, kwargs)
                if self.filled == self.needed and frame.early_stop:
                    raise _StopRecompute
            leaves = [
                o.replay_value(frame.name) if isinstance(o, TensorSource) else o.value
                for o in expected.outputs
            ]
            if expected.output_spec is None:
                return leaves[0]
            return tree_unflatten(leaves, expected.output_spec)
        self.region_stack.append(expected)
        try:
            with profiler_range("remat.region:", frame.name, "::", qualname):
                return fn(*args, **kwargs)
        except Exception as e:
            note_exception(e)
            raise
        finally:
            self.region_stack.pop()

    def keep(self, t: torch.Tensor) -> bool:
        return True

