"""Thread-local state of torch_remat.

Like PyTorch's saved-tensor hooks, all of it is per thread: two threads that run
checkpoints at the same time never see each other's frames.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch


class _ThreadState(threading.local):
    def __init__(self) -> None:
        # Active scopes, innermost last: a checkpoint frame during its forward, or a
        # replay scope during a recompute.
        self.stack: list[Any] = []
        self.recompute_depth = 0


_tls = _ThreadState()


class ActiveScope(Protocol):
    """What code running inside a checkpoint can ask of the scope around it: the
    forward of a checkpoint (a ``CheckpointFrame``) or its recompute (a
    ``ReplayScope``). ``remat.region`` and ``recompute_needs_tensor`` call into it;
    diagnostics read it. Nothing else is assumed of the objects on the stack."""

    phase: str
    """``"forward"`` or ``"recompute"``."""
    frame: Any
    """The ``CheckpointFrame`` of the checkpoint call."""
    region_stack: list[Any]
    """RegionRecords of the regions running, outermost first."""

    @property
    def in_save_region(self) -> bool:
        """True while a SAVE region's body runs (forward only)."""
        ...

    def run_region(self, fn: Any, name: str, recompute: bool, args: tuple, kwargs: dict) -> Any: ...

    def keep(self, t: Any) -> bool: ...


FORWARD = "forward"
RECOMPUTE = "recompute"


def current_scope() -> ActiveScope | None:
    """The innermost checkpoint forward or recompute running in this thread."""
    stack = _tls.stack
    return stack[-1] if stack else None


def is_recomputing() -> bool:
    """Return True while a checkpoint is being recomputed in this thread.

    Use it to skip forward-only side effects (logging, metrics, counters) during the
    replay that backward triggers::

        if not remat.is_recomputing():
            record_metric(value)

    False in code that ``torch.compile`` compiled: its recompute is part of the
    compiled backward graph, which re-runs no Python.
    """
    if torch.compiler.is_compiling():
        return False
    return _tls.recompute_depth > 0
