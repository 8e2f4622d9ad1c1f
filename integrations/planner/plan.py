"""``plan_remat``: the cheapest exact remat policy that fits a memory budget.

The planner measures, it does not estimate: every option of every distinct block
is installed with :func:`~torch_remat.integrations.apply_remat` and run once on the
example (see ``_measure``), an exact solver picks one option per block (``_solve``),
and the chosen plan is installed and measured once more, so the bytes a plan
reports are bytes that were seen. The bytes are those the step keeps for its
backward, which do not depend on when a collective's threads let go of their
buffers, so one run of an option is its measurement on every run.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torch_remat as remat
from torch_remat._integration import format_bytes

from . import _distributed, _report
from ._measure import (
    BASE,
    LossFn,
    Placement,
    blocks_drawing_no_random_numbers,
    install,
    measure,
    refuse_applied_remat,
    settle,
)
from ._solve import Point, cheapest_within, frontier
from ._space import OFF, BlockSelector, Candidates, Group, Option, group_blocks, select_blocks

Budget = float | int | str

AUTO_MARGIN = 0.1
"""``budget="auto"`` keeps this fraction of the device's total memory free."""

FORMAT_VERSION = 1


class InfeasibleBudgetError(remat.RematError, ValueError):
    """No policy holds as few activation bytes as the budget asks for."""


class PlanMismatchError(remat.RematError):
    """The chosen plan, installed and run, held other bytes than predicted."""


@dataclass(frozen=True)
class Measured:
    """One option of one block as measured: bytes held after the forward, and the
    FLOPs and aten ops its recompute runs in the backward."""

    option: Option
    bytes: int
    flops: int
    ops: int

    def to_json(self) -> dict:
        return {**self.option.to_json(), "bytes": self.bytes, "flops": self.flops, "ops": self.ops}

    @staticmethod
    def from_json(d: dict) -> Measured:
        return Measured(Option.from_json(d), d["bytes"], d["flops"], d["ops"])


@dataclass(frozen=True)
class Replaced:
    """A cheaper plan that a whole run showed to hold other bytes than predicted."""

    options: dict[str, Option]
    predicted_bytes: int
    measured_bytes: int


