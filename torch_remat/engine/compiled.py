"""``remat.checkpoint`` and ``remat.region`` while ``torch.compile`` traces them.

The eager engine works through saved-tensor hooks and a Python replay; neither can
run inside a compiled graph. Under compilation a checkpoint therefore lowers to the
same higher-order op as ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
(Dynamo traces its body into the surrounding graph, AOTAutograd traces it again
into the joint forward/backward graph) and leaves the decision of what to save to
AOTAutograd's min-cut partitioner, steered by per-op tags:

* Dynamo records a ``remat.region`` call as ``torch.fx.traceback.annotate``
  metadata on every node it traces inside the region: ``node.meta["custom"]``
  holds the qualified region name (:data:`REGION_KEY`), whether it is a SAVE
  region (:data:`SAVE_KEY`), and the checkpoint's name (:data:`CHECKPOINT_KEY`).
* The checkpoint is traced with a selective-checkpoint ``context_fn`` whose policy
  runs once per ATen op while AOTAutograd traces the body. The FX interpreter
  that runs the body makes the Dynamo node's metadata current, so the policy reads
  the region of the op from it: ops in a SAVE region are ``MUST_SAVE``, all others
  ``PREFER_RECOMPUTE``. torch's checkpoint machinery writes the policy into
  ``node.meta["recompute"]`` of the joint graph, which the partitioner obeys.

What the eager engine does in Python has no run time of its own here: the
"recompute" is nodes of the compiled backward graph. Hence:

* ``recompute_needs_tensor`` is a no-op: the graph names every data dependency, so
  the partitioner never hands backward a tensor that was not kept.
* ``is_recomputing()`` is False in compiled code: Python is not re-run in backward.
* RNG: the compiler never re-draws a random op of the forward in backward (the
  partitioner does not recompute random ops; inductor replays them from
  functionalized seeds; a backend that runs the graph without AOTAutograd, such as
  Dynamo's ``eager``, recomputes nothing), so the stock RNG state
  hooks are not needed and are accepted and ignored. Any other state hook cannot be restored inside a graph and
  is refused with :class:`~torch_remat.RematCompileError`.
* ``early_stop``, ``rebuild`` and ``determinism_check`` concern the Python replay and do
  nothing.
* Saved-tensor hooks (``saved_tensors_hooks=``, ``input_saved_tensors_hooks=``, a
  ``remat.saved_tensors_hooks`` context) would pack what remat keeps; the compiled
  graph saves its tensors itself, so they are refused with
  :class:`~torch_remat.RematCompileError` rather than ignored. The exception is an
  ``ActivationOffloader`` as ``saved_tensors_hooks=``: the SAVE regions its
  ``regions=`` patterns match are marked (:data:`OFFLOAD_KEY`) and their ops tagged
  ``MUST_CPU_OFFLOAD``, which ``_compat.offload_tagged_saves_when_partitioning``
  makes AOTAutograd honour (the forward graph saves host copies of them).
* ``memory_budget=`` traces the body under
  ``torch.autograd.graph.region_activation_memory_budget`` and tags the ops outside
  SAVE regions ``PREFER_SAVE``, so that the partitioner chooses within the budget.
* The reports name a compiled graph's saved tensors after their checkpoint and
  region from what AOTAutograd's partition of the graph records (below).

Which checkpoint and region each tensor a compiled graph saves was traced in
(:func:`compiled_saves_of`):

A compiled forward hands its backward one autograd node
(``CompiledFunctionBackward``) holding every saved tensor, in the order of the
partitioned forward graph's outputs after the user outputs. The graph's nodes
carry the ``remat.region``/``remat.checkpoint`` annotations
(``node.meta["custom"]``, see compiled.py), but the graph is gone by run time.
So when AOTAutograd partitions a graph, the checkpoint and region of each saved
output are recorded here, keyed by the metadata object that the compiled
function keeps; the reports look the record up from the autograd node.

A saved tensor that carries no checkpoint of its own (a graph input, or the output
of code before the checkpoint) is recorded as the input of a checkpoint when every
node of the backward graph that reads it was traced in that checkpoint: then it is
held for that checkpoint alone. Read by anything else, it stays unattributed.

A record describes the graph, not one call: tensors are matched to it by
position, and a mismatch in count, dtype or a static size makes the lookup say
"not attributed" instead of guessing.

"""

