"""torch_remat: activation rematerialization for PyTorch.

``remat.checkpoint`` is non-reentrant activation checkpointing in which regions of
source code can be marked to keep their activations
(``remat.region(fn, name, recompute=False)``) instead of being recomputed.
"""

from ._errors import (
    PlaceholderReadError,
    RecomputeMismatchError,
    RematCompileError,
    RematError,
    SavedTensorModifiedError,
)
from .diagnostics.alloc_sites import clear_memory_snapshot_cache, record_save_sites
from .diagnostics.format import format_bytes
from .diagnostics.graph_saves import discover_autograd_roots
from .diagnostics.memory_report import format_current_memory_report, print_current_memory_report
from .diagnostics.named_save import save_for_backward
from .diagnostics.oom import attach_oom_observer, format_oom_saved_tensors_report, oom_observer
from .diagnostics.saved_report import (
    SavedTensorsReport,
    format_saved_tensors_report,
    print_saved_tensors_report,
    saved_tensors_report,
)
from .diagnostics.snapshot_annotate import label_memory_snapshot, memory_snapshot_annotate
from .diagnostics.trace import Trace, collect_trace, trace_scope
from .engine.active import ActiveCheckpoint, active_checkpoint
from .engine.api import checkpoint
from .engine.naming import name_scope
from .engine.placeholder import is_placeholder
from .engine.regions import recompute_needs_tensor, region
from .engine.saved_hooks import (
    SavedTensorInfo,
    SavedTensorKind,
    current_saved_tensor_info,
    saved_tensors_hooks,
)
from .engine.state import is_recomputing
from .engine.state_hooks import CPURNGStateHook, DeviceRNGStateHook, RecomputeStateHook
from .scope.api import gradient_checkpoint_scope

__version__ = "0.2.0"

__all__ = [
    "checkpoint",
    "region",
    "recompute_needs_tensor",
    "name_scope",
    "RecomputeStateHook",
    "CPURNGStateHook",
    "DeviceRNGStateHook",
    "is_recomputing",
    "is_placeholder",
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
    "Trace",
    "print_current_memory_report",
    "format_current_memory_report",
    "print_saved_tensors_report",
    "format_saved_tensors_report",
    "saved_tensors_report",
    "SavedTensorsReport",
    "save_for_backward",
    "record_save_sites",
    "oom_observer",
    "attach_oom_observer",
    "format_oom_saved_tensors_report",
    "discover_autograd_roots",
    "memory_snapshot_annotate",
    "label_memory_snapshot",
    "clear_memory_snapshot_cache",
    "active_checkpoint",
    "ActiveCheckpoint",
    "format_bytes",
]
