"""The aggregated memory report of many ranks, and how it reads at a thousand of them.

:class:`ClusterMemoryReport` is built on the gathering rank from one compact record
per rank (see ``reports.rank_summary``): the bytes held for backward in total and
per region. Its text fits a screen at any world size: per region the min / median /
max and the ranks holding the most, and the ranks grouped by equal bytes with the
outliers first (``_rank_groups``). Its JSON keeps every rank's numbers.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Any

from torch_remat._integration import format_bytes

from ._rank_groups import equal_value_groups, group_lines, heaviest_label, top_ranks

OUTSIDE_REGIONS = "(outside regions)"


@dataclass
class CheckpointAcrossRanks:
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
    """Every rank's bytes held for backward, aggregated (what
    :func:`gather_memory_report` returns on ``dst``). ``str(report)`` is the text,
    ``to_json()`` the machine form with every rank."""

    ranks: list[int]
    """Global rank of each column, in group order."""

    rank_summaries: list[dict[str, Any]]
    """Each rank's compact record: ``{"total": bytes, "regions": [[name, bytes, calls], ...]}``."""

    imbalance_threshold: float = 0.10
    regions: list[CheckpointAcrossRanks] = field(default_factory=list)

    top: int = 3
    """Ranks named per region as holding the most (those above its median)."""

    groups: int = 4
    """Most lines of equal-value groups per column (the rest are summed up in one)."""

    def __post_init__(self) -> None:
        if not self.regions:
            self.regions = regions_across_ranks(self.rank_summaries)

    @property
    def totals(self) -> list[int]:
        """Bytes held for backward on each rank."""
        return [int(s["total"]) for s in self.rank_summaries]

    @property
    def total_spread(self) -> float:
        top = max(self.totals)
        return 0.0 if top == 0 else (top - min(self.totals)) / top

    def imbalanced(self) -> list[CheckpointAcrossRanks]:
        """Regions whose (max - min) / max over ranks exceeds the threshold."""
        return [r for r in self.regions if r.spread > self.imbalance_threshold]

    @property
    def is_imbalanced(self) -> bool:
        return self.total_spread > self.imbalance_threshold or bool(self.imbalanced())

    # ------------------------------------------------------------------ text

    def sections(self) -> list[list[str]]:
        """The text's blocks, in order (``format`` puts a blank line between them)."""
        return [[self._headline()], self._rank_lines(), self._region_lines(), [self._verdict()]]

    def format(self) -> str:
        return "\n\n".join("\n".join(lines) for lines in self.sections() if lines)

    def __str__(self) -> str:
        return self.format()

    def _headline(self) -> str:
        fmt, totals = format_bytes, self.totals
        head = f"torch_remat memory across {len(self.ranks)} ranks: saved for backward {fmt(sum(totals))} in total"
        if min(totals) == max(totals):
            return f"{head}, {fmt(totals[0])} on every rank"
        heaviest = self.ranks[totals.index(max(totals))]
        return (
            f"{head}; per rank min {fmt(min(totals))}, median "
            f"{fmt(int(statistics.median(totals)))}, max {fmt(max(totals))} (rank {heaviest})"
        )

    def _rank_lines(self) -> list[str]:
        groups = equal_value_groups(self.totals, self.ranks)
        if len(groups) == 1:
            return []  # the headline says it
        head = "per rank, equal totals grouped (outliers first):"
        return [head, *group_lines(groups, format_bytes, limit=self.groups, indent="  ")]

    def _region_lines(self) -> list[str]:
        fmt = format_bytes
        rows = [["region", "min", "median", "max", "most on", ""]]
        details: list[list[str]] = []
        for r in self.regions:
            flag = f"! {r.spread:.0%} spread" if r.spread > self.imbalance_threshold else ""
            groups = equal_value_groups(r.bytes_per_rank, self.ranks)
            if len(groups) == 1:
                most = "all ranks"
                details.append([])
            else:
                most = heaviest_label(r.bytes_per_rank, self.ranks, self.top)
                details.append(group_lines(groups, fmt, limit=self.groups, indent="      "))
            rows.append([r.name, fmt(r.min_bytes), fmt(int(r.median_bytes)), fmt(r.max_bytes), most, flag])
        table = _aligned(rows, indent="  ")
        uneven = " (bytes by rank under each uneven region, outliers first)" if any(details) else ""
        lines = [f"per region{uneven}:", table[0]]
        for row, extra in zip(table[1:], details):
            lines += [row, *extra]
        return lines

    def _verdict(self) -> str:
        limit = f"{self.imbalance_threshold:.0%}"
        if not self.is_imbalanced:
            return f"balanced: no rank or region differs by more than {limit}"
        names = ", ".join(r.name for r in self.imbalanced()) or "none"
        return (
            f"imbalance: totals differ by {self.total_spread:.1%} of the max (over "
            f"{limit} flagged); regions over {limit}: {names}"
        )

    # ------------------------------------------------------------------ JSON

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
                    "top_ranks": top_ranks(r.bytes_per_rank, self.ranks, self.top),
                    "spread": r.spread,
                }
                for r in self.regions
            ],
        }

    def to_json(self, **json_kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **json_kwargs)


def regions_across_ranks(rank_summaries: list[dict[str, Any]]) -> list[CheckpointAcrossRanks]:
    """One :class:`CheckpointAcrossRanks` per region name any rank reported, in the order
    first seen, ``(outside regions)`` last; a rank without the region holds 0 there."""
    names: dict[str, None] = {}
    held: list[dict[str, tuple[int, int]]] = []
    for summary in rank_summaries:
        mine = {name: (int(nbytes), int(calls)) for name, nbytes, calls in summary["regions"]}
        names.update(dict.fromkeys(n for n in mine if n != OUTSIDE_REGIONS))
        held.append(mine)
    names[OUTSIDE_REGIONS] = None
    return [
        CheckpointAcrossRanks(
            name,
            [mine.get(name, (0, 0))[0] for mine in held],
            [mine.get(name, (0, 0))[1] for mine in held],
        )
        for name in names
    ]


def _aligned(rows: list[list[str]], indent: str) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.ljust(w) if i in (0, 4) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        cells = cells[:-1] + [r[-1]]  # the last column (flags) is not padded
        out.append((indent + "  ".join(cells)).rstrip())
    return out

