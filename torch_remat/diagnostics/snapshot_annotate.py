"""CUDA memory snapshots and what torch_remat holds.

``torch.cuda.memory._snapshot()`` lists the caching allocator's segments and blocks
(address, size, state, allocation stack). Two directions:

* ``remat.memory_snapshot_annotate(snapshot)`` (upstream torch-remat's contract)
  returns a labeller ``tensor -> "file:line function" | None``: the allocation site
  of the active block holding the tensor's storage (so every view of a storage gets
  the same label), for the ``annotate=`` of the reports.
* ``remat.label_memory_snapshot(snapshot)`` writes into the snapshot: a block that
  holds a tensor a checkpoint keeps for backward gets a ``"remat"`` entry, one label
  per held tensor whose storage starts inside the block, ``{"checkpoint", "region",
  "tensor", "nbytes"}``, so a snapshot viewer (or a script) sees "layers.3 / attn /
  saved.2" instead of an anonymous 16 MiB block.
"""

from __future__ import annotations

import bisect
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import _compat
from .._errors import RematError
from .alloc_sites import SnapshotIndex, cached_snapshot, format_site, is_user_file
from .holdings import entry_holdings
from .memory_report import Ledger, checkpoint_block
from .registry import live_entries


def held_storage_labels(device_type: str) -> list[tuple[int, int, dict[str, Any]]]:
    """``(device index, data_ptr, label)`` of every storage on ``device_type`` that a
    live checkpoint holds (parameters excluded), in registry order: one label per
    storage and region, named as the saved-tensors report's rows name what lies on
    it (``"saved.0, saved.1"``, ``"y (output at idx 0)"``), with the bytes the
    report counts for it there (0 where it counts the storage in another region),
    so the labels' bytes add up to the report's."""
    out = []
    ledger = Ledger()
    for entry in live_entries():
        holdings = entry_holdings(entry)
        if holdings is None:
            continue
        for region in checkpoint_block(holdings, ledger).regions:
            here: dict[int, dict[str, Any]] = {}
            for row in region.rows:
                for info in row.storages:
                    if info.device.type != device_type:
                        continue
                    label = here.get(info.key)
                    if label is not None:  # a view of a storage labelled above
                        label["tensor"] += f", {row.name}"
                        continue
                    here[info.key] = label = {
                        "checkpoint": holdings.name,
                        "region": region.region,
                        "tensor": row.name,
                        "nbytes": info.nbytes if row.kind == "storage" else 0,
                    }
                    out.append((info.device.index or 0, info.data_ptr, label))
    return out


@functools.lru_cache(maxsize=4096)
def _library_path(filename: str) -> bool:
    # A file of this machine is judged by where it is (inside torch, torch_remat or
    # its integrations); a stack recorded elsewhere (a snapshot loaded from disk)
    # by its directories: one named torch or torch_remat is a library's.
    if os.path.exists(filename):
        return not is_user_file(filename)
    parts = filename.replace(os.sep, "/").split("/")[:-1]
    return not filename.endswith(".py") or "torch" in parts or "torch_remat" in parts


def site_from_frames(frames: Sequence[Mapping[str, Any]] | None) -> str | None:
    """``file:line function`` of the innermost frame of an allocation stack
    (innermost first) outside torch and torch_remat; ``file:line`` of the innermost
    frame when all are library frames; None for no frames."""
    frames = list(frames or ())
    for f in frames:
        filename = f.get("filename", "")
        if filename and not _library_path(filename):
            return format_site(filename, f.get("line", 0), f.get("name", "?"))
    if frames:
        f = frames[0]
        return f"{os.path.basename(f.get('filename', '?'))}:{f.get('line', 0)}"
    return None


