"""The exact solver: a multiple-choice knapsack over blocks, solved by dynamic
programming on Pareto frontiers.

Each block offers measured options ``(bytes, cost)``; a plan takes one option per
block; its bytes and cost are the sums. The frontier after ``k`` blocks holds every
plan of the first ``k`` blocks that no other plan beats on both bytes and cost; a
plan for all blocks that is optimal for some budget extends an optimal prefix, so
the last frontier holds the optimum for every budget at once. Costs are tuples of
ints compared in order and summed element by element: the planner's are
``(predicted nanoseconds, FLOPs, ops)`` (nanoseconds 0 throughout when no time is
predicted), so FLOPs then aten ops decide where time does not.

Frontier entries point back to the entry they extend instead of carrying their
choice sequence, so a step costs (frontier size x options), not x depth too. Ties
are broken by position in the previous frontier, then option index: the same
measurements always give the same plan.

A tensor one block makes and several blocks' options may keep (T5's position
bias: made by the first block, kept by a later block's checkpoint as an input and
by a SAVE region of the first block) is held once however many of the chosen
options keep it: a plan's bytes are then its options' sums plus those tensors'
bytes once each (:class:`Shared`). The frontier is then one per set of such
tensors kept so far (only those a block still to come may keep too): an option
adds the bytes of those it keeps that are not in its state's set. Without such
tensors it is the plain frontier above.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

Cost = tuple[int, ...]


@dataclass(frozen=True)
class Shared:
    """Tensors that several blocks' options may keep, counted once per plan."""

    bytes: Mapping[Hashable, int]
    """Each such tensor's bytes, by its key."""
    keeps: Sequence[Sequence[frozenset]]
    """Per block and option, the keys of those the option keeps."""
    staying_keeps: Sequence[Sequence[frozenset | None]] | None = None
    """Per block and option, for an offloaded option: the keys it keeps when it is
    one of the last ``keep`` offloaded blocks, left on the device (None: not
    offloaded)."""


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


def _add(a: Cost, b: Cost) -> Cost:
    return tuple(x + y for x, y in zip(a, b))


