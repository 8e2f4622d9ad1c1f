"""Per-checkpoint memory blocks and ``remat.print_current_memory_report``.

A block reads::

    layers.0: 28 B resident in 2 storage(s)
    layers.0::attn.softmax: 28 B
      12 B  lse    (3,)  float32
      16 B  probs  (4,)  float32

One row per storage, in the order the region saved them. A storage is counted once
(per report): a second tensor on a storage already listed in the same region is a
``view`` row, or joins the first row's name when it is the very same tensor; one
counted in another block is a ``shared`` row. Neither adds bytes, so a header is
always the sum of its rows. Parameters (leaves that require grad) are not listed.
A row whose tensor uses less than the storage it pins says so (``pins 4.0 KiB,
uses 1.0 KiB``). SAVE-region saves the replay rebuilds hold nothing; a footer
counts them (``3 saves rebuilt on recompute, 6.0 KiB not held``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from .._tensors import TensorMeta
from ..engine.context import FORWARD, current_pass
from .alloc_sites import cuda_site_lookup
from .format import align_rows, format_bytes, format_dtype, format_shape
from .holdings import HeldGroup, Holdings, frame_holdings
from .storage import StorageInfo, storages_of

_RIGHT = (True, False, False, False, False)


@dataclass
class TensorRow:
    kind: str  # "storage" (counted here), "view" or "shared" (counted elsewhere)
    names: list[str]  # of the saved tensors on this row (one, or several identical)
    output_index: int | None  # the region output on this storage, if any
    meta: TensorMeta | None
    nbytes: int  # bytes this row adds to the report
    storage_bytes: int
    storages: list[StorageInfo] = field(default_factory=list)
    site: str | None = None
    counted_in: str | None = None
    # a tensor on this row, for an ``annotate=`` labeller (never printed)
    tensor: Any = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        names = list(self.names)
        if self.output_index is not None:
            names.append(f"(output at idx {self.output_index})")
        if len(names) > 1 and self.output_index is not None:
            names[-2:] = [f"{names[-2]} {names[-1]}"]
        return ", ".join(names)

    def cells(self, checkpoint: str = "") -> list[str]:
        """Text cells; a storage counted elsewhere in the same ``checkpoint`` is
        named by region only, so identical layers read identically."""
        if self.kind == "storage":
            size = format_bytes(self.nbytes)
        else:
            size = self.kind
        name = self.name
        if self.kind == "storage" and self.meta is not None:
            used = _used_bytes(self.meta)
            if used < self.storage_bytes:
                name += f" (pins {format_bytes(self.storage_bytes)}, uses {format_bytes(used)})"
        where = self.counted_in
        if where is not None:
            prefix = f"{checkpoint}::"
            if checkpoint and where.startswith(prefix):
                where = where[len(prefix) :]
            name = f"{name} (counted in {where})"
        shape = format_shape(self.meta.shape) if self.meta is not None else "?"
        dtype = format_dtype(self.meta.dtype) if self.meta is not None else "?"
        return [size, name, shape, dtype, f"@ {self.site}" if self.site else ""]

    def to_dict(self) -> dict[str, Any]:
        meta = self.meta
        devices = sorted({str(s.device) for s in self.storages})
        return {
            "name": self.name,
            "kind": self.kind,
            "bytes": self.nbytes,
            "storage_bytes": self.storage_bytes,
            "shape": list(meta.shape) if meta is not None else None,
            "dtype": format_dtype(meta.dtype) if meta is not None else None,
            "device": devices[0] if len(devices) == 1 else (devices or None),
            "site": self.site,
            "counted_in": self.counted_in,
        }


@dataclass
class RegionBlock:
    checkpoint: str
    region: str
    rows: list[TensorRow]

    @property
    def label(self) -> str:
        return f"{self.checkpoint}::{self.region}"

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    @property
    def storages(self) -> int:
        return sum(len(r.storages) for r in self.rows if r.kind == "storage")


@dataclass
class CheckpointBlock:
    """What one checkpoint call holds, as rows per region."""

    name: str
    regions: list[RegionBlock]
    rebuilt: int = 0
    rebuilt_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    @property
    def storages(self) -> int:
        return sum(r.storages for r in self.regions)

    def rows(self) -> list[TensorRow]:
        return [row for r in self.regions for row in r.rows]

    def lines(self) -> list[str]:
        out = [f"{self.name}: {format_bytes(self.nbytes)} resident in {self.storages} storage(s)"]
        for r in self.regions:
            out.append(f"{r.label}: {format_bytes(r.nbytes)}")
            cells = [row.cells(self.name) for row in r.rows]
            out.extend(align_rows(cells, _RIGHT, indent="  "))
        if self.rebuilt:
            out.append(
                f"  {self.rebuilt} save(s) rebuilt on recompute, "
                f"{format_bytes(self.rebuilt_bytes)} not held"
            )
        return out

    def format(self) -> str:
        return "\n".join(self.lines())

    def signature(self) -> tuple:
        """Equal for checkpoints whose blocks read the same apart from their name."""
        return tuple(
            (r.region, tuple(tuple(row.cells(self.name)) for row in r.rows)) for r in self.regions
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bytes": self.nbytes,
            "storages": self.storages,
            "rebuilt_saves": self.rebuilt,
            "rebuilt_bytes": self.rebuilt_bytes,
            "regions": [
                {
                    "region": r.region,
                    "bytes": r.nbytes,
                    "tensors": [row.to_dict() for row in r.rows],
                }
                for r in self.regions
            ],
        }


class Ledger:
    """Which storages a report has counted already, and where."""

    def __init__(self, excluded: set[int] | None = None) -> None:
        self.owner: dict[int, str] = {}
        self.excluded: set[int] = excluded if excluded is not None else set()


def _same_tensor(a: TensorMeta | None, b: TensorMeta | None) -> bool:
    if a is None or b is None:
        return False
    return (a.shape, a.stride, a.storage_offset, a.dtype) == (
        b.shape,
        b.stride,
        b.storage_offset,
        b.dtype,
    )


def _region_block(checkpoint: str, group: HeldGroup, ledger: Ledger) -> RegionBlock:
    block = RegionBlock(checkpoint, group.region, [])
    here: dict[int, TensorRow] = {}  # storage key -> this block's first row on it
    on: dict[int, list[TensorRow]] = {}  # storage key -> this block's rows on it
    for item in group.items:
        if item.parameter:
            continue
        infos = [i for t in item.tensors for i in storages_of(t)]
        if infos and all(i.key in ledger.excluded for i in infos):
            continue
        first = next((here[i.key] for i in infos if i.key in here), None)
        if item.kept_output is not None:
            if first is not None:  # already listed as a saved tensor: just say so
                if first.output_index is None:
                    first.output_index = item.kept_output
                continue
            names, output = [], item.kept_output
        else:
            names, output = [item.name], item.output_index
        size = sum(i.nbytes for i in infos)
        if first is not None:
            # the same tensor saved again (also after a view of its storage): one row
            same = next(
                (r for i in infos for r in on.get(i.key, ()) if _same_tensor(r.meta, item.meta)), None
            )
            if same is not None:
                same.names.extend(names)
                if same.output_index is None:
                    same.output_index = output
                continue
            row = TensorRow("view", names, output, item.meta, 0, size, infos)
        else:
            new = [i for i in infos if i.key not in ledger.owner]
            if new or not infos:
                row = TensorRow(
                    "storage", names, output, item.meta, sum(i.nbytes for i in new), size, new
                )
                for i in new:
                    ledger.owner[i.key] = block.label
            else:
                owner = ledger.owner[infos[0].key]
                row = TensorRow(
                    "shared", names, output, item.meta, 0, size, infos, counted_in=owner
                )
            for i in infos:
                here.setdefault(i.key, row)
        for i in infos:
            on.setdefault(i.key, []).append(row)
        row.site = item.site
        row.tensor = item.tensors[0] if item.tensors else None
        block.rows.append(row)
    return block


def checkpoint_block(holdings: Holdings, ledger: Ledger) -> CheckpointBlock:
    blocks = [_region_block(holdings.name, g, ledger) for g in holdings.groups]
    return CheckpointBlock(
        holdings.name, [b for b in blocks if b.rows], holdings.rebuilt, holdings.rebuilt_bytes
    )


def _used_bytes(meta: TensorMeta) -> int:
    """Bytes of storage a tensor's elements span (from its first to its last)."""
    if any(s == 0 for s in meta.shape):
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(meta.shape, meta.stride))
    return span * meta.dtype.itemsize


