"""``remat.print_saved_tensors_report``: everything held for backward, by region.

::

    saved for backward: 240 B resident -- 2 region(s) 192 B, outside regions 48 B

    regions:
      96 B  x2  layer.0-1  (2 storages each)

    outside regions: 48 B in 1 storage
           48 B  TanhBackward0 (x1)

    region detail:
    [x2: layer.0-1]
    layer.0: 96 B resident in 2 storage(s)
    layer.0::sq: 96 B
      48 B  y (output at idx 0)  (3, 4)  float32
      48 B  gf                   (3, 4)  float32

"Regions" are checkpoint calls whose saves the graph from the given roots holds,
and calls whose blocks read the same are grouped. "Outside regions" are tensors
saved by autograd nodes that no checkpoint packed, grouped by node type. Without
roots, every checkpoint call still holding memory (from the registry, so none is
missed) and the graph of every live tensor. Each storage is counted once in the
whole report, checkpoints first; parameters are never counted. Nothing is
unpacked, so building the report never recomputes a checkpoint.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from .format import align_rows, format_bytes, plural
from .graph_saves import live_graph_roots, root_nodes, walk_graph_saves
from .holdings import compiled_holdings, entry_holdings
from .memory_report import (
    CheckpointBlock,
    Ledger,
    TensorRow,
    add_allocation_sites,
    check_annotate,
    checkpoint_block,
)
from .registry import live_entries
from .storage import StorageInfo, storages_of

OUTSIDE = "outside regions"


@dataclass
class OutsideGroup:
    """Saves outside checkpoints by one autograd node type."""

    node_type: str
    nodes: int = 0
    nbytes: int = 0
    storages: list[StorageInfo] = field(default_factory=list)
    site: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node_type,
            "count": self.nodes,
            "bytes": self.nbytes,
            "storages": len(self.storages),
            "site": self.site,
        }


@dataclass
class CheckpointGroup:
    """Checkpoint calls whose blocks read the same apart from their names."""

    blocks: list[CheckpointBlock]

    @property
    def names(self) -> str:
        return compress_names([b.name for b in self.blocks])

    @property
    def label(self) -> str:
        return f"x{len(self.blocks)}: {self.names}"


def compress_names(names: list[str]) -> str:
    """``["layer.0", "layer.1", "layer.3"]`` -> ``"layer.0-1,3"``."""
    matches = [re.fullmatch(r"(.*?)(\d+)", n) for n in names]
    if all(matches) and len({m.group(1) for m in matches}) == 1:  # type: ignore[union-attr]
        prefix = matches[0].group(1)  # type: ignore[union-attr]
        nums = sorted({int(m.group(2)) for m in matches})  # type: ignore[union-attr]
        runs: list[str] = []
        start = prev = nums[0]
        for n in nums[1:] + [None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            if n is not None:
                start = prev = n
        return prefix + ",".join(runs)
    unique = list(dict.fromkeys(names))
    if len(unique) > 4:
        return ", ".join(unique[:4]) + f", ... (+{len(unique) - 4})"
    return ", ".join(unique)


@dataclass
class SavedTensorsReport:
    """Structured form of the saved-tensors report; ``format()`` gives the text,
    ``to_dict()`` a JSON-ready dict (for aggregation across ranks or OOM dumps)."""

    checkpoints: list[CheckpointBlock]
    outside: list[OutsideGroup]
    torch_checkpoint_saves: int = 0
    """Tensors saved inside ``torch.utils.checkpoint`` calls: torch keeps those
    checkpoints' inputs where the report cannot see them, so they are not counted."""

    @property
    def checkpoint_bytes(self) -> int:
        return sum(b.nbytes for b in self.checkpoints)

    @property
    def outside_bytes(self) -> int:
        return sum(g.nbytes for g in self.outside)

    @property
    def total_bytes(self) -> int:
        return self.checkpoint_bytes + self.outside_bytes

    def groups(self) -> list[CheckpointGroup]:
        by_signature: dict[tuple, CheckpointGroup] = {}
        for block in self.checkpoints:
            key = block.signature()
            group = by_signature.get(key)
            if group is None:
                by_signature[key] = CheckpointGroup([block])
            else:
                group.blocks.append(block)
        return list(by_signature.values())

    def format(self) -> str:
        lines = [
            f"saved for backward: {format_bytes(self.total_bytes)} resident -- "
            f"{len(self.checkpoints)} region(s) {format_bytes(self.checkpoint_bytes)}, "
            f"outside regions {format_bytes(self.outside_bytes)}",
            "",
        ]
        if self.torch_checkpoint_saves:
            lines[1:1] = [
                f"not counted: {plural(self.torch_checkpoint_saves, 'tensor')} saved inside "
                "torch.utils.checkpoint calls (torch keeps those checkpoints' inputs where "
                "this report cannot see them)"
            ]
        groups = self.groups()
        if groups:
            lines.append("regions:")
            rows = []
            for g in groups:
                first = g.blocks[0]
                each = " each" if len(g.blocks) > 1 else ""
                rows.append(
                    [
                        format_bytes(first.nbytes),
                        f"x{len(g.blocks)}",
                        g.names,
                        f"({plural(first.storages, 'storage')}{each})",
                    ]
                )
            lines.extend(align_rows(rows, (True, False, False, False), indent="  "))
        else:
            lines.append("regions: none")
        lines.append("")
        storages = sum(len(g.storages) for g in self.outside)
        lines.append(
            f"{OUTSIDE}: {format_bytes(self.outside_bytes)} in {plural(storages, 'storage')}"
        )
        if self.outside:
            width = max(11, *(len(format_bytes(g.nbytes)) for g in self.outside))
            for g in self.outside:
                line = f"{format_bytes(g.nbytes):>{width}}  {g.node_type} (x{g.nodes})"
                lines.append(line + (f"  @ {g.site}" if g.site else ""))
        if groups:
            lines += ["", "region detail:"]
            for i, g in enumerate(groups):
                if i:
                    lines.append("")
                lines.append(f"[{g.label}]")
                lines.extend(g.blocks[0].lines())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total_bytes,
            "checkpoint_bytes": self.checkpoint_bytes,
            "outside_bytes": self.outside_bytes,
            "checkpoints": [b.to_dict() for b in self.checkpoints],
            "outside": [g.to_dict() for g in self.outside],
            "torch_checkpoint_saves": self.torch_checkpoint_saves,
        }


