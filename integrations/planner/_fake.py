"""Measure a remat configuration without allocating its memory: the same run as
``_measure.measure``, under ``FakeTensorMode``.

Fake tensors have storages with sizes but no data, so the forward and backward run
(shapes, dtypes, views, autograd, the engine's packing, rebuilding and replay) and
nothing proportional to the model is allocated. Bytes are counted the way the
planner counts them on real memory: every storage allocated in the forward and
still alive after ``loss_fn(model(*args))`` returns, once however many views and
saves share it, charged to the innermost block running when it was allocated.

* Fake storages: :class:`StorageLedger`, a dispatch mode over the fake mode, sees
  every op's outputs; a storage first seen as an output was allocated by that op
  (storages first seen as inputs existed before: parameters, buffers, the
  arguments). Python keeps one object per storage for as long as the storage lives,
  so a finalizer on it marks the exact moment it is freed; the ledger also keeps
  the running peak.
* Real storages: what the engine allocates outside the dispatcher (a checkpoint's
  copy of the CPU RNG state, a ``torch.ByteTensor`` of 5,056 B) is real even under
  fake mode and is counted from the profiler's allocator events, as ``measure``
  does.

FLOPs and aten ops of the recompute come from the same counter as ``measure``
(``FlopCounterMode``'s formulas work on shapes).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import logging
import math
import sys
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode

import torch_remat as remat
from torch_remat._integration import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    TorchDispatchMode,
    cpu_rng_state_reads,
    current_autograd_node,
    current_graph_task_id,
    first_input_metadata,
    local_scalar_dense,
    profiler_enabled,
    replays_observed,
    sequence_nr,
    storage_key,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
    version_of,
)
from torch_remat._integration import disable_current_modes as _disable_current_modes

from ..apply import remove_remat
from ._measure import (
    BASE,
    RANGE_PREFIX,
    BlockOutputs,
    LossFn,
    Measurement,
    PhaseTracker,
    Placement,
    RecomputeCounter,
    _profiled,
    blocks_drawing_no_random_numbers,
    checkpoint_holders,
    held_bytes_by_block,
    install,
    output_holders,
)
from ._offload import allocating_host_memory

_PRIM_DEVICE = torch.ops.prim.device.default


class LinearCalls(TorchFunctionMode):
    """Notes when ``F.linear`` runs with a plain (not wrapper subclass) bias.

    On a strided input it cannot flatten (a transposed activation: an RNN's
    ``batch_first`` output), ``at::linear`` runs ``matmul`` and then adds the bias
    in place into the product for plain tensors, and out of place for tensor
    subclasses, fake tensors among them. The ledger (:meth:`StorageLedger.
    _in_place_candidates`) counts that add as the real run does; below this mode
    the ops of ``linear`` are already decomposed, so only this mode can say that
    an add is ``linear``'s."""

    def __init__(self, ledger: StorageLedger) -> None:
        super().__init__()
        self.depth = 0
        self.ledger = ledger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not nn.functional.linear:
            return func(*args, **kwargs)
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if bias is None or hasattr(type(bias), "__tensor_flatten__"):  # a DTensor adds as a subclass
            return func(*args, **kwargs)
        self.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.depth -= 1
            # the product the bias was added to has died with linear's frame
            self.ledger.settle_in_place()