def frontier(
    options: Sequence[Sequence[tuple[int, Cost] | None]],
    staying: Sequence[Sequence[int | None]] | None = None,
    keep: int = 0,
    shared: Shared | None = None,
) -> list[Point]:
    """The Pareto frontier of plans for blocks whose options are ``options[i]``
    (an entry None: that option may not be chosen), the blocks in forward order.

    ``staying[i][j]``: for an offloaded option, the bytes it holds on the device
    over ``options[i][j]``'s when it is one of the last ``keep`` offloaded blocks of
    the plan (None: not offloaded). The plan's bytes then include them exactly: the
    blocks are taken from the last, with the number of offloaded blocks chosen after
    the current one (up to ``keep``) as a state, one frontier per state.

    ``shared``: tensors several options may keep, each counted once in a plan's
    bytes (see :class:`Shared`)."""
    staying_on = staying is not None and keep > 0 and any(x is not None for row in staying for x in row)
    if shared is not None and shared.bytes:
        try:
            return _frontier_with_shared(options, staying if staying_on else None, keep, shared)
        except _TooManyStates:
            # each option counts the shared tensors it keeps as its own: a plan's
            # bytes are then at most this sum over, never under
            options = [
                [None if o is None else (o[0] + sum(shared.bytes[k] for k in shared.keeps[i][j]), o[1])
                 for j, o in enumerate(opts)]
                for i, opts in enumerate(options)
            ]
            if staying_on and shared.staying_keeps is not None:
                staying = [
                    [None if x is None else x + sum(
                        shared.bytes[k] for k in (shared.staying_keeps[i][j] or frozenset()) - shared.keeps[i][j]
                    ) for j, x in enumerate(row)]
                    for i, row in enumerate(staying)
                ]
    if staying_on:
        return _frontier_with_staying(options, staying, keep)
    layers: list[list[tuple]] = []
    width = next((len(o[1]) for opts in options for o in opts if o is not None), 2)
    current: list[tuple] = [(0, (0,) * width, -1, -1)]
    for block_options in options:
        useful = _pareto([(o[0], o[1], i) for i, o in enumerate(block_options) if o is not None])
        current = _pareto(
            [
                (pb + ob, _add(pc, oc), k, i)
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


def _frontier_with_staying(
    options: Sequence[Sequence[tuple[int, Cost] | None]],
    staying: Sequence[Sequence[int | None]],
    keep: int,
) -> list[Point]:
    width = next((len(o[1]) for opts in options for o in opts if o is not None), 2)
    # per state: entries (bytes, cost, index in the previous layer's state list,
    # option, previous state)
    current: dict[int, list[tuple]] = {0: [(0, (0,) * width, -1, -1, -1)]}
    layers: list[dict[int, list[tuple]]] = []
    for i in reversed(range(len(options))):
        grown: dict[int, list[tuple]] = {}
        for state, entries in sorted(current.items()):
            for k, (pb, pc, _, _, _) in enumerate(entries):
                for j, o in enumerate(options[i]):
                    if o is None:
                        continue
                    extra, after = 0, state
                    if staying[i][j] is not None:
                        extra = staying[i][j] if state < keep else 0
                        after = min(state + 1, keep)
                    grown.setdefault(after, []).append((pb + o[0] + extra, _add(pc, o[1]), k, j, state))
        current = {s: _pareto(e) for s, e in grown.items()}
        layers.append(current)
    finals = _pareto([(e[0], e[1], s, k) for s, es in current.items() for k, e in enumerate(es)])
    points = []
    for bytes_, cost, state, k in finals:
        choices = []
        for layer in reversed(layers):  # the first block's layer is the last one built
            _, _, back, option, before = layer[state][k]
            choices.append(option)
            state, k = before, back
        points.append(Point(bytes_, cost, tuple(choices)))
    return points


def _frontier_with_shared(
    options: Sequence[Sequence[tuple[int, Cost] | None]],
    staying: Sequence[Sequence[int | None]] | None,
    keep: int,
    shared: Shared,
) -> list[Point]:
    """:func:`frontier` with :class:`Shared` tensors, the staying blocks too where
    ``staying`` is given. A state is (the keys of the shared tensors the options
    chosen so far keep that a block still to come may keep too, the number of
    offloaded blocks chosen so far, up to ``keep``). The blocks are taken in forward
    order, as :func:`frontier` takes them (the same ties broken the same way),
    or from the last where blocks stay (which ones do depends on the blocks after)."""
    width = next((len(o[1]) for opts in options for o in opts if o is not None), 2)
    order = list(range(len(options)))
    if staying is not None:
        order.reverse()
    step_of = {i: step for step, i in enumerate(order)}
    # the last step at which a block may keep each tensor: past it, the tensor
    # leaves the state
    last: dict[Hashable, int] = {}
    for rows in (shared.keeps, shared.staying_keeps or ()):
        for i, row in enumerate(rows):
            for keys in row:
                for key in keys or ():
                    last[key] = max(last.get(key, -1), step_of[i])
    nothing: frozenset = frozenset()
    # per state: entries (bytes, cost, rank of the previous state, index in its
    # list, option, previous state); the rank breaks ties before the state is compared
    current: dict[tuple[frozenset, int], list[tuple]] = {(nothing, 0): [(0, (0,) * width, -1, -1, -1, None)]}
    layers: list[dict[tuple[frozenset, int], list[tuple]]] = []
    for step, i in enumerate(order):
        grown: dict[tuple[frozenset, int], list[tuple]] = {}
        for rank, (state, entries) in enumerate(sorted(current.items(), key=_state_order)):
            kept, count = state
            for k, (pb, pc, *_) in enumerate(entries):
                for j, o in enumerate(options[i]):
                    if o is None:
                        continue
                    extra, after, keys = 0, count, shared.keeps[i][j]
                    if staying is not None and staying[i][j] is not None:
                        if count < keep:
                            extra = staying[i][j]
                            if shared.staying_keeps is not None and shared.staying_keeps[i][j] is not None:
                                keys = shared.staying_keeps[i][j]
                        after = min(count + 1, keep)
                    added = sum(shared.bytes[key] for key in keys if key not in kept)
                    held = frozenset(key for key in kept | keys if last[key] > step)
                    grown.setdefault((held, after), []).append(
                        (pb + o[0] + extra + added, _add(pc, o[1]), rank, k, j, state)
                    )
        if len(grown) > MAX_SHARED_STATES:
            raise _TooManyStates
        current = {s: _pareto(e) for s, e in grown.items()}
        layers.append(current)
    finals = _pareto([
        (e[0], e[1], rank, k, s)
        for rank, (s, es) in enumerate(sorted(current.items(), key=_state_order))
        for k, e in enumerate(es)
    ])
    points = []
    for bytes_, cost, _, k, state in finals:
        choices = [0] * len(options)
        for i, layer in zip(reversed(order), reversed(layers)):
            _, _, _, back, choices[i], before = layer[state][k]
            state, k = before, back
        points.append(Point(bytes_, cost, tuple(choices)))
    return points


MAX_SHARED_STATES = 4096
"""The most sets of shared tensors kept one step of :func:`_frontier_with_shared`
follows (2 for T5). Past it (many skip connections that options keep independently)
:func:`frontier` counts each option's shared tensors as its own, a sum that can lie
over a plan's bytes, never under; the plan's prediction still counts each once."""


class _TooManyStates(Exception):
    pass


def _state_order(item: tuple[tuple[frozenset, int], list]) -> tuple:
    (kept, count), _ = item
    return (sorted(kept), count)


def cheapest_within(points: Sequence[Point], budget: int) -> Point | None:
    """The cheapest plan of a frontier holding at most ``budget`` bytes (None: none)."""
    fitting = [p for p in points if p.bytes <= budget]
    return fitting[-1] if fitting else None
