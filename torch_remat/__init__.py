"""torch_remat: activation rematerialization for PyTorch.

``remat.checkpoint`` is non-reentrant activation checkpointing in which regions of
source code can be marked to keep their activations
(``remat.region(fn, name, recompute=False)``) instead of being recomputed.
"""


from . import _source_checkout
from ._errors import (
    PlaceholderReadError,
    RecomputeMismatchError,
    RematCompileError,
    RematError,
    SavedTensorModifiedError,
)
from .diagnostics import (
    attach_oom_observer,
    clear_memory_snapshot_cache,
    collect_trace,
    discover_autograd_roots,
    format_current_memory_report,
    format_oom_saved_tensors_report,
    format_saved_tensors_report,
    memory_snapshot_annotate,
    oom_observer,
    print_current_memory_report,
    print_saved_tensors_report,
    record_save_sites,
    save_for_backward,
    saved_tensors_report,
    trace_scope,
)
from .engine.api import checkpoint, recompute_needs_tensor, region
from .engine.context import active_checkpoint, is_recomputing, name_scope
from .engine.placeholder import is_placeholder
from .engine.rng import CPURNGStateHook, DeviceRNGStateHook, RecomputeStateHook
from .engine.saved_hooks import (
    SavedTensorInfo,
    SavedTensorKind,
    current_saved_tensor_info,
    saved_tensors_hooks,
)
from .scope.api import gradient_checkpoint_scope

__version__ = "0.3.0.dev0"

# The top level: every name of the upstream torch-remat package and of its
# documented contract, our error classes, and the few additions users reach for.
# Everything else public is one level down (torch_remat.diagnostics,
# torch_remat.offload, torch_remat.integrations).
__all__ = [
    "checkpoint",
    "region",
    "recompute_needs_tensor",
    "is_recomputing",
    "is_placeholder",
    "name_scope",
    "RecomputeStateHook",
    "DeviceRNGStateHook",
    "CPURNGStateHook",
    "saved_tensors_hooks",
    "current_saved_tensor_info",
    "SavedTensorInfo",
    "SavedTensorKind",
    "gradient_checkpoint_scope",
    "RematError",
    "PlaceholderReadError",
    "RecomputeMismatchError",
    "SavedTensorModifiedError",
    "RematCompileError",
    # diagnostics
    "collect_trace",
    "trace_scope",
    "print_current_memory_report",
    "format_current_memory_report",
    "print_saved_tensors_report",
    "format_saved_tensors_report",
    "saved_tensors_report",
    "save_for_backward",
    "oom_observer",
    "attach_oom_observer",
    "record_save_sites",
    "format_oom_saved_tensors_report",
    "discover_autograd_roots",
    "memory_snapshot_annotate",
    "clear_memory_snapshot_cache",
    "active_checkpoint",
]

# Names earlier releases exported here, and where they live now.
# From a source checkout, torch_remat.integrations is the sibling folder integrations/.
_source_checkout.install(__path__[0])
