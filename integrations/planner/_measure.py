"""Run one remat configuration of a model once and measure it.

Bytes: the storages the step keeps for its backward after ``loss_fn(model(*args))``
returns -- what :func:`torch_remat.saved_tensors_report` of the loss counts (tensors
saved by autograd, a checkpoint's inputs, SAVE outputs and RNG snapshots; never a
parameter) and the loss itself -- each once however many views or saves share it,
counted for the block whose forward allocated it. The allocation is read from the
CPU (or CUDA) allocator's events of ``torch.profiler`` (``profile_memory=True``): the
latest allocation at the storage's address made on the forward's thread inside the
forward is the one that made it (a live storage's address was not handed out again
since), and the innermost block running then owns it; storages allocated outside
every block (the embedding, the head, the loss) make the base, and storages that
existed before the forward (the arguments) count nowhere.

The count does not depend on timing. What a collective's machinery holds for a
while -- FSDP2's all-gather and reduce-scatter buffers and unsharded parameters,
DDP's buckets, a gloo worker thread's reference to a tensor it sent -- is not kept
for the backward by the step, so it is never counted, however late the thread that
holds it lets go; parameters (sharded, unsharded or replicated) are the model's,
not activations.

Recompute cost: every aten op that runs while a checkpoint is being recomputed in
the backward is charged to that checkpoint (``remat.active_checkpoint``), its FLOPs
by ``FlopCounterMode``'s formulas (matmul-like ops only) and counted as one op, so
the pointwise work that FLOPs ignore shows in the op count.

A measurement leaves the model as it found it: gradients, buffers (batch-norm
statistics) and the RNG states are put back afterwards.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.wrap import CustomPolicy
from torch.utils.flop_counter import flop_registry

import torch_remat as remat
from torch_remat._integration import TorchDispatchMode, disable_current_modes, tree_flatten

from ..apply import RematConfig, apply_remat, remat_module_names, remove_remat
from ._flops import flops as op_flops
from ._state import preserved_python_state

RANGE_PREFIX = "torch_remat.planner.block::"
"""Name prefix of the profiler ranges that mark each block's forward."""

FORWARD_RANGE = "torch_remat.planner.forward"
"""Name of the profiler range around ``loss_fn(model(*args))``: allocations inside
it, on its thread, are the forward's."""

BASE = ""
"""Key of the bytes allocated outside every block."""

PHASE_PREFIX = "torch_remat.planner.phase::"
"""Name prefix of the instant profiler ranges that mark where a phase of the step
begins (see :class:`PhaseTracker`)."""

HEAD = ("head", BASE)
"""The phase from the last block's forward returning until the backward reaches a
block: the head, the loss and their backward."""

LossFn = Callable[[Any], torch.Tensor]

OutputKey = tuple[str, int]
"""A storage a block returned, named the same in every run: the block that
allocated it and returned it, and its position among the tensors of the block's
output (``tree_flatten``). A block that passes it on returns the same storage;
the name is its maker's."""


@dataclass(frozen=True)
class Placement:
    """Which blocks are checkpointed, and which submodules of each run as SAVE regions.

    ``checkpointed`` maps a block's qualified name to the paths (inside the block) of
    its SAVE-region submodules; blocks not in it run without a checkpoint."""

    checkpointed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    rng_free: frozenset[str] = frozenset()
    """Blocks checkpointed without the RNG state hooks: they drew no random numbers
    (see :func:`blocks_drawing_no_random_numbers`), so there is no state to replay."""
    offloaded: frozenset[str] = frozenset()
    """Checkpointed blocks whose kept tensors an offloader moves to host memory."""
    offload: Any = None
    """The ``_offload.OffloadOptions`` those blocks' offloader runs with."""
    pool_bytes: int = 0
    """The offloader's pool capacity when the options leave it to the plan."""


