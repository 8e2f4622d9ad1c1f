"""The exact solver: a multiple-choice knapsack over blocks, solved by dynamic
programming on Pareto frontiers.

Each block offers measured options ``(bytes, cost)``; a plan takes one option per
block; its bytes and cost are the sums. The frontier after ``k`` blocks holds every
plan of the first ``k`` blocks that no other plan beats on both bytes and cost; a
plan for all blocks that is optimal for some budget extends an optimal prefix, so
the last frontier holds the optimum for every budget at once. Costs compare as
``(FLOPs, ops)``: FLOPs first, then the aten ops that FLOPs do not count.

Ties are broken by the choice sequence (lower option indices first), so the same
measurements always give the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Cost = tuple[int, int]


@dataclass(frozen=True)
class Point:
    """A plan: total bytes, total cost and the option index chosen for each block."""

    bytes: int
    cost: Cost
    choices: tuple[int, ...]


def _pareto(points: list[Point]) -> list[Point]:
    """Points no other point beats, by bytes ascending (cost then strictly falls)."""
    points.sort(key=lambda p: (p.bytes, p.cost, p.choices))
    kept: list[Point] = []
    for p in points:
        if not kept or p.cost < kept[-1].cost:
            kept.append(p)
    return kept


def frontier(options: Sequence[Sequence[tuple[int, Cost]]]) -> list[Point]:
    """The Pareto frontier of plans for blocks whose options are ``options[i]``."""
    current = [Point(0, (0, 0), ())]
    for block_options in options:
        useful = _pareto(
            [Point(b, c, (i,)) for i, (b, c) in enumerate(block_options)]
        )
        current = _pareto(
            [
                Point(p.bytes + o.bytes, (p.cost[0] + o.cost[0], p.cost[1] + o.cost[1]),
                      p.choices + o.choices)
                for p in current
                for o in useful
            ]
        )
    return current


def cheapest_within(points: Sequence[Point], budget: int) -> Point | None:
    """The cheapest plan of a frontier holding at most ``budget`` bytes (None: none)."""
    fitting = [p for p in points if p.bytes <= budget]
    return fitting[-1] if fitting else None
