"""Memory reports across ranks: what every rank holds for backward, side by side.

Each rank builds its own saved-tensors report (:func:`torch_remat.saved_tensors_report`:
every live checkpoint by region name, plus saves outside checkpoints) and
:func:`gather_memory_report` collects them on one rank, which shows per region the
min / median / max bytes over ranks and the rank holding the max, per-rank totals,
and flags imbalance.

The reports travel through the process group's key-value store
(``ProcessGroup.get_group_store()``), not through collectives. So the rank that
gathers can wait with a deadline: a rank that never arrives is named in an error
after ``timeout``, and because no collective was left half-done, the process group
stays usable. Ranks other than ``dst`` only write their report and return at once.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

import torch_remat as remat

OUTSIDE_REGIONS = "(outside regions)"
_KEY_PREFIX = "torch_remat/memory_report"
_calls_per_group: dict[str, int] = {}


class MemoryReportTimeout(RuntimeError):
    """Some ranks did not send their report to ``dst`` before the timeout."""

    def __init__(self, message: str, missing_ranks: list[int]) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks


@dataclass
class RegionAcrossRanks:
    """One region (checkpoint name, or saves outside checkpoints) over all ranks."""

    name: str
    bytes_per_rank: list[int]
    calls_per_rank: list[int]

    @property
    def min_bytes(self) -> int:
        return min(self.bytes_per_rank)

    @property
    def median_bytes(self) -> float:
        return statistics.median(self.bytes_per_rank)

    @property
    def max_bytes(self) -> int:
        return max(self.bytes_per_rank)

    @property
    def max_rank_index(self) -> int:
        return self.bytes_per_rank.index(self.max_bytes)

    @property
    def spread(self) -> float:
        """(max - min) / max: 0 when every rank holds the same."""
        return 0.0 if self.max_bytes == 0 else (self.max_bytes - self.min_bytes) / self.max_bytes


@dataclass
class ClusterMemoryReport:
    """Every rank's saved-tensors report, aggregated (what :func:`gather_memory_report`
    returns on ``dst``). ``str(report)`` is the table, ``to_json()`` the machine form."""

    ranks: list[int]
    """Global rank of each column, in group order."""

    rank_reports: list[dict[str, Any]]
    """Each rank's ``SavedTensorsReport.to_dict()``."""

    imbalance_threshold: float = 0.10
    regions: list[RegionAcrossRanks] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.regions:
            self.regions = _regions_across_ranks(self.rank_reports)

    @property
    def totals(self) -> list[int]:
        """Bytes held for backward on each rank."""
        return [int(r["total_bytes"]) for r in self.rank_reports]

    @property
    def total_spread(self) -> float:
        top = max(self.totals)
        return 0.0 if top == 0 else (top - min(self.totals)) / top

    def imbalanced(self) -> list[RegionAcrossRanks]:
        """Regions whose (max - min) / max over ranks exceeds the threshold."""
        return [r for r in self.regions if r.spread > self.imbalance_threshold]

    @property
    def is_imbalanced(self) -> bool:
        return self.total_spread > self.imbalance_threshold or bool(self.imbalanced())

    def format(self) -> str:
        fmt = remat.format_bytes
        heaviest = self.ranks[self.totals.index(max(self.totals))]
        lines = [
            f"torch_remat memory across {len(self.ranks)} ranks: saved for backward "
            f"{fmt(sum(self.totals))} in total, max {fmt(max(self.totals))} on rank {heaviest}",
            "",
            "per rank:",
        ]
        rows = [[f"rank {rank}", fmt(total)] for rank, total in zip(self.ranks, self.totals)]
        lines += _aligned(rows, indent="  ")
        lines += ["", "per region:"]
        rows = [["region", "min", "median", "max", "max on", ""]]
        for r in self.regions:
            flag = f"! {r.spread:.0%} spread" if r.spread > self.imbalance_threshold else ""
            rows.append(
                [
                    r.name,
                    fmt(r.min_bytes),
                    fmt(int(r.median_bytes)),
                    fmt(r.max_bytes),
                    f"rank {self.ranks[r.max_rank_index]}" if r.spread else "all ranks",
                    flag,
                ]
            )
        lines += _aligned(rows, indent="  ")
        lines.append("")
        limit = f"{self.imbalance_threshold:.0%}"
        if self.is_imbalanced:
            names = ", ".join(r.name for r in self.imbalanced()) or "none"
            lines.append(
                f"imbalance: totals differ by {self.total_spread:.1%} of the max (over "
                f"{limit} flagged); regions over {limit}: {names}"
            )
        else:
            lines.append(f"balanced: no rank or region differs by more than {limit}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": self.ranks,
            "totals": self.totals,
            "imbalance_threshold": self.imbalance_threshold,
            "imbalanced": self.is_imbalanced,
            "regions": [
                {
                    "name": r.name,
                    "bytes_per_rank": r.bytes_per_rank,
                    "calls_per_rank": r.calls_per_rank,
                    "min": r.min_bytes,
                    "median": r.median_bytes,
                    "max": r.max_bytes,
                    "max_rank": self.ranks[r.max_rank_index],
                    "spread": r.spread,
                }
                for r in self.regions
            ],
            "rank_reports": self.rank_reports,
        }

    def to_json(self, **json_kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **json_kwargs)