def check_annotate(annotate: Any) -> None:
    if annotate is not None and not callable(annotate):
        raise TypeError(
            "torch_remat: annotate must be None or a callable taking a tensor and "
            f"returning a label (str) or None, got {type(annotate).__name__}; for "
            "allocation sites pass remat.memory_snapshot_annotate(snapshot)."
        )


def add_allocation_sites(rows: list[TensorRow], annotate: Any = None) -> None:
    """Label rows: with ``annotate(tensor)`` where it gives a label, else from the
    CUDA allocator's history if it is on (rows without a site)."""
    if annotate is not None:
        for row in rows:
            if row.tensor is not None:
                label = annotate(row.tensor)
                if label is not None:
                    row.site = str(label)
    lookup: Callable[[StorageInfo], str | None] | None = cuda_site_lookup(
        [s for row in rows for s in row.storages]
    )
    if lookup is None:
        return
    for row in rows:
        if row.site is None:
            for s in row.storages:
                site = lookup(s)
                if site is not None:
                    row.site = site
                    break


def current_memory_block(annotate: Any = None) -> CheckpointBlock | None:
    """The block of the checkpoint whose forward is running in this thread."""
    active = current_pass()
    if active is None or active.phase != FORWARD:
        return None
    block = checkpoint_block(frame_holdings(active), Ledger())
    add_allocation_sites(block.rows(), annotate)
    return block


