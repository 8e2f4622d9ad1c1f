"""Allocation sites: the innermost user frame (``file:line function``) behind a storage.

Two sources:

* CUDA: the caching allocator's memory snapshot, when the user has turned history
  recording on (``torch.cuda.memory._record_memory_history()``). Each active block
  carries the stack of its allocation; a storage's data pointer falls inside exactly
  one block. Reports look this up themselves when they hold CUDA storages.
* Any device, opt in: inside ``with remat.record_save_sites():`` the pack hook of a
  SAVE region records the innermost user frame of each tensor it keeps. Outside
  that block the pack path does no extra work.

"User frame" means a Python frame whose file is not inside torch, torch_remat or
its integrations.
"""

from __future__ import annotations

import bisect
import contextlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import _compat
from ..engine.observers import CheckpointObserver, observe
from .storage import StorageInfo

if TYPE_CHECKING:
    from ..engine.frame import CheckpointFrame
    from ..engine.records import RegionSaved

_library_dirs: tuple[str, ...] | None = None


def library_dirs() -> tuple[str, ...]:
    global _library_dirs
    if _library_dirs is None:
        dirs = [os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__))]
        try:
            spec = importlib.util.find_spec("torch_remat.integrations")
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(spec.submodule_search_locations)
        _library_dirs = tuple(os.path.join(os.path.abspath(d), "") for d in dirs)
    return _library_dirs


def is_user_file(filename: str) -> bool:
    if not filename.endswith(".py"):
        return False  # C++ frames, <frozen ...>, <string>, ??
    path = os.path.abspath(filename)
    return not path.startswith(library_dirs())


def format_site(filename: str, line: int, function: str) -> str:
    return f"{os.path.basename(filename)}:{line} {function}"


