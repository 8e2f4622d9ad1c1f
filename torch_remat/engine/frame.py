r"""One checkpoint call: :class:`CheckpointFrame`, from its forward until its graph dies.

The same saved-tensor-hook scheme as non-reentrant ``torch.utils.checkpoint``, plus
SAVE regions. The frame owns every piece of the call's bookkeeping; the other engine
modules hold records it creates (``records.py``), the rebuilt saves it owns
(``rebuild.py``) and the replay pass it starts (``replay.py``), and never assign
its attributes.

Forward (:meth:`CheckpointFrame.run_forward`):

* A pack hook (:meth:`~CheckpointFrame.pack`) sees every tensor autograd saves.
  Inside a SAVE region the tensor is kept (a ``RegionSaved``), or rebuilt by the
  replay when it is (a view of) an argument replayed code produces (a
  ``RebuiltSave``). Elsewhere only a ``Holder`` is packed and the tensor is dropped.
* Region calls (:meth:`~CheckpointFrame.run_region`) record what a SAVE region
  reads and returns (producer responsibility: ``TensorSource``\ s), keep the
  arguments its body writes in place as it left them, and copy the buffers it
  updates (the replay installs both where it skips the region).
* When the forward ends, checkpoint inputs only SAVE regions consumed are dropped
  (an autograd-graph walk finds what replayed code reads), the rebuilds are
  settled, and what is kept is stored (``TensorSource.store``).

Backward: the first unpack of an empty holder replays the function
(:meth:`~CheckpointFrame.recompute`) as a replay pass (``ReplayPass``) that refills
the holders in order. SAVE regions are not replayed: they return their kept
outputs, or placeholders, and restore the state snapshots taken when they returned
in forward. The replay stops as soon as every live holder is refilled (early stop).
Each refill belongs to the backward (graph task) that asked for it, and what that
backward did not use is freed when it ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import types
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.hooks import RemovableHandle

from .. import _compat
from .._autograd_hooks import (
    graph_task_key,
    pop_hooks,
    push_hooks,
    top_hooks,
    unpack_packed,
    when_backward_ends,
)
from .._compat import SETTING_GETTERS as _SETTING_GETTERS
from .._compat import TORCH_SETTINGS as _TORCH_SETTINGS
from .._compat import any_version, autograd_sequence_nr, profiler_enabled, sequence_nr, version_of
from .._compat import call as _call
from .._compat import function_mode_count as _function_mode_count
from .._errors import (
    CLONE_FIRST,
    RecomputeMismatchError,
    RematError,
    _StopRecompute,
    modified_in_place,
)
from .._tensors import CONSTANT_TYPES, describe_tensor, storage_ptr, storage_root
from .context import (
    FORWARD,
    _tls,
    current_prefixes,
    note_exception,
    profiler_range,
)
from .module_state import ContextVarUnset, ModuleState, entry_known, local_changed, local_watch
from .module_state import restore as restore_module_state
from .observers import observers_for_new_checkpoint
from .rebuild import Rebuilds, RebuiltSave, describe_rebuilt
from .records import (
    ARGUMENT,
    INPUT,
    OUTPUT,
    ArgumentOutput,
    Constant,
    Holder,
    Recreated,
    RegionRecord,
    RegionSaved,
    SourceIndex,
    TensorSource,
    describe_region,
    detached_copy,
    qualified_name,
    refuse_recompute_inside_save,
    region_leaves,
    release_traceback,
    unpack_unread,
)
from .replay import ReplayPass, replay_unpack
from .rng import (
    DeviceRNGStateHook,
    RNGUse,
    check_position,
    drawn_iterator,
    fingerprints,
    generator_states,
    holds_arrays,
    host_rng_state,
    position,
    restore_generator_states,
    restore_host_rng_state,
    same_state,
)
from .saved_hooks import KeptTensorHooks, next_call_serial, remat_machinery, torch_hooks_around

_grad_enabled = torch.is_grad_enabled
_default_dtype = torch.get_default_dtype

if TYPE_CHECKING:
    from .api import CheckpointedFunction

tree_flatten = _compat.tree_flatten
tree_unflatten = _compat.tree_unflatten
_NO_RANGE = contextlib.nullcontext()  # reusable: it holds no state (also "no autocast change")
_NO_STATES: list[Any] = []  # the snapshots of a checkpoint without state hooks (never written)



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


# the device types autocast has a dispatch key for: where a replay whose forward ran
# with autocast off everywhere turns it off (see CheckpointFrame._autocast_context)
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "hpu", "mps", "xla", "privateuseone", "mtia", "maia", "ipu")


def autocast_state(leaves: Sequence[Any]) -> list[tuple[str, bool, torch.dtype]] | None:
    """Autocast settings of every device the arguments live on (and CPU, CUDA);
    None when autocast is off on every device (one call, the common case)."""
    if not _compat.any_autocast_enabled():
        return None
    return [
        (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        for dev in _autocast_devices(leaves)
    ]


class ForwardScratch:
    """What the forward of one checkpoint call needs only while it runs: the region
    stack, the tensors producer responsibility tracks, the state last snapshotted.
    ``CheckpointFrame.scratch`` holds it from the call until the forward ends (or
    raises); the record the replays and the reports read is the frame itself."""

    __slots__ = (
        "region_stack", "save_depth", "region_names", "sources", "walk_roots",
        "save_output_seqs", "last_states", "host_last", "start_seq", "rng_start",
        "rng_entry", "outer_hooks", "kept_hooks", "output_sources", "unsummed",
        "last_needed_seq", "nested_tag", "entry_known",
    )

    def __init__(self) -> None:
        self.region_stack: list[RegionRecord] = []
        self.save_depth = 0
        self.region_names: set[str] = set()
        self.sources = SourceIndex()  # checkpoint inputs and SAVE outputs, by storage
        # where replayed code starts reading, besides the checkpoint's outputs
        self.walk_roots: list[Any] = []
        # sequence numbers of the SAVE outputs' autograd nodes (not the nodes: a SAVE
        # output that dies inside the forward frees its region's saves at once)
        self.save_output_seqs: set[int] = set()
        self.last_states: list[Any] = []  # the state hooks' last snapshots
        self.host_last: tuple[Any, ...] | None = None  # Python's/NumPy's RNG, last read
        self.start_seq = 0  # autograd's sequence number at entry
        self.rng_start: list[Any] | None = None  # generator fingerprints at entry
        self.rng_entry: list[Any] | None = None  # hooked generators' positions at entry
        self.outer_hooks: Any = None  # the user's torch hooks around the checkpoint
        # saved-tensor hooks for what this call keeps, resolved in run_forward
        self.kept_hooks: KeptTensorHooks | None = None
        self.output_sources: list[TensorSource] = []  # SAVE outputs it tracks
        # determinism_check="bitwise": (holder index, tensor, autograd sequence number)
        # of saves without history, summed once their op has run (see frame.pack)
        self.unsummed: list[tuple[int, torch.Tensor, int]] = []
        # the autograd sequence number at the last save outside SAVE regions that a
        # replay must recreate (Rebuilds.settle: where early stop would end it)
        self.last_needed_seq = 0
        # what a checkpoint nested in this one is handing to this one's pack hook
        # (see set_nested_tag): noted with each save (holder_meta), so that a replay
        # whose nested checkpoints keep other tensors than in the forward is refused
        # rather than misaligned
        self.nested_tag: tuple | None = None
        # the ids of what the module state recorded at entry (module_state.entry_known),
        # built at the first SAVE region whose body may hold locals
        self.entry_known: set[int] | None = None


class CheckpointFrame:
    """State of one checkpointed call, from its forward until its graph dies."""

    def __init__(self, fn: Callable[..., Any], checkpointed: CheckpointedFunction) -> None:
        options = checkpointed.options
        self.fn = fn
        self.name = checkpointed.name
        self.checkpointed = checkpointed  # options and memos shared by its calls
        self.state_hooks = options.state_hooks
        self.early_stop = options.early_stop
        self.check_metadata = options.check_metadata
        self.bitwise_check = options.bitwise_check
        # What the forward needs only while it runs; None once it has ended.
        self.scratch: ForwardScratch | None = ForwardScratch()
        # Everything below is the record the replays and the reports read.
        self.holders: list[weakref.ref] = []
        self.holder_meta: list[tuple] = []
        self.holder_checksums: list[Any] = []
        self.regions: list[RegionRecord] = []
        self.replay_regions: list[RegionRecord] = []
        # indices of the hooks that replay a default generator: their position is
        # checked in the replay (rng.check_position) at each top-level SAVE region
        # call, where the replay stops early, and where the forward ended
        self.rng_checks = (
            [i for i, h in enumerate(self.state_hooks) if isinstance(h, DeviceRNGStateHook)]
            if self.state_hooks else None
        )
        self.rng_end: list[Any] | None = None
        self.inputs: list[TensorSource] = []
        self.leaves: list[Any] = []
        self.spec = None
        self.entry_states: list[Any] = []
        # (device, enabled, dtype) per device; None: off on every device
        self.autocast: list[tuple[str, bool, torch.dtype]] | None = None
        self.autocast_cache = True
        # torch's process-wide switches (_compat.TORCH_SETTINGS: default dtype, matmul
        # precision, attention backends...) and the TorchFunctionModes active when the
        # forward started: the replay runs under the same
        self.torch_settings: tuple[Any, ...] | None = ()
        # what torch.get_float32_matmul_precision reports then (None: refused), set
        # back with them where the replay's code switched one (_SettingsBack)
        self.matmul_precision: str | None = None
        self.function_modes: tuple[Any, ...] = ()
        # how many TorchDispatchModes were active when the forward started (a replay
        # under another count may take composite ops' other variants: ReplayPass.pack)
        self.dispatch_modes = 0
        # whether the forward ran inside a forward-mode AD dual level (for messages)
        self.dual_level = False
        # parametrize.cached()'s entries when the forward ran under it (None: off)
        self.parametrize_cache: dict | None = None
        # (index, meta, payload, held_anyway) of the inputs packed at entry that the
        # replay does not read (records.unpack_unread); None when nothing was packed
        # at entry
        self.unread_inputs: list | None = None
        self.call = next_call_serial()
        self.name_prefixes = current_prefixes()  # remat.name_scope; the replay reuses them
        self.forward_done = False
        # backward (graph_task_key) -> what its replay recreated and it has not
        # unpacked yet; dropped when that backward ends
        self.recreated: dict[Any, Recreated] = {}
        self.arg_aliases: list[tuple[int, int]] = []  # (i, j): argument i is argument j
        self.module_state: ModuleState | None = None
        # replay_regions index of a SAVE region -> copies of the buffers it updated
        self.region_buffers: dict[int, list[Any]] = {}
        # Python's random and NumPy's generator (rng.host_rng_state) at entry, kept
        # only if the forward drew
        self.host_entry: tuple[Any, ...] | None = None
        # generator objects the module state holds (ModuleState.generators):
        # their states are part of host_state()
        self.generators: tuple[Any, ...] = ()
        # an iterator among them the forward drew from (next(self.rates)): it cannot
        # be set back, so the replay is refused
        self.drawn_iterator: Any = None
        self.rng_use: RNGUse | None = None
        self.rebuilds = Rebuilds(options.rebuild, checkpointed.flop_memo)  # saves the replay refills
        self.observers = observers_for_new_checkpoint(_tls.recompute_depth > 0)
        for observer in self.observers.created:
            observer.checkpoint_created(self)

    # ------------------------------------------------------ the active-pass protocol

    phase = FORWARD

    @property
    def frame(self) -> CheckpointFrame:
        return self

    @property
    def in_save_region(self) -> bool:
        scratch = self.scratch
        return scratch is not None and scratch.save_depth > 0

    @property
    def region_stack(self) -> list[RegionRecord]:
        """The regions the forward is in, outermost first (none once it has ended)."""
        scratch = self.scratch
        return scratch.region_stack if scratch is not None else []

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
                self.scratch.sources.add(x, src)
        self.entry_states = self.scratch.last_states = [h.snapshot() for h in self.state_hooks]
        # where the generators the stock hooks restore stand at entry (the RNG guard
        # does not watch them): the replay's positions are checked only if they moved
        self.scratch.rng_entry = position(self.state_hooks, self.rng_checks) if self.rng_checks else None
        self.autocast = autocast_state(leaves)
        self.autocast_cache = torch.is_autocast_cache_enabled()
        try:
            self.torch_settings = tuple(map(_call, _SETTING_GETTERS))
        except Exception:  # a getter this torch refuses in some state: not replayed
            self.torch_settings = None
        self.matmul_precision = _compat.legacy_matmul_precision()
        self.function_modes = _compat.function_modes() if _function_mode_count() else ()
        self.dispatch_modes = _compat.dispatch_mode_count()
        self.dual_level = _compat.forward_ad_level() >= 0
        self.parametrize_cache = _compat.parametrize_cache()
        around = top_hooks(False)
        if around is not None and _compat.is_torch_checkpoint_hooks(around):
            raise RematError(
                f"torch_remat: remat.checkpoint '{self.name}' runs inside torch.utils.checkpoint, "
                "so the same code is checkpointed twice (run three times per step). This "
                "happens when torch's apply_activation_checkpointing (or a framework calling "
                "it, e.g. torchtune's set_activation_checkpointing or a trainer's own "
                "activation checkpointing) is applied after apply_remat. Apply only one: "
                "turn the framework's activation checkpointing off, or do not apply remat."
            )
        self.scratch.outer_hooks = torch_hooks_around(around)
        self.scratch.kept_hooks = KeptTensorHooks(
            self.name, self.call, *self.checkpointed.options.kept_hooks, self.scratch.outer_hooks
        )
        kept_hooks = self.scratch.kept_hooks
        if kept_hooks.inputs is not None or (
            self.scratch.outer_hooks is not None and not kept_hooks.nested and not remat_machinery(self.scratch.outer_hooks)
        ):
            # under saved-tensor hooks every input is packed now (records.pack_at_entry)
            for src in self.inputs:
                src.pack_at_entry(kept_hooks.inputs)
            self.unread_inputs = []
        self.scratch.start_seq = _compat.autograd_sequence_nr()
        checkpointed = self.checkpointed
        self.module_state = ModuleState.capture(
            self.fn, checkpointed.unwritten_buffers, leaves, checkpointed.capture_memo
        )
        self.scratch.rng_start = fingerprints(self.checkpointed.options.guarded_generators)
        if self.module_state is not None:
            self.generators = self.module_state.generators
        self.host_entry = self.scratch.host_last = self.host_state()
        try:
            push_hooks(self, unpack_packed)
        except RuntimeError as e:
            raise RematError(
                f"torch_remat: remat.checkpoint '{self.name}' needs saved-tensor hooks, "
                "but they are disabled here (torch.autograd.graph."
                f"disable_saved_tensors_hooks) with the message: {e}. Call the function "
                "without remat.checkpoint in this context, or leave that context first."
            ) from e
        tls = _tls
        tls.stack.append(self)
        observers = self.observers.forward
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
        scratch = self.scratch
        for source in self.inputs + (scratch.output_sources if scratch else []):
            source.release()  # (also listed by RegionRecords)
        self.scratch = None
        self.inputs = []
        self.rebuilds.abandon()
        self.leaves = []
        self.module_state = self.host_entry = None

    def pack(self, t: torch.Tensor) -> Any:
        """The pack hook of the forward (the frame itself is pushed, see ``__call__``)."""
        scratch = self.scratch
        if scratch.save_depth:
            return self._pack_in_save_region(t)
        holders = self.holders
        holder = Holder(self, len(holders))
        # A tensor the checkpoint keeps anyway fills its holder now, unless the
        # user's own hooks (offloading) were active around the checkpoint: then the
        # kept copy lives where those hooks put it, and the replay refills the holder.
        sources = scratch.sources.lookup(t)
        if sources is not None:
            for s in sources:
                s.mark_kept(t)
            # Kept tensors packed by hooks live where the hooks put them.
            if scratch.outer_hooks is None and not any(s.hooks or s.saved is not None for s in sources):
                holder.keep_value(t.detach())
        if holder.kept is None:
            # where early stop would end a replay without rebuilds (Rebuilds.settle)
            scratch.last_needed_seq = autograd_sequence_nr()
        holders.append(weakref.ref(holder))
        stack = scratch.region_stack
        self.holder_meta.append(
            (t.shape, t.dtype, t.device, stack[-1].qualname if stack else None, version_of(t), scratch.nested_tag)
        )
        if self.bitwise_check:
            from .replay import (  # looked up at the call: tests count its calls
                checksum,
                opaque_workspace,
            )

            seq = _compat.autograd_sequence_nr()
            if scratch.unsummed and scratch.unsummed[-1][2] != seq:
                self._sum_saved()
            if opaque_workspace(t):
                self.holder_checksums.append(None)
            elif t.is_leaf:  # (no autograd history)
                # maybe an argument its op fills after saving it (rrelu's noise):
                # summed when the next op saves, or when the forward ends
                self.holder_checksums.append(None)
                scratch.unsummed.append((len(self.holder_checksums) - 1, t, seq))
            else:
                self.holder_checksums.append(checksum(t))
        return holder

    def _sum_saved(self) -> None:
        from .replay import checksum

        for index, t, _ in self.scratch.unsummed:
            self.holder_checksums[index] = checksum(t)
        self.scratch.unsummed.clear()

    # The frame is its own pack hook, so that the hook can carry per-call attributes
    # (a bound method cannot): for torch's checkpoint, the user's hooks under it are
    # those around the checkpoint, the ones that pack what it keeps (outer_hooks).
    __call__ = pack

    def _pack_in_save_region(self, t: torch.Tensor) -> RegionSaved | RebuiltSave:
        rebuild = self.rebuilds.running
        if rebuild is not None:
            # (a view of) an argument the replay recomputes, not modified since the call
            root = storage_root(t)
            for arg in rebuild.args:
                if arg.root is root and t.dtype is arg.layout[3] and version_of(t) == arg.version:
                    a = arg.tensor
                    if t.dtype.is_complex and (t.is_conj() is not a.is_conj() or t.is_neg() is not a.is_neg()):
                        break  # a conjugate/negative view: refilled as a view it would lose the bit
                    saved = RebuiltSave(self, arg, self.scratch.region_stack[-1], t)
                    arg.saves.append(weakref.ref(saved))
                    return saved
        scratch = self.scratch
        region = scratch.region_stack[-1]
        name = f"saved.{len(region.saved)}"
        kept_hooks = scratch.kept_hooks
        if kept_hooks.nested:  # packed by the outer checkpoint's pass
            outer = scratch.outer_hooks[0]
            set_nested_tag(outer, (self.name, "saved", region.qualname, name))
            try:
                saved = RegionSaved(region, name, t, scratch.outer_hooks, self.unread_inputs)
            finally:
                set_nested_tag(outer, None)
        else:
            hooks = kept_hooks.region_save(region.qualname, t) or scratch.outer_hooks
            saved = RegionSaved(region, name, t, hooks, self.unread_inputs)
        region.add_saved(saved)
        for observer in self.observers.kept:
            observer.tensor_kept(self, saved, t)
        return saved

    def run_region(self, fn: Callable[..., Any], name: str, recompute: bool, args, kwargs) -> Any:
        scratch = self.scratch
        qualname = qualified_name(scratch.region_stack, name)
        if qualname in scratch.region_names:
            raise ValueError(
                f"torch_remat: region name '{qualname}' is used twice in one forward of "
                f"checkpoint '{self.name}'. Region names identify regions between the "
                "forward and the recompute; give each call its own name (for example "
                "f'expert.{i}' inside a loop)."
            )
        in_save = scratch.save_depth > 0
        if in_save and recompute:
            raise refuse_recompute_inside_save(qualname, scratch.region_stack[-1].qualname)
        scratch.region_names.add(qualname)
        record = RegionRecord(self.name, name, qualname, recompute)
        self.regions.append(record)
        if not in_save:
            self.replay_regions.append(record)
        leaves = region_leaves(args, kwargs)
        if scratch.sources.by_root:
            self._consume_region_args(leaves, recompute and not in_save, not in_save)
        stack = _tls.stack
        if len(stack) > 1:
            for outer in stack[:-1]:
                # A checkpoint nested in the replayed code of an outer one is re-run
                # whole (SAVE bodies included) by the outer replay: for the outer
                # frame, this region reads its arguments in replayed code.
                if outer.phase == FORWARD and not outer.in_save_region and outer.scratch.sources:
                    outer._consume_region_args(leaves, True, False)
        observers = self.observers
        if not observers.regions:
            return self._run_region_body(fn, record, in_save, args, kwargs, leaves)
        for observer in observers.entered:
            observer.region_entered(self, record)
        try:
            out = self._run_region_body(fn, record, in_save, args, kwargs, leaves)
        finally:
            for observer in observers.exited:
                observer.region_exited(self, record)
        return out

    def _run_region_body(self, fn, record: RegionRecord, in_save: bool, args, kwargs, leaves) -> Any:
        scratch = self.scratch
        recompute = record.recompute
        top_save = not recompute and not in_save
        # A top-level SAVE region's body is skipped by the replay, which then writes
        # what it changed: the tensor arguments it wrote in place (their versions
        # now) and the buffers it updated (ModuleState.buffers_now).
        if top_save:
            versions = [(i, t, any_version(t)) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
            module_state = self.module_state
            buffers = module_state.buffers_now() if module_state is not None and module_state.buffer_groups else None
            contents = module_state.containers_now() if module_state is not None and module_state.containers else None
            if module_state is not None:
                # what the code before the body rebound is replayed: the look where
                # the body returns compares with the attributes as the body found them
                # (a body that sets back a value the code before it changed)
                module_state.attributes_rebound()
            modes = (_grad_enabled(), _default_dtype())
            hooks_from = RemovableHandle.next_id  # (the ids of hooks the body registers)
            # the body's closure and arguments, which may hold this forward's own
            # Python state: changed there, the replay runs the body again
            passed = [*args, *kwargs.values()] if kwargs else args
            local = None
            # (not while Dynamo traces this eager path: it cannot trace the look)
            if _may_hold_locals(fn, passed) and not torch.compiler.is_compiling():
                if scratch.entry_known is None:
                    scratch.entry_known = entry_known(module_state)
                local = local_watch(fn, passed, scratch.entry_known)
        written: list[tuple[int, torch.Tensor]] = []
        scratch.region_stack.append(record)
        rebuild = None
        if not recompute:
            scratch.save_depth += 1
            if not in_save:
                if self.rng_checks:
                    record.entered(position(self.state_hooks, self.rng_checks))
                rebuild = self.rebuilds.open(self, record.qualname, leaves)
        ok = False
        try:
            if profiler_enabled():
                with torch.profiler.record_function(f"remat.region:{self.name}::{record.qualname}"):
                    out = fn(*args, **kwargs)
            else:
                out = fn(*args, **kwargs)
            if top_save:
                if buffers:
                    updated = module_state.updated_in_region(buffers)
                    if updated:
                        self.region_buffers[len(self.replay_regions) - 1] = updated
                # (position, tensor) of the arguments written in place
                # (nn.ReLU(inplace=True), a Function that marks its input dirty)
                written = [(i, t) for i, t, version in versions if any_version(t) != version]
                _note_modes_left(record, modes)
                if local is not None and local_changed(local):
                    record.replay_body()
            ok = True
        except Exception as e:
            note_exception(e)
            if top_save:
                _note_modes_left(record, modes)  # (as where it returns: the caller goes on so)
                # The replay skips this body, so it re-raises the same error for
                # code that catches it and falls back to another path.
                self._region_returned(record, contents, hooks_from, raised=detached_copy(e))
            raise
        finally:
            scratch.region_stack.pop()
            if not recompute:
                scratch.save_depth -= 1
            if rebuild is not None:
                self.rebuilds.close(self, rebuild, ok)
        if top_save:
            self._record_region_outputs(record, out, leaves, written)
            if written:
                self._record_written_arguments(record, written)
            self._region_returned(record, contents, hooks_from)
        return out

    def _region_returned(
        self, record: RegionRecord, contents: list[Any] | None, hooks_from: int,
        raised: BaseException | None = None,
    ) -> None:
        """A top-level SAVE region's body returned (or raised ``raised``): note on
        ``record`` what the replay sets where it skips the body. The state hooks'
        snapshots; Python's random, NumPy's generator and the held generators if they
        moved since the last look (in the body or before it: the replay sets the
        state the forward had here, whatever the body drew); the module attributes,
        module-level variables and closure values the body rebound (the look
        before it took them as the body found them), and
        what the body changed in the containers (``contents``: theirs at its start)."""
        # (one call per region: this runs at every SAVE region's return)
        states = self._snapshot_after_region() if self.state_hooks else _NO_STATES
        scratch = self.scratch
        host = host_rng_state() if not self.generators else self.host_state()
        if host == scratch.host_last:
            host = None
        else:
            scratch.host_last = host
        module_state = self.module_state
        attributes = module_state.attributes_rebound() if module_state is not None else None
        if contents is not None:
            changed = module_state.containers_changed(contents)
            if changed:
                attributes = (attributes or []) + changed
        if RemovableHandle.next_id != hooks_from and module_state is not None:
            # module hooks the body registered (on a later module, once): there
            # after it in the replay too
            added = module_state.hooks_added_since(hooks_from)
            if added:
                attributes = (attributes or []) + added
        record.returned(states, host, attributes, raised)

    def host_state(self) -> tuple[Any, ...]:
        """Python's random, NumPy's generator and the torch.Generator objects the
        module state holds, now: compare two with ``==``."""
        state = host_rng_state()
        return (state, generator_states(self.generators)) if self.generators else state

    def set_host_state(self, state: tuple[Any, ...]) -> None:
        """Make ``state`` (from :meth:`host_state`) current again."""
        if self.generators:
            restore_host_rng_state(state[0])
            restore_generator_states(self.generators, state[1])
        else:
            restore_host_rng_state(state)

    def _snapshot_after_region(self) -> list[Any]:
        # A state that did not change since the last snapshot (no random numbers
        # drawn in between) is shared rather than stored again: a CPU generator
        # state is 5 KB per snapshot. (Called only with state hooks.)
        states = []
        for hook, previous in zip(self.state_hooks, self.scratch.last_states):
            state = hook.snapshot()
            states.append(previous if same_state(previous, state) else state)
        self.scratch.last_states = states
        return states

    def keep(self, t: torch.Tensor) -> bool:
        """``recompute_needs_tensor`` during the forward. False if ``t`` is unknown."""
        sources = self.scratch.sources.lookup(t) if self.scratch.sources.by_root else None
        if sources is None:
            if self.scratch.save_depth:
                # recorded on the outermost SAVE region of the stack: the one whose
                # outputs the replay reads (a nested one's never reach it)
                for record in self.scratch.region_stack:
                    if not record.recompute:
                        record.needs_kept(storage_root(t))
                        break
                return True
            return False
        for s in sources:
            s.mark_kept(t)
        return True

    def _finish(self, out: Any) -> None:
        scratch = self.scratch
        if scratch.unsummed:
            self._sum_saved()
        for record in self.replay_regions:
            release_traceback(record.raised)
        self.rng_use = RNGUse.of_forward(scratch.rng_start)
        host_now = self.host_state()
        if self.generators:
            self.drawn_iterator = drawn_iterator(self.generators, self.host_entry[1], host_now[1])
        if (
            scratch.host_last == self.host_entry and host_now == self.host_entry
            and not (self.generators and holds_arrays(self.generators))
        ):
            # nothing drawn from Python's, NumPy's or a held generator (an array the
            # code holds is set around the replay whether or not the forward changed it)
            self.host_entry = None
        if self.rng_checks:
            end = position(self.state_hooks, self.rng_checks)
            if end == scratch.rng_entry:
                self.rng_checks = None  # nothing drew from the hooked generators: nothing to check
            else:
                self.rng_end = end
        if self.module_state is not None:
            self.module_state.finish(self.name, self.checkpointed.unwritten_buffers)
        updated = [s for s in scratch.output_sources if s.updated_after_return()]
        if updated:
            self._replay_bodies_of(updated)
        candidates = []
        for s in self.inputs:
            if not s.keep:
                if s.save_consumed and s.ref.requires_grad:
                    candidates.append(s)
                else:
                    s.mark_needed()
        if candidates:
            mark_inputs_read_by_replayed_code(
                out, candidates, scratch.save_output_seqs, scratch.start_seq, scratch.walk_roots
            )
        self.rebuilds.settle(self, out)
        if not self.rebuilds.by_pos and all(r() is None or r().kept is not None for r in self.holders):
            # Backward never replays this checkpoint: no input is read again (one
            # modified in place stays, so that storing it reports the modification).
            for s in self.inputs:
                s.keep_if_modified()
        unread = self.unread_inputs
        outer = scratch.outer_hooks[0] if scratch.kept_hooks.nested else None
        try:
            for s in self.inputs:
                if unread is not None and not s.keep:
                    unread.append((s.index, s.meta, s.saved, s.held_anyway))
                    s.drop_saved()
                if outer is not None:
                    set_nested_tag(outer, (self.name, s.kind, s.region, s.index))
                s.store(self.name)
            for s in scratch.output_sources:
                if outer is not None:
                    set_nested_tag(outer, (self.name, s.kind, s.region, s.index))
                s.store(self.name)
        finally:
            if outer is not None:
                set_nested_tag(outer, None)
        self.scratch = None
        self.leaves = [None if isinstance(x, torch.Tensor) else x for x in self.leaves]
        self.forward_done = True

    def _replay_bodies_of(self, updated: list[TensorSource]) -> None:
        """SAVE outputs the forward's code updated in place after their regions
        returned (Falcon's ``mlp_output += attention_output``): what the regions
        returned is gone, so the replay runs their bodies again rather than hand
        back the updated tensors (which it would update a second time). Nothing is
        kept of those outputs, and the checkpoint's inputs a SAVE region read are
        kept, as the bodies read them again."""
        region_of = {
            id(o): record for record in self.replay_regions for o in record.outputs
            if type(o) is TensorSource
        }
        storages = set()
        for s in updated:
            storages.add(storage_ptr(s.kept_tensor if s.kept_tensor is not None else s.ref()))
            s.not_kept()
            region_of[id(s)].replay_body()
        # an op after the region saved the output (relu_ its result): the replay
        # makes it again, held for backward it would be memory no report counts
        for ref in self.holders:
            holder = ref()
            if holder is not None and holder.kept is not None and storage_ptr(holder.kept.data) in storages:
                holder.drop_kept()
        for s in self.inputs:
            if s.save_consumed and not s.keep:
                s.mark_kept(s.ref)

    # ----------------------------------------------------------------- backward


    def unpack_holder(self, holder: Holder) -> torch.Tensor:
        kept = holder.kept
        if kept is not None:
            if self.unread_inputs:  # (take_refill drains them for the others)
                unpack_unread(self.unread_inputs)
            t = kept.data
            if version_of(t) != kept.version:
                raise self._modified_error(holder.index, kept.version, version_of(t))
            return t
        return self.take_refill(holder)

    def take_refill(self, holder: Holder | RebuiltSave) -> torch.Tensor:
        """The tensor the replay recreated for this backward, replaying first."""
        if self.unread_inputs:  # (a rebuilt save's unpack comes here directly)
            unpack_unread(self.unread_inputs)
        key = graph_task_key()
        slot = holder.index if type(holder) is Holder else holder.slot
        store = self.recreated.get(key)
        if store is None:
            store = self.replay(key)
        try:
            t, version = store.take(slot)
        except KeyError:
            raise RematError(
                f"torch_remat: a tensor saved inside checkpoint '{self.name}' was "
                "unpacked twice in the same backward. If a custom autograd Function "
                "reads ctx.saved_tensors more than once, read it once and reuse it."
            ) from None
        if type(key) is object:
            self.forget(key)  # unpacked outside a backward: nothing else will use them
        if version_of(t) != version:
            if type(holder) is Holder:
                raise self._modified_error(holder.index, version, version_of(t))
            raise modified_in_place(describe_rebuilt(holder), "after it was saved", CLONE_FIRST,
                                    (version, version_of(t)))
        return t

    def forget(self, key: Any) -> None:
        """Drop what the replay recreated for the backward ``key`` and it did not
        unpack (a backward that reached only part of the graph, e.g.
        ``autograd.grad(..., inputs=...)`` with ``retain_graph=True``)."""
        self.recreated.pop(key, None)

    def _modified_error(self, index: int, old: int, new: int) -> RematError:
        return modified_in_place(
            self.describe_holder(index), "after it was saved", CLONE_FIRST, (old, new)
        )

    def describe_holder(self, index: int) -> str:
        """``tensor #3 saved for backward by region 'attn' of checkpoint 'layers.0'
        (shape (2, 4), float32)``."""
        shape, dtype, _, region, _, _ = self.holder_meta[index]
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
        """The forward's autocast settings where they differ from the current ones."""
        if self.autocast is None:  # off everywhere in the forward
            if not _compat.any_autocast_enabled():
                return _NO_RANGE
            stack = contextlib.ExitStack()
            for dev in _AUTOCAST_DEVICES:
                try:
                    on = torch.is_autocast_enabled(dev)
                except RuntimeError:  # a device type this build does not know
                    continue
                if on:
                    stack.enter_context(torch.autocast(dev, enabled=False))
            return stack
        changed = [
            (dev, enabled, dtype)
            for dev, enabled, dtype in self.autocast
            if torch.is_autocast_enabled(dev) != enabled
            or (enabled and torch.get_autocast_dtype(dev) != dtype)
        ]
        if not changed:
            return _NO_RANGE
        stack = contextlib.ExitStack()
        for dev, enabled, dtype in changed:
            stack.enter_context(
                torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache)
            )
        return stack

    def path_advice(self) -> str:
        """The end of a message saying that the replay took another path."""
        if self.dual_level:
            return (
                " Its forward ran inside a forward-mode AD dual level "
                "(torch.autograd.forward_ad): on dual tensors ops save more for backward "
                "(their tangents' graph), and the replay runs on the primal values only. "
                "Take forward-mode and reverse-mode gradients of a checkpointed function "
                "in separate calls, or call it without remat.checkpoint inside the dual level."
            )
        return " The replay must take the same path as the forward."

    def _settings_context(self) -> contextlib.AbstractContextManager:
        """The forward's torch settings and function modes where they differ from the
        current ones (``torch.set_default_dtype`` or a ``torch.device`` block around
        the forward only, a matmul precision changed since)."""
        settings = self.torch_settings
        try:
            same = settings is None or tuple(map(_call, _SETTING_GETTERS)) == settings
        except Exception:  # (see run_forward)
            same = True
            settings = None
        if same and not (self.function_modes or _function_mode_count()):
            return _NO_RANGE
        return _compat.torch_settings_as(None if same else settings, self.function_modes)

    def replay(self, key: Any) -> Recreated:
        """Replay the function for the backward ``key``: returns the store of what it
        recreated, which the frame holds until that backward ends.

        The replay runs in a copy of the caller's context: the context variables it
        sets (the forward's values where it skips a SAVE region, a ``var.set`` of the
        replayed code) are never seen by the caller, whose context ends the backward
        as it was."""
        context = contextvars.copy_context()
        unset: set[contextvars.ContextVar] = set()
        while True:
            try:
                return context.run(self._replay, key)
            except ContextVarUnset as e:
                # a variable the forward ran without, set since: the replay runs in
                # a context holding the caller's values of all the others
                if not e.installing or e.var in unset:
                    raise RecomputeMismatchError(*e.args).with_traceback(e.__traceback__) from None
                unset.add(e.var)
                context = contextvars.Context()
                for var, value in contextvars.copy_context().items():
                    if var not in unset:
                        context.run(var.set, value)

    def _replay(self, key: Any) -> Recreated:
        if not self.forward_done:
            raise RematError(
                f"torch_remat: backward reached tensors saved inside checkpoint "
                f"'{self.name}' while its forward was still running (autograd.grad or "
                "backward called inside the checkpointed function). This is not "
                "supported; compute such gradients outside remat.checkpoint."
            )
        if self.drawn_iterator is not None:
            raise RecomputeMismatchError(
                f"torch_remat: the forward of checkpoint '{self.name}' drew from a "
                f"{type(self.drawn_iterator).__name__} iterator the checkpointed code holds "
                "(a generator or an itertools schedule: next(self.rates)). An iterator "
                "cannot be set back, so the recompute would draw the next values, not "
                "those the forward read, and advance it twice per step. Draw outside the "
                "checkpointed function and pass the value in, or keep the drawn value in "
                "a module attribute."
            )
        store = Recreated()
        needed = 0
        for ref in self.holders:
            h = ref()
            if h is not None and h.kept is None:
                needed += 1
        if self.rebuilds.by_pos:
            needed += self.rebuilds.count_to_refill(store)
        replay = ReplayPass(self, store, needed)
        args, kwargs = self.replay_args()
        hooks = self.state_hooks
        rng = self.rng_use
        caller_rng = rng.caller_states() if rng is not None else []
        caller_states = [h.snapshot() for h in hooks]
        # (the caller's host state read before the hooks set theirs: a hook may set
        # Python's random or a held array too)
        host_caller = self.host_state() if self.host_entry is not None else None
        for h, s in zip(hooks, self.entry_states):
            h.restore(s)
        if host_caller is not None:  # the forward drew from Python's random or NumPy's
            self.set_host_state(self.host_entry)
        unrestored = rng.unrestored() if rng is not None else []
        module_undo = []
        state = self.module_state
        if state is not None and (not state.functions_only or not all(
            # (a plain function reading no state: installed only where the caller
            # gave one of its functions another body or defaults since)
            f.__code__ is code and f.__defaults__ is defaults and f.__kwdefaults__ is kwdefaults
            for f, (code, defaults, kwdefaults, _) in state.function_parts
        )):
            try:
                module_undo = state.install(self.name)
                replay.restore_modules_with(module_undo)
            except BaseException:
                for h, s in zip(hooks, caller_states):
                    h.restore(s)
                if host_caller is not None:
                    self.set_host_state(host_caller)
                raise
        rng_error = None
        tls = _tls
        tls.stack.append(replay)
        tls.recompute_depth += 1
        caller_prefixes, tls.prefixes = tls.prefixes, self.name_prefixes  # remat.name_scope
        observers = self.observers.replay
        for observer in observers:
            observer.replay_started(self)
        caller_dtype = _default_dtype()  # (before the settings context sets the forward's)
        settings_context = self._settings_context()
        try:
            push_hooks(replay, replay_unpack)
            try:
                with torch.enable_grad(), self._autocast_context(), settings_context, (
                    torch.profiler.record_function(f"remat.recompute:{self.name}")
                    if profiler_enabled() else _NO_RANGE
                ), (
                    _compat.parametrize_cache_as(self.parametrize_cache)
                    if self.parametrize_cache is not None else _NO_RANGE
                ):
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
            if replay.unchecked:
                replay.check_saved()
        finally:
            tls.stack.pop()
            tls.recompute_depth -= 1
            tls.prefixes = caller_prefixes
            if module_undo:
                restore_module_state(module_undo)
            if replay.set_dtype:  # a skipped region set the one its body left
                torch.set_default_dtype(caller_dtype)
            if settings_context is _NO_RANGE and self.torch_settings:
                # the replay ran under the caller's settings (the forward's): its
                # code may have switched one and stopped early, before the
                # forward's own code switched it back
                for (get, _), value in zip(_TORCH_SETTINGS, self.torch_settings):
                    if get() != value:
                        _compat.set_torch_settings(self.torch_settings, self.matmul_precision)
                        break
            for record in self.replay_regions:
                release_traceback(record.raised)
            for h, s in zip(hooks, caller_states):
                h.restore(s)
            if host_caller is not None:
                self.set_host_state(host_caller)
            if rng is not None:
                rng_error = rng.finish(self.name, unrestored, caller_rng)
            for observer in observers:
                observer.replay_ended(self)
        if rng_error is not None:
            raise rng_error
        if replay.filled < needed:
            raise RecomputeMismatchError(
                f"torch_remat: the recompute of checkpoint '{self.name}' saved "
                f"{replay.counter} tensors for backward, but its forward saved "
                f"{len(self.holders)} outside SAVE regions, so {needed - replay.filled} "
                "needed tensor(s) were never recreated. "
                + replay.region_sequences()
                + self.path_advice()
            )
        # Tensors the replay saved for backward keep its pack hook, and so the pass,
        # alive as long as their graph; a graph the backward never reaches (a
        # key/value cache the replay appended to) would keep the frame and through
        # its arguments that graph itself, a cycle through autograd that Python's
        # collector cannot see.
        replay.release()
        self.recreated[key] = store
        if type(key) is not object:
            when_backward_ends(key, functools.partial(_forget, weakref.ref(self), key))
        return store

    # ------------------------------------------- a SAVE region's arguments and outputs

    def _consume_region_args(self, leaves: Sequence[Any], by_replayed_code: bool, replay_level: bool) -> None:
        """A region call's tensor arguments (``leaves``: :func:`region_leaves`), as
        producer responsibility sees them: SAVE outputs it reads are kept; checkpoint
        inputs are kept when replayed code reads them, else marked as consumed by a SAVE
        region (the input walk decides)."""
        for x in leaves:
            if isinstance(x, torch.Tensor):
                sources = self.scratch.sources.lookup(x)
                if sources is None:
                    # Computed by replayed code and handed to a region: where the
                    # input walk starts too, besides the checkpoint's outputs.
                    if replay_level and x.grad_fn is not None:
                        self.scratch.walk_roots.append(x.grad_fn)
                    continue
                for s in sources:
                    if s.kind != INPUT or by_replayed_code:
                        s.mark_kept(x)
                    else:
                        s.consumed_by_save()


    def _record_region_outputs(
        self, record: RegionRecord, out: Any, arguments: Sequence[Any], written: Sequence[tuple[int, Any]]
    ) -> None:
        """A top-level SAVE region returned: observe each output tensor as a source the
        replay may need (kept later if producer responsibility says so); an output
        that is one of its ``arguments`` itself, not ``written`` by it, is handed back
        as that argument."""
        leaves, spec = flatten_region_outputs(out, record.qualname, self.name)
        pending = record.take_pending_keep() if record.pending_keep else None
        scratch = self.scratch
        hooks = scratch.kept_hooks.bind_outputs()
        outputs: list[Any] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                j = next((j for j, a in enumerate(arguments) if a is leaf), None)
                if j is not None and not any(w == j for w, _ in written):
                    outputs.append(ArgumentOutput(j))
                    if pending and any(p is storage_root(leaf) for p in pending):
                        self.keep(leaf)  # (as the argument's: it is the argument)
                    continue
                src = TensorSource(OUTPUT, i, leaf, record.qualname, hooks)
                scratch.sources.add(leaf, src)
                scratch.output_sources.append(src)
                node = leaf.grad_fn
                if node is not None:
                    seq = sequence_nr(node)
                    scratch.save_output_seqs.add(seq)
                    self.rebuilds.output_edges[(seq, leaf.output_nr)] = src
                if pending and any(p is storage_root(leaf) for p in pending):
                    src.mark_kept(leaf)
                outputs.append(src)
            else:
                outputs.append(leaf)
        record.outputs_recorded(spec, outputs)


    def _record_written_arguments(self, record: RegionRecord, written: list[tuple[int, torch.Tensor]]) -> None:
        """A top-level SAVE region wrote arguments in place. The replay skips its body,
        so at the region it writes the forward's values into its own arguments: each
        written argument becomes a source holding its value as the body left it
        (kept: replayed code may read the argument after the region, which no save
        shows). An earlier SAVE output written this way has no value left to hand
        back as it was before: the replay gets a placeholder for it."""
        hooks = self.scratch.kept_hooks.bind_outputs()
        for i, t in written:
            replay_has_it = True
            earlier = [s for s in self.scratch.sources.lookup(t) or () if s.region != record.qualname]
            if earlier:
                replay_has_it = any(s.kind == INPUT for s in earlier)
                for s in earlier:
                    if s.kind != INPUT:
                        s.overwrite(record.qualname)
                        self.scratch.sources.drop(t, s)
            src = TensorSource(ARGUMENT, i, t, record.qualname, hooks)
            self.scratch.sources.add(t, src)
            self.scratch.output_sources.append(src)
            node = t.grad_fn
            if node is not None:  # the input walk does not enter the region through it
                self.scratch.save_output_seqs.add(sequence_nr(node))
            if replay_has_it:
                src.mark_kept(t)
            record.wrote_argument(i, src, version_of(t))


