"""``remat.active_checkpoint``: which checkpoint and region a thread is running,
now or at the moment an exception was raised.

Out-of-memory diagnosis needs the second form: by the time an ``except`` block (or
a context manager's ``__exit__``) sees a ``torch.OutOfMemoryError``, every
checkpoint the error passed through has already popped its bookkeeping. The
innermost checkpoint or region an exception leaves records on it where it was
raised (the same answer :func:`active_checkpoint` gives while it runs), so the
answer needs neither the traceback nor the names of the engine's variables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .state import FORWARD, RECOMPUTE, _tls

# Attribute set on an exception by the innermost checkpoint or region it leaves.
_WHERE = "__remat_active_checkpoint__"


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
        where = getattr(exception, _WHERE, None)
        return where if isinstance(where, ActiveCheckpoint) else None
    stack = _tls.stack
    if not stack:
        return None
    scope = stack[-1]
    regions = scope.region_stack
    return ActiveCheckpoint(
        scope.frame.name,
        RECOMPUTE if _tls.recompute_depth else FORWARD,
        regions[-1].qualname if regions else None,
    )


def note_exception(exception: BaseException) -> None:
    """Record on ``exception`` where it was raised, while the scope it leaves is
    still active (the innermost checkpoint or region it passes through records it;
    the outer ones leave it as it is). :func:`active_checkpoint` reads it back."""
    if getattr(exception, _WHERE, None) is None:
        try:
            setattr(exception, _WHERE, active_checkpoint())
        except (AttributeError, TypeError):  # an exception type without attributes
            pass


def forget_exception_site(exception: BaseException) -> None:
    """Drop the recorded site from a copy that will be raised somewhere else."""
    exception.__dict__.pop(_WHERE, None)
