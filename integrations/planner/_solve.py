"""The exact solver: a multiple-choice knapsack over blocks, solved by dynamic
programming on Pareto frontiers.

Each block offers measured options ``(bytes, cost)``; a plan takes one option per
block; its bytes and cost are the sums. The frontier after ``k`` blocks holds every
plan of the first ``k`` blocks that no other plan beats on both bytes and cost; a
plan for all blocks that is optimal for some budget extends an optimal prefix, so
the last frontier holds the optimum for every budget at once. Costs compare as
``(FLOPs, ops)``: FLOPs first, then the aten ops that FLOPs do not count.

Frontier entries point back to the entry they extend instead of carrying their
choice sequence, so a step costs (frontier size x options), not x depth too. Ties
are broken by position in the previous frontier, then option index: the same
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


def _pareto(entries: list[tuple]) -> list[tuple]:
    """Entries ``(bytes, cost, ...)`` no other beats, by bytes ascending (the cost
    then strictly falls)."""
    entries.sort()
    kept: list[tuple] = []
    for e in entries:
        if not kept or e[1] < kept[-1][1]:
            kept.append(e)
    return kept


def frontier(options: Sequence[Sequence[tuple[int, Cost]]]) -> list[Point]:
    """The Pareto frontier of plans for blocks whose options are ``options[i]``."""
    layers: list[list[tuple]] = []
    current: list[tuple] = [(0, (0, 0), -1, -1)]
    for block_options in options:
        useful = _pareto([(b, c, i) for i, (b, c) in enumerate(block_options)])
        current = _pareto(
            [
                (pb + ob, (pc[0] + oc[0], pc[1] + oc[1]), k, i)
                for k, (pb, pc, _, _) in enumerate(current)
                for ob, oc, i in useful
            ]
        )
        layers.append(current)
    points = []
    for bytes_, cost, back, option in current:
        choices = [option]
        for layer in reversed(layers[:-1]):
            _, _, back, option = layer[back]
            choices.append(option)
        points.append(Point(bytes_, cost, tuple(reversed(choices)) if layers else ()))
    return points


def cheapest_within(points: Sequence[Point], budget: int) -> Point | None:
    """The cheapest plan of a frontier holding at most ``budget`` bytes (None: none)."""
    fitting = [p for p in points if p.bytes <= budget]
    return fitting[-1] if fitting else None