_compat.mark_internal_pack_hook(CheckpointFrame, "scratch.outer_hooks")  # pushed only while the forward runs


def _may_hold_locals(fn: Any, arguments: Any) -> bool:
    """Whether a SAVE body could reach Python state of the forward's own through its
    closure or its arguments (a module called on tensors cannot: :func:`local_watch`)."""
    return not isinstance(fn, nn.Module) or any(not isinstance(x, torch.Tensor) for x in arguments)


def _note_modes_left(record: RegionRecord, entry: tuple[bool, torch.dtype]) -> None:
    """A top-level SAVE region's body returned or raised: grad mode or the default
    dtype it left switched (``entry``: both at its start) go on the record. The code
    after it runs so, and so must the replay, which skips the body."""
    left = (_grad_enabled(), _default_dtype())
    if left != entry:
        record.modes_exit = left


def set_nested_tag(outer: Any, tag: tuple | None) -> None:
    """Say to ``outer``, the pass whose pack hook a nested checkpoint's kept tensors
    go through (the outer checkpoint's forward or replay), what the next pack is:
    ``(checkpoint, kind, region, name)``, None once it is done."""
    if type(outer) is CheckpointFrame:
        scratch = outer.scratch
        if scratch is not None:
            scratch.nested_tag = tag
    elif type(outer) is ReplayPass:
        outer.nested_tag = tag


