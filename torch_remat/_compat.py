"""Every private PyTorch API torch_remat uses, in one place.

torch_remat is tested on torch 2.13.0, the floor declared in pyproject.toml, and on
2.15.0. Each name below is an internal of those releases; when a torch upgrade moves
one, this is the only module to change. Uses outside this module are only of public
names. Where a later release made a name public, the public one is used where it
exists and the private one stays here as the fallback for older releases.

===============================================  =============================================
private name                                      why torch_remat needs it
===============================================  =============================================
``_C._autograd._push/_pop/_top_saved_tensors_    push hooks without a context manager object
default_hooks``                                   per checkpoint (the pack path is hot), and
                                                  read the hooks active around a checkpoint
``_C._autograd._saved_tensors_hooks_*``           tell ``disable_saved_tensors_hooks`` apart
                                                  and keep its message across stack surgery
``_C._autograd._make_saved_tensor``               store kept inputs as autograd SavedTensors
                                                  (user hooks and the in-place check apply)
``_C._autograd._get_sequence_nr``                 which autograd nodes a checkpoint created
``_C._current_graph_task_id``,                    key recomputed tensors by the backward
``_C._get_graph_exec_group``                      (graph task) that needs them
``_C._autograd._profiler_enabled``                build profiler range names only when profiling
``_C._DisableTorchDispatch``                      compare state snapshots below dispatch modes
``Tensor._version``, ``Tensor._base``,           check saves, kept outputs, module state and
``UntypedStorage._cdata``,                        arguments for in-place writes; follow views
``Node._sequence_nr``                             to their storage root; tell storages apart
                                                  without reading data pointers (fake tensors);
                                                  which autograd nodes a checkpoint created
``Tensor._backward_hooks``,                        remove the hooks a replay registers on
``Tensor._post_accumulate_grad_hooks``            tensors it did not create (a parameter's)
``_C._autograd._unsafe_set_version_counter``      give a buffer's replay copy the version the
                                                  forward saw (saved-tensor checks compare it)
``_C._disabled_torch_function_impl``              a placeholder's torch_function after its in-place check
``torch.utils.checkpoint``'s hook functions       refuse a checkpoint started inside torch's
(by their module)                                 checkpoint (a block checkpointed twice)
``utils.checkpoint._Holder``                       what torch's checkpoint packs: the reports
                                                  say how many such saves they cannot count
``_neg_view``                                     give a kept output held through its storage
                                                  root back its negative bit
``_disable_dynamo``                               run the replay eagerly under compiled autograd
``_dynamo.disable(reason=)``                      run the scope's entry and exit eagerly, saying why
                                                  (imported at the first call, as ``_disable_dynamo``)
``_dynamo_marked_constant`` (function attribute)  what ``torch.compiler.assume_constant_result``
                                                  sets, set without importing Dynamo
``_C._cuda_attach_out_of_memory_observer``        the CUDA OOM observer (CUDA builds only)
``_C._cuda_isHistoryEnabled``                     allocation sites from the memory history
``_functorch._aot_autograd.graph_compile.         see which forward-graph node each tensor a
_categorize_saved_tensors_for_backward``          compiled graph saves comes from (reports)
``_functorch._aot_autograd.graph_compile.         turn the CPU-offload tags of a compiled
_partition_joint_graph_into_fw_bw``,              checkpoint into the marks torch's activation
``_functorch.config.enable_activation_            offloading pass reads (2.13 tags such ops but
offloading``, node meta ``should_offload`` /      neither keeps nor offloads them), and see
``saved_for_offloading``                          which saves went to the host (reports)
``_functorch.partitioners.choose_saved_values_    under a memory budget below 1, save the
set``                                             tensors of a MUST_SAVE multi-output op
                                                  (layer norm, dropout), not its tuple
``CompiledFunction.metadata``, ``node.            the AOTAutograd metadata and the saves
_forward_cls``, ``ctx._tensors_no_vc_check``      without version check of a compiled node
``utils._pytree.tree_flatten/tree_unflatten/      find the tensors in a region's arguments and
tree_map/SUPPORTED_NODES``                        outputs, and rebuild the containers, exactly
                                                  as autograd and torch.compile see them
``utils._python_dispatch.TorchDispatchMode``      record the aten ops a scope or the planner's
                                                  measuring pass runs
``Tensor._make_wrapper_subclass``                 a placeholder tensor without storage
``nn.modules.batchnorm._NormBase``                tell batch norms apart: their kernels update
                                                  running stats without bumping versions
``_subclasses.fake_tensor.FakeTensor``            leave fake tensors' graphs out of the reports;
(``FakeTensorMode``), ``utils._python_dispatch    the planner's forecast runs its measurements
._disable_current_modes``                         on fake tensors (and steps out of the mode)
``_subclasses.fake_tensor.DataDependentOutput     the forecast names the op and the module that
Exception`` (``DynamicOutputShapeException``)     read tensor values a fake tensor does not have
``cuda.memory._snapshot``                         the allocator's blocks with their stacks
                                                  (allocation sites, snapshot annotation)
``distributed.algorithms._checkpoint.checkpoint_  recognise torch's checkpoint wrappers and read
wrapper`` (``CheckpointImpl``, ``CheckpointWrap   their options (apply_remat takes the arguments
per``, ``OffloadWrapper``, ``checkpoint_wrapper   of apply_activation_checkpointing); torch
``, ``offload_wrapper``)                          exports them only from this module; the
                                                  module itself, whose two functions the
                                                  switch torch_checkpointing_as_remat replaces
``distributed.fsdp.wrap._Policy``,                tell an FSDP auto-wrap policy object from a
``_Policy._run_policy``                           callable one and ask it which modules it
                                                  wraps, as torch's own code does
``distributed.tensor._random`` (``_rng_tracker``  create DTensor's RNG tracker before the first
, ``OffsetBasedRNGTracker``, ``is_rng_supported_  checkpoint, as its dispatcher would at the
mesh``)                                           first random op (no public constructor)
``testing._internal.distributed.fake_pg``         register the "fake" process-group backend: a
                                                  layout's forecast runs the real FSDP2 / tensor
                                                  parallel code for N ranks in one process
``_higher_order_ops.wrap`` logger and its         drop torch's context_fn warning for the
``tag_activation_checkpoint_impl`` frame          region policy torch_remat passes itself
``_checkpoint_internal``, ``_user_hooks`` (the    mark torch_remat's pack hooks as not the
attributes ``utils.checkpoint`` reads on a pack   user's, so that SAC (2.15+) routes what it
hook)                                             caches through the user's hooks only
``autograd.Variable._execution_engine``           free refills a backward did not use when it
``.queue_callback``                               ends; before 2.15 only (from 2.15: the public
                                                  ``autograd.graph.queue_callback``)
``_C._get/_set_`` of the float32 matmul           run the replay under the switches its
precision, fp32 precision per backend, cuDNN,     forward ran under (TORCH_SETTINGS): they
oneDNN, SDPA backends, deterministic algorithms   change what an op computes or saves
``autograd.forward_ad._current_level``          say that a replay differs because its forward
                                                  ran on dual tensors
``aten._local_scalar_dense``                     the planner's fake run answers a value read
                                                  where it knows the value
``nn.modules.module._global_forward_*hooks*``    run the replay with the forward hooks of its
(and a module's ``_forward_*hooks*`` dicts)        forward, added or removed since (hooks.py)
``_C._len_torch_function_stack``, ``_get_         run the replay under the TorchFunctionModes
function_stack_at``, ``_push_on/_pop_torch_       of its forward (a ``torch.device`` block)
function_stack``
``_C._len_torch_dispatch_stack``                  tell a replay under other TorchDispatchModes
                                                  than its forward (composite ops' out-of-place
                                                  variants: saves at other versions)
``_C._is_any_autocast_enabled``                  skip reading each device's autocast state at
                                                  every checkpoint call when none is on
the memory layout of ``CPUGeneratorImpl``        tell whether a random number was drawn from
(its mt19937 words and cached normal samples,     the CPU generator without ``get_state()``
found and checked at first use)                   (a 5 KB tensor) twice per checkpoint call
``_C.DisableTorchFunction``                       run those checks' ops outside the caller's
                                                  TorchFunctionModes (a ``torch.device`` block)
===============================================  =============================================

The torch.distributed names are looked up on first use, so that ``import torch_remat``
works on builds of torch without torch.distributed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import operator
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import (
    DataDependentOutputException as DataDependentOutputException,
)
from torch._subclasses.fake_tensor import DynamicOutputShapeException as DynamicOutputShapeException
from torch._subclasses.fake_tensor import FakeTensor as FakeTensor
from torch._subclasses.fake_tensor import FakeTensorMode as FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # noqa: F401
from torch.utils._pytree import SUPPORTED_NODES as _PYTREE_NODES
from torch.utils._pytree import tree_flatten as tree_flatten
from torch.utils._pytree import tree_map as tree_map
from torch.utils._pytree import tree_unflatten as tree_unflatten


def tree_leaves(tree: Any) -> list[Any]:
    """``tree_flatten(tree)[0]``, several times faster on what aten ops take and
    return (tensors and numbers in plain tuples, lists and dicts): any other node
    type (a ``torch.Size``, a named tuple, a registered class) flattens through
    ``tree_flatten`` itself, so the leaves and their order are always its."""
    out: list[Any] = []
    if _plain_leaves(tree, out):
        return out
    return tree_flatten(tree)[0]


def _plain_leaves(tree: Any, out: list[Any]) -> bool:
    kind = type(tree)
    if kind is tuple or kind is list:
        items = tree
    elif kind is dict:
        items = tree.values()  # (pytree flattens a dict in insertion order)
    elif kind in _PYTREE_NODES or isinstance(tree, tuple):
        return False
    else:
        out.append(tree)
        return True
    for x in items:
        kind = type(x)
        if kind is tuple or kind is list or kind is dict or kind in _PYTREE_NODES or isinstance(x, tuple):
            if not _plain_leaves(x, out):
                return False
        else:
            out.append(x)
    return True

# the releases CI tests on (scripts/test.sh, TORCH_VERSION): the floor and the newest
TESTED_TORCH = ("2.13.0", "2.15.0")

push_saved_tensors_hooks = torch._C._autograd._push_saved_tensors_default_hooks
pop_saved_tensors_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
saved_tensors_hooks_disabled_message = (
    torch._C._autograd._saved_tensors_hooks_get_disabled_error_message
)
enable_saved_tensors_hooks = torch._C._autograd._saved_tensors_hooks_enable
disable_saved_tensors_hooks = torch._C._autograd._saved_tensors_hooks_disable
make_saved_tensor = torch._C._autograd._make_saved_tensor
SavedTensor = torch._C._autograd.SavedTensor
autograd_sequence_nr = torch._C._autograd._get_sequence_nr
current_graph_task_id = torch._C._current_graph_task_id
# the autograd node whose backward is running on this thread (None outside one)
current_autograd_node = torch._C._current_autograd_node
# Newer than the rest: absent, every backward is its own group.
get_graph_exec_group = getattr(torch._C, "_get_graph_exec_group", lambda: None)
profiler_enabled = torch._C._autograd._profiler_enabled
DisableTorchDispatch = torch._C._DisableTorchDispatch
set_version_counters = torch._C._autograd._unsafe_set_version_counter
disabled_torch_function_impl = torch._C._disabled_torch_function_impl
disable_dynamo = torch._disable_dynamo


def disable_dynamo_saying(reason: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: ``fn`` runs eagerly where torch.compile traces its caller (a graph
    break), and under ``fullgraph=True`` Dynamo's error carries ``reason``. Dynamo is
    imported at the first call, not here (as ``torch._disable_dynamo`` does)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        disabled: list[Callable[..., Any]] = []

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not disabled:
                import torch._dynamo

                disabled.append(torch._dynamo.disable(fn, reason=reason, wrapping=False))
            return disabled[0](*args, **kwargs)

        return run

    return decorate
make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
BatchNormBase = torch.nn.modules.batchnorm._NormBase


def fake_tensor_type() -> type:
    """``torch._subclasses.fake_tensor.FakeTensor``: the reports skip the graphs of fake
    tensors (a tracing mode's, whose storages must not be touched)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def cuda_memory_snapshot() -> dict:
    """``torch.cuda.memory._snapshot()``: the caching allocator's segments and blocks."""
    return torch.cuda.memory._snapshot()


_CHECKPOINT_WRAPPER_NAMES = (
    "CheckpointImpl", "CheckpointWrapper", "OffloadWrapper", "checkpoint_wrapper",
    "offload_wrapper",
)


def __getattr__(name: str):
    """The torch.distributed names of the table above, imported on first use."""
    if name in _CHECKPOINT_WRAPPER_NAMES:
        from torch.distributed.algorithms._checkpoint import checkpoint_wrapper

        return getattr(checkpoint_wrapper, name)
    if name == "FSDPPolicy":
        from torch.distributed.fsdp.wrap import _Policy

        return _Policy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def checkpoint_wrapper_module():
    """torch's ``distributed.algorithms._checkpoint.checkpoint_wrapper`` module itself:
    ``torch_checkpointing_as_remat`` replaces its ``apply_activation_checkpointing``
    and ``checkpoint_wrapper`` while it is open."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper

    return checkpoint_wrapper


def run_fsdp_policy(policy, model) -> dict:
    """The modules an FSDP ``_Policy`` object selects in ``model`` (none ignored), each
    with its wrapper kwargs: what ``apply_activation_checkpointing`` asks of it."""
    return policy._run_policy(model, ignored_modules=set(), root_kwargs={})


def register_fake_process_group() -> None:
    """Make ``dist.init_process_group("fake", ...)`` available: torch registers the
    backend (collectives that move no data, for any world size in one process) when
    its testing module is imported; it is exported nowhere else."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


def dtensor_rng_tracker() -> object | None:
    """DTensor's RNG tracker (``torch.distributed.tensor._random._rng_tracker``), None
    before DTensor or :func:`create_dtensor_rng_tracker` made one."""
    from torch.distributed.tensor import _random

    return _random._rng_tracker


def dtensor_rng_supported_mesh(mesh) -> bool:
    """Whether DTensor draws random numbers on ``mesh`` through its RNG tracker."""
    from torch.distributed.tensor import _random

    return _random.is_rng_supported_mesh(mesh)


def create_dtensor_rng_tracker(mesh) -> None:
    """Make DTensor's RNG tracker for ``mesh``, as DTensor's dispatcher does at its
    first random op (rank 0's generator state is broadcast: call on every rank)."""
    from torch.distributed.tensor import _random

    _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh, run_state_sync=True)
