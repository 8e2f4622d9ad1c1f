"""``remat.active_checkpoint``: which checkpoint and region a thread is running,
now or at the moment an exception was raised.

Out-of-memory diagnosis needs the second form: by the time an ``except`` block (or
a context manager's ``__exit__``) sees a ``torch.OutOfMemoryError``, every
checkpoint the error passed through has already popped its bookkeeping. The
error's traceback still holds the frames it was raised through, and the
checkpoint's own frames among them say which checkpoint, which phase and which
region were running.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

from .frame import CheckpointFrame
from .replay import ReplayScope
from .state import FORWARD, RECOMPUTE, _tls

# Frames of the core that mark where a traceback entered a checkpoint or a region.
_CHECKPOINT_CODES = {
    CheckpointFrame.run_forward.__code__: FORWARD,
    CheckpointFrame.recompute.__code__: RECOMPUTE,
}
_REGION_CODES = (CheckpointFrame.run_region.__code__, ReplayScope.run_region.__code__)


@dataclass(frozen=True)
class ActiveCheckpoint:
    """A checkpoint call being run: its ``region_name``, the phase (``"forward"``,
    or ``"recompute"`` while backward replays it, as :func:`is_recomputing` says:
    also for a checkpoint nested in one being replayed) and the qualified name of
    the innermost ``remat.region`` running inside it (None between regions)."""

    checkpoint: str
    phase: str
    region: str | None = None

    def format(self) -> str:
        """``checkpoint 'layers.3' (forward), region 'attn'``."""
        where = f"checkpoint '{self.checkpoint}' ({self.phase})"
        return where if self.region is None else f"{where}, region '{self.region}'"

    def __str__(self) -> str:
        return self.format()

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "phase": self.phase, "region": self.region}


def active_checkpoint(exception: BaseException | None = None) -> ActiveCheckpoint | None:
    """The innermost checkpoint (and region) this thread is running, or None.

    With ``exception``, where that exception was raised instead, read from its
    traceback, so it still answers in the ``except`` block after the checkpoint
    has exited::

        try:
            loss = model(batch).sum()
            loss.backward()
        except torch.OutOfMemoryError as e:
            print("ran out in", remat.active_checkpoint(e))

    Nested checkpoints report the innermost one. Returns None when no checkpoint
    was running (or the exception was raised outside every checkpoint).
    """
    if exception is not None:
        return _from_traceback(exception.__traceback__)
    stack = _tls.stack
    if not stack:
        return None
    scope = stack[-1]
    name = scope.frame.name
    phase = RECOMPUTE if _tls.recompute_depth else FORWARD
    regions = scope.region_stack
    return ActiveCheckpoint(name, phase, regions[-1].qualname if regions else None)


def _from_traceback(tb: TracebackType | None) -> ActiveCheckpoint | None:
    found: ActiveCheckpoint | None = None
    recomputing = False  # the traceback runs outermost first
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        phase = _CHECKPOINT_CODES.get(code)
        if phase is not None:
            recomputing = recomputing or phase == RECOMPUTE
            owner = frame.f_locals.get("self")
            name = getattr(owner, "name", None)
            if isinstance(name, str):
                found = ActiveCheckpoint(name, RECOMPUTE if recomputing else FORWARD)
        elif found is not None and code in _REGION_CODES:
            qualname = frame.f_locals.get("qualname")
            if isinstance(qualname, str):
                found = ActiveCheckpoint(found.checkpoint, found.phase, qualname)
        tb = tb.tb_next
    return found