def _aligned(rows: list[list[str]], indent: str) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        cells = cells[:-1] + [r[-1]]  # the last column (flags) is not padded
        out.append((indent + "  ".join(cells)).rstrip())
    return out


def _regions_across_ranks(rank_reports: Sequence[dict[str, Any]]) -> list[RegionAcrossRanks]:
    names: dict[str, None] = {}
    per_rank: list[dict[str, tuple[int, int]]] = []
    for report in rank_reports:
        held: dict[str, tuple[int, int]] = {}
        for block in report["checkpoints"]:
            nbytes, calls = held.get(block["name"], (0, 0))
            held[block["name"]] = (nbytes + int(block["bytes"]), calls + 1)
            names.setdefault(block["name"], None)
        held[OUTSIDE_REGIONS] = (int(report["outside_bytes"]), len(report["outside"]))
        per_rank.append(held)
    names[OUTSIDE_REGIONS] = None
    return [
        RegionAcrossRanks(
            name,
            [held.get(name, (0, 0))[0] for held in per_rank],
            [held.get(name, (0, 0))[1] for held in per_rank],
        )
        for name in names
    ]


def gather_memory_report(
    roots: Any = None,
    group: dist.ProcessGroup | None = None,
    dst: int = 0,
    *,
    timeout: datetime.timedelta | float = 60.0,
    tag: str | int | None = None,
    imbalance_threshold: float = 0.10,
) -> ClusterMemoryReport | None:
    """Gather every rank's saved-tensors report on ``dst`` and aggregate it.

    Call it on every rank of ``group`` at the same point, after the forward and
    before the backward, with that rank's loss as ``roots`` (see
    :func:`torch_remat.saved_tensors_report`). Returns a :class:`ClusterMemoryReport`
    on ``dst`` (a global rank) and None on the other ranks, which do not wait.

    Args:
        timeout: how long ``dst`` waits for the other ranks (seconds or timedelta).
            A rank that has not reported by then is named in a
            :class:`MemoryReportTimeout`; the process group stays usable.
        tag: identifies this gathering across ranks (e.g. the step number). By
            default each process counts its calls per group, so a rank that once
            skips the call stays one call behind; pass the step to recover.
        imbalance_threshold: flag ranks and regions whose (max - min) / max over
            ranks exceeds this fraction (default 10%).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "gather_memory_report needs an initialized process group "
            "(torch.distributed.init_process_group); in one process use "
            "torch_remat.print_saved_tensors_report(loss)."
        )
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    if dst not in ranks:
        raise ValueError(f"gather_memory_report: dst={dst} is not in the group (ranks {ranks}).")
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if tag is None:
        count = _calls_per_group.get(group.group_name, 0)
        _calls_per_group[group.group_name] = count + 1
        tag = f"call{count}"
    store = group.get_group_store()
    prefix = f"{_KEY_PREFIX}/{tag}/"

    report = remat.saved_tensors_report(roots).to_dict()
    store.set(prefix + str(me), json.dumps(report).encode())
    if me != dst:
        return None

    keys = [prefix + str(r) for r in ranks]
    missing = _wait_for_keys(store, keys, ranks, timeout)
    if missing:
        arrived = [r for r in ranks if r not in missing]
        raise MemoryReportTimeout(
            f"gather_memory_report: rank(s) {', '.join(map(str, missing))} did not send "
            f"their memory report within {timeout:g} s (tag {tag!r}; arrived: "
            f"{', '.join(map(str, arrived))}). Every rank of the group must call "
            "gather_memory_report at the same point; a rank that skipped it, crashed "
            "or is stuck in an earlier collective never arrives. The process group is "
            "unaffected.",
            missing,
        )
    reports = [json.loads(store.get(k)) for k in keys]
    for k in keys:
        store.delete_key(k)
    return ClusterMemoryReport(ranks, reports, imbalance_threshold)


def _wait_for_keys(store: Any, keys: list[str], ranks: list[int], timeout: float) -> list[int]:
    """Ranks whose key did not appear within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pending = list(zip(ranks, keys))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        rank, key = pending[0]
        try:
            store.wait([key], datetime.timedelta(seconds=remaining))
        except RuntimeError:  # the store's timeout (DistStoreError)
            break
        pending.pop(0)
    return [rank for rank, key in pending if not store.check([key])]