from __future__ import annotations

import fnmatch
import functools
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .. import _compat
from .._errors import RematCompileError
from .context import current_pass
from .records import nested_name, refuse_recompute_inside_save
from .rng import DeviceRNGStateHook
from .saved_hooks import hooks_context_active

CHECKPOINT_KEY = "remat_checkpoint"
"""``node.meta["custom"]`` key: the name of the checkpoint a node was traced in."""
REGION_KEY = "remat_region"
"""``node.meta["custom"]`` key: the qualified name of the innermost region of a node."""
SAVE_KEY = "remat_save"
"""``node.meta["custom"]`` key: True inside a SAVE region (``recompute=False``)."""
OFFLOAD_REGIONS_KEY = "remat_offload_regions"
"""``node.meta["custom"]`` key: the ``regions=`` patterns of the checkpoint's
:class:`~torch_remat.offload.ActivationOffloader` (a tuple), set on the nodes of a
checkpoint given one as ``saved_tensors_hooks=``."""
OFFLOAD_MIN_BYTES_KEY = "remat_offload_min_bytes"
"""``node.meta["custom"]`` key: that offloader's ``min_bytes``."""
OFFLOAD_CHECKPOINTS_KEY = "remat_offload_checkpoints"
"""``node.meta["custom"]`` key: that offloader's ``checkpoints=`` patterns (a tuple):
a region offloads only inside a checkpoint whose name one matches."""
OFFLOAD_KEY = "remat_offload"
"""``node.meta["custom"]`` key: True on the nodes of a SAVE region whose qualified
name the checkpoint's offloader matches: their saved outputs go to the host."""
BUDGET_KEY = "remat_memory_budget"
"""``node.meta["custom"]`` key: the ``memory_budget=`` of the checkpoint."""


def _custom_meta() -> dict[str, Any]:
    return fx_traceback.get_current_meta().get("custom") or {}


def _output_bytes(out: Any) -> int | None:
    """Bytes of the tensors an op returned; None when a size is symbolic."""
    total = 0
    for t in _compat.tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            numel = t.numel()
            if not isinstance(numel, int):
                return None
            total += numel * t.element_size()
    return total


