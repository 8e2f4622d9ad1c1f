"""Diagnostics: traces, memory and saved-tensors reports, named saves, allocation
sites and the OOM observer.

The second tier of the public API: the functions most users need are also at the
top level (``remat.collect_trace``, ``remat.print_saved_tensors_report``, ...); the
types they return and the less common calls live here.

They observe the checkpoint engine through :mod:`torch_remat.engine.observers`
and read its records; the engine never imports them.
"""

from ..engine.context import ActiveCheckpoint, active_checkpoint
from .alloc_sites import clear_memory_snapshot_cache, record_save_sites
from .graph_saves import discover_autograd_roots
from .memory_report import format_current_memory_report, print_current_memory_report
from .named_save import save_for_backward
from .oom import attach_oom_observer, format_oom_saved_tensors_report, oom_observer
from .saved_report import (
    SavedTensorsReport,
    format_saved_tensors_report,
    print_saved_tensors_report,
    saved_tensors_report,
)
from .snapshot_annotate import label_memory_snapshot, memory_snapshot_annotate
from .trace import OpTrace, ScopeTrace, Trace, collect_trace, trace_scope

__all__ = [
    "collect_trace",
    "trace_scope",
    "Trace",
    "OpTrace",
    "ScopeTrace",
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
]
