"""The replay pass: what runs while backward recomputes a checkpoint.

:class:`ReplayPass` is the active pass during one replay of a
``CheckpointFrame``: its pack hook refills the frame's holders in order (checking
each recreated tensor against what the forward saved), and its region calls hand
back a skipped SAVE region's kept outputs (or placeholders), restore the state
snapshots taken when the region returned, install its buffer updates and refill its
rebuilt saves.

Opt-in, ``determinism_check="bitwise"``: every tensor the forward drops gets a
checksum of its bits, which the replay compares with the tensor it recreates. The
default check compares only shape, dtype and device, which cannot see, for example,
dropout replayed without its RNG state hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .. import _compat
from .._compat import version_of
from .._errors import (
    CLONE_FIRST,
    PlaceholderReadError,
    RecomputeMismatchError,
    RematError,
    _StopRecompute,
    modified_in_place,
)
from .._tensors import checksum, format_dtype, same_storage
from .context import RECOMPUTE, note_exception, profiler_range
from .placeholder import Placeholder, read_error_message
from .records import (
    ArgumentOutput,
    Recreated,
    RegionRecord,
    TensorSource,
    describe_region,
    detached_copy,
    qualified_name,
    region_leaves,
)
from .rng import check_position, position

if TYPE_CHECKING:
    from .frame import CheckpointFrame

tree_unflatten = _compat.tree_unflatten



# Packed for tensors saved during a replay; the replay's own graph is never run.
_REPLAYED = object()


def replay_unpack(packed: Any) -> torch.Tensor:
    raise RematError(
        "torch_remat: backward was run through the graph built while recomputing a "
        "checkpoint (autograd.grad or backward inside the checkpointed function). This "
        "is not supported."
    )


class ReplayPass:
    """Recreates a frame's saved tensors for one backward, into that backward's store
    (``store``, a :class:`~torch_remat.engine.records.Recreated`).

    While it runs it is the active pass (see :class:`~torch_remat.engine.context.ActivePass`).
    """

    phase = RECOMPUTE
    in_save_region = False

    def __init__(self, frame: CheckpointFrame, store: Recreated, needed: int) -> None:
        self.frame = frame
        self.store = store
        self.needed = needed
        self.counter = 0
        self.filled = 0
        # the autograd sequence number when the replay started: nodes numbered from
        # it on are the replay's own (see other_variant)
        self.start_seq = _compat.autograd_sequence_nr()
        self.run_to_end = False  # set by stop()
        # the autograd sequence number of the op whose save completed the set, when
        # the stop waits for that op to run (see pack)
        self.stop_after: int | None = None
        self.no_history_seq: int | None = None  # the last op that saved one without history
        # determinism_check="bitwise": saves without history not compared yet
        # (index, tensor, region, autograd sequence number); see pack
        self.unchecked: list[tuple[int, torch.Tensor, str | None, int]] = []
        self.region_pos = 0
        # what ModuleState.install changed, for skipped SAVE regions to add to
        self.module_undo: list[tuple[Any, Any, Any]] = []
        self.region_stack: list[RegionRecord] = []
        self.seen_regions: list[tuple[str, bool]] = []  # (qualname, recompute)
        self.nested_tag: tuple | None = None  # as ForwardScratch.nested_tag
        # a skipped SAVE region set the default dtype its body left: the caller's is
        # set back when the replay ends (CheckpointFrame.replay)
        self.set_dtype = False
        # > 0 while the body of a SAVE region runs again (RegionRecord.rerun): its
        # saves and the regions inside it are the body's own, not the forward's
        self.rerun_depth = 0

    def release(self) -> None:
        """The replay is over: drop what it refers to (see its end in ``frame.replay``)."""
        self.frame = self.store = None  # type: ignore[assignment]
        self.module_undo, self.region_stack, self.seen_regions = [], [], []
        self.unchecked = []

    def restore_modules_with(self, undo: list[tuple[Any, Any, Any]]) -> None:
        """What puts the modules' state back when this replay ends (the replay adds
        the attributes it sets where it skips a SAVE region)."""
        self.module_undo = undo

    def pack(self, t: torch.Tensor) -> Any:
        if self.rerun_depth:  # (the forward's saves of that body are kept: RegionSaved)
            return _REPLAYED
        if self.unchecked and self.unchecked[-1][3] != _compat.autograd_sequence_nr():
            self.check_saved()
        if self.stop_after is not None and _compat.autograd_sequence_nr() != self.stop_after:
            self.settle_stop()  # a later op saves: the one that completed the set has run
        i = self.counter
        self.counter = i + 1
        frame = self.frame
        holders = frame.holders
        if i >= len(holders):
            raise RecomputeMismatchError(
                f"torch_remat: the recompute of checkpoint '{frame.name}' saved more "
                f"tensors for backward than its forward did ({len(frame.holders)} outside "
                f"SAVE regions). {self.region_sequences()}{frame.path_advice()}"
            )
        holder = holders[i]()
        if holder is None or holder.kept is not None or i in self.store.tensors:
            return _REPLAYED
        if type(t) is Placeholder:  # (never subclassed: make_placeholder builds them)
            raise PlaceholderReadError(
                read_error_message(t._origin, "code outside SAVE regions saved for backward a tensor that")
            )
        shape, dtype, device, region, version, nested = frame.holder_meta[i]
        if nested != self.nested_tag:
            raise RecomputeMismatchError(
                f"torch_remat: tensor #{i} saved for backward in checkpoint '{frame.name}' "
                f"was {_nested_what(nested)} in forward but {_nested_what(self.nested_tag)} "
                "in the recompute: a checkpoint nested in it kept other tensors when the "
                "recompute ran it again. Code in a nested checkpoint must keep the same "
                "tensors while remat.is_recomputing() is True: call remat.region and "
                "remat.recompute_needs_tensor the same way in both (recompute_needs_tensor "
                f"costs nothing in a recompute). {self.region_sequences()}"
            )
        if version_of(t) != version and not self.other_variant(t):
            # The replay recreates fresh tensors with the versions the forward saw;
            # a differing version means a tensor both passes share (a closure tensor,
            # a buffer) was modified in place after the forward saved it.
            raise modified_in_place(
                frame.describe_holder(i),
                f"after the forward saved it: it was at version {version} when the "
                f"forward saved it and is at version {version_of(t)} in the recompute",
                CLONE_FIRST,
            )
        if frame.check_metadata and (t.shape != shape or t.dtype is not dtype or t.device != device):
            raise RecomputeMismatchError(
                f"torch_remat: tensor #{i} saved for backward by {describe_region(region)} of "
                f"checkpoint '{frame.name}' was {tuple(shape)} {dtype} on {device} in forward but "
                f"{tuple(t.shape)} {t.dtype} on {t.device} in the recompute. "
                f"{self.region_sequences()} The replay must compute the same values as "
                "the forward; state it depends on (RNG, counters) must be restored with "
                "recompute_state_hooks."
            )
        no_history = t.is_leaf  # (grad_fn is None, without a Python object for the node)
        if no_history:
            self.no_history_seq = _compat.autograd_sequence_nr()
        if frame.bitwise_check:
            if no_history:  # compared once its op has run, as in the forward
                self.unchecked.append((i, t, region, self.no_history_seq))
            else:
                check_bitwise(frame, i, t, region)
        self.store.put(i, t.detach())
        self.filled += 1
        if self.filled == self.needed and frame.early_stop and not self.run_to_end:
            seq = _compat.autograd_sequence_nr()
            if self.no_history_seq == seq:
                # This op saved a tensor without history: maybe an argument it fills
                # after saving it (rrelu saves its noise tensor, then draws into it).
                # Stopping here would skip the op's kernel and hand backward unwritten
                # memory: stop at the next op's save (or run to the end) instead.
                self.stop_after = seq
            else:
                self.stop()
        return _REPLAYED

    def other_variant(self, t: torch.Tensor) -> bool:
        """Whether ``t``, saved at another version than in the forward, is a tensor
        this replay made, under another number of TorchDispatchModes than the
        forward ran under (a FLOP counter around backward only): torch's composite
        ops then take their out-of-place variants (``at::linear`` adds its bias with
        ``add``, not ``add_``), which compute the same values. A tensor both passes
        share, modified in place since the forward saved it, was made before."""
        if _compat.dispatch_mode_count() == self.frame.dispatch_modes or t.is_leaf:
            return False
        node = t.grad_fn
        return node is not None and _compat.sequence_nr(node) >= self.start_seq

    # The pass is pushed as its own pack hook, as the frame is: nothing is handed to
    # user hooks during a replay, so torch's checkpoint sees none under it.
    __call__ = pack

    def check_saved(self) -> None:
        """The bitwise check of the saves without history whose op has run since."""
        pending, self.unchecked = self.unchecked, []
        for i, t, region, _ in pending:
            check_bitwise(self.frame, i, t, region)

    def settle_stop(self) -> None:
        """A stop waiting for the op that saved the last needed tensor to run (see
        :meth:`pack`) happens now: a later op saves, a region is called, or a bare op
        reads a SAVE output that was not kept (no longer needed)."""
        if self.stop_after is not None:
            self.stop_after = None
            self.stop()

    def stop(self) -> None:
        """Every tensor this backward needs is back: stop the replay, unless a
        generator the forward drew from stands elsewhere than where the forward
        ended. Then the replay runs to the end, where its position is checked
        (frame.replay): the forward drew after this point, or another thread drew
        from the generator while the forward ran (which the check refuses). No
        generator is read at each save of the forward for this."""
        frame = self.frame
        if frame.rng_checks and position(frame.state_hooks, frame.rng_checks) != frame.rng_end:
            self.run_to_end = True
            return
        raise _StopRecompute

    def region_sequences(self) -> str:
        fwd = ", ".join(f"{r.qualname} ({r.kind})" for r in self.frame.replay_regions)
        rec = ", ".join(f"{q} ({'recompute' if r else 'save'})" for q, r in self.seen_regions)
        return f"Regions in forward: [{fwd}]; regions in the recompute so far: [{rec}]."

    def run_region(self, fn: Callable[..., Any], name: str, recompute: bool, args, kwargs) -> Any:
        if self.rerun_depth:
            # inside a SAVE body run again: a plain call, as in its forward, under its
            # name (remat.active_checkpoint() names it as the forward did)
            qualname = qualified_name(self.region_stack, name)
            self.region_stack.append(RegionRecord(self.frame.name, name, qualname, recompute))
            try:
                return self._run_body(fn, qualname, args, kwargs)
            finally:
                self.region_stack.pop()
        if self.unchecked:  # their ops have run: compared before the region's own checks
            self.check_saved()
        if self.stop_after is not None:
            self.settle_stop()
        frame = self.frame
        qualname = qualified_name(self.region_stack, name)
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
            if expected.rerun:
                return self._rerun_body(fn, pos, expected, args, kwargs)
            for hook, state in zip(frame.state_hooks, expected.exit_states):
                hook.restore(state)
            if expected.host_exit is not None and frame.host_entry is not None:
                frame.set_host_state(expected.host_exit)
            if expected.attributes_exit:
                frame.module_state.skip_attributes(expected.attributes_exit, self.module_undo)
            if expected.modes_exit is not None:
                # the grad mode and default dtype the body left (the replay's grad
                # mode ends with it; the caller's default dtype is set back)
                grad, dtype = expected.modes_exit
                torch.set_grad_enabled(grad)
                if dtype is not torch.get_default_dtype():
                    self.set_dtype = True
                    torch.set_default_dtype(dtype)
            updated = frame.region_buffers.get(pos)
            if updated:
                frame.module_state.skip_region(updated)
            if expected.raised is not None:
                # A fresh copy each time: the stored one would collect this
                # replay's traceback, and with it the replay's tensors.
                raise detached_copy(expected.raised)
            if frame.rebuilds.by_pos:
                self._refill_arguments(pos, args, kwargs)
            if expected.written:
                # after the refills above: those are the arguments as the body got them
                write_arguments(frame.name, expected.written, args, kwargs)
            arguments = None
            leaves = []
            for o in expected.outputs:
                if isinstance(o, TensorSource):
                    leaves.append(o.replay_value(frame.name))
                elif type(o) is ArgumentOutput:  # the argument itself, as in the forward
                    if arguments is None:
                        arguments = region_leaves(args, kwargs)
                    leaves.append(arguments[o.index])
                else:
                    leaves.append(o.value)
            if expected.output_spec is None:
                return leaves[0]
            return tree_unflatten(leaves, expected.output_spec)
        self.region_stack.append(expected)
        try:
            return self._run_body(fn, qualname, args, kwargs)
        finally:
            self.region_stack.pop()

    def _run_body(self, fn: Callable[..., Any], qualname: str, args, kwargs) -> Any:
        try:
            with profiler_range("remat.region:", self.frame.name, "::", qualname):
                return fn(*args, **kwargs)
        except Exception as e:
            note_exception(e)
            raise

    def _refill_arguments(self, pos: int, args, kwargs) -> None:
        """The saves of SAVE region ``pos``'s arguments that the replay rebuilds,
        from the arguments as its body gets them; stops the replay once every
        tensor this backward needs is back."""
        frame = self.frame
        filled = frame.rebuilds.refill(self, pos, args, kwargs)
        if filled:
            self.filled += filled
            if self.filled == self.needed and frame.early_stop and not self.run_to_end:
                self.stop()

    def _rerun_body(self, fn: Callable[..., Any], pos: int, record: RegionRecord, args, kwargs) -> Any:
        """Run the body of SAVE region ``pos`` again (RegionRecord.rerun): it draws,
        updates and rebinds what it did in the forward, from the same state, so
        nothing is set for it; its arguments' rebuilt saves are refilled first."""
        if self.frame.rebuilds.by_pos:
            self._refill_arguments(pos, args, kwargs)
        self.rerun_depth += 1
        self.region_stack.append(record)
        try:
            return self._run_body(fn, record.qualname, args, kwargs)
        finally:
            self.region_stack.pop()
            self.rerun_depth -= 1

    def keep(self, t: torch.Tensor) -> bool:
        return True



