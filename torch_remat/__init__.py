"""torch_remat: activation rematerialization for PyTorch.

``remat.checkpoint`` is non-reentrant activation checkpointing in which regions of
source code can be marked to keep their activations
(``remat.region(fn, name, recompute=False)``) instead of being recomputed.
"""

from ._active_checkpoint import ActiveCheckpoint, active_checkpoint
from ._alloc_sites import record_save_sites
from ._checkpoint import checkpoint
from ._errors import (
    PlaceholderReadError,
    RecomputeMismatchError,
    RematError,
    SavedTensorModifiedError,
)
from ._format import format_bytes
from ._memory_report import format_current_memory_report, print_current_memory_report
from ._named_save import save_for_backward
from ._oom import attach_oom_observer, oom_observer
from ._region import recompute_needs_tensor, region
from ._saved_report import (
    SavedTensorsReport,
    format_saved_tensors_report,
    print_saved_tensors_report,
    saved_tensors_report,
)
from ._scope import gradient_checkpoint_scope
from ._state import is_recomputing
from ._state_hooks import CPURNGStateHook, DeviceRNGStateHook, RecomputeStateHook
from ._trace import Trace, collect_trace, trace_scope

__version__ = "0.2.0"

__all__ = [
    "checkpoint",
    "region",
    "recompute_needs_tensor",
    "RecomputeStateHook",
    "CPURNGStateHook",
    "DeviceRNGStateHook",
    "is_recomputing",
    "gradient_checkpoint_scope",
    "RematError",
    "PlaceholderReadError",
    "RecomputeMismatchError",
    "SavedTensorModifiedError",
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
    "active_checkpoint",
    "ActiveCheckpoint",
    "format_bytes",
]