@dataclass
class Measurement:
    """What one run of a configuration held and recomputed, per block."""

    bytes_by_block: dict[str, int]
    """Bytes still allocated after the forward, by the block that allocated them
    (``BASE``: outside every block)."""
    flops_by_block: dict[str, int]
    ops_by_block: dict[str, int]
    host_by_block: dict[str, int] = field(default_factory=dict)
    """Bytes of host buffers an offloader holds for the backward, by block (not in
    :attr:`bytes_by_block`, which counts device memory)."""
    back_by_block: dict[str, int] = field(default_factory=dict)
    """Device bytes those tensors take once copied back, by block (see
    ``_offload.MeasuringOffloader.back_now``)."""
    peak_bytes: int | None = None
    """The most device bytes the step's own storages held at once, from just before
    the forward to the end of the backward (None: not measured)."""
    phase_peaks: dict[tuple[str, str], int] | None = None
    """The most bytes alive at once in each phase of the step (keys: see
    :class:`PhaseTracker`; None: not measured)."""
    outputs: dict[OutputKey, tuple[int, frozenset[str]]] = field(default_factory=dict)
    """The kept storages that a block returned from its forward and allocated in it
    (in :attr:`bytes_by_block`, under that block), by :data:`OutputKey`: their
    bytes, and the blocks keeping them (see :func:`output_holders`)."""

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_block.values())


# ------------------------------------------------------------------ model state