def region_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective-checkpoint policy of a compiled checkpoint: called for every
    ATen op AOTAutograd traces in its body, while the Dynamo node it comes from is
    the current node."""
    if not torch.compiler.is_compiling():
        # Not traced: a backend without AOTAutograd (Dynamo's "eager") runs torch's
        # checkpoint as is, with preserve_rng_state=False, so a recomputed dropout
        # would draw a new mask. Keeping every op is the safe reading there.
        return CheckpointPolicy.MUST_SAVE
    custom = _custom_meta()
    if custom.get(SAVE_KEY):
        if custom.get(OFFLOAD_KEY):
            # The offloader's min_bytes, as eagerly: a smaller output stays on the
            # device. A symbolic size is taken as large enough.
            nbytes = _output_bytes(getattr(ctx, "op_output", None))
            if nbytes is None or nbytes >= custom.get(OFFLOAD_MIN_BYTES_KEY, 0):
                return CheckpointPolicy.MUST_CPU_OFFLOAD
        return CheckpointPolicy.MUST_SAVE
    if custom.get(BUDGET_KEY) is not None:
        if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
            # Under a budget below 1 the partitioner's knapsack may recompute an op
            # it otherwise bans from recompute, a random one too: backward would
            # draw a new dropout mask. MUST_SAVE is the one tag it never overrides.
            return CheckpointPolicy.MUST_SAVE
        # Under a memory budget the partitioner chooses what bare code keeps:
        # PREFER_SAVE is no constraint to it (only *_RECOMPUTE and MUST_SAVE are).
        return CheckpointPolicy.PREFER_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# A functools.partial of a module-level function: Dynamo stores it as a constant in
# the checkpoint op (a closure would be refused).
# Cache entries may be modified in place (dropout draws into a buffer with
# bernoulli_ and scales it with div_): only the untraced path caches, and it
# replays nothing, so the cached tensor is the final one either way.
_REGION_CONTEXT_FN = functools.partial(
    create_selective_checkpoint_contexts, region_policy, allow_cache_entry_mutation=True
)
_compat.quiet_own_context_fn_warning(_REGION_CONTEXT_FN)  # the user passed no context_fn


@_compat.assume_constant_result
def _enclosing_region() -> tuple[str, bool]:
    # Read while Dynamo traces (the annotations of the enclosing regions are
    # current then) and baked into the graph as a constant, so no guard is needed.
    custom = _custom_meta()
    return custom.get(REGION_KEY, ""), bool(custom.get(SAVE_KEY, False))


@_compat.assume_constant_result
def _offloads(qualname: str) -> bool:
    # Whether the offloader of the enclosing checkpoint moves what region
    # ``qualname`` keeps: its patterns match the name as the eager pack hook's do.
    custom = _custom_meta()
    patterns = custom.get(OFFLOAD_REGIONS_KEY)
    if not patterns or not any(fnmatch.fnmatchcase(qualname, p) for p in patterns):
        return False
    # and its checkpoint (the innermost) one the offloader's checkpoints= match
    checkpoint = custom.get(CHECKPOINT_KEY) or ""
    return any(fnmatch.fnmatchcase(checkpoint, p) for p in custom.get(OFFLOAD_CHECKPOINTS_KEY, ("*",)))


@_compat.assume_constant_result
def _eager_checkpoint_running() -> bool:
    return current_pass() is not None


def refuses_state_hook(hook: Any) -> bool:
    """True for a state hook a compiled checkpoint cannot honour: anything but the
    stock RNG hooks, whose state the compiler replays itself."""
    return not isinstance(hook, DeviceRNGStateHook)


def _raise_compile_error(message: str) -> None:
    raise RematCompileError(message)


# A refusal runs as a graph break (torch.compiler.disable): raised while Dynamo
# traces, the error would only make Dynamo fall back to eager, or, under
# fullgraph=True, turn into its "observed exception" report without our text.
# Under fullgraph=True Dynamo cannot break there and reports the disabled call
# with its reason, so the reason is the message itself where it can be.
# Built once Dynamo is imported (torch.compiler.disable imports it, which a program
# that never compiles should not pay for), before anything is traced.
_REFUSE_REASONS = {
    "option": "it raises RematCompileError: a remat.checkpoint option that cannot work under "
    "torch.compile (state hooks other than the RNG hooks, saved_tensors_hooks, "
    "input_saved_tensors_hooks); without fullgraph=True the RematCompileError names "
    "the checkpoint and the option",
    "ambient hooks": "it raises RematCompileError: a remat.saved_tensors_hooks context is active "
    "around a compiled remat.checkpoint, and its hooks cannot run inside a compiled graph; "
    "leave the context out of compiled code or run the block eagerly",
}
_refusers: dict[str, Callable[[str], None]] = {}


def _refuser(kind: str) -> Callable[[str], None]:
    """The disabled function that raises a refusal of ``kind`` (see _REFUSE_REASONS)."""
    refuse = _refusers.get(kind)
    if refuse is None:
        refuse = _refusers[kind] = torch.compiler.disable(
            _raise_compile_error, reason=_REFUSE_REASONS[kind]
        )
    return refuse


def _build_refusers() -> None:
    for kind in _REFUSE_REASONS:
        _refuser(kind)


_compat.when_dynamo_imported(_build_refusers)


_refusals: dict[str, Callable[[], None]] = {}


def _refusal(message: str) -> Callable[[], None]:
    if torch.compiler.is_compiling():
        # Decorated while Dynamo traces, where torch.compiler.disable cannot run.
        return functools.partial(_refuser("option"), message)
    refuse = _refusals.get(message)
    if refuse is None:
        refuse = torch.compiler.disable(
            functools.partial(_raise_compile_error, message),
            reason=f"it raises RematCompileError: {message}",
        )
        _refusals[message] = refuse
    return refuse


def _state_hooks_message(name: str, hooks: tuple[Any, ...]) -> str:
    names = ", ".join(type(h).__name__ for h in hooks if refuses_state_hook(h))
    return (
        f"torch_remat: checkpoint '{name}' runs under torch.compile with "
        f"recompute_state_hooks ({names}) that the compiled graph cannot call: its "
        "recompute is part of the compiled backward, where no Python runs, so "
        "snapshot() and restore() would never be called. RNG needs no hook under "
        "compile (the compiler replays random ops itself). Make the state a tensor "
        "input of the checkpointed function, or compile inside the checkpoint "
        "instead: remat.checkpoint(...)(torch.compile(block))."
    )


def _pack_hooks_message(name: str, options: list[str]) -> str:
    given = " and ".join(options)
    return (
        f"torch_remat: checkpoint '{name}' was given {given}, which cannot run under "
        "torch.compile: the compiled graph saves its tensors for backward itself and "
        "calls no remat pack or unpack hook, so these hooks would never be called. "
        "An ActivationOffloader as saved_tensors_hooks= is the exception: it compiles "
        "to torch's CPU-offload tags for the SAVE regions its regions= patterns match "
        "(a compiled graph cannot offload its inputs, so input_saved_tensors_hooks= "
        "stays refused). Run this block eagerly (leave it out of torch.compile, e.g. "
        "with torch.compiler.disable), or drop the option and offload what the "
        "compiled graph saves with torch's own hooks around the compiled call "
        "(torch.autograd.graph.save_on_cpu() or torch.autograd.graph.saved_tensors_hooks)."
    )


def _ambient_hooks_message(name: str) -> str:
    return (
        f"torch_remat: checkpoint '{name}' runs under torch.compile inside a "
        "remat.saved_tensors_hooks context, whose hooks cannot run there: the compiled "
        "graph saves its tensors for backward itself and calls no remat pack or unpack "
        "hook. Leave the context out around compiled code, run this block eagerly, or "
        "use torch's own hooks around the compiled call "
        "(torch.autograd.graph.save_on_cpu() or torch.autograd.graph.saved_tensors_hooks). "
        "To offload SAVE regions of a compiled checkpoint, pass the ActivationOffloader "
        "as the checkpoint's saved_tensors_hooks= instead."
    )


OffloadSpec = tuple[tuple[str, ...], str, tuple[str, ...]]
"""What a compiled checkpoint takes from its offloader: ``(regions patterns, min_bytes,
checkpoints patterns)``, ``min_bytes`` in decimal digits. (A number Dynamo reads off an
object becomes symbolic under ``dynamic=True``, or once a recompile sees it change, as
when two blocks of one class have different options; the annotation takes constants
only. A string is guarded by its value and turned back into the number while tracing,
a constant.)"""


def offload_spec(pair: Any) -> OffloadSpec | None:
    """The offload a compiled checkpoint does for its ``saved_tensors_hooks=``
    option: for an :class:`~torch_remat.offload.ActivationOffloader` that moves what
    SAVE regions keep (``kinds`` holding ``BACKWARD`` or ``SAVE_OUTPUT``), its
    ``regions=`` patterns, ``min_bytes`` and ``checkpoints=`` patterns; None for any
    other hooks."""
    from .. import SavedTensorKind
    from ..offload.offloader import ActivationOffloader

    owner = getattr(getattr(pair, "pack", None), "__self__", None)
    if not isinstance(owner, ActivationOffloader) or pair.unpack != owner.unpack_hook:
        return None
    if not owner.kinds & {SavedTensorKind.BACKWARD, SavedTensorKind.SAVE_OUTPUT}:
        return None  # it moves only checkpoint inputs, which a compiled graph cannot
    return tuple(owner.regions), str(int(owner.min_bytes)), tuple(owner.checkpoints)


def option_refusal(
    name: str, hooks: tuple[Any, ...], kept: tuple[Any, Any]
) -> Callable[[], None] | None:
    """What a compiled call of checkpoint ``name`` must raise for its options, built
    when the checkpoint is created: None when every option works under compile."""
    if any(refuses_state_hook(h) for h in hooks):
        return _refusal(_state_hooks_message(name, hooks))
    options = [
        option
        for option, pair in zip(("saved_tensors_hooks", "input_saved_tensors_hooks"), kept)
        if pair is not None and not (option == "saved_tensors_hooks" and offload_spec(pair) is not None)
    ]
    if options:
        return _refusal(_pack_hooks_message(name, options))
    return None


def _budget_error(joint: Any, error: RuntimeError) -> Exception | None:
    """The partitioner's refusal of a budget that does not cover its whole graph (or
    of two budgets in one), said in terms of the checkpoints given ``memory_budget``."""
    if "region_activation_memory_budget" not in str(error):
        return None
    budgets: dict[str, float] = {}
    for node in joint.graph.nodes:
        custom = node.meta.get("custom") or {}
        if custom.get(BUDGET_KEY) is not None:
            budgets.setdefault(str(custom.get(CHECKPOINT_KEY)), custom[BUDGET_KEY])
    if not budgets:
        return None
    named = ", ".join(f"'{name}' (memory_budget={b})" for name, b in budgets.items())
    hints = _unbudgeted_op_hints(joint, str(error))
    if hints:
        return RematCompileError(
            f"torch_remat: checkpoint {named} runs under torch.compile in a graph torch's "
            "partitioner cannot budget: its budget must cover every forward op of the "
            "graph, and torch added ops of its own outside the checkpoint's traced body: "
            + "; ".join(hints) + f". torch said: {error}"
        )
    return RematCompileError(
        f"torch_remat: checkpoint {named} runs under torch.compile in a graph torch's "
        "partitioner cannot budget: it applies one activation memory budget to a whole "
        "compiled graph, which must cover every forward op of the graph and be the "
        "same everywhere. Compile the checkpointed block by itself (block.compile() "
        "after apply_remat) so that the checkpoint is the whole graph, move the other "
        "code into the checkpoint, or separate it with torch._dynamo.graph_break(). "
        f"torch said: {error}"
    )


def _unbudgeted_op_hints(joint: Any, error: str) -> list[str]:
    """What the ops torch's refusal lists as unannotated are, where torch adds them
    itself (no placement of the checkpoint helps), and what to do about each."""
    found = re.search(r"Unannotated ops: \[(.*?)\]", error)
    names = re.findall(r"'([^']+)'", found.group(1)) if found else []
    hints = []
    if any(n.startswith("inductor_seeds") for n in names):
        hints.append(
            "inductor's seeds for the block's random ops (dropout); a budget cannot cover "
            "them under inductor: compile with backend='aot_eager', or drop memory_budget "
            "for blocks with random ops"
        )
    if any(n.startswith("copy_") for n in names):
        hints.append(
            "the in-place updates of the block's buffers or inputs (a training-mode "
            "BatchNorm's running statistics), which torch applies after the traced body: "
            "drop memory_budget for blocks that update buffers"
        )
    # (Dynamo hands a float that changed between calls to the recompiled graph as a
    # 0-d tensor input, which the unannotated ops convert and use)
    unannotated = [n for n in joint.graph.nodes if n.name in names]
    if any(
        getattr(a, "op", None) == "placeholder" and isinstance(a.meta.get("val"), torch.Tensor)
        and a.meta["val"].dim() == 0
        for n in unannotated for a in n.args
    ):
        hints.append(
            "the arithmetic on a Python number the block reads (a float attribute or "
            "module-level variable) that changed between calls and became an input of the "
            "recompiled graph: keep it constant, or set "
            "torch._dynamo.config.specialize_float = True"
        )
    return hints


@_compat.assume_constant_result
def _observe_partitions() -> bool:
    # Runs once per trace, outside the graph: from now on AOTAutograd's partitions
    # record which checkpoint and region each saved tensor comes from (reports),
    # and honour the CPU-offload tags of offloaded regions.
    observe_compiled_partitions()
    _compat.offload_tagged_saves_when_partitioning(_budget_error)
    _compat.save_tensors_of_multi_output_must_saves()
    return True


def run_checkpoint(
    fn: Callable[..., Any],
    name: str,
    refusal,
    args,
    kwargs,
    offload: OffloadSpec | None = None,
    budget: str | None = None,
):
    """``remat.checkpoint(region_name=name)(fn)(*args, **kwargs)`` while Dynamo
    traces; ``refusal`` is :func:`option_refusal`'s, ``offload`` :func:`offload_spec`'s
    and ``budget`` the checkpoint's ``memory_budget`` as ``repr`` writes it (a string,
    as ``min_bytes`` in :data:`OffloadSpec`)."""
    memory_budget = None if budget is None else float(budget)
    if refusal is not None:
        refusal()
    if hooks_context_active():  # Dynamo guards on it: entering one retraces
        _refuser("ambient hooks")(_ambient_hooks_message(name))
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    _observe_partitions()

    # Keyword arguments go through a closure: torch's checkpoint would take those
    # named like its own options (debug, early_stop, ...) for itself.
    def body(*body_args: Any) -> Any:
        return fn(*body_args, **kwargs)

    annotation: dict[str, Any] = {CHECKPOINT_KEY: name, BUDGET_KEY: memory_budget}
    if offload is not None:
        # Regions inside read the patterns (_offloads); a nested checkpoint without
        # an offloader of its own stays under this one's, as eagerly under a context.
        regions, min_bytes, checkpoints = offload
        annotation[OFFLOAD_REGIONS_KEY] = regions
        annotation[OFFLOAD_MIN_BYTES_KEY] = int(min_bytes)
        annotation[OFFLOAD_CHECKPOINTS_KEY] = checkpoints
    with fx_traceback.annotate(annotation):
        if memory_budget is None:
            return torch.utils.checkpoint.checkpoint(
                body, *args, use_reentrant=False, context_fn=_REGION_CONTEXT_FN
            )
        # torch's annotation of the body's nodes, read by the partitioner (which
        # wants it on every forward op of the graph).
        with torch.autograd.graph.region_activation_memory_budget(memory_budget):
            return torch.utils.checkpoint.checkpoint(
                body, *args, use_reentrant=False, context_fn=_REGION_CONTEXT_FN
            )


def run_region(fn: Callable[..., Any], name: str, recompute: bool, args, kwargs) -> Any:
    """``remat.region(fn, name, recompute=...)(*args, **kwargs)`` while Dynamo traces.
    ``name`` carries the ``remat.name_scope`` prefixes and ``fn`` runs without them,
    as in eager (``api.region``), so compiled reports name regions as eager ones do.
    Outside a compiled checkpoint the annotation steers nothing."""
    outer, outer_saves = _enclosing_region()
    qualname = nested_name(outer, name)
    if outer_saves and recompute:
        raise refuse_recompute_inside_save(qualname, outer)
    annotation: dict[str, Any] = {REGION_KEY: qualname, SAVE_KEY: not recompute}
    annotation[OFFLOAD_KEY] = not recompute and _offloads(qualname)
    with fx_traceback.annotate(annotation):
        return fn(*args, **kwargs)


def eager_checkpoint_running() -> bool:
    """True while Dynamo traces code that an eager ``remat.checkpoint`` calls
    (``remat.checkpoint(...)(torch.compile(block))``). Regions there are plain
    calls: the compiled block is one autograd op to the eager checkpoint, saved
    and replayed whole."""
    return _eager_checkpoint_running()


# ----------------------------------------------- where a compiled graph's saves come from


@dataclass(frozen=True)
class CompiledSave:
    """One tensor output of a partitioned forward graph saved for backward."""

    node: str  # the forward graph node's name (``tanh``, ``primals_1``)
    checkpoint: str | None  # the remat checkpoint it was traced in, or is an input of
    region: str | None  # the qualified name of its innermost region, if any
    dtype: torch.dtype | None
    shape: tuple[int | None, ...] | None  # None for a symbolic size
    is_input: bool = False  # traced outside ``checkpoint``, read only by its backward
    offloaded: bool = False  # a host copy of ``node``'s output (an offloaded region's)

    def matches(self, t: torch.Tensor) -> bool:
        if self.dtype is not None and t.dtype != self.dtype:
            return False
        if self.shape is None:
            return True
        return len(self.shape) == t.dim() and all(
            s is None or s == n for s, n in zip(self.shape, t.shape)
        )


@dataclass(frozen=True)
class CompiledSaves:
    """The saved tensors of one compiled graph, in the order its autograd node
    holds them: ``save_for_backward``'s, then those kept without a version check."""

    checked: tuple[CompiledSave, ...]
    unchecked: tuple[CompiledSave, ...]


