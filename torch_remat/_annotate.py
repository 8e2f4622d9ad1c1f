"""Upstream torch-remat's module path for the memory-snapshot labeller.

Code and tests written for torch-remat 0.2.2 import these names from
``torch_remat._annotate``; they are torch_remat's own (see
``diagnostics/snapshot_annotate.py`` and ``diagnostics/alloc_sites.py``). New code
uses ``remat.memory_snapshot_annotate`` and ``remat.clear_memory_snapshot_cache``.
"""

from __future__ import annotations

from typing import Any

from .diagnostics.alloc_sites import clear_memory_snapshot_cache, memoized_snapshot
from .diagnostics.snapshot_annotate import memory_snapshot_annotate, site_from_frames

__all__ = ["clear_memory_snapshot_cache", "memory_snapshot_annotate"]

_alloc_site_from_frames = site_from_frames


def _memory_snapshot(*, refresh: bool = False) -> dict[str, Any]:
    """The allocator snapshot, kept until ``refresh=True`` or
    :func:`clear_memory_snapshot_cache`."""
    return memoized_snapshot(refresh)