def saved_tensors_report(roots: Any = None, annotate: Any = None) -> SavedTensorsReport:
    """Build the report for the autograd graphs reachable from ``roots`` (a loss
    tensor, tensors, or autograd nodes): the checkpoint calls whose saves they hold,
    and the saves outside checkpoints.

    With ``roots=None`` it covers everything alive: every checkpoint call still
    holding memory (from a weak registry of calls, so none is missed) and the graphs
    of every live tensor, found without a loss handle (slower: it scans the garbage
    collector's objects). This is what the OOM observer prints.

    ``annotate``: a callable ``tensor -> str | None`` (such as
    :func:`memory_snapshot_annotate`'s labeller) whose label is printed after a
    row as ``@ label``, in place of the allocation site."""
    _check_roots(roots)
    check_annotate(annotate)
    nodes = root_nodes(roots) if roots is not None else live_graph_roots()
    graph = walk_graph_saves(nodes)
    ledger = Ledger(graph.parameter_storages)
    blocks = []
    for entry in live_entries():
        if roots is not None and not graph.reaches(entry):
            continue
        holdings = entry_holdings(entry)
        if holdings is not None:
            block = checkpoint_block(holdings, ledger)
            if block.regions:
                blocks.append(block)
    for holdings in compiled_holdings(graph.compiled):
        block = checkpoint_block(holdings, ledger)
        if block.regions:
            blocks.append(block)
    groups: dict[str, OutsideGroup] = {}
    tensor_of: dict[int, torch.Tensor] = {}  # storage key -> a tensor on it (annotate)
    for saves in graph.outside:
        new = []
        for t in saves.tensors:
            for info in storages_of(t):
                if info.key not in ledger.excluded and info.key not in ledger.owner:
                    ledger.owner[info.key] = OUTSIDE
                    new.append(info)
                    if annotate is not None:
                        tensor_of[info.key] = t
        if new:
            group = groups.setdefault(saves.node_type, OutsideGroup(saves.node_type))
            group.nodes += 1
            group.nbytes += sum(i.nbytes for i in new)
            group.storages.extend(new)
    outside = sorted(groups.values(), key=lambda g: (-g.nbytes, g.node_type))
    _add_sites(blocks, outside, annotate, tensor_of)
    return SavedTensorsReport(blocks, outside, graph.torch_checkpoint_saves)


def _check_roots(roots: Any) -> None:
    items = roots if isinstance(roots, (list, tuple, set, frozenset)) else [roots]
    for r in items:
        if r is not None and not isinstance(r, torch.Tensor) and not hasattr(r, "next_functions"):
            raise TypeError(
                "saved_tensors_report: roots must be None (everything alive), a tensor "
                "(the loss), autograd nodes, or a list of them; got "
                f"{type(r).__name__} ({r!r})."
            )


def _add_sites(
    blocks: list[CheckpointBlock],
    outside: list[OutsideGroup],
    annotate: Any = None,
    tensor_of: dict[int, torch.Tensor] | None = None,
) -> None:
    # An outside group shows the site of its largest storage.
    largest = []
    for g in outside:
        info = max(g.storages, key=lambda s: s.nbytes)
        row = TensorRow("storage", [g.node_type], None, None, 0, 0, [info])
        row.tensor = (tensor_of or {}).get(info.key)
        largest.append(row)
    add_allocation_sites([row for b in blocks for row in b.rows()] + largest, annotate)
    for g, row in zip(outside, largest):
        g.site = row.site


def format_saved_tensors_report(roots: Any = None, annotate: Any = None) -> str:
    """The saved-tensors report as text (see :func:`saved_tensors_report`)."""
    return saved_tensors_report(roots, annotate).format()


def print_saved_tensors_report(
    loss: Any = None, file: IO[str] | None = None, annotate: Any = None, *, roots: Any = None
) -> None:
    """Print what is held for backward, by checkpoint region and outside regions.

    ::

        loss = model(inputs).sum()
        remat.print_saved_tensors_report(loss)

    Lists the checkpoint calls whose saves ``loss``'s graph holds (identical ones
    grouped, e.g. ``x2 layer.0-1``) and the tensors saved outside checkpoints in
    that graph. Without ``loss``, everything alive: every checkpoint call still
    holding memory and every live graph. The total equals the bytes those storages
    occupy; parameters are not counted. It never triggers a recompute. Prints to
    stdout unless ``file`` is given; ``annotate`` labels rows (see
    :func:`saved_tensors_report`). ``roots=`` (upstream torch-remat's name) is the
    same as ``loss``.
    """
    if roots is not None:
        if loss is not None:
            raise TypeError(
                "print_saved_tensors_report: pass the graph roots once, as loss or as "
                "roots=, not both."
            )
        loss = roots
    text = format_saved_tensors_report(loss, annotate)
    print(text, file=file if file is not None else sys.stdout)