@contextlib.contextmanager
def preserved_state(model: nn.Module, args: Sequence[Any]) -> Iterator[None]:
    """Run with no gradients on the model and the leaf arguments; give back their
    gradients, the parameters and buffers (the tensor objects each module held,
    with their values) and the RNG states on exit, so that measuring steps leaves
    no trace (a later training step sees what it would have seen without them):
    a forward that rebinds a buffer (``self.avg = ...``) or an optimizer step fused
    into backward (``register_post_accumulate_grad_hook``) included. FSDP2 modules
    are resharded on entry and on exit: a forward without a backward (the
    planner's no-gradient forwards) leaves the root's parameters unsharded, and the
    parameters registered then are not the sharded ones its gradients go to."""
    _reshard_fsdp(model)
    leaves = [p for p in model.parameters()] + [
        a for a in args if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad
    ]
    grads = [t.grad for t in leaves]
    # Detached, not zeroed: backward would accumulate into the caller's tensors.
    for t in leaves:
        t.grad = None
    # (slot dict, name, tensor, its value): every module's parameters and buffers;
    # the values in host memory, so that planning a large model on a device does
    # not hold a second copy of its parameters there
    slots = []
    # A sharded model (FSDP2, tensor parallel: DTensor parameters) is left to its
    # owner, which swaps parameter objects in and out around each forward and frees
    # the unsharded storage: only its buffers' values are put back.
    sharded = any(hasattr(p, "device_mesh") for p in model.parameters())
    for m in model.modules():
        for table in ((m._buffers,) if sharded else (m._parameters, m._buffers)):
            for name, t in table.items():
                if t is not None and not hasattr(t, "device_mesh"):
                    slots.append((table, name, t, t.detach().to("cpu", copy=True)))
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        with preserved_python_state(model):
            yield
    finally:
        _reshard_fsdp(model)
        with torch.no_grad():
            for table, name, t, value in slots:
                table[name] = t
                if not torch.equal(t.detach().cpu(), value):
                    t.copy_(value)
        for t, g in zip(leaves, grads):
            t.grad = g
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _reshard_fsdp(model: nn.Module) -> None:
    """Reshard every FSDP2 module of ``model`` (its sharded parameters registered)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def install(model: nn.Module, config: Placement, *, measuring: bool = False) -> Any:
    """Put ``config`` on ``model`` with :func:`apply_remat` (after removing any).
    Returns the offloader installed for ``config.offloaded`` (None: none);
    ``measuring``: the one a measurement runs (see ``_offload``)."""
    remove_remat(model)
    if not config.checkpointed:
        return None
    offloader = None
    if config.offloaded:
        from ._offload import offloader_for

        offloader = offloader_for(
            sorted(config.offloaded), config.offload, measuring=measuring, pool_bytes=config.pool_bytes
        )
    blocks = {model.get_submodule(name): name for name in config.checkpointed}
    saves = {
        model.get_submodule(f"{name}.{path}")
        for name, paths in config.checkpointed.items()
        for path in paths
    }
    no_rng = {model.get_submodule(n) for n in config.checkpointed if n in config.rng_free}

    def select(m: nn.Module) -> bool | dict[str, Any]:
        # Per-module options of a policy: no RNG snapshot for these blocks.
        if m in no_rng:
            return {"preserve_rng_state": False}
        return m in blocks

    apply_remat(
        model,
        auto_wrap_policy=CustomPolicy(select),
        remat=RematConfig(
            save_modules=(lambda m: m in saves) if saves else None, saved_tensors_hooks=offloader
        ),
    )
    return offloader


def blocks_drawing_no_random_numbers(
    model: nn.Module,
    args: Sequence[Any],
    block_names: Sequence[str],
    forward: Callable[[], Any] | None = None,
    order: list[str] | None = None,
) -> list[str]:
    """The blocks, in training mode, whose forward on ``args`` left the CPU generator
    (and the current CUDA generator, if CUDA is initialized) where it found it: they
    draw no random numbers, so a checkpoint of theirs needs no RNG snapshot (5,056 B
    on CPU, more than a small block holds). A block in eval mode is never listed:
    training would switch its dropout on. ``forward``: runs the model once (default:
    ``model(*args)`` without gradients, its state put back)."""

    def state() -> list[torch.Tensor]:
        out = [torch.get_rng_state()]
        if torch.cuda.is_initialized():
            out.append(torch.cuda.get_rng_state())
        return out

    before: dict[str, list[torch.Tensor]] = {}
    drew: dict[str, bool] = {}
    handles = []
    for name in block_names:
        block = model.get_submodule(name)

        def pre(_m: nn.Module, _a: Any, _name: str = name) -> None:
            if order is not None and _name not in order:
                order.append(_name)
            with disable_current_modes():  # (a fake forward: the states are real)
                before[_name] = state()

        def post(_m: nn.Module, _a: Any, _o: Any, _name: str = name) -> None:
            with disable_current_modes():
                now = state()
                changed = any(not torch.equal(a, b) for a, b in zip(before.pop(_name), now))
            drew[_name] = drew.get(_name, False) or changed

        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(post))
    try:
        if forward is not None:
            forward()
        else:
            with preserved_state(model, args), torch.no_grad():
                model(*args)
    finally:
        for h in handles:
            h.remove()
    return [
        n for n in block_names
        if n in drew and not drew[n]
        and all(m.training for m in model.get_submodule(n).modules())
    ]


# ------------------------------------------------------------------ bytes


class PhaseTracker:
    """Splits a step into phases by block, so that a plan's step peak can be composed
    from the runs that measured its blocks' options (``RematPlan.predicted_peak``):

    * ``("forward", b)``: block ``b``'s forward, and the code run since the forward
      of the block before it returned (the embedding, for the first block);
    * :data:`HEAD`: from the last block's forward returning until the backward
      reaches a block's outputs;
    * ``("backward", b)``: from the backward reaching ``b``'s outputs (a hook on
      their gradient nodes) until it reaches another block's.

    In each phase the bytes of the blocks before ``b`` are held as they were after
    the forward (their backward comes later) and the blocks after it hold nothing
    that depends on their options (their backward is done, or their forward has not
    run). ``switch(key)`` is called at every change; a recompute running a block's
    forward again changes nothing."""

    def __init__(self, names: Sequence[str], switch: Callable[[tuple[str, str]], None]) -> None:
        self.names = list(names)
        self.switch = switch
        self.key: tuple[str, str] = ("forward", self.names[0]) if self.names else HEAD
        self.reached: set[str] = set()

    def entered(self, name: str) -> None:
        if not remat.is_recomputing():
            self._to(("forward", name))

    def left(self, name: str, out: Any) -> None:
        if remat.is_recomputing():
            return
        i = self.names.index(name)
        self._to(("forward", self.names[i + 1]) if i + 1 < len(self.names) else HEAD)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.grad_fn.register_prehook(lambda _grads, _name=name: self._reached(_name))

    def _reached(self, name: str) -> None:
        if name not in self.reached:
            self.reached.add(name)
            self._to(("backward", name))

    def _to(self, key: tuple[str, str]) -> None:
        if key != self.key:
            self.key = key
            self.switch(key)


class BlockOutputs:
    """The storages each block's forward returned (a replay's call excepted), by
    ``ident(tensor)`` (the ids of the storages under a tensor: addresses on real
    tensors, storage keys on fake ones), to name a kept storage the same in every
    run (see :data:`OutputKey`)."""

    def __init__(self, ident: Callable[[torch.Tensor], list[int]]) -> None:
        self.ident = ident
        self.returned: dict[int, dict[str, int]] = {}
        """Storage id -> block -> position of the first tensor on it in the output
        of that block's latest call."""

    def left(self, name: str, out: Any) -> None:
        if remat.is_recomputing():
            return
        seen: set[int] = set()
        for i, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor):
                for sid in self.ident(t):
                    if sid not in seen:
                        seen.add(sid)
                        self.returned.setdefault(sid, {})[name] = i

    def key(self, sid: int, allocated_by: str) -> OutputKey | None:
        """The name of storage ``sid`` allocated in block ``allocated_by``'s forward,
        if that block returned it (a block passing it on returns it too: the maker's
        is the name); None otherwise. The allocation tells an address handed out
        again apart: the block returning the earlier storage there did not make
        this one."""
        i = self.returned.get(sid, {}).get(allocated_by)
        return None if i is None else (allocated_by, i)