def take_snapshot(what: str = "memory_snapshot_annotate") -> dict[str, Any]:
    """The allocator's snapshot (cached, see :func:`clear_memory_snapshot_cache`),
    or :class:`RematError` saying why none can be taken."""
    if not _compat.cuda_memory_snapshot_available():
        raise RematError(
            f"torch_remat: {what}() needs a CUDA memory snapshot, but "
            "no CUDA device is available here (a CPU-only build of torch, or no visible "
            "GPU), so there is no allocator to snapshot. Pass a snapshot dict taken where CUDA runs "
            f"({what}(snapshot)), or leave annotate= out of the report."
        )
    try:
        return cached_snapshot()[0]
    except Exception as e:
        raise RematError(
            f"torch_remat: {what}() could not take a CUDA memory "
            f"snapshot ({type(e).__name__}: {e}). Pass a snapshot dict "
            f"({what}(snapshot)), or leave annotate= out of the report."
        ) from e


def memory_snapshot_annotate(
    snapshot: Mapping[str, Any] | None = None,
) -> Callable[[torch.Tensor], str | None]:
    """A labeller for the ``annotate=`` of the reports: ``label(tensor)`` is the
    allocation site (``"attn.py:42 forward"``) of the ``active_allocated`` block of
    ``snapshot`` holding the tensor's storage, None when no block holds it (or it
    has no storage). Every view of a storage gets the label of the storage.

    ``snapshot`` is a ``torch.cuda.memory._snapshot()`` dict; None takes one now
    (reusing torch_remat's cached one, see :func:`clear_memory_snapshot_cache`), and
    raises :class:`RematError` where none can be taken (a build without CUDA).
    Allocation stacks are recorded only while
    ``torch.cuda.memory._record_memory_history()`` is on. The site is the innermost
    frame outside torch and torch_remat (:func:`site_from_frames`). The snapshot is
    indexed once, here; each call is a binary search."""
    if snapshot is None:
        snapshot = take_snapshot()
    if not isinstance(snapshot, Mapping):
        raise TypeError(
            "torch_remat: memory_snapshot_annotate(snapshot) takes a "
            f"torch.cuda.memory._snapshot() dict or None, got {type(snapshot).__name__}."
        )
    blocks = []
    for segment in snapshot.get("segments", ()):
        # a block without an address starts where the one before it ended (as in
        # SnapshotIndex): the segment's blocks tile it in order
        address = segment.get("address", 0)
        for b in segment.get("blocks", ()):
            start = b.get("address", address)
            address = start + b.get("size", 0)
            if b.get("state") != "active_allocated":
                continue
            site = site_from_frames(b.get("frames"))
            if site is not None:
                blocks.append((start, address, site))
    blocks.sort()
    starts = [start for start, _, _ in blocks]

    def label(tensor: torch.Tensor) -> str | None:
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except Exception:  # no storage: a placeholder, a meta or wrapper tensor
            return None
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and ptr < blocks[i][1]:
            return blocks[i][2]
        return None

    return label


def label_memory_snapshot(
    snapshot: dict[str, Any] | None = None, *, device_type: str = "cuda"
) -> dict[str, Any]:
    """Label the active blocks of ``snapshot`` that hold tensors kept by checkpoints.

    ``snapshot`` is a ``torch.cuda.memory._snapshot()`` dict (None: take one now,
    or reuse the one torch_remat cached, see :func:`clear_memory_snapshot_cache`).
    Each ``active_allocated`` block holding the start of a kept tensor's storage
    gains ``block["remat"] = [{"checkpoint": ..., "region": ..., "tensor": ...,
    "nbytes": ...}, ...]``: the region's qualified name, ``(inputs)`` for kept
    checkpoint inputs or ``(state snapshots)``, and the tensor's name as the reports
    print it (``saved.0``, ``(output at idx 1)``). The dict is changed in place and
    returned. Storages are matched by data pointer on ``device_type`` devices whose
    index equals the segment's ``"device"`` (``device_type="cpu"`` matches CPU
    tensors, which is how it is tested without a GPU).
    """
    if snapshot is None:
        snapshot = take_snapshot("label_memory_snapshot")
    index = SnapshotIndex(snapshot)
    for device, ptr, label in held_storage_labels(device_type):
        block = index.block_at(device, ptr)
        if block is not None:
            block.setdefault("remat", []).append(label)  # type: ignore[attr-defined]
    return snapshot
