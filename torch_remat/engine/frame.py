"""The per-call state of one ``remat.checkpoint``: its forward bookkeeping and the
recompute that backward triggers.

Mechanism (the same saved-tensor-hook scheme as non-reentrant
``torch.utils.checkpoint``, plus SAVE regions):

* During the forward a pack hook sees every tensor autograd saves. Inside a SAVE
  region the tensor is kept (a :class:`RegionSaved`). Elsewhere only a
  :class:`Holder` is packed and the tensor is dropped.
* When backward unpacks a holder, the function is replayed under a second pack hook
  that refills the holders in order. SAVE regions are not replayed: they return
  their kept outputs, or placeholders, and restore the state snapshots taken when
  they returned in forward. The replay stops as soon as every live holder is
  refilled (early stop).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .. import _compat
from .._autograd_hooks import pop_hooks, push_hooks, top_hooks, unpack_packed
from .._errors import (
    RematError,
)
from .._tensors import storage_root
from . import rebuild as rb
from .active import note_exception
from .module_state import ModuleState
from .naming import current_prefixes
from .observers import observers_for_new_checkpoint
from .profiling import profiler_range
from .rebuild import RebuiltSave
from .rebuild_decide import settle_rebuilds
from .recompute import FrameBackward, autocast_state
from .records import Holder, RegionRecord, RegionSaved, detached_copy, release_traceback
from .region_io import consume_region_args, record_region_outputs, region_leaves
from .region_writes import SaveRegionWatch
from .rng_guard import RNGUse, fingerprints, position
from .saved_hooks import KeptTensorHooks, next_call_serial
from .sources import INPUT, SourceIndex, TensorSource
from .state import FORWARD, _tls
from .state_hooks import DeviceRNGStateHook, same_state
from .walk import mark_inputs_read_by_replayed_code


class CheckpointFrame(FrameBackward):
    """State of one checkpointed call, from its forward until its graph dies."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        state_hooks: tuple[Any, ...],
        early_stop: bool,
        check_metadata: bool,
        bitwise_check: bool,
        kept_options: tuple[Any, Any] = (None, None),
        rebuild: str = "free",
        flop_limits: dict | None = None,
    ) -> None:
        self.fn = fn
        self.name = name
        self.state_hooks = state_hooks
        self.early_stop = early_stop
        self.rebuild_policy = rebuild  # "free", "always" or "never" (rebuild.py)
        self.flop_limits = flop_limits  # rebuild_decide's memo, per checkpointed function
        self.check_metadata = check_metadata
        self.bitwise_check = bitwise_check
        self.holders: list[weakref.ref] = []
        self.holder_meta: list[tuple] = []
        self.holder_checksums: list[Any] = []
        self.regions: list[RegionRecord] = []
        self.replay_regions: list[RegionRecord] = []
        self.region_names: set[str] = set()
        self.region_stack: list[RegionRecord] = []
        self.save_depth = 0
        self.sources = SourceIndex()
        self.inputs: list[TensorSource] = []
        self.output_sources: list[TensorSource] = []
        self.save_output_nodes: list[Any] = []
        self.walk_roots: list[Any] = []
        self.leaves: list[Any] = []
        self.spec = None
        self.entry_states: list[Any] = []
        self.last_states: list[Any] = []
        self.autocast: list[tuple[str, bool, torch.dtype]] = []
        self.autocast_cache = True
        self.outer_hooks = None
        # saved-tensor hooks for what this call keeps: (saved_tensors_hooks,
        # input_saved_tensors_hooks) options, resolved in run_forward (saved_hooks.py)
        self.kept_options = kept_options
        self.kept_hooks: KeptTensorHooks | None = None
        self.call = next_call_serial()
        self.name_prefixes = current_prefixes()  # remat.name_scope; the replay reuses them
        self.start_seq = 0
        self.forward_done = False
        self.recomputed_keys: set[Any] = set()
        self.arg_aliases: list[tuple[int, int]] = []  # (i, j): argument i is argument j
        self.module_state: ModuleState | None = None
        # replay_regions index of a SAVE region -> copies of the buffers it updated
        self.region_buffers: dict[int, list[Any]] = {}
        self.rng_start: list[Any] | None = None  # generator fingerprints at entry
        self.rng_use: RNGUse | None = None
        # indices of the hooks that replay a default generator: their position is
        # checked in the replay (rng_guard.check_position) at each top-level SAVE
        # region call, where the replay stops early, and where the forward ended
        self.rng_checks = (
            [i for i, h in enumerate(state_hooks) if isinstance(h, DeviceRNGStateHook)] if state_hooks else None
        )
        self.rng_end: list[Any] | None = None
        self.rng_last_holder: tuple[int, list[Any]] | None = None
        rb.reset(self)  # rebuild, rebuilds, last_needed_seq, output_edges
        self.observers = observers_for_new_checkpoint(_tls.recompute_depth > 0)
        for observer in self.observers.all:
            observer.checkpoint_created(self)

    # ------------------------------------------------------ the active-scope protocol

    phase = FORWARD

    @property
    def frame(self) -> CheckpointFrame:
        return self

    @property
    def in_save_region(self) -> bool:
        return self.save_depth > 0

    def subscribe(self, observer: Any) -> None:
        """Send this checkpoint's remaining events to ``observer`` too."""
        self.observers = self.observers.with_(observer)

    # ------------------------------------------------------------------ forward

    def run_forward(self, args: tuple, kwargs: dict) -> Any:
        if not kwargs and all(
            isinstance(a, torch.Tensor) or not isinstance(a, (list, tuple, dict)) for a in args
        ):
            leaves, spec = list(args), None
        else:
            leaves, spec = tree_flatten((args, kwargs))
        self.leaves, self.spec = leaves, spec
        first: dict[int, int] = {}
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                j = first.setdefault(id(x), i)
                if j != i:
                    # The replay passes the same object again (code may test `q is k`).
                    self.arg_aliases.append((i, j))
                    continue
                src = TensorSource(INPUT, i, x)
                self.inputs.append(src)
                self.sources.add(x, src)
        self.entry_states = self.last_states = [h.snapshot() for h in self.state_hooks]
        self.autocast = autocast_state(leaves)
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.outer_hooks = top_hooks(False)
        if self.outer_hooks is not None and _compat.is_torch_checkpoint_hooks(self.outer_hooks):
            raise RematError(
                f"torch_remat: remat.checkpoint '{self.name}' runs inside torch.utils.checkpoint, "
                "so the same code is checkpointed twice (run three times per step). This "
                "happens when torch's apply_activation_checkpointing (or a framework calling "
                "it, e.g. torchtune's set_activation_checkpointing or a trainer's own "
                "activation checkpointing) is applied after apply_remat. Apply only one: "
                "turn the framework's activation checkpointing off, or do not apply remat."
            )
        self.kept_hooks = KeptTensorHooks(self.name, self.call, *self.kept_options, self.outer_hooks)
        for src in self.inputs:
            src.hooks = self.kept_hooks.inputs
        self.start_seq = _compat.autograd_sequence_nr()
        self.module_state = ModuleState.capture(self.fn)
        self.rng_start = fingerprints()
        try:
            push_hooks(self.pack, unpack_packed)
        except RuntimeError as e:
            raise RematError(
                f"torch_remat: remat.checkpoint '{self.name}' needs saved-tensor hooks, "
                "but they are disabled here (torch.autograd.graph."
                f"disable_saved_tensors_hooks) with the message: {e}. Call the function "
                "without remat.checkpoint in this context, or leave that context first."
            ) from e
        tls = _tls
        tls.stack.append(self)
        observers = self.observers.all
        try:
            try:
                for observer in observers:
                    observer.forward_entered(self)
                with profiler_range("remat.forward:", self.name):
                    out = self.fn(*args, **kwargs)
                if type(out) is types.GeneratorType:
                    raise TypeError(
                        f"torch_remat: the function of checkpoint '{self.name}' returned a "
                        "generator: its code runs only when the generator is consumed, after "
                        "the checkpoint returned, so nothing would be checkpointed. Return "
                        "the values (e.g. a tuple or list) instead."
                    )
            except Exception as e:
                note_exception(e)
                raise
            finally:
                tls.stack.pop()
                pop_hooks()
                for observer in observers:
                    observer.forward_exited(self)
            self._finish(out)
        except BaseException:
            # Includes an outer replay stopping early inside _finish (nested
            # checkpoints store their kept tensors through the outer pack hook).
            self._abandon()
            raise
        return out

    def _abandon(self) -> None:
        # The forward raised: drop what only _finish would have released. The output
        # sources and the SAVE output nodes reach the graph, whose saved tensors
        # reach this frame through the pack hook: a cycle through autograd nodes,
        # which the garbage collector cannot see.
        for source in self.inputs + self.output_sources:  # also listed by RegionRecords
            source.ref = source.hold = None
        self.walk_roots = []
        self.inputs = []
        self.output_sources = []
        self.save_output_nodes = []
        rb.abandon(self)
        self.sources = SourceIndex()
        self.leaves = []
        self.module_state = self.rng_start = None

    def pack(self, t: torch.Tensor) -> Any:
        if self.save_depth:
            return self._pack_in_save_region(t)
        holder = Holder(self, len(self.holders))
        # A tensor the checkpoint keeps anyway fills its holder now, unless the
        # user's own hooks (offloading) were active around the checkpoint: then the
        # kept copy lives where those hooks put it, and the replay refills the holder.
        sources = self.sources.lookup(t)
        if sources is not None:
            for s in sources:
                s.mark_kept(t)
            # Kept tensors packed by hooks live where the hooks put them.
            if self.outer_hooks is None and not any(s.hooks for s in sources):
                d = t.detach()
                holder.static = d
                holder.static_version = d._version
        if holder.static is None:
            self.last_needed_seq = _compat.autograd_sequence_nr()
            if self.rng_checks:
                # where the generators stood at the last tensor a replay refills
                # (where it stops early), for rng_guard.check_position
                self.rng_last_holder = (holder.index, position(self.state_hooks, self.rng_checks))
        self.holders.append(weakref.ref(holder))
        stack = self.region_stack
        self.holder_meta.append(
            (t.shape, t.dtype, t.device, stack[-1].qualname if stack else None, t._version)
        )
        if self.bitwise_check:
            from .determinism import checksum

            self.holder_checksums.append(checksum(t))
        return holder

    def _pack_in_save_region(self, t: torch.Tensor) -> RegionSaved | RebuiltSave:
        rebuild = self.rebuild
        if rebuild is not None:
            # (a view of) an argument the replay recomputes, not modified since the call
            root = storage_root(t)
            for arg in rebuild.args:
                if arg.root is root and t.dtype is arg.layout[3] and t._version == arg.version:
                    a = arg.tensor
                    if t.dtype.is_complex and (t.is_conj() is not a.is_conj() or t.is_neg() is not a.is_neg()):
                        break  # a conjugate/negative view: refilled as a view it would lose the bit
                    saved = RebuiltSave(self, arg, self.region_stack[-1], t)
                    arg.saves.append(weakref.ref(saved))
                    return saved
        region = self.region_stack[-1]
        hooks = self.kept_hooks.region_save(region.qualname, t) or self.outer_hooks
        saved = RegionSaved(region, f"saved.{len(region.saved)}", t, hooks)
        region.saved.append(weakref.ref(saved))
        for observer in self.observers.kept:
            observer.tensor_kept(self, saved, t)
        return saved

    def qualify(self, name: str) -> str:
        stack = self.region_stack
        return f"{stack[-1].qualname}.{name}" if stack else name

    def run_region(self, fn: Callable[..., Any], name: str, recompute: bool, args, kwargs) -> Any:
        qualname = self.qualify(name)
        if qualname in self.region_names:
            raise ValueError(
                f"torch_remat: region name '{qualname}' is used twice in one forward of "
                f"checkpoint '{self.name}'. Region names identify regions between the "
                "forward and the recompute; give each call its own name (for example "
                "f'expert.{i}' inside a loop)."
            )
        in_save = self.save_depth > 0
        if in_save and recompute:
            raise ValueError(
                f"torch_remat: region '{qualname}' asks to be recomputed, but it is "
                f"nested inside SAVE region '{self.region_stack[-1].qualname}' whose "
                "body is never replayed. Make the outer region recompute=True, or the "
                "inner one recompute=False."
            )
        self.region_names.add(qualname)
        record = RegionRecord(self.name, name, qualname, recompute)
        self.regions.append(record)
        if not in_save:
            self.replay_regions.append(record)
        leaves = region_leaves(args, kwargs)
        if self.sources:
            consume_region_args(self, leaves, recompute and not in_save, not in_save)
        for outer in _tls.stack[:-1]:
            # A checkpoint nested in the replayed code of an outer one is re-run whole
            # (SAVE bodies included) by the outer replay: for the outer frame, this
            # region reads its arguments in replayed code.
            if outer.phase == FORWARD and not outer.in_save_region and outer.sources:
                consume_region_args(outer, leaves, True, False)
        observers = self.observers.regions
        for observer in observers:
            observer.region_entered(self, record)
        try:
            out = self._run_region_body(fn, record, in_save, args, kwargs, leaves)
        finally:
            for observer in observers:
                observer.region_exited(self, record)
        return out

    def _run_region_body(self, fn, record: RegionRecord, in_save: bool, args, kwargs, leaves) -> Any:
        recompute = record.recompute
        watch = None if recompute or in_save else SaveRegionWatch(self.module_state, leaves)
        self.region_stack.append(record)
        rebuild = None
        if not recompute:
            self.save_depth += 1
            if not in_save:
                if self.rng_checks:
                    record.rng_entry = position(self.state_hooks, self.rng_checks)
                rebuild = rb.open_rebuild(self, record.qualname, leaves)
        ok = False
        try:
            with profiler_range("remat.region:", self.name, "::", record.qualname):
                out = fn(*args, **kwargs)
            if watch is not None:
                watch.check(self, record.qualname)
            ok = True
        except Exception as e:
            note_exception(e)
            if not recompute and not in_save:
                # The replay skips this body, so it re-raises the same error for
                # code that catches it and falls back to another path.
                record.raised = detached_copy(e)
                record.exit_states = self._snapshot_after_region()
            raise
        finally:
            self.region_stack.pop()
            if not recompute:
                self.save_depth -= 1
            if rebuild is not None:
                rb.close_rebuild(self, rebuild, ok)
        if not recompute and not in_save:
            record_region_outputs(self, record, out)
            record.exit_states = self._snapshot_after_region()
        return out

    def _snapshot_after_region(self) -> list[Any]:
        # A state that did not change since the last snapshot (no random numbers
        # drawn in between) is shared rather than stored again: a CPU generator
        # state is 5 KB per snapshot.
        states = []
        for hook, previous in zip(self.state_hooks, self.last_states):
            state = hook.snapshot()
            states.append(previous if same_state(previous, state) else state)
        self.last_states = states
        return states

    def keep(self, t: torch.Tensor) -> bool:
        """``recompute_needs_tensor`` during the forward. False if ``t`` is unknown."""
        sources = self.sources.lookup(t) if self.sources else None
        if sources is None:
            if self.save_depth:
                # recorded on the outermost SAVE region of the stack: the one whose
                # outputs the replay reads (a nested one's never reach it)
                for record in self.region_stack:
                    if not record.recompute:
                        record.pending_keep.append(weakref.ref(storage_root(t)))
                        break
                return True
            return False
        for s in sources:
            s.mark_kept(t)
        return True

    def _finish(self, out: Any) -> None:
        for record in self.replay_regions:
            release_traceback(record.raised)
        self.rng_use, self.rng_start = RNGUse.of_forward(self.rng_start), None
        if self.rng_checks:
            if self.rng_use is None:
                self.rng_checks = None  # nothing drew: nothing to check
            else:
                self.rng_end = position(self.state_hooks, self.rng_checks)
        if self.module_state is not None:
            self.module_state.finish(self.name)
        candidates = []
        for s in self.inputs:
            if not s.keep:
                if s.save_consumed and s.ref.requires_grad:
                    candidates.append(s)
                else:
                    s.keep = True
        if candidates:
            mark_inputs_read_by_replayed_code(
                out, candidates, self.save_output_nodes, self.start_seq, self.walk_roots
            )
        settle_rebuilds(self, out)
        for s in self.inputs:
            s.store(self.name)
        for s in self.output_sources:
            s.store(self.name)
        self.sources = SourceIndex()
        self.save_output_nodes = []
        self.output_edges = {}
        self.walk_roots = []
        self.leaves = [None if isinstance(x, torch.Tensor) else x for x in self.leaves]
        self.forward_done = True