def checkpoint_holders(report: Any, ident: Callable[[torch.Tensor], list[int]]) -> dict[int, set[str]]:
    """Storage id -> names of the checkpoints (the blocks: ``apply_remat`` names a
    checkpoint by its module's qualified name) whose holdings in ``report`` (a
    saved-tensors report) include it: its inputs, SAVE outputs and saves, each
    checkpoint's whole list, a storage another checkpoint counted included. Ids as
    the storages' addresses; a row without them (fake tensors) by ``ident`` of its
    tensor."""
    out: dict[int, set[str]] = defaultdict(set)
    for block in report.checkpoints:
        for row in block.rows():
            ids = [st.data_ptr for st in row.storages if st.nbytes > 0]
            if not ids and row.tensor is not None:
                ids = ident(row.tensor)
            for sid in ids:
                out[sid].add(block.name)
    return dict(out)


def output_holders(
    kept: dict[int, int], allocated: dict[int, str], returned: BlockOutputs, holders: dict[int, set[str]]
) -> dict[OutputKey, tuple[int, frozenset[str]]]:
    """:attr:`Measurement.outputs` of a run: of the ``kept`` storages (id -> bytes),
    those a block allocated (``allocated``: id -> block) and returned, with the
    checkpoints holding each (``holders``, see :func:`checkpoint_holders`); one
    that no checkpoint holds is held by the graph, and its maker counts as its
    holder. (A block called twice names its calls' outputs alike: they are
    counted together.)"""
    out: dict[OutputKey, tuple[int, frozenset[str]]] = {}
    for sid, nbytes in kept.items():
        block = allocated.get(sid)
        if not block:  # (outside every block, or before the forward)
            continue
        key = returned.key(sid, block)
        if key is not None:
            before, others = out.get(key, (0, frozenset()))
            out[key] = (before + nbytes, others | frozenset(holders.get(sid) or (block,)))
    return out


def storage_ptrs(t: torch.Tensor) -> list[int]:
    """Addresses of the storages under a real tensor (a wrapper's inner ones)."""
    found: dict[int, int] = {}
    _root_storages(t, found)
    return list(found)


def _mark_phase(key: tuple[str, str]) -> None:
    """An instant profiler range naming the phase that begins now."""
    r = torch.profiler.record_function(PHASE_PREFIX + "::".join(key))
    r.__enter__()
    r.__exit__(None, None, None)


@contextlib.contextmanager
def _block_ranges(
    model: nn.Module, block_names: Sequence[str], returned: BlockOutputs | None = None
) -> Iterator[None]:
    """A profiler range around each block's forward (outside its checkpoint), and a
    mark where each phase of :class:`PhaseTracker` begins; ``returned`` records
    what each forward returns."""
    handles = []
    open_ranges: dict[nn.Module, list[Any]] = defaultdict(list)
    phases = PhaseTracker(block_names, _mark_phase)
    for name in block_names:
        block = model.get_submodule(name)

        def enter(module: nn.Module, _args: Any, _name: str = name) -> None:
            phases.entered(_name)
            r = torch.profiler.record_function(RANGE_PREFIX + _name)
            r.__enter__()
            open_ranges[module].append(r)

        def leave(module: nn.Module, _args: Any, out: Any, _name: str = name) -> None:
            open_ranges[module].pop().__exit__(None, None, None)
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