class StorageLedger(TorchDispatchMode):
    """Fake storages allocated by ops while active: which are alive, the block each
    was allocated in, and the peak of their total."""

    def __init__(self, fake_mode: FakeTensorMode | None = None) -> None:
        super().__init__()
        # A real tensor an op reads (a target a loss closure holds) is converted by the
        # fake mode below: converted here first (the mode memoizes the conversion), its
        # fake storage is known as existing, not taken for one the op allocated.
        self.fake_mode = fake_mode
        self.converted: list[torch.Tensor] = []
        # counts the recompute's FLOPs and ops at each op while the backward runs
        self.counter: RecomputeCounter | None = None
        self.blocks: list[str] = []
        """The stack of blocks whose forward is running (innermost last)."""
        self.live: dict[int, tuple[int, str]] = {}
        self.known: set[int] = set()
        self.current = 0
        self.peak = 0
        self.learned: dict[Any, list[tuple]] = _LEARNED
        self.modules: dict[int, str] = {}
        """``id(module) -> qualified name`` of the model's modules, to name the
        module whose code ran an op that fake tensors cannot run."""
        self.spikes: dict[Any, int] = {}
        """Per op signature (see ``_transient_key``), the most bytes alive when an op
        of it started: its real kernel's transient bytes (outputs and internal
        temporaries, learned once per signature) peak above that."""
        self.pending: dict[Any, tuple] = {}
        """Signatures not learned yet: ``(func, flat arguments, spec, grad mode)``."""
        self.real_live: dict[int, int] = {}
        """Real storages the engine allocated outside the dispatcher (a checkpoint's
        copy of the CPU RNG state, a fingerprint of it) that are alive: key -> bytes."""
        self.shadows: dict[int, int] = {}
        """Fake storage key -> bytes of the real ``constant`` its tensor carries: the
        fake mode computes small values made from Python numbers
        (``torch.tensor(d).sqrt()``) for real too, and the profiler counts that real
        copy, which the real run does not hold: one tensor, not two."""
        self.made_by: dict[int, int] = {}
        """Fake storage key -> sequence number of the backward node whose run
        allocated it (see :meth:`_in_place_candidates`)."""
        self.zeros: set[int] = set()
        """Fake storages a backward node allocated filled with zeros (``new_zeros``,
        ``zeros_like``): see :meth:`_in_place_candidates`."""
        self.node: int | None = None
        """The sequence number of the backward node running the current op; None
        outside a backward and in the backward of a Python ``autograd.Function``,
        whose ops are the user's code."""
        self.real_blocks: dict[int, str] = {}
        """The block each storage of :attr:`real_live` was allocated in."""
        self.replay_numbers: dict[str, int] = {}
        """Per block, the bytes of Python numbers its forward wrapped in real tensors
        that its graph keeps (see :meth:`replay_started`)."""
        self.extras: list[int] = []
        """The bytes :meth:`replay_started` counts for each replay running."""
        self.peak_extra = 0
        """Of :attr:`peak`, the bytes counted for running replays' numbers (an upper
        bound of theirs: the peak may lie above the real one by that much)."""
        self.spike_extras: dict[Any, int] = {}
        """Per signature in :attr:`spikes`, the replays' numbers counted in it."""
        self.quiet: tuple[int, Any, int] | None = None
        """While a backward node of :data:`_REAL_PATH_BACKWARDS` runs: (its sequence
        number, its signature, the bytes alive as it started). Its ops raise neither
        the peak nor a spike: its real path is learned whole (:func:`learn_nodes`)."""
        self.pending_nodes: dict[Any, None] = {}
        """Node signatures (see :func:`_node_key`) not learned yet."""
        self.node_fallback: dict[Any, int] = {}
        """Per node signature, the most bytes its fake ops held above its start: its
        transient where the real one could not be learned."""
        self.linear: LinearCalls | None = None
        """Set while a step runs: whether the current op is ``F.linear``'s."""
        self.phase: tuple[str, str] | None = None
        """The phase of the step running (see ``_measure.PhaseTracker``); None: the
        step is not split into phases."""
        self.phases: list[tuple[tuple[str, str] | None, int, int, dict[Any, int], dict[Any, int]]] = []
        """Each phase that ended: (its key, :attr:`peak`, :attr:`peak_extra`,
        :attr:`spikes` and :attr:`spike_extras` as it ended)."""
        self.in_place: tuple[tuple[int, ...], Any, tuple[int, int]] | None = None
        """The op that just ran out of place where the real backward runs in place
        if an argument dies with it: (those arguments' storage keys, its spike's
        signature and the spike noted before it, the peak before its outputs)."""

    def _raise_peak(self, value: int) -> None:
        if self.quiet is not None:
            _, key, start = self.quiet
            if value - start > self.node_fallback.get(key, 0):
                self.node_fallback[key] = value - start
            return
        if value > self.peak:
            self.peak = value
            self.peak_extra = sum(self.extras)

    def replay_started(self, checkpoint: str) -> None:
        """A checkpoint's replay starts: until it ends, its graph holds the Python
        numbers its ops wrap in real tensors again (``q * math.sqrt(1 / E)``), as many
        as the forward's graph of that block holds; they are made outside the
        dispatcher, where the ledger does not see them, so they are counted as
        alive for the whole replay."""
        self._between_ops()
        n = self.replay_numbers.get(checkpoint, 0)
        self.extras.append(n)
        self.current += n
        self._raise_peak(self.current)

    def replay_ended(self, checkpoint: str) -> None:
        self._between_ops()
        if self.extras:
            self.current -= self.extras.pop()

    def _forget(self, key: int) -> None:
        self.known.discard(key)
        self.shadows.pop(key, None)
        self.zeros.discard(key)
        self.made_by.pop(key, None)
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]

    def _see(self, t: torch.Tensor, allocated: bool) -> None:
        if not isinstance(t, FakeTensor):
            # A wrapper (DTensor): its op ran on the inner tensors below this mode,
            # so the inner tensors of its outputs are what that op allocated.
            flatten = getattr(t, "__tensor_flatten__", None)
            if flatten is not None:
                for name in flatten()[0]:
                    inner = getattr(t, name)
                    if isinstance(inner, torch.Tensor):
                        self._see(inner, allocated)
            return
        st = t.untyped_storage()
        key = storage_key(st)
        if key in self.known:
            return
        self.known.add(key)
        weakref.finalize(st, self._forget, key)
        if allocated:
            n = st.nbytes()
            block = self.blocks[-1] if self.blocks else BASE
            if allocating_host_memory():  # an offloader's host buffer: not device memory
                return
            self.live[key] = (n, block)
            self.current += n
            self._raise_peak(self.current)
            if self.node is not None:
                self.made_by[key] = self.node
            constant = getattr(t, "constant", None)
            if isinstance(constant, torch.Tensor) and not isinstance(constant, FakeTensor):
                self.shadows[key] = constant.untyped_storage().nbytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE:
            # A device query of a fake tensor (C++ asks a subclass for its device):
            # no op, no allocation, nothing counted. Most dispatches of a fake step
            # are these (about three in five).
            return func(*args)
        kwargs = kwargs or {}
        out = self._run_op(func, args, kwargs)
        if self.counter is not None:
            self.counter.count(func, args, kwargs, out)
        return out

    def _run_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.in_place is not None and func is not _PRIM_DEVICE:  # (a query, asked as an op returns)
            self.settle_in_place()
        self.node, node = _backward_node()
        self._follow_node(node)
        # torch.tensor([0, 1]) in the model's code makes a real tensor outside the
        # dispatcher and hands it to lift_fresh: an allocation of the step's, not a
        # tensor that existed before it (a target the loss closure holds)
        fresh = func in _LIFT_FRESH_OPS
        lifted: list[torch.Tensor] = []
        flat = tree_leaves((args, kwargs))  # (once per op: this runs at every op)
        for a in flat:
            if isinstance(a, torch.Tensor):
                if (
                    self.fake_mode is not None
                    and not isinstance(a, FakeTensor)
                    and not hasattr(type(a), "__tensor_flatten__")  # a wrapper (DTensor)
                ):  # of fakes: its inner tensors are fake already; nothing to convert
                    a = self.fake_mode.from_tensor(a)
                    # alive, so that the op's conversion finds it (a fresh one only
                    # through the op: afterwards it lives as long as the model keeps it)
                    (lifted if fresh else self.converted).append(a)
                self._see(a, allocated=fresh)
        before = self.current
        answered, answer = read_known_value(func, args, kwargs)
        if answered:
            return answer
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            # computed from the arguments' values where the fake run knows them all
            # (token ids routed by a hash, a padding mask's nonzero)
            out = outputs_of_known_values(func, args, kwargs)
            if out is None:
                block = self.blocks[-1] if self.blocks else None
                raise DataDependentOpError(_data_dependent_message(func, self.modules, block)) from e
        except RuntimeError as e:
            # A fake (meta) kernel may refuse what the real kernel runs: the meta
            # kernel of aten._grouped_mm (transformers' MoE experts) wants bfloat16,
            # the CPU kernel also takes float32. Outputs as the real kernel makes them.
            out = _as_real_kernel(func, args, kwargs, e)
        if func.overloadpacket.__name__ in REAL_LAYOUT_OPS and self.fake_mode is not None:
            out = _as_run(func, args, kwargs, out, self.learned)
        if torch.Tag.nondeterministic_seeded in func.tags and _may_draw(func, args, kwargs):
            _draw_like(out)
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        if self.fake_mode is not None:
            carry_known_values(func, flat, (args, kwargs), outs)
        candidates = self._in_place_candidates(func, args, kwargs, out)
        spike_key = _transient_key(func, flat) if candidates else None
        spiked = (self.spikes.get(spike_key, -1), self.spike_extras.get(spike_key, 0))
        peak = (self.peak, self.peak_extra)
        self._spike(func, flat, (args, kwargs), outs, before)
        for o in outs:
            self._see(o, allocated=True)
        if candidates:
            self.in_place = (candidates, (spike_key, spiked), peak)
        elif func.overloadpacket.__name__ in _ZEROS_OPS and isinstance(out, FakeTensor) and self.node is not None:
            self.zeros.add(storage_key(out.untyped_storage()))
        return out

    def _in_place_candidates(self, func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, ...]:
        """Storage keys of the arguments that the real backward would have written
        in place of ``func``'s output, had they died with it (see
        :meth:`settle_in_place`); empty for most ops.

        A fake tensor counts as a tensor subclass, and under any dispatch mode so
        does every tensor: where torch's backward checks for subclasses to stay
        functional, the fake run takes the out-of-place branch. Two such branches
        allocate an output the real run does not:

        * autograd sums a tensor's gradients in place into the sum so far when its
          input buffer holds the only reference to it, else out of place;
        * the backward of ``gather``, ``take``, ``masked_select``, ``index_select``
          and indexing scatters into fresh zeros in place, else out of place.

        Only ops run by torch's own backward nodes qualify (a Python
        ``autograd.Function``'s backward is the user's code, run as written).

        In the forward (and a replay), ``F.linear`` on an input it cannot flatten adds
        its bias in place into the product for plain tensors (see
        :class:`LinearCalls`), out of place for fakes."""
        linear = self.linear
        if (
            linear is not None and linear.depth and func is torch.ops.aten.add.Tensor
            and not kwargs and len(args) == 2 and isinstance(out, FakeTensor)
        ):
            a = args[0]
            if (
                isinstance(a, FakeTensor) and a.shape == out.shape and a.dtype == out.dtype
                and a.untyped_storage().nbytes() == out.untyped_storage().nbytes()
            ):
                return (storage_key(a.untyped_storage()),)
            return ()
        node = self.node
        if node is None or not isinstance(out, FakeTensor) or torch.is_grad_enabled():
            return ()
        name = func.overloadpacket.__name__
        if name == "add" and func is torch.ops.aten.add.Tensor and not kwargs and len(args) == 2:
            # Autograd writes into the sum so far (the first argument: a gradient
            # another node made) and only if it holds the only reference to it and to
            # its storage: not a view, which keeps its base; dying with the sum shows
            # the rest. (A sum inside a node's formula adds what that node made.)
            a = args[0]
            if (
                isinstance(a, FakeTensor) and not a._is_view() and a.shape == out.shape
                and a.dtype == out.dtype and a.is_contiguous()
                and a.untyped_storage().nbytes() == out.untyped_storage().nbytes()
            ):
                key = storage_key(a.untyped_storage())
                if self.made_by.get(key, node) != node:
                    return (key,)
            return ()
        if name in _SCATTER_INTO_ZEROS_OPS and args and isinstance(args[0], FakeTensor):
            key = storage_key(args[0].untyped_storage())
            if (
                key in self.zeros and self.made_by.get(key) == node
                and args[0].untyped_storage().nbytes() == out.untyped_storage().nbytes()
            ):
                return (key,)
        return ()

    def _follow_node(self, node: Any) -> None:
        """Before an op: if a backward node whose CPU kernel takes another path than
        fake tensors do starts, note its signature and the bytes alive; its ops are
        then counted as alive but not in the peak (see :attr:`quiet`)."""
        if (
            node is None or torch.is_grad_enabled()  # (a replay run as the node unpacks)
            or type(node).__name__ not in _REAL_PATH_BACKWARDS
        ):
            self.quiet = None
            return
        seq = self.node
        if self.quiet is not None and self.quiet[0] == seq:
            return
        key = _node_key(node)
        if key is None:
            self.quiet = None
            return
        self.quiet = (seq, key, self.current)
        if key not in _TRANSIENT:
            self.pending_nodes[key] = None
        if self.current > self.spikes.get(key, -1):
            self.spikes[key] = self.current
            self.spike_extras[key] = sum(self.extras)

    def _between_ops(self) -> None:
        """Called from outside the dispatcher (a replay starting or ending, an
        allocation or resize of the engine's, the end of the step): no backward
        node's ops are running now, and the last op has returned."""
        self.quiet = None
        self.settle_in_place()

    def settle_in_place(self) -> None:
        """The op noted by :meth:`_in_place_candidates` has returned: if one of its
        candidate arguments died with it, the real backward wrote that argument in
        place, allocating nothing: its output is not counted on top of what was
        alive, neither in the peak nor as the op's transient."""
        pending, self.in_place = self.in_place, None
        if pending is None:
            return
        keys, (spike_key, (spiked, spike_extra)), (peak, peak_extra) = pending
        if all(key in self.live for key in keys):
            return  # every candidate outlived the op: out of place in the real run too
        self.peak, self.peak_extra = peak, peak_extra
        if spiked < 0:
            self.spikes.pop(spike_key, None)
            self.spike_extras.pop(spike_key, None)
        else:
            self.spikes[spike_key] = spiked
            self.spike_extras[spike_key] = spike_extra

    def _spike(self, func: Any, flat: list[Any], tree: Any, outs: list[torch.Tensor], before: int) -> None:
        """Note the bytes alive as ``func`` started (``before``), for its real
        kernel's transient peak (outputs and internal temporaries), learned after
        the step. Not for outputs over ``LEARN_CAP`` (a small input expanded, a
        ``new_zeros`` of any size). ``flat``: the leaves of ``tree``, its
        ``(args, kwargs)``; ``outs``: its output tensors."""
        if self.fake_mode is None or allocating_host_memory() or self.quiet is not None:
            return
        key = _transient_key(func, flat)
        if key is None:
            return
        outputs = sum(o.untyped_storage().nbytes() for o in outs)
        if outputs > LEARN_CAP:
            return
        if key not in _TRANSIENT and key not in self.pending:
            # The arguments' layouts, not the tensors (kept, they would not be freed)
            spec = tree_flatten(tree)[1]
            layouts = [_ArgumentLayout(a) if isinstance(a, torch.Tensor) else a for a in flat]
            self.pending[key] = (func, layouts, spec, torch.is_grad_enabled())
        if before > self.spikes.get(key, -1):
            self.spikes[key] = before
            self.spike_extras[key] = sum(self.extras)

    def real_allocated(self, t: torch.Tensor) -> None:
        """A real tensor the engine allocated outside the dispatcher (an RNG state):
        alive in the step's bytes until its storage is freed."""
        self._between_ops()
        st = t.untyped_storage()
        key = storage_key(st)
        if key in self.real_live:
            return
        n = st.nbytes()
        self.real_live[key] = n
        self.real_blocks[key] = self.blocks[-1] if self.blocks else BASE
        self.current += n
        self._raise_peak(self.current)

        def freed(_key: int = key) -> None:
            self.current -= self.real_live.pop(_key, 0)
            self.real_blocks.pop(_key, None)

        weakref.finalize(st, freed)

    def enter_phase(self, key: tuple[str, str]) -> None:
        """The phase ``key`` begins: the peak and spikes so far are the ended phase's."""
        self._between_ops()
        self.phases.append((self.phase, self.peak, self.peak_extra, self.spikes, self.spike_extras))
        self.phase = key
        self.peak, self.peak_extra = self.current, sum(self.extras)
        self.spikes, self.spike_extras = {}, {}

    def transient_peak(self) -> tuple[int, int]:
        """The peak with each op's learned transient bytes on top of what was alive
        when it started (signatures not learned: their outputs, as counted), and the
        bytes of running replays' numbers counted in it (:meth:`replay_started`)."""
        return max(self._phase_peaks(), key=lambda p: p[1])[1:]

    def phase_peaks(self) -> dict[tuple[str, str], int]:
        """:meth:`transient_peak` of each phase."""
        out: dict[tuple[str, str], int] = {}
        for key, peak, _ in self._phase_peaks():
            if key is not None:
                out[key] = max(out.get(key, 0), peak)
        return out

    def _phase_peaks(self) -> list[tuple[tuple[str, str] | None, int, int]]:
        self._between_ops()
        out = []
        for key, peak, numbers, spikes, spike_extras in [
            *self.phases, (self.phase, self.peak, self.peak_extra, self.spikes, self.spike_extras)
        ]:
            for signature, before in spikes.items():
                extra = _TRANSIENT.get(signature)
                if extra is None:
                    extra = self.node_fallback.get(signature)
                if extra is not None and before + extra > peak:
                    peak, numbers = before + extra, spike_extras.get(signature, 0)
            out.append((key, peak, numbers))
        return out

    def resized(self, st: Any, before: int, after: int) -> None:
        """A fake storage was resized outside the dispatcher (``UntypedStorage.resize_``:
        FSDP2 allocates and frees a unit's unsharded parameters so). Grown from empty,
        it is allocated now, in the running block; shrunk to empty, freed."""
        self._between_ops()
        key = storage_key(st)
        if key not in self.known:
            self.known.add(key)
            weakref.finalize(st, self._forget, key)
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]
        if after > 0 and (entry is not None or before == 0):
            block = entry[1] if entry is not None else (self.blocks[-1] if self.blocks else BASE)
            self.live[key] = (after, block)
            self.current += after
            self._raise_peak(self.current)

    def see_existing(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            self._see(t, allocated=False)

    def held_by_block(self, excluding: frozenset[int] = frozenset()) -> dict[str, int]:
        """Bytes of the live storages each block allocated, but for the storages
        keyed (``_cdata``) in ``excluding``."""
        held: dict[str, int] = defaultdict(int)
        for key, (n, block) in self.live.items():
            if key not in excluding:
                held[block] += n
        return dict(held)

    def shadows_by_block(self) -> dict[str, int]:
        """Bytes of the real constants the live fake storages carry, by the block
        that allocated them (see :attr:`shadows`)."""
        held: dict[str, int] = defaultdict(int)
        for key, n in self.shadows.items():
            entry = self.live.get(key)
            if entry is not None:
                held[entry[1]] += n
        return dict(held)

    def reset_peak(self) -> None:
        self.peak = self.current


# ------------------------------------------------- small values the fake run knows
#
# Model code reads some tensor values to choose its path: transformers skips an
# attention mask of all ones (``padding_mask.sum() == padding_mask.numel()``) and
# lets SDPA's ``is_causal`` mask instead, and on a fake tensor, whose values it cannot
# read, builds the explicit mask, which the real run never makes (and, for grouped-
# query attention, repeats K/V). The fake run therefore carries the real values of
# small tensors whose values it can know: the arguments (an attention mask, token
# ids), tensors made from Python numbers and shapes (``torch.ones(b, s)``,
# ``arange``), and what ops on only such tensors compute from them. Each is computed
# on a worker thread, where neither the fake mode nor the profiler that counts the
# step's real allocations is active; a read of a value (``bool()``, ``.item()``)
# answers from them, and transformers sees such a tensor as a plain one. Values made
# from parameters, activations or random numbers stay unknown, as before.

_KNOWN_NUMEL = 1 << 16
"""Tensors of at most this many elements have their values carried."""

_VALUE_FACTORIES = frozenset({
    "ones", "zeros", "full", "arange", "scalar_tensor", "eye", "linspace", "tril_indices",
    "triu_indices", "lift_fresh", "lift_fresh_copy",
})
"""Ops whose outputs' values follow from their Python arguments alone."""

_SHAPE_FACTORIES = frozenset({
    "ones_like", "zeros_like", "full_like", "new_ones", "new_zeros", "new_full",
})
"""Ops whose outputs' values follow from their tensor arguments' shapes alone."""

_ABSOLUTE_LAYOUT_OPS = frozenset({"as_strided", "as_strided_", "as_strided_scatter", "set_"})
"""Ops that read a tensor's storage offset and strides as they are: a value carried
laid out otherwise (an argument's compact copy) does not answer them."""

_VALUE_READS = frozenset({
    local_scalar_dense,
    torch.ops.aten.item.default,  # (undecomposed under inference_mode)
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
})

_STALE: set[int] = set()
"""Fake storages written by an op whose result the fake run could not know: the
values carried for tensors in them are out of date."""

_KNOWN: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}
"""``id(fake) -> (a weak reference to it, the real value it stands for, the fake's
version then)``: a write through any view of its storage, seen or not, bumps the
version its views share, and the value is no longer known. The
values live here only and die on the worker thread (:func:`_sweep`): freed on the
profiled thread, a block allocated before the profiler started would make it warn."""