neg_view = torch._neg_view
torch_checkpoint_holder_type = getattr(torch.utils.checkpoint, "_Holder", None)


def is_torch_checkpoint_hooks(hooks) -> bool:
    """Are ``(pack, unpack)`` the saved-tensor hooks of ``torch.utils.checkpoint``
    (non-reentrant, in its forward or its recompute)?"""
    return getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


def cuda_memory_history_may_be_enabled() -> bool:
    """False only when the allocator says it records no history (then a snapshot
    has no frames to read)."""
    enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    return enabled is None or bool(enabled())


def cuda_memory_snapshot_available() -> bool:
    """Whether ``torch.cuda.memory._snapshot()`` can be taken here: a CUDA device is
    available (a CUDA build on a machine without a GPU has the binding but no
    allocator to read) and the build has the binding (CPU-only builds lack it)."""
    return torch.cuda.is_available() and hasattr(torch._C, "_cuda_memorySnapshot")


queue_backward_callback = getattr(
    torch.autograd.graph, "queue_callback", torch.autograd.Variable._execution_engine.queue_callback
)
"""Run ``callback`` when the current backward (graph task) finishes (public from
torch 2.15 as ``torch.autograd.graph.queue_callback``)."""


def mark_internal_pack_hook(hook: Any, user_hooks_attribute: str | None = None) -> None:
    """Make ``torch.utils.checkpoint`` count ``hook``, a pack hook torch_remat pushes
    (a function, or a class whose instances are the pack hooks), as internal rather
    than the user's.

    From torch 2.15, selective checkpointing (SAC) routes the tensors it caches
    through "the user's" saved-tensor hooks (``respect_saved_tensors_hooks``) and
    warns while that option is unset. It takes the innermost pair on the stack,
    stepping past each pack hook whose ``_checkpoint_internal`` is true to the pair
    its ``_user_hooks`` names (its own hooks carry the two attributes). Ours carry
    them too: ``_user_hooks`` is the instance attribute ``user_hooks_attribute``,
    or None (no user hooks) when that is None. Older releases read neither."""
    hook._checkpoint_internal = True
    hook._user_hooks = (
        None if user_hooks_attribute is None else property(operator.attrgetter(user_hooks_attribute))
    )