@dataclass
class RematPlan:
    """A remat policy chosen for a budget, with the measurements it was chosen from."""

    blocks: list[str]
    """Qualified names of the blocks, in forward order."""
    table: list[list[Measured]]
    """Per block, every measured option (index 0: no checkpoint)."""
    choices: list[int]
    """Per block, the index of the chosen option in ``table``."""
    base_bytes: int
    """Bytes held outside every block (embeddings, head, loss)."""
    budget_bytes: int
    candidates: dict[str, dict[str, str]] = field(default_factory=dict)
    """Candidate SAVE submodules (path inside the block: class name), by the first
    block of each group of identical blocks."""
    measured_bytes: int | None = None
    """Bytes measured with the plan installed (None: not verified)."""
    _model: Any = field(default=None, repr=False, compare=False)
    _frontier: list[Point] | None = field(default=None, repr=False, compare=False)
    rng_free: list[str] = field(default_factory=list)
    """Blocks that drew no random numbers while planning: checkpointed without an
    RNG snapshot."""
    checkpoint_base_bytes: int | None = None
    """Bytes held outside every block when some block is checkpointed (None: as
    ``base_bytes``): a checkpoint keeps its block's inputs, and an input made outside
    the blocks that the block itself does not save (transformers' ``position_ids``)
    is then held too. Shared by all blocks, so it is counted once."""
    replaced: Replaced | None = field(default=None, compare=False)
    """The cheaper plan the budget first chose, when its whole run held other bytes
    than its blocks' options add up to (see :func:`verified_plan`)."""

    # ---------------------------------------------------------------- numbers

    @property
    def chosen(self) -> list[Measured]:
        return [options[i] for options, i in zip(self.table, self.choices)]

    def base_for(self, choices: Sequence[int]) -> int:
        """Bytes outside the blocks for a plan choosing ``choices`` (index 0: off)."""
        if any(choices) and self.checkpoint_base_bytes is not None:
            return self.checkpoint_base_bytes
        return self.base_bytes

    @property
    def predicted_bytes(self) -> int:
        """Activation bytes held after the forward with the plan applied."""
        return self.base_for(self.choices) + sum(m.bytes for m in self.chosen)

    @property
    def recompute_flops(self) -> int:
        """FLOPs the plan's recomputes add to every step."""
        return sum(m.flops for m in self.chosen)

    @property
    def recompute_ops(self) -> int:
        """aten ops the plan's recomputes add to every step."""
        return sum(m.ops for m in self.chosen)

    @property
    def no_remat_bytes(self) -> int:
        """Activation bytes without any checkpoint (what a fraction budget scales)."""
        return self.base_bytes + sum(options[0].bytes for options in self.table)

    @property
    def options(self) -> dict[str, Option]:
        """The chosen option of each block."""
        return {name: m.option for name, m in zip(self.blocks, self.chosen)}

    def frontier(self) -> list[Point]:
        """Every plan that no other beats on both bytes and recompute cost; bytes
        include the base."""
        if self._frontier is None:
            points = frontier([[(m.bytes, (m.flops, m.ops)) for m in opts] for opts in self.table])
            # Shared by the plans for_budget derives: they have the same table.
            based = sorted(
                (Point(p.bytes + self.base_for(p.choices), p.cost, p.choices) for p in points),
                key=lambda p: (p.bytes, p.cost),
            )
            self._frontier = []
            for p in based:  # the base differs for the plan without checkpoints
                if not self._frontier or p.cost < self._frontier[-1].cost:
                    self._frontier.append(p)
        return list(self._frontier)

    @property
    def minimum_bytes(self) -> int:
        """The fewest activation bytes any policy in the search space holds."""
        return self.frontier()[0].bytes

    # ---------------------------------------------------------------- re-solving

    def for_budget(self, budget: Budget) -> RematPlan:
        """The cheapest plan for another budget, from the same measurements (no run)."""
        budget_bytes = resolve_budget(budget, self.no_remat_bytes)
        point = cheapest_within(self.frontier(), budget_bytes)
        if point is None:
            raise InfeasibleBudgetError(_infeasible(budget, budget_bytes, self))
        return RematPlan(
            self.blocks, self.table, list(point.choices), self.base_bytes, budget_bytes,
            self.candidates, None, self._model, self.frontier(), list(self.rng_free),
            self.checkpoint_base_bytes,
        )

    def with_choices(self, choices: Sequence[int]) -> RematPlan:
        """This plan with other options chosen (same table and budget)."""
        return RematPlan(
            self.blocks, self.table, list(choices), self.base_bytes, self.budget_bytes,
            self.candidates, None, self._model, self._frontier, list(self.rng_free),
            self.checkpoint_base_bytes,
        )

    def next_plans(self, groups: Sequence[Sequence[int]]) -> list[RematPlan]:
        """Plans to try when this one, run whole, does not hold what its blocks'
        options add up to: the next cheapest plans within the budget, then the
        cheapest within it whose blocks of each group (``groups``: block indices)
        share one option -- each group's options were measured with all its blocks
        at that option, so such a plan holds what its table says."""
        fitting = [p for p in self.frontier() if p.bytes <= self.budget_bytes]
        out = [
            self.with_choices(p.choices) for p in reversed(fitting)
            if list(p.choices) != self.choices
        ][: MAX_PLAN_RUNS - 2]
        per_group = frontier([
            [
                (sum(self.table[b][k].bytes for b in g),
                 (sum(self.table[b][k].flops for b in g), sum(self.table[b][k].ops for b in g)))
                for k in range(len(self.table[g[0]]))
            ]
            for g in groups
        ])
        uniform = None
        for point in per_group:
            choices = [0] * len(self.blocks)
            for g, k in zip(groups, point.choices):
                for b in g:
                    choices[b] = k
            candidate = self.with_choices(choices)
            if candidate.predicted_bytes <= self.budget_bytes and (
                uniform is None or (candidate.recompute_flops, candidate.recompute_ops)
                < (uniform.recompute_flops, uniform.recompute_ops)
            ):
                uniform = candidate
        if uniform is not None and uniform.choices not in [self.choices, *(q.choices for q in out)]:
            out.append(uniform)
        return out

    def pareto(self, budgets: Sequence[float] | None = None) -> _report.ParetoTable:
        """The cheapest plan's bytes and recompute cost for budget fractions
        ``budgets`` (default 0, 0.05, 0.1, 0.2, ..., 1.0), as a table."""
        return _report.pareto_table(self, budgets)

    def hand_policies(self) -> dict[str, tuple[int, int, int]]:
        """``(bytes, FLOPs, ops)`` of the hand-written policies (see ``_report``)."""
        return _report.hand_policies(self)

    # ---------------------------------------------------------------- using it

    def config(self) -> Placement:
        return Placement(
            {n: o.save for n, o in self.options.items() if o.checkpoint},
            frozenset(self.rng_free),
        )

    def apply(self, model: nn.Module | None = None) -> list[str]:
        """Install the plan with ``apply_remat`` (one call: the chosen blocks are
        checkpointed, the chosen submodules of each run as SAVE regions). ``model``:
        the planned model by default (required after :meth:`load`). Returns the
        checkpointed block names."""
        model = self._resolve_model(model)
        refuse_applied_remat(model)
        self._check_blocks(model)
        install(model, self.config())
        return [n for n, o in self.options.items() if o.checkpoint]

    def _check_blocks(self, model: nn.Module) -> None:
        """Refuse a model that lacks some of the plan's blocks or SAVE-region
        submodules (a plan loaded for another model), naming them."""
        names = dict(model.named_modules())
        missing = [b for b in self.blocks if b not in names]
        for block, paths in self.config().checkpointed.items():
            missing += [f"{block}.{p}" for p in paths if block in names and f"{block}.{p}" not in names]
        if missing:
            shown = ", ".join(f"'{m}'" for m in missing[:8]) + (", ..." if len(missing) > 8 else "")
            raise ValueError(
                f"RematPlan.apply: the model ({type(model).__name__}) has no module {shown}: "
                f"{len(missing)} of the modules this plan was made for "
                f"({len(self.blocks)} blocks) are missing. Apply the plan to the model it "
                "was planned on (same architecture and module names), or plan this model "
                "with plan_remat."
            )

    def _resolve_model(self, model: nn.Module | None) -> nn.Module:
        if model is not None:
            return model
        planned = self._model() if self._model is not None else None
        if planned is None:
            raise ValueError(
                "RematPlan.apply: this plan holds no model (it was loaded from a file, or "
                "the planned model was deleted); pass the model: plan.apply(model)."
            )
        return planned

    def plot(self, path: str | Path) -> Path:
        """Draw the Pareto curve with the hand policies as points (needs matplotlib:
        ``pip install torch-remat[plot]``)."""
        from ._plot import plot_pareto

        return plot_pareto(self, Path(path))

    # ---------------------------------------------------------------- files

    def to_json(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "blocks": self.blocks,
            "table": [[m.to_json() for m in opts] for opts in self.table],
            "choices": self.choices,
            "base_bytes": self.base_bytes,
            "budget_bytes": self.budget_bytes,
            "candidates": self.candidates,
            "measured_bytes": self.measured_bytes,
            "rng_free": self.rng_free,
            "checkpoint_base_bytes": self.checkpoint_base_bytes,
        }

    def save(self, path: str | Path) -> None:
        """Write the plan and its measurements as JSON."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @staticmethod
    def from_json(data: dict) -> RematPlan:
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(
                f"RematPlan.load: format {data.get('format')!r} is not {FORMAT_VERSION}; "
                "plan again with this version of torch_remat."
            )
        return RematPlan(
            list(data["blocks"]),
            [[Measured.from_json(m) for m in opts] for opts in data["table"]],
            list(data["choices"]),
            data["base_bytes"],
            data["budget_bytes"],
            {k: dict(v) for k, v in data["candidates"].items()},
            data["measured_bytes"],
            rng_free=list(data.get("rng_free", [])),
            checkpoint_base_bytes=data.get("checkpoint_base_bytes"),
        )

    @staticmethod
    def load(path: str | Path) -> RematPlan:
        """Read a plan written by :meth:`save`; apply it with ``plan.apply(model)``."""
        return RematPlan.from_json(json.loads(Path(path).read_text()))

    def format(self) -> str:
        return _report.format_plan(self)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return (
            f"RematPlan({len(self.blocks)} blocks, predicted_bytes={self.predicted_bytes}, "
            f"recompute_flops={self.recompute_flops}, budget_bytes={self.budget_bytes})"
        )


# -------------------------------------------------------------------- budget


def resolve_budget(budget: Budget, no_remat_bytes: int) -> int:
    """Bytes of a budget: a float is a fraction of ``no_remat_bytes``, an int is bytes,
    ``"auto"`` is the free CUDA memory less ``AUTO_MARGIN`` of the total."""
    if isinstance(budget, bool):
        raise TypeError("plan_remat: budget must be a fraction (float), bytes (int) or 'auto'.")
    if isinstance(budget, float):
        if not budget >= 0:
            raise ValueError(f"plan_remat: a fraction budget must be >= 0, got {budget}.")
        return int(budget * no_remat_bytes)
    if isinstance(budget, int):
        if budget < 0:
            raise ValueError(f"plan_remat: a byte budget must be >= 0, got {budget}.")
        return budget
    if budget == "auto":
        if not torch.cuda.is_available():
            raise ValueError(
                "plan_remat: budget='auto' reads the free CUDA memory, and no CUDA device "
                "is available; on CPU pass a fraction of the no-remat activation bytes "
                "(e.g. budget=0.3) or a number of bytes (int)."
            )
        free, total = torch.cuda.mem_get_info()
        return max(0, free - int(AUTO_MARGIN * total))
    raise TypeError(
        f"plan_remat: budget must be a fraction (float), bytes (int) or 'auto', got {budget!r}."
    )


def _infeasible(budget: Budget, budget_bytes: int, plan: RematPlan) -> str:
    low, full = plan.minimum_bytes, plan.no_remat_bytes
    return (
        f"plan_remat: budget {budget!r} ({budget_bytes:,} B) is below the minimum "
        f"achievable activation memory of {low:,} B ({format_bytes(low)}, "
        f"{low / full:.3f} of the {full:,} B without remat). Raise the budget to at least "
        f"{low:,} B (or {low / full:.3f}), or add candidates/blocks so more can be recomputed."
    )


# -------------------------------------------------------------------- planning

# At most this many whole-plan runs verify a plan: the chosen one, the next cheapest
# within the budget, and one whose identical blocks share an option.
MAX_PLAN_RUNS = 4


def verified_plan(
    plan: RematPlan, groups: Sequence[Sequence[int]], run: Any
) -> tuple[RematPlan, str | None]:
    """The first of ``plan`` and :meth:`RematPlan.next_plans` whose whole run
    (``run(plan) -> bytes by block``) holds what it predicts, with
    ``measured_bytes`` set; or ``plan`` and the mismatch of its run. Each block's
    options are measured with its identical neighbours at the same option, so a
    mixed plan can hold more or less than its sum where a block keeps its
    neighbour's output depending on the neighbour's option (in bf16, RMSNorm saves
    an fp32 copy of its input: a block's output is kept only when the next block is
    checkpointed)."""
    first: str | None = None
    for candidate in [plan, *plan.next_plans(groups)]:
        by_block = run(candidate)
        candidate.measured_bytes = sum(by_block.values())
        if candidate.measured_bytes == candidate.predicted_bytes:
            if candidate is not plan:
                candidate.replaced = Replaced(
                    plan.options, plan.predicted_bytes, plan.measured_bytes or 0
                )
            return candidate, None
        if first is None:
            first = _report.mismatch_message(candidate, by_block)
            plan.measured_bytes = candidate.measured_bytes
    return plan, first


def measure_table(
    model: nn.Module,
    args: Sequence[Any],
    loss_fn: LossFn,
    blocks: list[str],
    groups: list[Group],
    rng_free: frozenset[str] = frozenset(),
    measure: Any = measure,
) -> tuple[int, int, list[list[Measured]]]:
    """Run every option of every group once; ``(base bytes without checkpoints, base
    bytes with some, per-block options)``. ``measure``: how one configuration is run
    (``_measure.measure`` on real tensors, ``_fake.measure_fake`` for a forecast)."""
    measure(model, args, loss_fn, Placement(), blocks)  # warm-up: lazy state, first-call caches
    off = measure(model, args, loss_fn, Placement(), blocks)
    table: dict[str, list[Measured]] = {
        b: [Measured(OFF, off.bytes_by_block[b], 0, 0)] for b in blocks
    }
    bases: list[int] = []

    def run(group: Group, option: Option) -> None:
        got = measure(
            model, args, loss_fn, Placement(dict.fromkeys(group.blocks, option.save), rng_free),
            blocks,
        )
        bases.append(got.bytes_by_block[BASE])
        for b in group.blocks:
            table[b].append(
                Measured(option, got.bytes_by_block[b], got.flops_by_block[b], got.ops_by_block[b])
            )

    for group in groups:
        if group.exhaustive:
            for option in group.options()[1:]:
                run(group, option)
            continue
        # Too many subsets to measure: the full checkpoint and each unit alone, then
        # the combinations their sums predict to be on the frontier (see _space).
        for option in group.first_options():
            run(group, option)

        def summed(i: int, group: Group = group) -> tuple[int, tuple[int, int]]:
            ms = [table[b][i] for b in group.blocks]
            return sum(m.bytes for m in ms), (sum(m.flops for m in ms), sum(m.ops for m in ms))

        single = [summed(2 + u) for u in range(len(group.units))]
        for option in group.predicted_options(single, summed(1)):
            run(group, option)
    base = off.bytes_by_block[BASE]
    return base, max(bases, default=base), [table[b] for b in blocks]


def plan_remat(
    model: nn.Module,
    example_args: Any,
    loss_fn: LossFn = lambda out: out.sum(),
    budget: Budget = 0.5,
    *,
    blocks: BlockSelector = None,
    candidates: Candidates = None,
    per_rank: bool = False,
    verify: bool = True,
) -> RematPlan:
    """Choose, per block, no checkpoint or a checkpoint with some candidate
    submodules as SAVE regions, so that the activation bytes held after the forward
    are at most ``budget`` at the least recompute cost (FLOPs, then aten ops).

    Args:
        example_args: the forward's positional arguments (a tensor or a tuple): one
            real batch of the shape training will use.
        loss_fn: maps the model's output to the scalar loss.
        budget: a fraction (float) of the activation bytes without remat, bytes
            (int), or ``"auto"`` (free CUDA memory less a margin; an error on CPU).
        blocks: the modules to checkpoint (class, classes or predicate); default
            the children with submodules and parameters of the outermost
            ``nn.ModuleList``, ``nn.ModuleDict`` or ``nn.Sequential`` holding two or
            more of them (the model itself included).
        candidates: submodules that may become SAVE regions: module classes and
            glob patterns of qualified names, or a predicate ``(path, module)``;
            default the leaf modules with parameters and the attention/MLP/MoE
            containers with parameters, sibling projections that read the same
            input (q/k/v, gate/up) taken together. A block with more than
            ``MAX_EXHAUSTIVE_OPTIONS`` (128) options is measured for the full
            checkpoint, each candidate alone and at most ``MAX_PREDICTED`` (16)
            combinations predicted to be on its frontier, not for every subset.
        per_rank: under an initialized process group, each rank plans for its own
            measurements and budget; otherwise rank 0's choice is broadcast, so
            every rank applies the same policy. Every rank runs the measurements
            either way (a sharded forward needs all ranks).
        verify: install the chosen plan and measure it. Where it holds other bytes
            than predicted (blocks that keep each other's tensors depending on
            their options), the next cheapest plans are run (see
            :func:`verified_plan`) and the first that holds what it predicts is
            returned, naming the plan it replaced; when none does,
            :class:`PlanMismatchError` names each block whose bytes differ. Under a
            process group the chosen plan alone is verified (runs are collective),
            on every rank; without ``per_rank`` a mismatch on any rank raises the
            same error on every rank.

    Raises :class:`InfeasibleBudgetError` (naming the minimum achievable bytes) when
    no policy fits. The model is returned unchanged; ``plan.apply()`` installs it.
    """
    refuse_applied_remat(model)
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    names = select_blocks(model, blocks)
    groups = group_blocks(model, names, candidates, args)
    settle(model, args, loss_fn)
    rng_free = blocks_drawing_no_random_numbers(model, args, names)
    base, checkpoint_base, table = measure_table(
        model, args, loss_fn, names, groups, frozenset(rng_free)
    )
    measured = RematPlan(
        names, table, [0] * len(names), base, 0,
        {g.blocks[0]: dict(zip(g.candidates, g.kinds)) for g in groups}, None, weakref.ref(model),
        rng_free=rng_free, checkpoint_base_bytes=checkpoint_base,
    )
    plan, error = _solve_or_error(measured, budget)
    if not per_rank:
        plan, error = _distributed.agree(measured, plan, error)
    if error is not None:
        raise InfeasibleBudgetError(error)
    if verify:
        def run(candidate: RematPlan) -> dict[str, int]:
            return measure(model, args, loss_fn, candidate.config(), names).bytes_by_block

        if not _distributed.in_group():
            plan, mismatch = verified_plan(plan, block_groups(names, groups), run)
        else:
            # Verified as chosen: a run of another plan on one rank alone would
            # wait forever in a collective of the sharded forward.
            by_block = run(plan)
            plan.measured_bytes = sum(by_block.values())
            mismatch = None
            if plan.measured_bytes != plan.predicted_bytes:
                mismatch = _report.mismatch_message(plan, by_block)
            if not per_rank:
                mismatch = _distributed.agree_on_verification(mismatch)
        if mismatch is not None:
            raise PlanMismatchError(mismatch)
    return plan


def block_groups(names: Sequence[str], groups: Sequence[Group]) -> list[list[int]]:
    """The indices in ``names`` of each group's blocks."""
    return [[names.index(b) for b in g.blocks] for g in groups]


def _solve_or_error(measured: RematPlan, budget: Budget) -> tuple[RematPlan, str | None]:
    try:
        return measured.for_budget(budget), None
    except InfeasibleBudgetError as e:
        return measured, str(e)

