"""How diagnostics follow the checkpoint engine without the engine knowing them.

An observer is any object with some of the methods of :class:`CheckpointObserver`.
The engine calls them at fixed points and never looks at what they do; diagnostics
(traces, the registry behind the reports, named saves, allocation sites) are
observers. Observers may read the records they are handed but must not change how
the engine runs.

Two ways to subscribe:

* :func:`add_process_observer`: every checkpoint of the process (the registry);
* :func:`observe` (a context manager): checkpoints whose forward starts in this
  thread inside the block (``collect_trace``, ``record_save_sites``).

A checkpoint takes the observers active when it is created, so an observer sees a
whole forward or none of it; :meth:`CheckpointFrame.subscribe` adds one to a
single checkpoint later (``save_for_backward`` naming a tensor). Checkpoints created
while another is being recomputed get only the process observers: a replay is not
a forward.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .frame import CheckpointFrame
    from .records import RegionRecord, RegionSaved


class CheckpointObserver:
    """The events of the engine. Every method does nothing by default.

    ``frame`` is the :class:`~torch_remat.engine.frame.CheckpointFrame` (None for a
    ``remat.region`` called outside any checkpoint), ``record`` a
    :class:`~torch_remat.engine.records.RegionRecord`.
    """

    def checkpoint_created(self, frame: CheckpointFrame | None) -> None:
        """A checkpoint call starts (before its forward runs)."""

    def forward_entered(self, frame: CheckpointFrame | None) -> None:
        """The checkpointed function is about to run."""

    def forward_exited(self, frame: CheckpointFrame | None) -> None:
        """The checkpointed function returned or raised."""

    def region_entered(self, frame: CheckpointFrame | None, record: RegionRecord) -> None:
        """A ``remat.region`` body is about to run in a forward."""

    def region_exited(self, frame: CheckpointFrame | None, record: RegionRecord) -> None:
        """A region body returned or raised; a SAVE region's outputs are recorded."""

    def tensor_kept(self, frame: CheckpointFrame | None, saved: RegionSaved, tensor: Any) -> None:
        """A SAVE region kept ``tensor`` for backward as ``saved`` (a RegionSaved)."""

    def replay_started(self, frame: CheckpointFrame | None) -> None:
        """Backward starts recomputing the checkpoint."""

    def replay_ended(self, frame: CheckpointFrame | None) -> None:
        """The recompute stopped (done, stopped early, or raised)."""


def _overrides(observer: Any, method: str) -> bool:
    impl = getattr(type(observer), method, None)
    return impl is not None and impl is not getattr(CheckpointObserver, method)


class ObserverSet:
    """The observers of one checkpoint, split by event so the engine loops only over
    those that implement it (an observer's no-op defaults are never called)."""

    __slots__ = ("all", "created", "forward", "regions", "entered", "exited", "kept", "replay")

    def __init__(self, observers: tuple[Any, ...] = ()) -> None:
        self.all = observers
        self.created = tuple(o for o in observers if _overrides(o, "checkpoint_created"))
        self.forward = tuple(
            o for o in observers if _overrides(o, "forward_entered") or _overrides(o, "forward_exited")
        )
        self.entered = tuple(o for o in observers if _overrides(o, "region_entered"))
        self.exited = tuple(o for o in observers if _overrides(o, "region_exited"))
        self.regions = bool(self.entered or self.exited)  # (one test per region call)
        self.kept = tuple(o for o in observers if _overrides(o, "tensor_kept"))
        self.replay = tuple(
            o for o in observers if _overrides(o, "replay_started") or _overrides(o, "replay_ended")
        )

    def with_(self, observer: Any) -> ObserverSet:
        return self if observer in self.all else ObserverSet((*self.all, observer))


_process: list[Any] = []


class _ThreadObservers(threading.local):
    def __init__(self) -> None:
        self.observers: tuple[Any, ...] = ()


_thread = _ThreadObservers()


def add_process_observer(observer: Any) -> None:
    """Subscribe ``observer`` to every checkpoint created from now on, in any thread."""
    if observer not in _process:
        _process.append(observer)


def remove_process_observer(observer: Any) -> None:
    if observer in _process:
        _process.remove(observer)


@contextlib.contextmanager
def observe(observer: Any) -> Iterator[Any]:
    """Subscribe ``observer``, in this thread, to the checkpoints (and the regions
    outside checkpoints) that start inside the block."""
    previous = _thread.observers
    _thread.observers = (*previous, observer)
    try:
        yield observer
    finally:
        _thread.observers = previous


def thread_observers() -> tuple[Any, ...]:
    return _thread.observers


_sets: dict[tuple[Any, ...], ObserverSet] = {}


def observers_for_new_checkpoint(recomputing: bool) -> ObserverSet:
    key = tuple(_process) if recomputing else (*_process, *_thread.observers)
    found = _sets.get(key)
    if found is None:
        if len(_sets) >= 64:  # ever new observer combinations: start over
            _sets.clear()
        found = _sets[key] = ObserverSet(key)
    return found