def _allocation_events(prof: Any, device: str | None = None) -> list[tuple[int, int, int, str]]:
    """``(time_ns, address, size, block)`` of every allocation (size > 0) and free
    (size < 0), ``block`` being the innermost block range around it (``device``: of
    that device type only)."""
    events = []
    stack = [(e, BASE) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        e, block = stack.pop()
        if e.name.startswith(RANGE_PREFIX):
            block = e.name[len(RANGE_PREFIX) :]
        stack.extend((c, block) for c in e.children)
        fields = e.extra_fields
        # Allocation events are the ones whose fields carry an allocation size.
        if hasattr(fields, "alloc_size") and hasattr(fields, "ptr"):
            if device is not None and getattr(fields.device, "type", device) != device:
                continue
            events.append((e.start_time_ns, fields.ptr, fields.alloc_size, block))
    events.sort(key=lambda ev: ev[0])
    return events


def held_bytes_by_block(prof: Any) -> dict[str, int]:
    """Bytes allocated under ``prof`` and still allocated at its end, by block.

    A free pairs with the *oldest* live allocation at its address: the memory at an
    address is freed before it is handed out again, but a free made on another
    thread (a gloo worker dropping a collective's buffers) can carry a later
    timestamp than the main thread's next allocation at that address."""
    live: dict[int, deque[tuple[int, str]]] = defaultdict(deque)
    for _, ptr, size, block in _allocation_events(prof):
        if size > 0:
            live[ptr].append((size, block))
        elif live.get(ptr):
            live[ptr].popleft()
    held: dict[str, int] = defaultdict(int)
    for entries in live.values():
        for size, block in entries:
            held[block] += size
    return dict(held)


def _forward_allocations(prof: Any) -> dict[int, str]:
    """Address -> block of the latest allocation made inside :data:`FORWARD_RANGE`
    on its thread (``BASE``: outside every block range). Other threads (a gloo
    worker) are not inside the range and allocate nothing the forward keeps."""
    latest: dict[int, tuple[int, str]] = {}
    stack: list[tuple[Any, str | None]] = [
        (e, None) for e in prof.profiler.kineto_results.experimental_event_tree()
    ]
    while stack:
        e, block = stack.pop()
        if e.name == FORWARD_RANGE:
            block = BASE
        elif block is not None and e.name.startswith(RANGE_PREFIX):
            block = e.name[len(RANGE_PREFIX) :]
        stack.extend((c, block) for c in e.children)
        if block is None:
            continue
        fields = e.extra_fields
        if hasattr(fields, "alloc_size") and hasattr(fields, "ptr") and fields.alloc_size > 0:
            seen = latest.get(fields.ptr)
            if seen is None or seen[0] < e.start_time_ns:
                latest[fields.ptr] = (e.start_time_ns, block)
    return {ptr: block for ptr, (_, block) in latest.items()}


def _root_storages(t: Any, out: dict[int, int]) -> None:
    if not isinstance(t, torch.Tensor):
        return
    flatten = getattr(t, "__tensor_flatten__", None)
    if type(t) is not torch.Tensor and flatten is not None:  # a wrapper (DTensor)
        for name in flatten()[0]:
            _root_storages(getattr(t, name, None), out)
        return
    if t.device.type == "meta":
        return
    st = t.untyped_storage()
    if st.nbytes() > 0:
        out[st.data_ptr()] = st.nbytes()


def kept_storages(loss: Any, report: Any = None) -> dict[int, int]:
    """Address -> bytes of every storage the step keeps for the backward of ``loss``
    (a tensor or a sequence of them): those :func:`torch_remat.saved_tensors_report`
    counts (``report``: that report of ``loss``, made already), and the loss's own.
    Found by walking the graph and the checkpoints' holdings, so the answer depends
    only on what the program holds, not on when another thread drops a buffer it
    shared."""
    out: dict[int, int] = {}
    if report is None:
        report = remat.saved_tensors_report(loss)
    for block in report.checkpoints:
        for row in block.rows():
            for s in row.storages:
                if s.nbytes > 0:
                    out[s.data_ptr] = s.nbytes
    for group in report.outside:
        for s in group.storages:
            if s.nbytes > 0:
                out[s.data_ptr] = s.nbytes
    for t in loss if isinstance(loss, (list, tuple)) else (loss,):
        _root_storages(t, out)
    return out


def kept_bytes_by_block(
    prof: Any, loss: Any, kept: dict[int, int] | None = None, allocated: dict[int, str] | None = None
) -> dict[str, int]:
    """Bytes the forward profiled by ``prof`` (inside :data:`FORWARD_RANGE`)
    allocated and the step keeps for the backward of ``loss``, by block (``kept``:
    the storages to count, default :func:`kept_storages` of ``loss``; ``allocated``:
    ``_forward_allocations(prof)``, read already)."""
    if allocated is None:
        allocated = _forward_allocations(prof)
    held: dict[str, int] = defaultdict(int)
    for ptr, nbytes in (kept_storages(loss) if kept is None else kept).items():
        block = allocated.get(ptr)
        if block is not None:
            held[block] += nbytes
    return dict(held)


def step_peak(prof: Any, leave_out: frozenset[int] = frozenset(), device: str = "cpu") -> int:
    """The most bytes allocated under ``prof`` on ``device`` (a device type) and
    alive at once, its allocations and frees in time order (from 0 when it
    started); storages at the addresses ``leave_out`` (an offloader's host buffers,
    on CPU in the same allocator) are not counted."""
    live = peak = 0
    for _, ptr, size, _ in _allocation_events(prof, device):
        if ptr in leave_out:
            continue
        live += size
        peak = max(peak, live)
    return peak


def phase_peaks(
    prof: Any, block_names: Sequence[str], leave_out: frozenset[int] = frozenset(), device: str = "cpu"
) -> dict[tuple[str, str], int]:
    """The most bytes alive at once in each phase of the step (see
    :class:`PhaseTracker`), counted as :func:`step_peak` counts them."""
    marks = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.name.startswith(PHASE_PREFIX):
            kind, _, block = e.name[len(PHASE_PREFIX):].partition("::")
            marks.append((e.start_time_ns, (kind, block)))
    marks.sort(key=lambda m: m[0])
    key = ("forward", block_names[0]) if block_names else HEAD
    live = 0
    peaks = {key: 0}
    i = 0
    for time_ns, ptr, size, _ in _allocation_events(prof, device):
        while i < len(marks) and marks[i][0] <= time_ns:
            key = marks[i][1]
            peaks[key] = max(peaks.get(key, 0), live)
            i += 1
        if ptr in leave_out:
            continue
        live += size
        peaks[key] = max(peaks[key], live)
    for _, later in marks[i:]:
        peaks[later] = max(peaks.get(later, 0), live)
    return peaks


@contextlib.contextmanager
def _profiled(
    block_names: Sequence[str] = (), model: nn.Module | None = None, returned: BlockOutputs | None = None
) -> Iterator[Any]:
    """Profile with the block ranges on (``returned``: recording what the blocks
    return) and the cycle collector off, so that what the forward allocates is
    freed by reference counting alone, the same in every run. (Frees of older
    garbage do not count: only storages allocated under the profiler are paired.
    No collection first: a full one costs seconds in a process with compiled
    code.)"""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with contextlib.ExitStack() as stack:
            if model is not None:
                stack.enter_context(_block_ranges(model, block_names, returned))
            yield stack.enter_context(_profiler())
    finally:
        if was_enabled:
            gc.enable()


def _profiler() -> torch.profiler.profile:
    # The profiler's library logs each start and stop on stderr unless its log level
    # says otherwise; it reads the level when the profiler is first used (a level the
    # caller set is kept).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, profile_memory=True)


# ------------------------------------------------------------------ recompute cost


class RecomputeCounter(TorchDispatchMode):
    """FLOPs and aten ops run while each checkpoint is recomputed, by its name: as a
    dispatch mode of its own, or through :meth:`count` from another mode's dispatch
    (the fake runs' ledger: one Python mode less at every op)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, int] = defaultdict(int)
        self.ops: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.count(func, args, kwargs, out)
        return out

    def count(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """``func`` ran on ``args`` and ``kwargs``, returning ``out``."""
        if func.namespace == "aten" and remat.is_recomputing():
            active = remat.active_checkpoint()
            name = active.checkpoint if active is not None else BASE
            self.ops[name] += 1
            self.flops[name] += op_flops(func, args, kwargs, out, flop_registry)


# ------------------------------------------------------------------ one run


def measure(
    model: nn.Module,
    args: Sequence[Any],
    loss_fn: LossFn,
    config: Placement,
    block_names: Sequence[str],
    *,
    peak: bool = False,
    measuring: bool = True,
) -> Measurement:
    """Install ``config``, run one forward and backward, and measure them.
    ``peak``: profile the backward too, for the step's peak (slower).
    ``measuring``: an offloaded placement runs the measuring offloader (every
    tensor moves as it is packed); False: the offloader a plan installs."""
    offloader = install(model, config, measuring=measuring)
    host: dict[str, int] = {}
    back: dict[str, int] = {}
    returned = BlockOutputs(storage_ptrs)
    try:
        with preserved_state(model, args):
            counter = RecomputeCounter()
            with _profiled(block_names, model, returned) as prof:
                with torch.profiler.record_function(FORWARD_RANGE):
                    loss = loss_fn(model(*args))
                report = remat.saved_tensors_report(loss)
                kept = kept_storages(loss, report)
                holders = checkpoint_holders(report, storage_ptrs)
                del report  # (its rows hold tensors: the backward must free them)
                if hasattr(offloader, "back_now"):
                    back = offloader.back_now()
                if peak:
                    with counter:
                        loss.backward()
                    del loss
            pooled = offloader.pool.addresses() if offloader is not None else frozenset()
            on_device = {p: n for p, n in kept.items() if p not in pooled}
            allocated = _forward_allocations(prof)
            held = kept_bytes_by_block(prof, None, on_device, allocated)
            outputs = output_holders(on_device, allocated, returned, holders)
            if hasattr(offloader, "host"):
                host = dict(offloader.host)  # what its buffers took, by checkpoint (= block)
            if not peak:
                with counter:
                    loss.backward()
                del loss
            device = next((p.device.type for p in model.parameters()), "cpu")
            peak_bytes = step_peak(prof, pooled, device) if peak else None
            phases = phase_peaks(prof, block_names, pooled, device) if peak else None
    finally:
        remove_remat(model)
    return Measurement(
        bytes_by_block={n: held.get(n, 0) for n in [BASE, *block_names]},
        flops_by_block={n: counter.flops.get(n, 0) for n in block_names},
        ops_by_block={n: counter.ops.get(n, 0) for n in block_names},
        host_by_block={n: host.get(n, 0) for n in block_names},
        back_by_block={n: back.get(n, 0) for n in block_names},
        peak_bytes=peak_bytes,
        phase_peaks=phases,
        outputs=outputs,
    )


def settle(model: nn.Module, args: Sequence[Any], loss_fn: LossFn) -> None:
    """Run the steps after which a wrapper stops changing its own state, unprofiled
    and leaving no trace: DDP rebuilds its gradient buckets in the first forward
    after a backward, freeing the ones it built at wrapping (the profiler, seeing a
    block freed that it did not see allocated, says so on stderr)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return
    for _ in range(2):
        with preserved_state(model, args):
            loss = loss_fn(model(*args))
            loss.backward()
            del loss


def activation_bytes(model: nn.Module, args: Sequence[Any], loss_fn: LossFn) -> int:
    """Bytes that ``loss_fn(model(*args))`` allocates and keeps for the backward
    (plus the loss), counted the way the planner counts them, with whatever remat
    ``model`` carries now. Runs the backward too, to free them."""
    with preserved_state(model, args):
        with _profiled() as prof:
            with torch.profiler.record_function(FORWARD_RANGE):
                loss = loss_fn(model(*args))
        held = sum(kept_bytes_by_block(prof, loss).values())
        loss.backward()
        del loss
    return held


def refuse_applied_remat(model: nn.Module) -> None:
    applied = remat_module_names(model)
    if applied:
        raise ValueError(
            f"plan_remat: remat is already applied to {applied}; the planner measures "
            "the model without it. Call torch_remat.integrations.remove_remat(model) "
            "first, then plan and apply the plan."
        )
