"""Thread-local state of torch_remat.

Like PyTorch's saved-tensor hooks, all of it is per thread: two threads that run
checkpoints at the same time never see each other's frames.
"""

from __future__ import annotations

import threading
from typing import Any


class _ThreadState(threading.local):
    def __init__(self) -> None:
        # Active scopes, innermost last: a checkpoint frame during its forward, or a
        # replay scope during a recompute.
        self.stack: list[Any] = []
        self.recompute_depth = 0
        # Diagnostics: the trace being collected (remat.collect_trace) and whether
        # allocation sites of saved tensors are recorded (remat.record_save_sites).
        self.trace: Any = None
        self.record_sites = False


_tls = _ThreadState()


def current_scope() -> Any:
    stack = _tls.stack
    return stack[-1] if stack else None


def is_recomputing() -> bool:
    """Return True while a checkpoint is being recomputed in this thread.

    Use it to skip forward-only side effects (logging, metrics, counters) during the
    replay that backward triggers::

        if not remat.is_recomputing():
            record_metric(value)
    """
    return _tls.recompute_depth > 0