# id(metadata) -> (a weak reference to it, its record)
_records: dict[int, tuple[Any, CompiledSaves]] = {}


def _static(size: Any) -> int | None:
    return size if isinstance(size, int) else None


def _checkpoint_of(node: Any) -> str | None:
    return (getattr(node, "meta", {}).get("custom") or {}).get(CHECKPOINT_KEY)


def _sole_reader(placeholder: Any) -> str | None:
    """The checkpoint every backward node reading ``placeholder`` was traced in."""
    if placeholder is None or not placeholder.users:
        return None
    readers = {_checkpoint_of(user) for user in placeholder.users}
    return readers.pop() if len(readers) == 1 else None


def _describe(node: Any, backward_inputs: dict[str, Any]) -> CompiledSave | None:
    """None for what is not a tensor (a symbolic int, an opaque object)."""
    val = getattr(node, "meta", {}).get("val")
    if not isinstance(val, torch.Tensor):
        return None
    source = _compat.host_copy_source(node)
    if source is not None:
        # The host copy of an offloaded save: named and placed after what it copies.
        return CompiledSave(
            source.name,
            _checkpoint_of(source),
            (source.meta.get("custom") or {}).get(REGION_KEY),
            val.dtype,
            tuple(_static(s) for s in val.shape),
            offloaded=True,
        )
    checkpoint = _checkpoint_of(node)
    is_input = False
    if checkpoint is None:
        # The backward graph's placeholder for a saved tensor has its forward name.
        checkpoint = _sole_reader(backward_inputs.get(node.name))
        is_input = checkpoint is not None
    return CompiledSave(
        node.name,
        checkpoint,
        None if is_input else (node.meta.get("custom") or {}).get(REGION_KEY),
        val.dtype,
        tuple(_static(s) for s in val.shape),
        is_input,
    )


