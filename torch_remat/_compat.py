"""Every private PyTorch API torch_remat uses, in one place.

torch_remat is tested on torch 2.13.0, the floor declared in pyproject.toml. Each
name below is an internal of that release; when a torch upgrade moves one, this is
the only module to change. Uses outside this module are only of public names.

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
``autograd.Variable._execution_engine``           free refills a backward did not use when it
                                                  ends (``queue_callback``)
``_C._autograd._profiler_enabled``                build profiler range names only when profiling
``_C._DisableTorchDispatch``                      compare state snapshots below dispatch modes
``_C._autograd._unsafe_set_version_counter``      give a buffer's replay copy the version the
                                                  forward saw (saved-tensor checks compare it)
``_C._disabled_torch_function_impl``              placeholder subclass without torch_function
``torch.utils.checkpoint``'s hook functions       refuse a checkpoint started inside torch's
(by their module)                                 checkpoint (a block checkpointed twice)
``utils.checkpoint._Holder``                       what torch's checkpoint packs: the reports
                                                  say how many such saves they cannot count
``_neg_view``                                     give a kept output held through its storage
                                                  root back its negative bit
``_disable_dynamo``                               run the replay eagerly under compiled autograd
``_C._cuda_attach_out_of_memory_observer``        the CUDA OOM observer (CUDA builds only)
``_C._cuda_isHistoryEnabled``                     allocation sites from the memory history
``_functorch._aot_autograd.graph_compile.         see which forward-graph node each tensor a
_categorize_saved_tensors_for_backward``          compiled graph saves comes from (reports)
``CompiledFunction.metadata``, ``node.            the AOTAutograd metadata and the saves
_forward_cls``, ``ctx._tensors_no_vc_check``      without version check of a compiled node
===============================================  =============================================
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

TESTED_TORCH = "2.13.0"

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
# Newer than the rest: absent, every backward is its own group.
get_graph_exec_group = getattr(torch._C, "_get_graph_exec_group", lambda: None)
profiler_enabled = torch._C._autograd._profiler_enabled
DisableTorchDispatch = torch._C._DisableTorchDispatch
set_version_counters = torch._C._autograd._unsafe_set_version_counter
disabled_torch_function_impl = torch._C._disabled_torch_function_impl
disable_dynamo = torch._disable_dynamo
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


def queue_backward_callback(callback) -> None:
    """Run ``callback`` when the current backward (graph task) finishes."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


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