def cuda_oom_observer_attacher():
    """``torch._C._cuda_attach_out_of_memory_observer``, or None on builds without
    CUDA; looked up at call time."""
    return getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)


def observe_saved_tensor_partition(callback) -> None:
    """After AOTAutograd splits a joint graph and sorts the forward graph's outputs
    into saved tensors, call ``callback(fw_module, bw_module, fw_metadata,
    num_forward_outputs)``: the forward and backward graphs, the
    ``ViewAndMutationMeta`` its ``CompiledFunction`` carries at run time, and how many
    forward outputs precede the saved ones. Installed once; an
    error in ``callback`` is its own to handle. Does nothing on a torch without
    that step."""
    try:
        from torch._functorch._aot_autograd import graph_compile

        original = graph_compile._categorize_saved_tensors_for_backward
    except (ImportError, AttributeError):
        # Another torch layout: compiling must not fail over a report; compiled
        # saves are then reported outside regions (bytes still exact).
        return
    if getattr(original, "torch_remat_observer", None) is callback:
        return

    import inspect

    signature = inspect.signature(original)

    def categorize(*args, **kwargs):
        result = original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs).arguments
            observed = (
                bound["fw_module"], bound["bw_module"], bound["fw_metadata"],
                bound["num_inner_fwd_outputs"],
            )
        except (TypeError, KeyError):
            # Another signature: leave the graph unrecorded (reported outside regions).
            return result
        callback(*observed)
        return result

    categorize.torch_remat_observer = callback  # type: ignore[attr-defined]
    graph_compile._categorize_saved_tensors_for_backward = categorize


