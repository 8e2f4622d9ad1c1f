"""A weak registry of checkpoint calls whose saved tensors may still be alive.

Reports without a loss handle (the OOM observer, ``print_saved_tensors_report()``)
need every checkpoint that still holds memory. Today a frame lives as long as
anything it packed, because autograd keeps the pack hook (``frame.pack``) of each
saved tensor; the registry does not rely on that. Each frame gets an entry: while
the frame lives the entry reads it; if it dies first, a weakref callback keeps only
weak references to the tensors its SAVE regions saved, in forward order. The entry
never holds a tensor, and it is dropped once nothing it refers to is alive.
"""

from __future__ import annotations

import itertools
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any

from ..engine.observers import CheckpointObserver, add_process_observer
from .named_save import link_saved_outputs

if TYPE_CHECKING:
    from ..engine.frame import CheckpointFrame
    from ..engine.records import RegionRecord

_serials = itertools.count()
_entries: dict[int, FrameEntry] = {}
_PRUNE_EVERY = 512


class FrameEntry:
    __slots__ = ("serial", "name", "ref", "regions", "dead_saved")

    def __init__(self, frame: CheckpointFrame, serial: int) -> None:
        self.serial = serial
        self.name: str = frame.name
        # The frame's own list: holding it costs nothing while the frame lives.
        self.regions: list[Any] | None = frame.regions
        self.dead_saved: list[weakref.ref] | None = None
        self.ref = weakref.ref(frame, partial(_frame_died, serial))

    def frame(self) -> Any:
        return self.ref()

    def alive(self) -> bool:
        if self.ref() is not None:
            return True
        saved = self.dead_saved
        return bool(saved) and any(r() is not None for r in saved)


def _frame_died(serial: int, _ref: weakref.ref) -> None:
    entry = _entries.get(serial)
    if entry is None:
        return
    regions, entry.regions = entry.regions, None
    saved = [r for rec in regions or () for r in rec.saved if r() is not None]
    if saved:
        entry.dead_saved = saved
    else:
        _entries.pop(serial, None)


class _Registrar(CheckpointObserver):
    """Subscribed to every checkpoint of the process: enters it in the registry,
    and links each SAVE region's saved tensors to its outputs when it returns."""

    def checkpoint_created(self, frame: CheckpointFrame | None) -> None:
        serial = next(_serials)
        _entries[serial] = FrameEntry(frame, serial)
        if serial % _PRUNE_EVERY == 0:
            prune()

    def region_exited(self, frame: CheckpointFrame | None, record: RegionRecord) -> None:
        if record.saved and not record.recompute:
            link_saved_outputs(record)


add_process_observer(_Registrar())


def prune() -> None:
    for serial, entry in list(_entries.items()):
        if not entry.alive():
            _entries.pop(serial, None)


def live_entries() -> list[FrameEntry]:
    """Entries of checkpoints that still hold something, in creation order."""
    prune()
    return [e for _, e in sorted(_entries.items())]
