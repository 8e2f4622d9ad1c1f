"""Ranks written for people: ranges instead of lists, equal values grouped, outliers first.

At a thousand ranks a line per rank is a page per number. Most ranks of a job hold
the same bytes (same model, same batch shape), so the readable form of a per-rank
column is its distinct values, each with the ranks holding it as ranges
(``ranks 0-511, 513-1023``), the values farthest from the median first and the
most common one last.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def rank_ranges(ranks: Sequence[int], limit: int = 4) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``; past ``limit`` ranges the rest is
    counted (``"0-2, 5, ... (+3 ranges)"``)."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return span_ranges(spans, limit)


def span_ranges(spans: Sequence[Sequence[int]], limit: int = 4) -> str:
    """:func:`rank_ranges` of sorted, disjoint ``[first, last]`` spans: ``[[0, 2], [5, 5]]``
    -> ``"0-2, 5"``."""
    text = [str(a) if a == b else f"{a}-{b}" for a, b in spans]
    if len(text) > limit:
        text = text[:limit] + [f"... (+{len(text) - limit} ranges)"]
    return ", ".join(text)


def rank_label(ranks: Sequence[int], limit: int = 4) -> str:
    """``"rank 3"``, ``"ranks 3, 900"``, or ``"ranks 0-511, 513-1023 (1023 ranks)"``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    text = f"ranks {rank_ranges(ranks, limit)}"
    return text if len(ranks) <= 2 else f"{text} ({len(ranks)} ranks)"


@dataclass
class ValueGroup:
    """The ranks holding one value."""

    value: int
    ranks: list[int]


def equal_value_groups(values: Sequence[int], ranks: Sequence[int]) -> list[ValueGroup]:
    """Ranks grouped by equal value, outliers first: by distance from the median,
    larger values first on ties, the most common value last."""
    by_value: dict[int, list[int]] = {}
    for rank, value in zip(ranks, values):
        by_value.setdefault(value, []).append(rank)
    groups = [ValueGroup(v, rs) for v, rs in by_value.items()]
    if len(groups) == 1:
        return groups
    median = statistics.median(values)
    common = max(groups, key=lambda g: (len(g.ranks), -abs(g.value - median)))
    groups.remove(common)
    groups.sort(key=lambda g: (-abs(g.value - median), -g.value))
    return groups + [common]


def group_lines(
    groups: list[ValueGroup], fmt: Callable[[int], str], *, limit: int, indent: str
) -> list[str]:
    """One line per group (``"2.13 MiB  ranks 0-511 (512 ranks)"``), at most
    ``limit``: the outliers that fit and the most common value; the groups between
    are summed up in one line."""
    if len(groups) > limit:
        shown = groups[: limit - 2] + [groups[-1]]
        rest = groups[limit - 2 : -1]
        low, high = min(g.value for g in rest), max(g.value for g in rest)
        count = sum(len(g.ranks) for g in rest)
        summary = f"{len(rest)} other values on {count} ranks, {fmt(low)} to {fmt(high)}"
    else:
        shown, summary = groups, ""
    width = max(len(fmt(g.value)) for g in shown)
    lines = [f"{indent}{fmt(g.value).rjust(width)}  {rank_label(g.ranks)}" for g in shown]
    if summary:
        lines.insert(len(lines) - 1, f"{indent}{'...'.rjust(width)}  {summary}")
    return lines


def top_ranks(values: Sequence[int], ranks: Sequence[int], k: int) -> list[int]:
    """The ``k`` ranks holding the most, largest first (lower rank first on ties)."""
    order = sorted(range(len(values)), key=lambda i: (-values[i], ranks[i]))
    return [ranks[i] for i in order[:k]]


def heaviest_label(values: Sequence[int], ranks: Sequence[int], k: int) -> str:
    """The ranks above the median (or, when none is, those at the max), the ``k``
    largest named: ``"ranks 517, 3, 924"``, ``"ranks 0, 1, 2 +509 more"``."""
    median = statistics.median(values)
    above = [i for i, v in enumerate(values) if v > median]
    if not above:
        top = max(values)
        above = [i for i, v in enumerate(values) if v == top]
    named = sorted(above, key=lambda i: (-values[i], ranks[i]))[:k]
    text = ("rank " if len(above) == 1 else "ranks ") + ", ".join(str(ranks[i]) for i in named)
    return text + (f" +{len(above) - k} more" if len(above) > k else "")