def _nested_what(tag: tuple | None) -> str:
    """How a replay mismatch names what a save was (see ``set_nested_tag``)."""
    if tag is None:
        return "saved by its own code"
    checkpoint, kind, region, name = tag
    where = f" of region '{region}'" if region else ""
    return f"kept by nested checkpoint '{checkpoint}' ({kind} {name}{where})"


def write_arguments(checkpoint: str, written: list, args: tuple, kwargs: dict) -> None:
    """At a skipped SAVE region whose body wrote arguments in place: write the values
    the body left into the replay's arguments, at the versions it left them."""
    leaves = region_leaves(args, kwargs)
    for i, source, version in written:
        t = leaves[i] if i < len(leaves) else None
        if not isinstance(t, torch.Tensor) or isinstance(t, Placeholder):
            continue  # nothing of it to write into (reads of it raise)
        value = source.replay_value(checkpoint)
        if isinstance(value, Placeholder):
            continue
        # (storages compared by identity: a fake tensor's data pointer reads the same
        # for all, so a forecast would skip the copy a real replay runs)
        if not same_storage(t, value) or t.storage_offset() != value.storage_offset():
            with torch.no_grad():
                t.copy_(value)
        _compat.set_version_counters((t,), (version,))


_compat.mark_internal_pack_hook(ReplayPass)


def opaque_workspace(t: torch.Tensor) -> bool:
    """A fused kernel's scratch buffer saved for its backward: a 1-D ``uint8`` tensor
    outside autograd (the workspace of oneDNN's and cuDNN's RNN kernels). Its padding
    is never written, so its bits differ from one call of the kernel to the next; the
    bitwise check compares its shape, dtype and device only."""
    return t.dtype == torch.uint8 and t.dim() == 1 and not t.requires_grad


def check_bitwise(frame: CheckpointFrame, index: int, t: torch.Tensor, region: str | None) -> None:
    expected = frame.holder_checksums[index]
    if expected is None or checksum(t) == expected:
        return
    where = f"region '{region}'" if region else "code outside regions"
    raise RecomputeMismatchError(
        f"torch_remat: determinism check failed for checkpoint '{frame.name}': tensor "
        f"#{index} saved for backward by {where} ({tuple(t.shape)}, "
        f"{format_dtype(t.dtype)}) has different bits in the recompute than "
        "in the forward. Something the replay depends on changed: usually RNG state "
        "(dropout) that needs a recompute_state_hooks entry, or a non-deterministic "
        "kernel."
    )