def mark_inputs_read_by_replayed_code(
    out: Any,
    candidates: Sequence[Any],
    save_output_seqs: set[int],
    start_seq: int,
    extra_roots: Sequence[Any] = (),
) -> None:
    """Set ``keep`` on every candidate input source that replayed code consumes."""
    targets: dict[tuple[int, int], list[Any]] = {}
    alive: list[Any] = []  # keeps node wrappers alive so their ids stay unique
    for s in candidates:
        edge = get_gradient_edge(s.ref)
        alive.append(edge.node)
        targets.setdefault((id(edge.node), edge.output_nr), []).append(s)
    stop = save_output_seqs  # the walk does not enter SAVE regions through their outputs
    seen: dict[int, Any] = {}
    stack: list[Any] = []
    roots = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    for node in [*roots, *extra_roots]:
        if node is None:
            continue
        seq = sequence_nr(node)
        if id(node) not in seen and seq not in stop and seq >= start_seq:
            seen[id(node)] = node
            stack.append(node)
    unfound = len(targets)
    while stack and unfound:
        node = stack.pop()
        for nxt, nr in node.next_functions:
            if nxt is None:
                continue
            hit = targets.pop((id(nxt), nr), None)
            if hit is not None:
                unfound -= 1
                for s in hit:
                    s.mark_needed()
            k = id(nxt)
            if k in seen:
                continue
            seen[k] = nxt
            seq = sequence_nr(nxt)
            if seq >= start_seq and seq not in stop:
                stack.append(nxt)


def flatten_region_outputs(out: Any, region: str, checkpoint: str) -> tuple[list[Any], Any]:
    """Return ``(leaves, spec)``; tensors stay tensors, other leaves become Constants.

    ``spec`` is None when the region returned a single tensor.
    """
    if isinstance(out, torch.Tensor):
        return [out], None
    leaves, spec = tree_flatten(out)
    result: list[Any] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            result.append(leaf)
        elif isinstance(leaf, CONSTANT_TYPES) or isinstance(leaf, enum.Enum):
            result.append(Constant(leaf))
        else:
            raise TypeError(
                f"torch_remat: SAVE region '{region}' of checkpoint '{checkpoint}' returned "
                f"an object of type {type(leaf).__qualname__} (output leaf {i}). The "
                "region is skipped during recompute, so torch_remat must hand its "
                "outputs back itself: return tensors, containers torch.utils._pytree "
                "understands (tuple, list, dict, namedtuple), or plain constants. Register "
                f"{type(leaf).__qualname__} with torch.utils._pytree.register_pytree_node, "
                "or return its tensors."
            )
    return result, spec