_BY_STORAGE: dict[int, set[int]] = {}
"""Fake storage key -> ids of the fakes in it with values carried."""

_RETIRED: list[torch.Tensor] = []
_worker: list[tuple[int, Any]] = []  # (process id, its executor)
_faked_depth: list[bool] = []  # faked() blocks open


def _pool() -> Any:
    import os

    if not _worker or _worker[0][0] != os.getpid():  # (a forked process has no thread of it)
        import concurrent.futures

        _worker[:] = [(os.getpid(), concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="remat-known"))]
    return _worker[0][1]


class _Layout:
    """A shape factory's tensor argument, made on the worker (only its layout counts)."""

    __slots__ = ("shape", "stride", "dtype", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride, self.dtype, self.device = t.shape, t.stride(), t.dtype, t.device


class _Copy:
    """A real tensor of the model's own (``torch.tensor(2)``), copied on the worker:
    a value carried must not keep the model's tensor alive."""

    __slots__ = ("tensor",)

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t


def _on_worker(func: Any, flat: list[Any], spec: Any) -> Any:
    """``func`` on the real arguments ``flat`` (``tree_flatten``'s, with ``spec``)
    on the worker thread, where neither a dispatch mode nor the profiler is active."""

    def run() -> Any:
        leaves = [
            torch.empty_strided(a.shape, a.stride, dtype=a.dtype, device=a.device)
            if type(a) is _Layout else a.tensor.clone() if type(a) is _Copy else a
            for a in flat
        ]
        args, kwargs = tree_unflatten(leaves, spec)
        with torch.no_grad():
            return func(*args, **kwargs)

    return _pool().submit(run).result()


def _sweep(everything: bool = False) -> None:
    """Hand the values of dead fakes (all of them: ``everything``) to the worker,
    which drops them."""
    dead = [k for k, (ref, _, _) in _KNOWN.items() if everything or ref() is None]
    for k in dead:
        _RETIRED.append(_KNOWN.pop(k)[1])
    if everything:
        _BY_STORAGE.clear()
    elif dead:
        gone = set(dead)
        for key in [key for key, ids in _BY_STORAGE.items() if not ids.difference_update(gone) and not ids]:
            del _BY_STORAGE[key]
    if _RETIRED:
        batch = _RETIRED[:]
        _RETIRED.clear()
        _pool().submit(batch.clear).result()


def _version(t: torch.Tensor) -> int | None:
    # (an inference tensor has no version counter, and cannot be written outside
    # inference mode)
    return None if t.is_inference() else version_of(t)


def known_value(t: Any) -> torch.Tensor | None:
    """The real value a fake tensor stands for, where the fake run knows it."""
    entry = _KNOWN.get(id(t))
    if entry is None or entry[0]() is not t or _version(t) != entry[2]:
        return None
    if _STALE and storage_key(t.untyped_storage()) in _STALE:
        return None
    return entry[1]


def know(fake: torch.Tensor, value: torch.Tensor) -> None:
    """Carry ``value`` (real) as what ``fake`` holds."""
    old = _KNOWN.get(id(fake))
    if old is not None:
        _RETIRED.append(old[1])
    _KNOWN[id(fake)] = (weakref.ref(fake), value, _version(fake))
    _BY_STORAGE.setdefault(storage_key(fake.untyped_storage()), set()).add(id(fake))
    if len(_KNOWN) % 256 == 0:
        _sweep()


def _forget_known(t: Any) -> None:
    entry = _KNOWN.pop(id(t), None)
    if entry is not None:
        _RETIRED.append(entry[1])
    if isinstance(t, FakeTensor):
        st = t.untyped_storage()
        key = storage_key(st)
        if key not in _STALE:
            _STALE.add(key)
            weakref.finalize(st, _STALE.discard, key)  # (a later storage may get its key)


def _small_plain(a: Any) -> bool:
    """A plain real tensor small enough for its values to be carried."""
    return type(a) is torch.Tensor and a.device.type != "meta" and a.numel() <= _KNOWN_NUMEL


def _real_leaf(a: Any) -> Any:
    """A tensor argument's real value: known, or a small real tensor itself
    (``torch.tensor(2)`` lifted into the fake run); None if unknown."""
    if isinstance(a, FakeTensor):
        return known_value(a)
    if _small_plain(a):
        return _Copy(a)
    return None


def _real_arguments(flat: list[Any]) -> list[Any] | None:
    """``flat`` (an op's flattened arguments) with each tensor replaced by its real
    value (:func:`_real_leaf`); None if one is unknown."""
    real = []
    for a in flat:
        if isinstance(a, torch.Tensor):
            a = _real_leaf(a)
            if a is None:
                return None
        real.append(a)
    return real


def read_known_value(func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """``(True, answer)`` for a read of a value the fake run knows (``bool(t)``,
    ``t.item()``), else ``(False, None)``."""
    if func not in _VALUE_READS:
        return False, None
    flat, spec = tree_flatten((args, kwargs))
    real = _real_arguments(flat)
    if real is None:
        return False, None
    try:
        return True, _on_worker(func, real, spec)
    except Exception:  # noqa: BLE001 (answered as before: from the fake op)
        return False, None


def outputs_of_known_values(func: Any, args: tuple, kwargs: dict) -> Any:
    """For an op whose output shapes depend on its arguments' values (``nonzero``,
    boolean indexing, ``unique``), fakes shaped as its real outputs, their values
    carried, where every tensor argument's value is known; else None."""
    flat, spec = tree_flatten((args, kwargs))
    fakes = [a for a in flat if isinstance(a, FakeTensor)]
    real = _real_arguments(flat) if fakes else None
    if real is None:
        return None
    try:
        real_out = _on_worker(func, real, spec)
    except Exception:  # noqa: BLE001 (refused as before)
        return None
    like = fakes[0]

    def fake_of(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        fake = like.new_empty_strided(value.shape, value.stride(), dtype=value.dtype)
        if value.numel() <= _KNOWN_NUMEL:
            know(fake, value)
        return fake

    return tree_map(fake_of, real_out)


def carry_known_values(func: Any, flat: list[Any], tree: Any, outs: list[Any]) -> None:
    """After an op ran on fakes (``tree``: its ``(args, kwargs)``; ``flat``: their
    leaves; ``outs``: its output tensors): carry the real values of its outputs
    where the fake run can know them; forget those of the arguments it wrote
    otherwise."""
    name = func.overloadpacket.__name__
    if not _KNOWN and name not in _VALUE_FACTORIES and name not in _SHAPE_FACTORIES:
        return  # (nothing known yet: no argument's value is)
    shape_only = name in _SHAPE_FACTORIES
    absolute = name in _ABSOLUTE_LAYOUT_OPS
    real: list[Any] = []
    knowable = (
        torch.Tag.nondeterministic_seeded not in func.tags
        and bool(outs)
        and all(isinstance(o, FakeTensor) and o.numel() <= _KNOWN_NUMEL for o in outs)
    )
    has_tensor = False
    for a in flat:
        if isinstance(a, torch.Tensor):
            has_tensor = True
            value = _real_leaf(a) if knowable else None
            if value is None:
                if not shape_only:
                    knowable = False
                    break
                value = _Layout(a)
            elif absolute and type(value) is not _Copy and (
                value.storage_offset() != a.storage_offset() or value.stride() != a.stride()
            ):
                knowable = False  # the value is laid out otherwise in its storage
                break
            a = value
        real.append(a)
    if knowable and not has_tensor:
        knowable = name in _VALUE_FACTORIES
    real_out = None
    if knowable:
        try:
            real_out = _on_worker(func, real, tree_flatten(tree)[1])
        except Exception:  # noqa: BLE001 (the values stay unknown)
            knowable = False
    if not knowable:
        if func._schema.is_mutable:
            for a in flat:
                if isinstance(a, torch.Tensor):
                    _forget_known(a)
        return
    real_outs = [o for o in tree_flatten(real_out)[0] if isinstance(o, torch.Tensor)]
    if len(real_outs) == len(outs):
        for fake, value in zip(outs, real_outs):
            know(fake, value)
    if func._schema.is_mutable:
        # it wrote arguments, and their values alike on the worker, where the values
        # of the other tensors in those storages (views of one another there as
        # here) changed with them. Autograd bumps the version those views share once
        # the op has returned: expected one higher.
        for a in _written_arguments(func, tree):
            key = storage_key(a.untyped_storage())
            for i in list(_BY_STORAGE.get(key, ())):
                entry = _KNOWN.get(i)
                t = entry[0]() if entry is not None else None
                if t is not None and storage_key(t.untyped_storage()) == key:
                    version = _version(t)
                    _KNOWN[i] = (entry[0], entry[1], None if version is None else version + 1)


def _written_arguments(func: Any, tree: tuple[tuple, dict]) -> list[torch.Tensor]:
    """The fake tensors an op writes in place (its schema's written arguments;
    ``tree``: its ``(args, kwargs)``)."""
    args, kwargs = tree
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, FakeTensor):
                out.append(t)
    return out


_LIFT_FRESH_OPS = frozenset(
    {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
)


def _backward_node() -> tuple[int | None, Any]:
    """The sequence number of the backward node of torch's running the current op,
    and the node ((None, None) outside a backward, or in a Python
    ``autograd.Function``'s backward)."""
    if current_graph_task_id() == -1:
        return None, None
    node = current_autograd_node()
    if node is None or isinstance(node, BackwardCFunction):
        return None, None
    return sequence_nr(node), node


def _one_hot(n: int, value: float) -> torch.Tensor:
    x = torch.zeros(n, dtype=torch.float64)
    x[n // 2] = value
    return x


def _no_zero(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float64)


def _lone_median(n: int) -> torch.Tensor:
    # torch.median is the lower median, element (n - 1) // 2 of the sorted values
    x = torch.ones(n, dtype=torch.float64)
    x[: (n - 1) // 2] = -1
    x[(n - 1) // 2] = 0
    return x


_REAL_PATH_BACKWARDS: dict[str, tuple[Any, Any]] = {
    # node name: (the forward it differentiates, called with the input and the
    # node's dim and keepdim where it has them; typical values of its input, given
    # the element count)
    "MaxBackward1": (torch.max, lambda k: _one_hot(k, 1.0)),
    "MinBackward1": (torch.min, lambda k: _one_hot(k, -1.0)),
    "MedianBackward0": (torch.median, _lone_median),
    "NanmedianBackward0": (torch.nanmedian, _lone_median),
    "ProdBackward0": (torch.prod, _no_zero),
    "ProdBackward1": (torch.prod, _no_zero),  # (its dim and keepdim)
    "CumprodBackward0": (torch.cumprod, _no_zero),  # (its dim)
}
"""Backward nodes whose CPU kernel branches where fake tensors cannot: the full
max, min and median spread the gradient over the elements equal to the result with
``index_put_`` on a mask (fake tensors, as tensor subclasses, and CUDA multiply by
the mask instead); ``prod`` and ``cumprod`` divide by the input when it holds no
zero (fake tensors take the path safe with zeros, which holds more). Learned whole
on typical values: a lone maximum, minimum or median; no zero."""


def _node_key(node: Any) -> Any:
    """The signature under which a :data:`_REAL_PATH_BACKWARDS` node's transient is
    learned, or None: an input not on the CPU, one over ``LEARN_CAP``. The input's
    shape and dtype come from the node that made it: reading the node's saved input
    would unpack it a second time (a checkpoint's saved tensor is unpacked once).
    It is learned contiguous."""
    meta = first_input_metadata(node)
    if meta is None or meta.device.type != "cpu":
        return None
    shape = tuple(meta.shape)
    dtype = meta.dtype
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > LEARN_CAP:
        return None
    name = type(node).__name__
    extra = tuple(
        getattr(node, a) for a in ("_saved_dim", "_saved_keepdim") if hasattr(node, a)
    )
    return ("node", name, extra, shape, dtype, torch.get_num_threads())


def learn_nodes(pending: dict[Any, Any]) -> None:
    """Run each node of ``pending`` (see :data:`_REAL_PATH_BACKWARDS`) once for real,
    on its typical values, and keep in ``_TRANSIENT`` the most bytes its backward
    held at once (its output and temporaries)."""
    todo = [k for k in pending if k not in _TRANSIENT]
    pending.clear()
    if not todo or profiler_enabled():
        return
    was = gc.isenabled()
    gc.disable()
    try:
        with _disable_current_modes():
            for key in todo:
                _, name, extra, shape, dtype, _ = key
                forward, values = _REAL_PATH_BACKWARDS[name]
                try:
                    x = values(math.prod(shape)).view(shape).to(dtype).requires_grad_()
                    y = forward(x, *extra)
                    g = torch.ones_like(y)  # alive as the node starts, as its gradient is
                    _TRANSIENT[key] = _most_held(functools.partial(torch.autograd.grad, y, x, g))
                except Exception:  # noqa: BLE001 (not learned: its fake ops stand)
                    _TRANSIENT[key] = None
    finally:
        if was:
            gc.enable()


def _most_held(run: Callable[[], Any]) -> int:
    """The most bytes ``run``'s allocations held at once (what it returns included)."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        got = run()
    del got
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = most = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        live += e.nbytes()
        most = max(most, live)
    return most


# ops a backward makes zeros with, and the scatters into them that torch's backward
# formulas run in place on plain tensors and out of place on subclasses
_ZEROS_OPS = frozenset({"new_zeros", "zeros_like", "zeros"})
_SCATTER_INTO_ZEROS_OPS = frozenset(
    {"scatter_add", "index_add", "index_put", "_unsafe_index_put", "put", "masked_scatter"}
)


REAL_LAYOUT_OPS = frozenset({
    # mkldnn's LSTM/GRU layer on CPU returns a workspace (saved for backward) whose
    # size its library chooses; the fake kernel returns an empty one
    "mkldnn_rnn_layer",
    # the CPU kernel returns a contiguous output whatever the input's layout; the fake
    # kernel keeps the input's strides (a transposed (B, L, C) activation), and the
    # ops after it then copy, or do not, differently
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
})
"""Ops whose real CPU outputs differ in size or layout from their fake twins' (by
name). The forecast runs each once, per shapes, on real zeros of its arguments'
shapes and takes the sizes and strides of the real outputs."""

_LEARNED: dict[Any, list[tuple]] = {}
"""Per op and argument shapes, the (shape, stride) of each tensor output of a real
run; the same in every forecast of a process, so it is kept across them."""


LEARN_CAP = 16 * 2**20
"""Ops whose tensor arguments hold at most this many bytes, and whose outputs too,
have their real CPU kernel's transient bytes learned (one real run per signature, on zeros); larger
ones are counted by their outputs alone (their real run would allocate and compute
what the forecast is there to avoid)."""

_TRANSIENT: dict[Any, int | None] = {}
"""Per op signature, the most bytes its real CPU kernel held at once above what
was alive when it started (its outputs and internal temporaries: a copy of a
strided operand, a library's workspace); None: not learnable (the run failed)."""


def _transient_key(func: Any, flat: list[Any]) -> Any:
    """The signature under which an op's transient bytes are learned (``flat``: its
    arguments' leaves), or None for an op that is not learned: a view, an op not of
    aten, an op on anything but CPU fakes, one with no tensor argument, one over
    ``LEARN_CAP``."""
    if func.namespace != "aten" or func.is_view:
        return None
    meta = []
    size = 0
    tensors = 0
    for a in flat:
        if isinstance(a, torch.Tensor):
            if not isinstance(a, FakeTensor) or a.device.type != "cpu":
                return None
            tensors += 1
            size += a.untyped_storage().nbytes()
            meta.append((tuple(a.shape), a.stride(), a.storage_offset(), a.dtype,
                         a.untyped_storage().nbytes()))
        elif isinstance(a, (torch.Generator, torch.Stream)):
            return None
        else:
            meta.append(repr(a))
    if not tensors or size > LEARN_CAP:
        return None
    return (func, torch.is_grad_enabled(), torch.get_num_threads(), tuple(meta))


class _ArgumentLayout:
    """A tensor argument's storage size, shape, strides, offset and dtype."""

    __slots__ = ("nbytes", "shape", "stride", "offset", "dtype")

    def __init__(self, t: torch.Tensor) -> None:
        self.nbytes = t.untyped_storage().nbytes()
        self.shape, self.stride = tuple(t.shape), t.stride()
        self.offset, self.dtype = t.storage_offset(), t.dtype

    def zeros(self) -> torch.Tensor:
        """Real zeros of this layout."""
        base = torch.zeros(self.nbytes, dtype=torch.uint8)
        return torch.empty(0, dtype=self.dtype).set_(
            base.untyped_storage(), self.offset, self.shape, self.stride
        )


def learn_transients(pending: dict[Any, tuple]) -> None:
    """Run each op of ``pending`` once on real zeros under the profiler and keep the
    most bytes it held at once (outputs and temporaries), in ``_TRANSIENT``."""
    todo = [(k, v) for k, v in pending.items() if k not in _TRANSIENT]
    pending.clear()
    if not todo or profiler_enabled():
        return
    rng = torch.get_rng_state()
    was = gc.isenabled()
    gc.disable()
    try:
        with _disable_current_modes():
            for key, (func, flat, spec, grad) in todo:
                try:
                    real = [a.zeros() if isinstance(a, _ArgumentLayout) else a for a in flat]
                    rargs, rkwargs = tree_unflatten(real, spec)
                    with torch.set_grad_enabled(grad):
                        _TRANSIENT[key] = _most_held(functools.partial(func, *rargs, **rkwargs))
                    del real, rargs, rkwargs
                except Exception:  # noqa: BLE001 (an op that fails on zeros is not learned)
                    _TRANSIENT[key] = None
    finally:
        if was:
            gc.enable()
        torch.set_rng_state(rng)


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    """Real zeros of ``t``'s storage size, shape, strides, offset and dtype."""
    return _ArgumentLayout(t).zeros()


def _run_on_zeros(func: Any, flat: list, spec: Any) -> Any:
    """``func`` run for real, outside the fake modes, on real zeros laid out as its
    (flattened) fake tensor arguments."""
    with _disable_current_modes():
        real = [_zeros_like(a) if isinstance(a, torch.Tensor) else a for a in flat]
        rargs, rkwargs = tree_unflatten(real, spec)
        return func(*rargs, **rkwargs)


def _as_run(func: Any, args: tuple, kwargs: dict, out: Any, learned: dict) -> Any:
    """``out`` (the fake outputs of ``func``) with the sizes and strides the real CPU
    kernel gives them, learned from one real run on zeros (memoized)."""
    flat, spec = tree_flatten((args, kwargs))
    if not all(isinstance(a, FakeTensor) and a.device.type == "cpu"
               for a in flat if isinstance(a, torch.Tensor)):
        return out
    key = (func, torch.is_grad_enabled(), tuple(
        (tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else repr(a)
        for a in flat
    ))
    if key not in learned:
        # In the caller's grad mode: a kernel may return a workspace only with
        # gradients on (mkldnn's RNN layer does).
        learned[key] = [
            (tuple(o.shape), o.stride()) if isinstance(o, torch.Tensor) else None
            for o in tree_flatten(_run_on_zeros(func, flat, spec))[0]
        ]
    outs, out_spec = tree_flatten(out)
    if len(outs) != len(learned[key]):
        return out
    fixed = []
    for o, layout in zip(outs, learned[key]):
        if isinstance(o, torch.Tensor) and layout is not None and (
            tuple(o.shape) != layout[0] or o.stride() != layout[1]
        ):
            # made below this mode, by the fake mode: a fake of the real layout
            o = torch.empty_strided(layout[0], layout[1], dtype=o.dtype, device=o.device)
        fixed.append(o)
    return tree_unflatten(fixed, out_spec)


def _as_real_kernel(func: Any, args: tuple, kwargs: dict, refused: RuntimeError) -> Any:
    """Fake outputs of ``func`` with the shapes, strides and dtypes its real CPU kernel
    gives them, from one real run on zeros (not memoized: an op whose fake kernel
    refuses is rare). Re-raises ``refused`` for an op on anything but CPU fakes, one
    over ``LEARN_CAP`` or one the real kernel refuses too."""
    flat, spec = tree_flatten((args, kwargs))
    tensors = [a for a in flat if isinstance(a, torch.Tensor)]
    if not tensors or func.namespace != "aten" or not all(
        isinstance(a, FakeTensor) and a.device.type == "cpu" for a in tensors
    ) or sum(a.untyped_storage().nbytes() for a in tensors) > LEARN_CAP:
        raise refused
    try:
        got = _run_on_zeros(func, flat, spec)
    except Exception:  # noqa: BLE001 (the real kernel refuses too: the fake's error stands)
        raise refused from None
    outs, out_spec = tree_flatten(got)
    faked_outs = [
        torch.empty_strided(tuple(o.shape), o.stride(), dtype=o.dtype, device=tensors[0].device)
        if isinstance(o, torch.Tensor) else o
        for o in outs
    ]
    return tree_unflatten(faked_outs, out_spec)


class DataDependentOpError(remat.RematError):
    """An op whose result depends on tensor values ran on fake tensors, which have
    shapes and no values."""


def _data_dependent_message(func: Any, modules: dict[int, str], block: str | None) -> str:
    """Names the op, the block being run and the innermost module of the model whose
    ``forward`` ran it (found on the Python stack), and the ways out."""
    where = "outside the model's modules (in loss_fn, say)"
    chain: list[str] = []  # innermost first: the module, then the modules around it
    frame = sys._getframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in modules:
            name = modules[id(owner)]
            text = f"{name!r} ({type(owner).__name__})" if name else (
                f"the model itself ({type(owner).__name__})"
            )
            if text not in chain:
                chain.append(text)
        frame = frame.f_back
    if chain:
        where = "in " + chain[0]
        outer = [c for c in chain[1:] if not c.startswith("the model itself")]
        if outer:
            where += ", inside " + ", ".join(outer)
    if block is not None and f"{block!r}" not in where:
        where += f", of block {block!r}"
    return (
        f"forecast_remat: {func} ran {where} on fake tensors, which have shapes and no "
        "values, and its result depends on the values (a data-dependent output shape, "
        "or a value read into Python: .item(), nonzero, a boolean mask, a branch on a "
        "tensor). Mixture-of-experts routing is the usual case: which tokens go to "
        "which expert, and so the shapes each expert runs on, depend on the router's "
        "values. No forecast is made rather than one with invented shapes. Plan on "
        "real tensors with plan_remat if the model fits this machine (it measures "
        "real runs, so any routing is fine), or make the shapes static: dispatch a "
        "fixed capacity of tokens per expert (topk over each expert's scores, padding "
        "or dropping the rest) instead of nonzero/boolean masks/bincount, or compute "
        "the value outside the forward and pass it in as a Python number."
    )


def _may_draw(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a random op draws from its generator with these arguments. An op
    tagged as random that takes a dropout probability (an attention kernel, an RNN)
    draws nothing at probability 0, and a dropout with ``train=False`` draws
    nothing; a real kernel leaves the generator where it was, so the fake run must
    too (else a block that draws nothing is taken to draw, and its checkpoints keep
    an RNG state they do not keep on real tensors)."""
    values = dict(kwargs)
    for arg, value in zip(func._schema.arguments, args):
        values[arg.name] = value
    for arg in func._schema.arguments:  # left out: the schema's default
        if arg.name not in values and arg.has_default_value():
            values[arg.name] = arg.default_value
    if values.get("train", True) is False:
        return False
    for name in ("dropout_p", "dropout"):
        p = values.get(name)
        if isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0:
            return False
    return True


def _draw_like(out: Any) -> None:
    """A fake random op draws nothing from its device's generator; the engine
    tells from the generator's state whether a checkpoint's forward drew random
    numbers (and then keeps the state to replay them). Draw one number from the CPU
    generator for a random op on CPU tensors, so the engine sees what it sees on
    real tensors."""
    devices = {o.device.type for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)}
    if "cpu" in devices:
        with _disable_current_modes():
            torch.rand(1)


@contextlib.contextmanager
def _storage_resizes(ledger: StorageLedger) -> Iterator[None]:
    """Report every resize of a fake (meta-device) storage to ``ledger`` while active."""
    original = torch.UntypedStorage.resize_

    def resize_(st: Any, size: int) -> Any:
        before = st.nbytes()
        out = original(st, size)
        if st.device.type == "meta":
            ledger.resized(st, before, st.nbytes())
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


@contextlib.contextmanager
def _rng_states(ledger: StorageLedger) -> Iterator[None]:
    """Follow the engine's reads of the CPU generator's state while active: a
    checkpoint's copy (kept until its backward) and the fingerprints of the RNG
    guard (freed at once) are real tensors allocated outside the dispatcher."""

    def read() -> None:
        ledger.settle_in_place()
        ledger._raise_peak(ledger.current + _cpu_state_bytes())

    with cpu_rng_state_reads(ledger.real_allocated, read):
        yield


@functools.cache
def _cpu_state_bytes() -> int:
    return torch.default_generator.get_state().untyped_storage().nbytes()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (``to_local()``); any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    if to_local is None:
        return t
    with torch.no_grad():
        return to_local()


def storage_bytes(tensors: Sequence[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages under ``tensors`` (DTensors: their local shards),
    each counted once however many tensors view it."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = local_tensor(t).untyped_storage()
        seen[storage_key(st)] = st.nbytes()
    return sum(seen.values())


def fake_storage_keys(t: torch.Tensor) -> list[int]:
    """Keys of the fake storages under ``t`` (a wrapper's inner ones; none for a
    real tensor)."""
    if isinstance(t, FakeTensor):
        return [storage_key(t.untyped_storage())]
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return []
    return [k for name in flatten()[0] for k in fake_storage_keys(getattr(t, name))]


@contextlib.contextmanager
def _block_ranges(
    ledger: StorageLedger, model: nn.Module, names: Sequence[str], returned: BlockOutputs | None = None
) -> Iterator[None]:
    handles = []
    ranges: list[Any] = []
    phases = PhaseTracker(names, ledger.enter_phase)
    ledger.phase = phases.key
    for name in names:
        block = model.get_submodule(name)

        def enter(_m: nn.Module, _a: Any, _name: str = name) -> None:
            phases.entered(_name)
            ledger.blocks.append(_name)
            # The range is opened by an op, which the fake mode would swallow.
            with _disable_current_modes():
                r = torch.profiler.record_function(RANGE_PREFIX + _name)
                r.__enter__()
            ranges.append(r)

        def leave(_m: nn.Module, _a: Any, out: Any, _name: str = name) -> None:
            ledger.blocks.pop()
            with _disable_current_modes():
                ranges.pop().__exit__(None, None, None)
            phases.left(_name, out)
            if returned is not None:
                returned.left(_name, out)

        handles.append(block.register_forward_pre_hook(enter))
        handles.append(block.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------ fake model


def fake_mode_of(model: nn.Module, args: Sequence[Any]) -> FakeTensorMode | None:
    """The fake mode the model's parameters or the arguments already belong to."""
    for t in [*model.parameters(), *model.buffers(), *args]:
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return None


def _to_fake(mode: FakeTensorMode, t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    if isinstance(t, FakeTensor):
        return t
    if t.device.type == "meta":
        with mode:
            out = torch.empty_strided(
                t.shape, t.stride(), dtype=t.dtype, device=device or torch.device("cpu")
            )
    else:
        out = mode.from_tensor(t.detach())
    return out


@contextlib.contextmanager
def _transformers_real_paths() -> Iterator[None]:
    """transformers decides some paths from tensor values, and takes its tracing
    path where it cannot read them (on a fake tensor): without an attention mask it
    reads the position ids for packed sequences, and with a fake answer it builds an
    explicit causal mask, which in turn repeats K/V for grouped-query attention
    instead of passing ``enable_gqa``: more bytes than the real run keeps. While
    active, fake position ids are taken as one sequence per row (the position ids
    the model makes itself, ``arange``), the real path for an unpacked batch,
    unless the fake run knows their values; and a fake whose values it knows
    (:func:`known_value`: an attention mask of ones) is not taken for a fake by
    transformers' ``is_fake_tensor``, so transformers reads it as it reads a real
    tensor."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    find = getattr(masking, "find_packed_sequence_indices", None)
    if find is None:
        yield
        return
    utils = sys.modules.get("transformers.utils.import_utils")
    is_fake = getattr(utils, "is_fake_tensor", None)

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> Any:
        if isinstance(position_ids, FakeTensor) and known_value(position_ids) is None:
            return None
        return find(position_ids)

    def is_fake_tensor(x: Any) -> bool:
        # a fake whose values the fake run knows reads as the real tensor would
        return is_fake(x) and known_value(x) is None

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    if is_fake is not None:
        utils.is_fake_tensor = is_fake_tensor
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find
        if is_fake is not None:
            utils.is_fake_tensor = is_fake


@contextlib.contextmanager
def _quiet_refused_fake_kernels() -> Iterator[None]:
    """torch's fake mode logs a traceback for a meta kernel that raises before the
    error reaches :func:`_as_real_kernel`, which answers it from the real kernel:
    that log is left out while forecasting."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def faked(
    model: nn.Module, args: Sequence[Any], device: torch.device | str | None = None
) -> Iterator[tuple[FakeTensorMode, tuple[Any, ...]]]:
    """The model with every parameter and buffer a fake tensor (real and meta ones
    are swapped for fakes of the same shape, dtype and strides, and swapped back on
    exit), and the arguments as fakes. Meta tensors become fakes on ``device``
    (default CPU); real ones keep theirs."""
    dev = torch.device(device) if device is not None else None
    mode = fake_mode_of(model, args) or FakeTensorMode(allow_non_fake_inputs=True)
    # The engine's real tensors (a checkpoint's copy of the RNG state) meet fakes.
    allowed, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True
    swapped: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    _faked_depth.append(True)
    # One fake per tensor object: a parameter tied in two modules (an embedding and
    # its head) stays one parameter, with one gradient and one optimizer state.
    fakes: dict[int, torch.Tensor] = {}
    try:
        for module in model.modules(remove_duplicate=False):
            for kind in ("_parameters", "_buffers"):
                table = getattr(module, kind)
                for name, t in list(table.items()):
                    if t is None or isinstance(t, FakeTensor):
                        continue
                    fake = fakes.get(id(t))
                    if fake is None:
                        fake = _to_fake(mode, t, dev)
                        if kind == "_parameters":
                            fake = nn.Parameter(fake, requires_grad=t.requires_grad)
                        fakes[id(t)] = fake
                    swapped.append((module, kind, name, t))
                    table[name] = fake

        # arguments sharing a storage with another are not given values: copied
        # apart, a write through one would not reach the other's value
        storages = collections.Counter(
            storage_key(a.untyped_storage()) for a in tree_flatten(list(args))[0]
            if type(a) is torch.Tensor and a.device.type != "meta"
        )

        def arg(a: Any) -> Any:
            if not isinstance(a, torch.Tensor) or isinstance(a, FakeTensor):
                return a
            f = _to_fake(mode, a, dev)
            if _small_plain(a) and storages[storage_key(a.untyped_storage())] == 1:
                know(f, a.detach().clone())  # (an attention mask, token ids: see known_value)
            return f.requires_grad_(a.requires_grad) if a.is_leaf else f


        with _transformers_real_paths(), _quiet_refused_fake_kernels():
            yield mode, tuple(tree_map(arg, list(args)))
    finally:
        mode.allow_non_fake_inputs = allowed
        for module, kind, name, t in reversed(swapped):
            getattr(module, kind)[name] = t
        if _faked_depth:
            _faked_depth.pop()
        if not _faked_depth:  # the outermost: no fake of this run is used again
            _sweep(everything=True)
            _STALE.clear()


def resized(args: Sequence[Any], mode: FakeTensorMode, batch: int, batch_dim: int = 0) -> tuple:
    """The (fake) arguments with dimension ``batch_dim`` of every tensor argument
    set to ``batch`` (a micro-batch of another size, allocating nothing)."""

    def one(a: Any) -> Any:
        if not isinstance(a, torch.Tensor) or a.dim() <= batch_dim:
            return a
        shape = list(a.shape)
        shape[batch_dim] = batch
        with mode:
            out = torch.empty(shape, dtype=a.dtype, device=a.device)
        return out.requires_grad_(a.requires_grad)

    return tuple(one(a) for a in args)


# ------------------------------------------------------------------ one run


class FakeMeasurement(Measurement):
    """A :class:`Measurement` from a fake run, with the step's peak."""

    peak_bytes: int = 0
    """Most bytes the step's own storages (activations, gradients, temporaries)
    held at once, forward and backward."""
    peak_margin: int = 0
    """How far ``peak_bytes`` may lie above the real step's peak: real storages
    the forward keeps that were allocated outside the dispatcher and that the
    ledger does not follow to their free (a Python number an op saves for its
    backward, wrapped in an 8 B tensor), counted as alive for the whole step, and
    those a replay running at the peak makes again, counted for the whole replay."""
    gradient_bytes: int = 0
    """Bytes of the parameters' gradients after the backward (distinct storages;
    DTensor gradients: this rank's shards)."""


def measure_fake(
    model: nn.Module,
    args: Sequence[Any],
    loss_fn: LossFn,
    config: Placement,
    block_names: Sequence[str],
    mode: FakeTensorMode,
    *,
    measuring: bool = True,
) -> FakeMeasurement:
    """``_measure.measure`` for a model and arguments that are fake already
    (``measuring``: as there, which offloader an offloaded placement runs)."""
    offloader = install(model, config, measuring=measuring)
    leaves = [p for p in model.parameters()] + [
        a for a in args if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad
    ]
    grads = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    cpu_rng = torch.get_rng_state()
    ledger = StorageLedger(mode)
    ledger.modules = _module_names(model)
    ledger.linear = LinearCalls(ledger)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with mode, ledger, ledger.linear, _storage_resizes(ledger), _rng_states(ledger), replays_observed(
            ledger.replay_started, ledger.replay_ended
        ):
            ledger.see_existing([*model.parameters(), *model.buffers(), *leaves])
            returned = BlockOutputs(fake_storage_keys)
            with _profiled() as prof, _block_ranges(ledger, model, block_names, returned):
                loss = loss_fn(model(*args))
            report = remat.saved_tensors_report(loss)
            holders = checkpoint_holders(report, fake_storage_keys)
            del report  # (its rows hold tensors: the backward must free them)
            parameters = _parameter_storages(model)
            outputs = output_holders(
                {key: n for key, (n, _) in ledger.live.items() if key not in parameters},
                {key: block for key, (_, block) in ledger.live.items()}, returned, holders,
            )
            real = held_bytes_by_block(prof)
            for block, n in ledger.shadows_by_block().items():  # counted as fakes
                real[block] = max(0, real.get(block, 0) - n)
            fake = ledger.held_by_block(excluding=parameters)
            host: dict[str, int] = {}
            back: dict[str, int] = {}
            if offloader is not None and hasattr(offloader, "host"):
                host, back = dict(offloader.host), offloader.back_now()
            # Real storages of the forward the ledger did not follow (it follows the
            # engine's RNG states): alive for the whole step, at most.
            unfollowed = max(0, sum(real.values()) - sum(ledger.real_live.values()))
            followed: dict[str, int] = defaultdict(int)
            for key, n in ledger.real_live.items():
                followed[ledger.real_blocks.get(key, BASE)] += n
            ledger.replay_numbers = {b: max(0, n - followed[b]) for b, n in real.items()}
            counter = ledger.counter = RecomputeCounter()  # (counted by the ledger)
            try:
                loss.backward()
            finally:
                ledger.counter = None
            del loss
            gradient_bytes = storage_bytes([p.grad for p in model.parameters()])
        learn_transients(ledger.pending)
        learn_nodes(ledger.pending_nodes)
        peak, replayed_numbers = ledger.transient_peak()
        peak += unfollowed
        phases = {key: p + unfollowed for key, p in ledger.phase_peaks().items()}
    finally:
        if was_enabled:
            gc.enable()
        for t, g in zip(leaves, grads):
            t.grad = g
        torch.set_rng_state(cpu_rng)
        remove_remat(model)
    result = FakeMeasurement(
        bytes_by_block={
            n: real.get(n, 0) + fake.get(n, 0) for n in [BASE, *block_names]
        },
        flops_by_block={n: counter.flops.get(n, 0) for n in block_names},
        ops_by_block={n: counter.ops.get(n, 0) for n in block_names},
        host_by_block={n: host.get(n, 0) for n in block_names},
        back_by_block={n: back.get(n, 0) for n in block_names},
        outputs=outputs,
    )
    result.peak_bytes = peak
    result.phase_peaks = phases
    result.peak_margin = unfollowed + replayed_numbers
    result.gradient_bytes = gradient_bytes
    return result


def _parameter_storages(model: nn.Module) -> frozenset[int]:
    """Keys of the storages the model's parameters are in now. After the forward
    FSDP2's root keeps its parameters unsharded (in storages the forward allocated)
    for the backward: they are the model's, not activations, and the planner's
    accounting (``_measure.kept_storages``) never counts a parameter, so neither
    does the forecast."""
    keys = set()
    for p in model.parameters():
        t = local_tensor(p)
        if isinstance(t, FakeTensor):
            keys.add(storage_key(t.untyped_storage()))
    return frozenset(keys)


def fake_forward(model: nn.Module, args: Sequence[Any], mode: FakeTensorMode) -> None:
    """One forward of the fake model without gradients; the CPU generator, which a
    fake random op advances (``_draw_like``), is put back."""
    cpu_rng = torch.get_rng_state()
    ledger = StorageLedger(mode)
    ledger.modules = _module_names(model)
    try:
        with torch.no_grad(), mode, ledger:
            model(*args)
    finally:
        torch.set_rng_state(cpu_rng)


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in model.named_modules(remove_duplicate=False)}


def fake_blocks_drawing_no_random_numbers(
    model: nn.Module, args: Sequence[Any], block_names: Sequence[str], mode: FakeTensorMode
) -> list[str]:
    """``_measure.blocks_drawing_no_random_numbers`` for a fake model: one forward
    without gradients, in which a fake random op draws from the CPU generator (see
    ``_draw_like``), so the blocks it leaves where they found it are the blocks that
    draw nothing on real tensors."""

    def forward() -> None:
        with torch.no_grad(), mode, StorageLedger(mode):
            model(*args)

    cpu_rng = torch.get_rng_state()
    try:
        return blocks_drawing_no_random_numbers(model, args, block_names, forward=forward)
    finally:
        torch.set_rng_state(cpu_rng)