def format_current_memory_report(annotate: Any = None) -> str:
    """What the checkpoint whose forward is running holds so far, as text.

    Call it from code running inside a ``remat.checkpoint`` forward. The first line
    is ``<checkpoint>: <bytes> resident in N storage(s)``; then, per region that
    holds something, ``<checkpoint>::<region>: <bytes>`` and one row per storage
    (bytes, name, shape, dtype, and ``@ file:line function`` when the allocation
    site is known). Names come from :func:`save_for_backward` where it was used,
    else ``saved.<i>``; kept region outputs read ``(output at idx i)`` and kept
    checkpoint inputs ``(input i)``.

    ``annotate``: a callable ``tensor -> str | None`` (such as
    :func:`memory_snapshot_annotate`'s labeller) whose label is printed after a
    row as ``@ label``, in place of the allocation site.
    """
    check_annotate(annotate)
    active = current_pass()
    if active is None:
        return (
            "torch_remat: no checkpoint forward is running in this thread; "
            "print_current_memory_report() describes the checkpoint whose forward calls it."
        )
    block = current_memory_block(annotate)
    if block is None:
        name = active.frame.name
        return (
            f"torch_remat: checkpoint '{name}' is being recomputed; the memory report "
            "describes the original forward only. Guard the call with "
            "`if not remat.is_recomputing():`."
        )
    return block.format()


def print_current_memory_report(file: IO[str] | None = None, annotate: Any = None) -> None:
    """Print :func:`format_current_memory_report` (to stdout by default)::

    if not remat.is_recomputing():
        remat.print_current_memory_report()
    """
    text = format_current_memory_report(annotate)
    print(text, file=file if file is not None else sys.stdout)
