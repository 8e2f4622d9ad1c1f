"""The thread context of the engine: the active pass, region-name prefixes, where an
exception was raised, and profiler ranges.

Like PyTorch's saved-tensor hooks, all of it is per thread: two threads that run
checkpoints at the same time never see each other's passes.

* The *active pass* (:func:`current_pass`): the innermost checkpoint forward (a
  ``CheckpointFrame``) or replay (a ``ReplayPass``) running in this thread, which
  ``remat.region``, ``recompute_needs_tensor`` and the diagnostics ask.
* ``remat.name_scope``: prefixes for region names, so one sub-block called twice in
  a checkpoint gets distinct regions. A checkpoint remembers the prefixes active
  when its forward started and its replay runs under the same ones, wherever
  backward runs. A region's body starts with no prefixes of its own (its regions are
  already qualified by the region's name), so ``name_scope("a")`` around
  ``region("outer")`` whose body calls ``region("inner")`` names them ``a/outer``
  and ``a/outer.inner``.
* ``remat.active_checkpoint``: which checkpoint and region a thread is running, now
  or at the moment an exception was raised. Out-of-memory diagnosis needs the second
  form: by the time an ``except`` block sees a ``torch.OutOfMemoryError``, every
  checkpoint the error passed through has already popped its bookkeeping. The
  innermost checkpoint or region an exception leaves records on it where it was
  raised.
* Named ranges for ``torch.profiler`` that cost one C call when no profiler runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .._compat import profiler_enabled as _profiler_enabled

if TYPE_CHECKING:
    from .frame import CheckpointFrame


class _ThreadState(threading.local):
    def __init__(self) -> None:
        # Active passes, innermost last: a checkpoint frame during its forward, or a
        # replay pass during its replay.
        self.stack: list[Any] = []
        self.recompute_depth = 0
        # remat.name_scope prefixes active now (a replay runs under its forward's)
        self.prefixes: tuple[str, ...] = ()


_tls = _ThreadState()


class ActivePass(Protocol):
    """What code running inside a checkpoint can ask of the pass around it: the
    forward of a checkpoint (a ``CheckpointFrame``) or its recompute (a
    ``ReplayPass``). ``remat.region`` and ``recompute_needs_tensor`` call into it;
    diagnostics read it. Nothing else is assumed of the objects on the stack."""

    phase: str
    """``"forward"`` or ``"recompute"``."""
    frame: CheckpointFrame
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


def current_pass() -> ActivePass | None:
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
    active = stack[-1]
    regions = active.region_stack
    return ActiveCheckpoint(
        active.frame.name,
        RECOMPUTE if _tls.recompute_depth else FORWARD,
        regions[-1].qualname if regions else None,
    )


def note_exception(exception: BaseException) -> None:
    """Record on ``exception`` where it was raised, while the pass it leaves is
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



@contextlib.contextmanager
def name_scope(prefix: str) -> Iterator[None]:
    """Name the regions called inside the block ``prefix/name``.

    ::

        with remat.name_scope("mlp_in"):
            h = mlp(x)          # its region "up" is named "mlp_in/up"
        with remat.name_scope("mlp_out"):
            y = mlp(h)          # ... and here "mlp_out/up"

    Nested scopes join with ``/`` (``outer/inner/name``). Reports, traces and error
    messages show the full name. Only ``remat.region`` names change; checkpoint
    names (``region_name``) do not.
    """
    if not isinstance(prefix, str):
        raise TypeError(f"remat.name_scope: prefix must be a string, got {type(prefix).__name__}.")
    if not prefix:
        raise ValueError(f"remat.name_scope: prefix must be a non-empty string, got {prefix!r}.")
    previous = _tls.prefixes
    _tls.prefixes = (*previous, prefix)
    try:
        yield
    finally:
        _tls.prefixes = previous


def current_prefixes() -> tuple[str, ...]:
    return _tls.prefixes


def prefixed_name(name: str, prefixes: tuple[str, ...]) -> str:
    return "/".join((*prefixes, name))


def without_prefixes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with no prefixes active (a region body)."""

    def body(*args: Any, **kwargs: Any) -> Any:
        previous = _tls.prefixes
        _tls.prefixes = ()
        try:
            return fn(*args, **kwargs)
        finally:
            _tls.prefixes = previous

    return body



_NULL = contextlib.nullcontext()


def profiler_range(*name_parts: str) -> contextlib.AbstractContextManager:
    """``record_function("".join(name_parts))`` while a profiler runs; otherwise a
    shared no-op (the name is not even built)."""
    if _profiler_enabled():
        return torch.profiler.record_function("".join(name_parts))
    return _NULL