def offload_tagged_saves_when_partitioning(refine_error=None) -> None:
    """Make AOTAutograd's partitioners honour ``CheckpointPolicy.MUST_CPU_OFFLOAD``
    and ``PREFER_CPU_OFFLOAD``. torch records these tags in ``node.meta["recompute"]``
    of the joint graph, but its partitioner treats such a node as untagged (it may
    recompute it or keep it on the device), and its activation-offloading pass
    (behind ``_functorch.config.enable_activation_offloading``) moves only saved
    forward outputs marked ``should_offload``. Before a joint graph is partitioned,
    a ``MUST_CPU_OFFLOAD`` node becomes ``MUST_SAVE`` and ``PREFER_CPU_OFFLOAD``
    ``PREFER_SAVE``, both marked ``should_offload``, and the pass runs for that
    partition: the forward graph then hands backward a ``prims.device_put(node,
    cpu)`` of each such save (named ``cpu_offload_<node>``) and the backward graph
    copies it back before first use. Graphs without the tags are partitioned as
    before. ``refine_error(joint_graph_module, error)``, if given, may return an
    exception to raise instead of a ``RuntimeError`` of the partitioner (None: the
    error as is). Installed once; does nothing on a torch without that step (the
    tags then reach torch's partitioner unchanged)."""
    try:
        from torch._functorch import config as functorch_config
        from torch._functorch._aot_autograd import graph_compile

        original = graph_compile._partition_joint_graph_into_fw_bw
        functorch_config.enable_activation_offloading  # noqa: B018 (present on this torch)
    except (ImportError, AttributeError):
        return
    if getattr(original, "torch_remat_offload", False):
        return
    from torch.utils.checkpoint import CheckpointPolicy

    as_saved = {
        CheckpointPolicy.MUST_CPU_OFFLOAD: CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_CPU_OFFLOAD: CheckpointPolicy.PREFER_SAVE,
    }

    def tagged_partition(fx_g, *args, **kwargs):
        tagged = [n for n in fx_g.graph.nodes if n.meta.get("recompute") in as_saved]
        if not tagged:
            return original(fx_g, *args, **kwargs)
        for node in tagged:
            node.meta["recompute"] = as_saved[node.meta["recompute"]]
            node.meta["should_offload"] = True
        with functorch_config.patch(enable_activation_offloading=True):
            return original(fx_g, *args, **kwargs)

    def partition(fx_g, *args, **kwargs):
        try:
            return tagged_partition(fx_g, *args, **kwargs)
        except RuntimeError as error:
            better = None if refine_error is None else refine_error(fx_g, error)
            if better is None:
                raise
            raise better from error

    partition.torch_remat_offload = True  # type: ignore[attr-defined]
    graph_compile._partition_joint_graph_into_fw_bw = partition


def save_tensors_of_multi_output_must_saves() -> None:
    """Under an activation memory budget below 1, torch 2.13's partitioner adds
    ``MUST_SAVE`` nodes to what the forward saves, a multi-output op's too (a
    ``native_layer_norm`` in a SAVE region, a ``native_dropout`` kept under a
    budget): the forward would then hand backward a tuple, which AOTAutograd refuses
    at run time. Its other paths save such an op's ``getitem`` outputs instead; so
    does this wrapper of its choice of saved values, for exactly the nodes whose
    value is not a tensor and whose users are ``getitem`` s. It also saves the
    outputs of such a node that backward needs where the choice left it out (see
    ``choose``). Installed once; does nothing on a torch without that step."""
    try:
        from torch._functorch import partitioners
        from torch.utils.checkpoint import CheckpointPolicy

        original = partitioners.choose_saved_values_set
    except (ImportError, AttributeError):
        return
    if getattr(original, "torch_remat_multi_output", False):
        return
    import operator

    def multi_output(node) -> bool:
        return (
            node.op == "call_function"
            and isinstance(node.meta.get("val"), (tuple, list))
            and node.meta.get("recompute") == CheckpointPolicy.MUST_SAVE
            and bool(node.users)
            and all(user.target is operator.getitem for user in node.users)
        )

    def needed_in_backward(node) -> bool:
        return getattr(node, "dist_from_bw", 0) < int(1e9)

    def choose(joint_graph, *args, **kwargs):
        saved = original(joint_graph, *args, **kwargs)
        chosen: list = []
        for node in saved:
            for n in sorted(node.users, key=lambda u: u.args[1]) if multi_output(node) else (node,):
                if n not in chosen:
                    chosen.append(n)
        # Where the budget's knapsack decides, torch 2.13 keeps a MUST_SAVE node only if
        # its storage is not an input's; a multi-output op has no storage (None), and
        # once the graph's inputs include a symbolic size (a recompile for another
        # shape) None is among the inputs' storages: the op (a native_dropout kept
        # under a budget) was then recomputed in backward, drawing a new mask. Its
        # outputs that backward needs are saved here instead.
        for node in joint_graph.nodes:
            if multi_output(node) and needed_in_backward(node):
                for n in sorted(node.users, key=lambda u: u.args[1]):
                    if n not in chosen and needed_in_backward(n):
                        chosen.append(n)
        return chosen

    choose.torch_remat_multi_output = True  # type: ignore[attr-defined]
    partitioners.choose_saved_values_set = choose


def host_copy_source(node):
    """The forward-graph node whose saved output ``node`` copies to the host, when
    ``node`` is the activation-offloading pass's ``cpu_offload_*`` copy; else None."""
    if getattr(node, "target", None) is not torch.ops.prims.device_put.default or not node.args:
        return None
    source = node.args[0]
    if not getattr(source, "meta", {}).get("saved_for_offloading", False):
        return None
    return source


def compiled_function_metadata(node) -> object | None:
    """The ``ViewAndMutationMeta`` of an AOTAutograd ``CompiledFunctionBackward``
    autograd node, or None for any other node."""
    forward_cls = getattr(node, "_forward_cls", None)
    if forward_cls is None or not hasattr(forward_cls, "compiled_fw"):
        return None
    return getattr(forward_cls, "metadata", None)