def _record(fw_module: Any, bw_module: Any, fw_metadata: Any, num_forward_outputs: int) -> None:
    try:
        (output,) = fw_module.graph.find_nodes(op="output")
        backward_inputs = {p.name: p for p in bw_module.graph.find_nodes(op="placeholder")}
        checked: list[CompiledSave] = []
        unchecked: list[CompiledSave] = []
        for node in output.args[0][num_forward_outputs:]:
            save = _describe(node, backward_inputs)
            if save is not None:
                unchecked_save = node.meta.get("saved_tensor_with_no_vc_check", False)
                (unchecked if unchecked_save else checked).append(save)
        key = id(fw_metadata)
        ref = weakref.ref(fw_metadata, lambda _ref, key=key: _records.pop(key, None))
    except Exception:
        # A graph this code does not understand (another torch release): its saves
        # are reported as not attributed; compiling must not fail over a report.
        return
    _records[key] = (ref, CompiledSaves(tuple(checked), tuple(unchecked)))


def observe_compiled_partitions() -> None:
    """Record the saves of every graph AOTAutograd partitions from now on."""
    _compat.observe_saved_tensor_partition(_record)


def is_compiled_node(node: Any) -> bool:
    """True for the autograd node of an AOTAutograd-compiled graph."""
    return _compat.compiled_function_metadata(node) is not None


def compiled_saves_of(node: Any) -> CompiledSaves | None:
    """The record of a compiled graph's autograd node; None for other nodes and for
    graphs partitioned before recording began (or loaded from a cache)."""
    metadata = _compat.compiled_function_metadata(node)
    if metadata is None:
        return None
    entry = _records.get(id(metadata))
    if entry is None or entry[0]() is not metadata:
        return None
    return entry[1]


def unchecked_saves(node: Any) -> list[Any]:
    """The tensors a compiled node keeps without a version check."""
    return _compat.unchecked_compiled_saves(node)

