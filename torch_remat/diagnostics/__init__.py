"""Diagnostics: traces, memory and saved-tensors reports, named saves, allocation
sites and the OOM observer.

The second tier of the public API: the functions are exported at the top level
(``remat.collect_trace``, ``remat.print_saved_tensors_report``, ...); the types
they return and ``label_memory_snapshot`` are exported here.

They observe the checkpoint engine through :mod:`torch_remat.engine.observers`
and read its records; the engine never imports them.
"""

from ..engine.context import ActiveCheckpoint, active_checkpoint  # noqa: F401
from .alloc_sites import clear_memory_snapshot_cache, record_save_sites  # noqa: F401
from .graph_saves import discover_autograd_roots  # noqa: F401
from .memory_report import format_current_memory_report, print_current_memory_report  # noqa: F401
from .named_save import save_for_backward  # noqa: F401
from .oom import attach_oom_observer, format_oom_saved_tensors_report, oom_observer  # noqa: F401
from .saved_report import (  # noqa: F401  # noqa: F401
    SavedTensorsReport,
    format_saved_tensors_report,
    print_saved_tensors_report,
    saved_tensors_report,
)
from .snapshot_annotate import label_memory_snapshot, memory_snapshot_annotate  # noqa: F401
from .trace import OpTrace, ScopeTrace, Trace, collect_trace, trace_scope  # noqa: F401

# The types the diagnostics return, and the one call found nowhere else. The
# functions above are the top level's (``remat.collect_trace``, ...): importable
# here too, exported there only, so that no name is exported in two namespaces.
__all__ = [
    "Trace",
    "OpTrace",
    "ScopeTrace",
    "SavedTensorsReport",
    "ActiveCheckpoint",
    "label_memory_snapshot",
]