def unchecked_compiled_saves(node) -> list:
    """Tensors a compiled node keeps without a version-counter check (stashed on
    ``ctx`` rather than saved with ``save_for_backward``), after its saved tensors."""
    return list(getattr(node, "_tensors_no_vc_check", None) or ())


class _OwnContextFnFilter(logging.Filter):
    """Drops torch's "Detected that context_fn is passed to torch.utils.checkpoint
    under torch.compile" record when the ``context_fn`` is ``own``: torch_remat's
    compiled checkpoint passes its region policy that way (a partial, compared by
    function and arguments, since Dynamo rebuilds it), and the warning (about
    in-place ops in a user's selective-checkpoint policy) would name an argument
    the user never gave. The record of any other ``context_fn`` passes.
    (torch logs it once per process: once dropped for ours, a later one of the
    user's is not logged in that process.)"""

    def __init__(self, own: object) -> None:
        super().__init__()
        self.own = own

    def filter(self, record: logging.LogRecord) -> bool:
        if "context_fn is passed to torch.utils.checkpoint" not in str(record.msg):
            return True
        frame = sys._getframe()
        while frame is not None:
            if frame.f_code.co_name == "tag_activation_checkpoint_impl":
                return not _same_partial(frame.f_locals.get("context_fn"), self.own)
            frame = frame.f_back
        return True


def _same_partial(a: object, b: object) -> bool:
    # Dynamo hands the traced op a rebuilt copy of the partial, not the object.
    return a is b or (
        isinstance(a, functools.partial) and isinstance(b, functools.partial)
        and a.func is b.func and a.args == b.args and a.keywords == b.keywords
    )


def quiet_own_context_fn_warning(own: object) -> None:
    """Install :class:`_OwnContextFnFilter` for ``own`` on torch's logger (once)."""
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    if not any(isinstance(f, _OwnContextFnFilter) and f.own is own for f in logger.filters):
        logger.addFilter(_OwnContextFnFilter(own))

# Tensor, storage and autograd-node internals, read (never written) on the hot path:
# attrgetter objects run in C, as fast as the attribute access they name.
version_of = operator.attrgetter("_version")
"""A tensor's version counter (bumped by every in-place write to it or a view)."""

INFERENCE_VERSION = -1
"""What :func:`any_version` reads for an inference tensor (made under
``torch.inference_mode()``): it has no version counter (reading one raises), and
outside inference mode nothing can update it in place."""


def any_version(t: torch.Tensor) -> int:
    """:data:`version_of` for a tensor that may be an inference tensor: a checkpoint
    input, a buffer or another tensor the code reads (a rotary table built under
    ``inference_mode``), a region's argument."""
    return INFERENCE_VERSION if t.is_inference() else t._version
view_base = operator.attrgetter("_base")
"""The tensor a view was taken of (None for a tensor that is not a view)."""
storage_key = operator.attrgetter("_cdata")
"""An ``UntypedStorage``'s identity: the address of its C++ object, the same for
every Python object of one storage while it lives (fake and meta storages too)."""
sequence_nr = operator.methodcaller("_sequence_nr")
"""An autograd node's sequence number (the order nodes were created in a thread)."""


def first_input_metadata(node: Any) -> Any:
    """Shape, dtype and device of the tensor an autograd node's first input edge
    leads to (the forward op's first input), read from the node that made it,
    without unpacking anything the node saved; None where that edge is empty."""
    edges = getattr(node, "next_functions", None)
    if not edges or edges[0][0] is None:
        return None
    producer, nr = edges[0]
    metadata = getattr(producer, "_input_metadata", None)
    if metadata is None or nr >= len(metadata):
        return None
    return metadata[nr]


def assume_constant_result(fn: Any) -> Any:
    """``torch.compiler.assume_constant_result`` without importing Dynamo.

    torch's decorator imports ``torch._dynamo`` (about 1 s on a CPU) only to set
    the flag Dynamo reads when it meets the function; ``import torch_remat`` marks
    its functions the same way and leaves Dynamo unloaded until a program compiles.
    ``tests/meta`` checks both: the import loads no Dynamo, and the fullgraph tests
    trace through these functions as constants."""
    fn._dynamo_marked_constant = True
    return fn


# ------------------------------------------------ work that waits for Dynamo's import
#
# ``import torch`` does not load ``torch._dynamo`` (about 1 s on a CPU); the first
# ``torch.compile`` does. Functions torch_remat needs while Dynamo traces, but which
# only Dynamo can build (``torch.compiler.disable`` cannot run inside a trace), are
# built right after that import by :func:`when_dynamo_imported`, through a finder on
# ``sys.meta_path`` that removes itself at that import.

_after_dynamo: list[Callable[[], None]] = []


def _dynamo_ready() -> bool:
    module = sys.modules.get("torch._dynamo")
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def _run_after_dynamo() -> None:
    pending, _after_dynamo[:] = list(_after_dynamo), []
    for callback in pending:
        try:
            callback()
        except Exception:  # never fail the user's import: the callback's work waits
            logging.getLogger("torch_remat").debug("after Dynamo's import", exc_info=True)


class _LoaderThen:
    """A loader that runs the callbacks waiting for Dynamo once its module ran."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # the module keeps its own loader (source lookups, reloads go to it)
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _run_after_dynamo()


class _DynamoImportFinder:
    """On ``sys.meta_path`` until ``torch._dynamo`` is found: that import's loader
    is wrapped so that :func:`_run_after_dynamo` follows it."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # (by the finders after this one)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _LoaderThen(spec.loader)
        return spec