def current_user_site() -> str | None:
    """The innermost user frame of the calling thread's Python stack."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename):
            return format_site(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


def choose_user_frame(frames: Sequence[Mapping[str, Any]]) -> str | None:
    """Pick the innermost user frame of an allocator stack (innermost first)."""
    for f in frames:
        filename = f.get("filename", "")
        if is_user_file(filename):
            return format_site(filename, f.get("line", 0), f.get("name", "?"))
    return None


class SnapshotIndex:
    """Active blocks of a ``torch.cuda.memory._snapshot()`` dict, searchable by address."""

    def __init__(self, snapshot: Mapping[str, Any], default_device: int = 0) -> None:
        blocks: dict[int, list[tuple[int, int, Mapping[str, Any]]]] = {}
        for seg in snapshot.get("segments", ()):
            device = seg.get("device", default_device)
            address = seg.get("address", 0)
            for b in seg.get("blocks", ()):
                start = b.get("address", address)
                size = b.get("size", 0)
                address = start + size
                if b.get("state") == "active_allocated":
                    blocks.setdefault(device, []).append((start, start + size, b))
        self._starts: dict[int, list[int]] = {}
        self._blocks = {}
        for device, items in blocks.items():
            items.sort(key=lambda x: x[0])
            self._blocks[device] = items
            self._starts[device] = [x[0] for x in items]

    def block_at(self, device: int, ptr: int) -> Mapping[str, Any] | None:
        """The active block (the snapshot's own dict) holding ``ptr``, or None."""
        starts = self._starts.get(device)
        if not starts:
            return None
        i = bisect.bisect_right(starts, ptr) - 1
        if i < 0:
            return None
        start, end, block = self._blocks[device][i]
        return block if start <= ptr < end else None

    def frames_at(self, device: int, ptr: int) -> Sequence[Mapping[str, Any]] | None:
        """The allocation stack of the active block holding ``ptr``, or None."""
        block = self.block_at(device, ptr)
        return None if block is None else list(block.get("frames") or ())

    def site_of(self, device: int, ptr: int) -> str | None:
        frames = self.frames_at(device, ptr)
        return None if frames is None else choose_user_frame(frames)


def cuda_site_lookup(infos: Iterable[StorageInfo]) -> Callable[[StorageInfo], str | None] | None:
    """A lookup from storage to allocation site, when some storages are on CUDA and
    the allocator records history; None otherwise (never raises)."""
    try:
        if not any(i.device.type == "cuda" for i in infos):
            return None
        if not torch.cuda.is_available():
            return None
        if not _compat.cuda_memory_history_may_be_enabled():
            return None
        index = cached_snapshot_index()
    except Exception:
        return None

    def lookup(info: StorageInfo) -> str | None:
        if info.device.type != "cuda":
            return None
        device = info.device.index if info.device.index is not None else 0
        return index.site_of(device, info.data_ptr)

    return lookup


# The allocator snapshot torch_remat last took, with its index, reused while the
# allocator has neither allocated nor freed a block since (an OOM observer builds
# several reports in a row; a snapshot with history can take seconds).
_cache: tuple[Any, tuple[dict[str, Any], SnapshotIndex]] | None = None


def _take_snapshot() -> dict[str, Any]:
    return _compat.cuda_memory_snapshot()


def _allocator_epoch() -> Any:
    """Changes whenever the allocator allocates or frees a block; None when it
    cannot tell (then nothing is cached)."""
    stats = torch.cuda.memory_stats()
    allocated, freed = stats.get("allocation.all.allocated"), stats.get("allocation.all.freed")
    return None if allocated is None or freed is None else (allocated, freed)


def cached_snapshot() -> tuple[dict[str, Any], SnapshotIndex]:
    """``torch.cuda.memory._snapshot()`` and its index, from the cache when the
    allocator has not changed since it was taken."""
    global _cache
    epoch = _allocator_epoch()
    if epoch is not None and _cache is not None and _cache[0] == epoch:
        return _cache[1]
    snapshot = _take_snapshot()
    device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    entry = (snapshot, SnapshotIndex(snapshot, device))
    _cache = None if epoch is None else (epoch, entry)
    return entry


def cached_snapshot_index() -> SnapshotIndex:
    return cached_snapshot()[1]


_memo: dict[str, Any] | None = None


def memoized_snapshot(refresh: bool = False) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()``, taken once and kept until ``refresh`` or
    :func:`clear_memory_snapshot_cache` (whatever the allocator did since). A build
    without CUDA has no allocator blocks: an empty snapshot."""
    global _memo
    if refresh or _memo is None:
        _memo = _take_snapshot() if _compat.cuda_memory_snapshot_available() else {"segments": []}
    return _memo


def clear_memory_snapshot_cache() -> None:
    """Drop the CUDA memory snapshot torch_remat keeps for allocation sites.

    Reports (and :func:`memory_snapshot_annotate` without a snapshot) take
    ``torch.cuda.memory._snapshot()`` and reuse it while the caching allocator has
    neither allocated nor freed a block since. Clear it to force a fresh snapshot
    (after ``torch.cuda.memory._record_memory_history()`` changed what is recorded)
    or to free the memory the snapshot occupies.
    """
    global _cache, _memo
    _cache = _memo = None


class _SiteRecorder(CheckpointObserver):
    def tensor_kept(
        self, frame: CheckpointFrame | None, saved: RegionSaved, tensor: torch.Tensor
    ) -> None:
        saved.located_at(current_user_site())


@contextlib.contextmanager
def record_save_sites() -> Iterator[None]:
    """Record where each tensor saved inside a SAVE region was saved from.

    Checkpoints started inside this block (in this thread) label every tensor their
    SAVE regions keep with the innermost user frame (``model.py:42 forward``), and
    the memory and saved-tensors reports print it after the row. It costs a Python
    stack walk per saved tensor, so it is off by default. On CUDA, allocation sites
    also come from the allocator when ``torch.cuda.memory._record_memory_history()``
    is on, without this block.
    """
    with observe(_SiteRecorder()):
        yield