def when_dynamo_imported(callback: Callable[[], None]) -> None:
    """Call ``callback`` once ``torch._dynamo`` is imported: now if it is."""
    if _dynamo_ready():
        callback()
        return
    _after_dynamo.append(callback)
    if not any(isinstance(f, _DynamoImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _DynamoImportFinder())


# ----------------------------------------------- torch.nn.utils.parametrize.cached()
#
# Under ``parametrize.cached()`` a parametrized weight is computed at its first read
# and served from a module-level cache after that (``_cache_enabled``, ``_cache``:
# private, named here). A forward that ran under it read some weights from the cache
# and computed the others; its replay must do the same, whether the backward runs
# inside that block (where the cache also holds what the forward computed) or
# outside it (no cache): it runs with the cache as the forward found it.


def parametrize_cache() -> dict | None:
    """The parametrization cache's entries now, if ``parametrize.cached()`` is on."""
    p = sys.modules.get("torch.nn.utils.parametrize")
    if p is None or not getattr(p, "_cache_enabled", 0):
        return None
    return dict(p._cache)


@contextlib.contextmanager
def parametrize_cache_as(entries: dict):
    """Run with ``parametrize.cached()`` on and its cache holding ``entries`` (from
    :func:`parametrize_cache`); the caller's cache is back afterwards."""
    p = sys.modules["torch.nn.utils.parametrize"]
    enabled, cache = p._cache_enabled, p._cache
    p._cache_enabled, p._cache = enabled + 1, dict(entries)
    try:
        yield
    finally:
        p._cache_enabled, p._cache = enabled, cache


# ----------------------------------------------- settings that decide what an op does
#
# Process-wide switches that change what an op computes or saves without changing
# its inputs: the default dtype (factory functions), float32 matmul and convolution
# precision (TF32, oneDNN's bf16), deterministic algorithms, cuDNN's and oneDNN's
# use, the scaled-dot-product-attention backends. A replay run under other values
# than its forward's recreates other values (silently wrong gradients) or other
# saves. Each entry is (getter, setter): getters are C functions (read at every
# checkpoint call, and by the replay: no Python frame), a setter takes what its
# getter returned. Only those this torch has and that read without error or warning.

def _with_warn_only(value: bool) -> None:
    torch._C._set_deterministic_algorithms(torch._C._get_deterministic_algorithms(), warn_only=value)


def _with_deterministic(value: bool) -> None:
    torch._C._set_deterministic_algorithms(value, warn_only=torch._C._get_deterministic_algorithms_warn_only())


_SMALLEST_DENORMAL = 5e-324


def _with_flush_denormal(state: tuple[float, int]) -> None:
    torch.set_flush_denormal(state[1] == 0)


def legacy_matmul_precision() -> str | None:
    """What ``torch.get_float32_matmul_precision`` reports where torch also has the
    per-backend precisions (:data:`TORCH_SETTINGS` holds those), which set it too;
    None where it has none, or refuses (they were set apart and disagree)."""
    if not _PER_BACKEND:
        return None
    try:
        return torch._C._get_float32_matmul_precision()
    except RuntimeError:
        return None


_PER_BACKEND = hasattr(torch._C, "_get_fp32_precision_getter") and hasattr(torch._C, "_get_float32_matmul_precision")
set_legacy_matmul_precision = getattr(torch._C, "_set_float32_matmul_precision", None)


def _settings_table() -> tuple[tuple[Callable[[], Any], Callable[[Any], None]], ...]:
    import warnings

    C = torch._C
    per_backend = hasattr(C, "_get_fp32_precision_getter")
    named = [
        # the legacy matmul precision only where the per-backend ones are missing:
        # they hold what it sets, and it raises once they disagree
        *([] if per_backend else [("_get_float32_matmul_precision", "_set_float32_matmul_precision")]),
        ("_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32"),
        ("_get_cudnn_enabled", "_set_cudnn_enabled"),
        ("_get_cudnn_deterministic", "_set_cudnn_deterministic"),
        ("_get_cudnn_benchmark", "_set_cudnn_benchmark"),
        ("_get_mkldnn_enabled", "_set_mkldnn_enabled"),
        ("_get_flash_sdp_enabled", "_set_sdp_use_flash"),
        ("_get_mem_efficient_sdp_enabled", "_set_sdp_use_mem_efficient"),
        ("_get_math_sdp_enabled", "_set_sdp_use_math"),
        ("_get_cudnn_sdp_enabled", "_set_sdp_use_cudnn"),
        ("_get_overrideable_sdp_enabled", "_set_sdp_use_overrideable"),
        ("_get_math_sdp_allow_fp16_bf16_reduction", "_set_math_sdp_allow_fp16_bf16_reduction"),
    ]
    table: list[tuple[Callable[[], Any], Callable[[Any], None]]] = [
        (torch.get_default_dtype, torch.set_default_dtype),
    ]
    gpu = torch.version.cuda is not None or torch.version.hip is not None
    if not gpu:  # (a CPU build: its cuDNN and CUDA switches change nothing)
        named = [(g, s) for g, s in named if not g.startswith("_get_cudnn_") or "sdp" in g]
    for get_name, set_name in named:
        get, set_ = getattr(C, get_name, None), getattr(C, set_name, None)
        if get is not None and set_ is not None:
            table.append((get, set_))
    if per_backend:
        for backend, op in (
            ("generic", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"),
            ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"),
        ):
            if backend == "cuda" and not gpu:
                continue
            table.append((
                functools.partial(C._get_fp32_precision_getter, backend, op),
                functools.partial(C._set_fp32_precision_setter, backend, op),
            ))
    if hasattr(C, "_get_deterministic_algorithms_warn_only"):
        table.append((C._get_deterministic_algorithms, _with_deterministic))
        table.append((C._get_deterministic_algorithms_warn_only, _with_warn_only))
    # torch.set_flush_denormal has no getter. The calling thread's flag (a CPU
    # control register) shows in Python's own float arithmetic: math.frexp of the
    # smallest denormal reads (0.5, -1073) while denormals are kept and (0.0, 0)
    # while they are flushed. (Its exponent, an int, tells them apart: comparing the
    # denormal itself with 0.0 is true while flushing.)
    table.append((functools.partial(math.frexp, _SMALLEST_DENORMAL), _with_flush_denormal))
    usable = []
    for get, set_ in table:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                get()
            except Exception:  # a backend this build does not know
                continue
        if not caught:
            usable.append((get, set_))
    return tuple(usable)


TORCH_SETTINGS = _settings_table()
SETTING_GETTERS = tuple(get for get, _ in TORCH_SETTINGS)
"""Read them all with ``tuple(map(call, SETTING_GETTERS))`` (``call``: below)."""

call: Callable[[Callable[[], Any]], Any] = getattr(operator, "call", None) or (lambda f: f())
"""``operator.call`` (3.11), a C function: reading the settings runs no Python frame."""

function_mode_count = torch._C._len_torch_function_stack
"""How many TorchFunctionModes are active (``torch.device`` as a context manager
is one, and so is ``torch.set_default_device``)."""

dispatch_mode_count = torch._C._len_torch_dispatch_stack
"""How many TorchDispatchModes are active. Under one, torch's composite ops take
their out-of-place variants (``at::linear`` adds the bias with ``add``, not
``add_``): equal values, other version counters."""


def function_modes() -> tuple[Any, ...]:
    """The active TorchFunctionModes, innermost last (call where
    :data:`function_mode_count` is not 0)."""
    return tuple(torch._C._get_function_stack_at(i) for i in range(function_mode_count()))


_SETTINGS_LOCK = threading.RLock()
"""Held by a replay that swaps the process-wide settings (see torch_settings_as)."""


@contextlib.contextmanager
def torch_settings_as(settings: tuple[Any, ...] | None, modes: tuple[Any, ...]):
    """Run with ``settings`` (read from :data:`SETTING_GETTERS`; None: as they are)
    and the TorchFunctionModes ``modes`` active in place of the current ones; the current
    ones are back afterwards, each as it was read before anything was set. The
    settings are process-wide: a replay that swaps them holds a lock, so that two
    such replays in two threads do not undo each other's."""
    current_modes = function_modes() if function_mode_count() else ()
    swap_modes = current_modes != modes
    swap_settings = settings is not None
    lock = _SETTINGS_LOCK if swap_settings else contextlib.nullcontext()
    with lock:
        # (read whether or not they are swapped: the code run inside may switch one
        # and stop before it switches it back, a replay that stops early)
        before = tuple(map(call, SETTING_GETTERS))
        legacy = legacy_matmul_precision()
        entered: list[Any] = []
        left: list[Any] = []
        try:
            for (get, set_), value in zip(TORCH_SETTINGS, settings if swap_settings else ()):
                if get() != value:
                    set_(value)
            if swap_modes:
                # through __exit__/__enter__: a torch.device block also sets the
                # default device torch.get_default_device() reports
                for mode in reversed(current_modes):
                    mode.__exit__(None, None, None)
                    left.append(mode)
                for mode in modes:
                    mode.__enter__()
                    entered.append(mode)
            yield
        finally:
            for mode in reversed(entered):
                mode.__exit__(None, None, None)
            for mode in reversed(left):
                mode.__enter__()
            set_torch_settings(before, legacy)


def set_torch_settings(settings: tuple[Any, ...], legacy: str | None) -> None:
    """Make ``settings`` (read from :data:`SETTING_GETTERS`) current, setting only
    those that differ, and where any did, the legacy matmul precision read with
    them (:func:`legacy_matmul_precision`) first."""
    changed = [(set_, value) for (get, set_), value in zip(TORCH_SETTINGS, settings) if get() != value]
    if changed and legacy is not None:
        set_legacy_matmul_precision(legacy)  # (it sets per-backend ones: set again below)
        changed = [(set_, value) for (get, set_), value in zip(TORCH_SETTINGS, settings) if get() != value]
    for set_, value in changed:
        set_(value)


def global_forward_hook_dicts() -> tuple[dict, ...]:
    """The dicts behind ``torch.nn.modules.module.register_module_forward_hook`` and
    ``register_module_forward_pre_hook`` (and their kwargs and always-called flags):
    hooks every module call runs."""
    m = sys.modules["torch.nn.modules.module"]
    names = (
        "_global_forward_pre_hooks", "_global_forward_hooks",
        "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called",
    )
    return tuple(getattr(m, n) for n in names if isinstance(getattr(m, n, None), dict))


def global_module_hook_dicts() -> tuple[dict, ...]:
    """Every dict of hooks registered for all modules (forward, backward, and
    buffer, module and parameter registration), keyed by their handle's id."""
    m = sys.modules["torch.nn.modules.module"]
    return tuple(v for k, v in vars(m).items() if k.startswith("_global") and "hook" in k and isinstance(v, dict))


local_scalar_dense = torch.ops.aten._local_scalar_dense.default
"""The op a tensor's value read into Python runs (``.item()``, ``bool()`` of a
0-d tensor): the planner's fake run answers it where it knows the value."""


def forward_ad_level() -> int:
    """The innermost forward-mode AD dual level open now (-1: none)."""
    return sys.modules["torch.autograd.forward_ad"]._current_level


# ---------------------------------------------- the CPU generator's state, read in place
#
# ``Generator.get_state()`` builds a 5 KB tensor (an allocation and a conversion of
# 624 words) and the RNG guard reads the CPU generator twice per checkpoint call. A
# ``torch.Generator``'s Python object holds an ``at::Generator``, a pointer to the
# ``CPUGeneratorImpl``, whose ``at::mt19937`` keeps ``seed_``, ``left_``,
# ``seeded_``, ``next_`` and ``state_[624]`` (uint32) in that order, followed by the
# cached normal samples ``std::optional<float>`` and ``std::optional<double>``. The
# words are found by their values and every field is checked against ``get_state()``
# on a scratch generator and then on the default one; padding bytes are not read (a
# ``set_state`` may rewrite them). Any mismatch leaves ``get_state()`` in use.

_MT_WORDS = 624


def _generator_impl_address(g: torch.Generator) -> int:
    import ctypes

    return ctypes.c_void_p.from_address(id(g) + object.__basicsize__).value or 0


def _legacy_fields(state: torch.Tensor) -> tuple[Any, ...]:
    """(seed, left, next, words, double sample valid, double sample, float sample
    valid, float sample) from a CPU ``get_state()``."""
    import ctypes
    import struct

    raw = ctypes.string_at(state.data_ptr(), state.nbytes)  # (no aten op)
    seed, left, _seeded, nxt = struct.unpack_from("QiiQ", raw, 0)
    words = struct.unpack_from(f"{_MT_WORDS}Q", raw, 24)
    at = 24 + 8 * _MT_WORDS
    _x, y, _rho, valid = struct.unpack_from("dddi", raw, at)
    fvalue, fvalid = struct.unpack_from("f?", raw, at + 28)
    return seed, left, nxt, words, bool(valid), y, bool(fvalid), fvalue


def _cpu_generator_fields(g: torch.Generator) -> tuple[int, int, int] | None:
    """The offsets of ``state_`` and of the ``optional<float>`` and
    ``optional<double>`` normal samples in
    ``g``'s ``CPUGeneratorImpl``, checked against ``get_state()``; None if not found."""
    import ctypes
    import struct

    base = _generator_impl_address(g)
    if not base:
        return None
    fields = _legacy_fields(g.get_state())
    probe = struct.pack("8I", *fields[3][:8])
    head = ctypes.string_at(base, 512)
    at = head.find(probe)
    if at < 24 or at % 4:
        return None
    # the mt19937 fields take 20 + 2496 bytes, padded to the 8-byte alignment of
    # seed_; the optional<float> follows, then the optional<double>, 8-byte aligned
    float_at = at - 20 + (20 + 4 * _MT_WORDS + 7) // 8 * 8
    return at, float_at, (float_at + 8 + 7) // 8 * 8


def _read_fields(base: int, at: int, float_at: int, double_at: int) -> tuple[Any, ...]:
    import ctypes
    import struct

    seed, left = struct.unpack("Qi", ctypes.string_at(base + at - 20, 12))
    nxt = struct.unpack("I", ctypes.string_at(base + at - 4, 4))[0]
    words = struct.unpack(f"{_MT_WORDS}I", ctypes.string_at(base + at, 4 * _MT_WORDS))
    fvalue, fvalid = struct.unpack("f?", ctypes.string_at(base + float_at, 5))
    dvalue, dvalid = struct.unpack("d?", ctypes.string_at(base + double_at, 9))
    return seed, left, nxt, words, dvalid, dvalue, fvalid, fvalue


def _fields_agree(g: torch.Generator, base: int, at: int, float_at: int, double_at: int) -> bool:
    want = _legacy_fields(g.get_state())
    got = _read_fields(base, at, float_at, double_at)
    # a sample's value is only meaningful while it is valid
    same = want[:5] == got[:5] and want[6] == got[6]
    return same and (not want[4] or want[5] == got[5]) and (not want[6] or want[7] == got[7])


def _field_views(base: int, at: int, float_at: int, double_at: int) -> Callable[[], Any]:
    """Read the fields in place: ctypes views (padding left out), whose ``raw``
    copies without a foreign call."""
    import ctypes

    head = (ctypes.c_char * 12).from_address(base + at - 20)  # seed_, left_
    words = (ctypes.c_char * (4 + 4 * _MT_WORDS)).from_address(base + at - 4)  # next_, state_
    float_sample = (ctypes.c_char * 5).from_address(base + float_at)
    double_sample = (ctypes.c_char * 9).from_address(base + double_at)

    def read() -> Any:
        # a sample's value bytes count only while its flag is set (assigning an
        # empty optional may copy any value bytes)
        f, d = float_sample.raw, double_sample.raw
        return head.raw, words.raw, f if f[4] else None, d if d[8] else None

    return read


@contextlib.contextmanager
def outside_modes():
    """Run the engine's own checks outside the caller's dispatch and function modes."""
    with disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def cpu_generator_reader(g: torch.Generator) -> Callable[[], Any] | None:
    """A function returning ``g``'s state, comparable with ``==`` (equal iff no
    number was drawn and no other state set in between), read in place; None where
    the layout is not the one checked for (then use ``get_state()``)."""
    # (no mode of the caller's sees the checks' ops: no dispatch mode, explicit CPU)
    with outside_modes():
        return _checked_cpu_reader(g)


def _checked_cpu_reader(g: torch.Generator) -> Callable[[], Any] | None:
    cpu = torch.device("cpu")
    try:
        scratch = torch.Generator(device=cpu)
        scratch.manual_seed(20240531)
        found = _cpu_generator_fields(scratch)
        if found is None:
            return None
        sbase = _generator_impl_address(scratch)
        read_scratch = _field_views(sbase, *found)
        # (step, whether it changes the state)
        checks = [
            (lambda: None, False),
            (lambda: torch.randn(1, generator=scratch, dtype=torch.float64, device=cpu), True),  # caches a sample
            (lambda: scratch.set_state(scratch.get_state()), False),
            (lambda: torch.rand(3, generator=scratch, device=cpu), True),
            (lambda: torch.randn(1, generator=scratch, dtype=torch.float64, device=cpu), True),
            (lambda: torch.randn(1, generator=scratch, device=cpu), True),
            (lambda: torch.randint(0, 10, (700,), generator=scratch, device=cpu), True),  # past a twist
            (lambda: scratch.set_state(scratch.get_state()), False),
            (lambda: scratch.manual_seed(7), True),
        ]
        seen_valid = False
        for step, changes in checks:
            before = read_scratch()
            step()
            if (read_scratch() != before) is not changes or not _fields_agree(scratch, sbase, *found):
                return None
            seen_valid |= _legacy_fields(scratch.get_state())[4]
        if not seen_valid:
            return None
        base = _generator_impl_address(g)
        if not base or not _fields_agree(g, base, *found):
            return None
    except Exception:
        return None
    read = _field_views(base, *found)
    read.generator = g  # type: ignore[attr-defined]  # (keeps the generator alive)
    return read


any_autocast_enabled = torch._C._is_any_autocast_enabled
"""Whether autocast is on for any device type (the C function itself: no Python
frame of this module on the replay's path)."""


tensor_hook_dicts: Callable[[torch.Tensor], tuple[Any, Any]] = operator.attrgetter(
    "_backward_hooks", "_post_accumulate_grad_hooks"
)
"""``tensor_hook_dicts(t)``: the dicts ``register_hook`` and
``register_post_accumulate_grad_hook`` add a tensor's hooks to (None before the
first; removing a key removes the hook, as its handle's ``remove`` does). A C
callable: the replay reads it, and its first unpack passes no frame of this module."""


def fsdp_module_class() -> type | None:
    """FSDP2's ``FSDPModule`` (the class ``fully_shard`` mixes into a module it
    shards), or None where ``torch.distributed.fsdp`` was never imported (then no
    module is one)."""
    module = sys.modules.get("torch.distributed.fsdp")
    return getattr(module, "FSDPModule", None) if module is not None else None
