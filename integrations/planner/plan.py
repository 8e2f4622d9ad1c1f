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

import dataclasses
import functools
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
    HEAD,
    LossFn,
    OutputKey,
    Placement,
    blocks_drawing_no_random_numbers,
    install,
    measure,
    refuse_applied_remat,
    settle,
)
from ._offload import OffloadOptions, compute_dtype, resolve_profile, timed
from ._offload import resolve as resolve_offload
from ._solve import Point, Shared, frontier
from ._space import OFF, BlockSelector, Candidates, Group, Option, group_blocks, select_blocks

Budget = float | int | str

AUTO_MARGIN = 0.1
"""``budget="auto"`` keeps this fraction of the device's total memory free."""

FORMAT_VERSION = 4
"""Written by plans whose table holds offloaded options whose copies back take
more device bytes than they moved (``Measured.back_bytes``); 3 by plans whose
table holds options keeping outputs several blocks keep (``Measured.shared``) and
none of those; 2 by plans whose table holds offloaded options and neither; others
write 1, which every version reads. A reader that predates a version refuses it
rather than predict other bytes."""

_OFFLOAD_FORMAT = 2
_SHARED_FORMAT = 3


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
    """Device bytes held after the forward (an offloaded option: what stays)."""
    flops: int
    ops: int
    host_bytes: int = 0
    """Host bytes an offloaded option's tensors occupy until the backward."""
    transient: int = 0
    """The step peak less the bytes held after the forward, in the run that
    measured this option (0: the peak was not measured)."""
    seconds: float = 0.0
    """Predicted added step time (recompute, plus exposed copies when offloaded;
    0 when no time is predicted)."""
    staying: int = 0
    """Offloaded: the device bytes the block's checkpoint call keeps when it is one
    of the forward's last ``prefetch`` offloaded calls (left on the device)."""
    rise: int | None = None
    """The peak during the block's backward (see ``_measure.PhaseTracker``) less
    the bytes held then by the blocks before it and outside every block, in the
    run that measured this option (None: not measured, or the backward never
    reached the block's outputs: a frozen block)."""
    forward_rise: int | None = None
    """The same for the block's forward (and the code run since the previous
    block's forward returned)."""
    head: int | None = None
    """The peak from the last block's forward returning until the backward reaches
    a block, less the bytes held after the forward, in that run."""
    shared: tuple[tuple[OutputKey, int], ...] = ()
    """The tensors this option keeps that one block makes and other blocks' options
    may keep too, with their bytes (see ``_measure.OutputKey``), not in
    :attr:`bytes`: a plan holds each once if any option it chooses keeps it (T5's
    position bias, made by the first block: kept by a later block's checkpoint as
    an input, and by a SAVE region of the first block around its attention)."""
    back_bytes: int = 0
    """Offloaded: the device bytes its tensors take once copied back, more than
    :attr:`host_bytes` where a tensor with gaps comes back spanning them (0: not
    recorded, a plan saved before it was; :attr:`host_bytes` is taken)."""

    @property
    def fetched_bytes(self) -> int:
        """The device bytes an offloaded option's copies back take."""
        return self.back_bytes or self.host_bytes

    @property
    def level(self) -> int:
        """How far the block's phases rise above its own bytes (with the blocks
        before it held): a plan's peak is at most its bytes plus the largest level
        of its options and the head's. The transient where phases were not measured."""
        if self.forward_rise is None:
            return self.transient
        return max(0, (self.rise if self.rise is not None else 0) - self.bytes, self.forward_rise - self.bytes)

    @property
    def cost(self) -> tuple[int, int, int]:
        """What the solver minimizes: (nanoseconds, FLOPs, ops)."""
        return (round(self.seconds * 1e9), self.flops, self.ops)

    def to_json(self) -> dict:
        out = {**self.option.to_json(), "bytes": self.bytes, "flops": self.flops, "ops": self.ops}
        for key in ("host_bytes", "transient", "seconds", "staying", "back_bytes"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        for key in ("rise", "forward_rise", "head"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.shared:
            out["shared"] = [[block, index, n] for (block, index), n in self.shared]
        return out

    @staticmethod
    def from_json(d: dict) -> Measured:
        return Measured(
            Option.from_json(d), d["bytes"], d["flops"], d["ops"],
            d.get("host_bytes", 0), d.get("transient", 0), d.get("seconds", 0.0), d.get("staying", 0),
            d.get("rise"), d.get("forward_rise"), d.get("head"),
            tuple(((block, index), n) for block, index, n in d.get("shared", ())),
            d.get("back_bytes", 0),
        )


# A table entry for an option whose run raised (see measure_table): dropped from the
# table once every group is measured.
_REFUSED = Measured(OFF, 0, 0, 0)


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
    """The bytes budget: ``budget`` resolved against the bytes without remat. With
    ``budget=None`` (only ``peak_budget`` bounds the plan) a number no plan reaches,
    twice what the largest option of every block holds; the printed plan says "no
    budget on the bytes after the forward" then."""
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
    offload: OffloadOptions | None = None
    """How offloaded options move their tensors (None: offload was not an option)."""
    peak_budget_bytes: int | None = None
    """The budget on the step peak (None: only the bytes after the forward count)."""
    measured_peak: int | None = None
    """The step peak measured with the plan installed (None: not measured)."""
    time_profile: str | None = None
    """Name of the device profile the added times were predicted for (None: no time
    predicted; the solver then minimizes FLOPs, then ops)."""
    offloader: Any = field(default=None, repr=False, compare=False)
    """The ``ActivationOffloader`` :meth:`apply` installed (None: the plan offloads
    nothing, or was not applied)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Options (``"block: policy"``) whose run raised, with the error's first line:
    the engine refused their SAVE regions on this model (a SAVE region's output the
    caller modifies in place, say). They are not in :attr:`table`."""

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
        """Activation bytes held after the forward with the plan applied (device
        bytes: what offloaded blocks move to host memory is not in them, except
        for the last ``prefetch`` offloaded blocks, which stay)."""
        return (
            self.base_for(self.choices) + sum(m.bytes for m in self.chosen) + self._staying()
            + sum(self.shared_kept().values())
        )

    def shared_kept(self) -> dict[OutputKey, int]:
        """The tensors the chosen options keep that several blocks' options may keep
        (see :attr:`Measured.shared`), each once, with their bytes. An offloaded
        block left on the device keeps what its resident twin keeps, too (what its
        SAVE regions keep stays)."""
        staying = set(self.staying_blocks())
        kept: dict[OutputKey, int] = {}
        for b, m in enumerate(self.chosen):
            kept.update(m.shared)
            if b in staying:
                kept.update(self._resident_twin(b).shared)
        return kept

    def _shared_kept_by_maker(self) -> dict[str, int]:
        """Bytes of :meth:`shared_kept` by the block that made each (allocated in
        its forward, and counted for it when a run measures by block)."""
        made: dict[str, int] = {}
        for (block, _), n in self.shared_kept().items():
            made[block] = made.get(block, 0) + n
        return made

    def _staying(self) -> int:
        """Device bytes the last ``prefetch`` offloaded blocks keep over what their
        offloaded option was measured holding (see ``_offload``)."""
        return sum(self.chosen[b].staying for b in self.staying_blocks())

    def staying_blocks(self) -> list[int]:
        """Indices of the offloaded blocks left on the device: the last ``prefetch``
        offloaded ones in forward order."""
        if self.offload is None or self.offload.prefetch == 0:
            return []
        offloaded = [b for b, m in enumerate(self.chosen) if m.option.offload]
        return offloaded[max(0, len(offloaded) - self.offload.prefetch):]

    @property
    def predicted_peak(self) -> int | None:
        """The step's peak with the plan applied (None: peaks were not measured).

        Each block's options were measured in runs where the other blocks ran
        without a checkpoint; a run's peak in each phase of the step (a block's
        forward, the head, a block's backward: ``_measure.PhaseTracker``) less the
        bytes held then by the blocks before that block carries over to any plan
        choosing the same option for it: in the phases of block ``b`` the blocks
        after it hold nothing that depends on their options. So the peak is the
        largest of, per block in forward order, the bytes the plan holds outside the
        blocks and in the blocks before it plus its option's rise in its forward and
        backward, and the plan's bytes after the forward plus the head's rise.

        With ``prefetch`` >= 1, four things differ from the runs the offloaded
        options were measured in (``prefetch=0``, see ``_offload``):

        * the last ``prefetch`` offloaded blocks stay on the device, so in their
          backward nothing is copied back: their rise is their resident twin's
          (same save set, measured holding those bytes);
        * an offloaded call's tensors leave the device only when the offloaded call
          ``prefetch`` later starts packing (the offloader copies call ``n - k`` out
          from call ``n``): in its own forward a block rises as its twin does, and
          the forward of every block up to that later call's also holds what the
          twin holds beyond the offloaded option (:attr:`Measured.staying`);
        * in the backward of block ``b`` the groups of up to ``prefetch`` earlier
          offloaded calls have been copied back ahead of use (the offloader issues
          call ``n - k``'s copy back when backward reaches call ``n``), so their
          copies back are on the device too (:attr:`Measured.fetched_bytes`: a
          tensor with gaps moved its elements and comes back spanning the gaps).

        Copies back ahead of use make the start of a block's backward differ from
        its measuring run in what is alive with its tensors; such a plan's peak is
        also bounded by its bytes after the forward plus the largest transient (peak
        less bytes after the forward) of its options, and the larger is taken.
        Options measured without phases (a plan saved before they were) get that
        bound alone.
        """
        if not any(m.transient for opts in self.table for m in opts):
            return None
        chosen = self.chosen
        staying = set(self.staying_blocks())
        ahead = self._copied_ahead(staying)
        if any(m.forward_rise is None or m.head is None for m in chosen):
            return self._peak_from_transients(staying, ahead)
        held = self.base_for(self.choices)
        made = self._shared_kept_by_maker()
        worst = 0
        k = self.offload.prefetch if self.offload is not None else 0
        moved_ahead = {b for b, m in enumerate(chosen) if k and m.option.offload and b not in staying}
        not_yet_moved = self._moved_late(moved_ahead)
        for b, m in enumerate(chosen):
            twin = self._resident_twin(b)
            # (with prefetch >= 1 nothing of an offloaded call moves in its own forward)
            rising = twin if (b in staying or b in moved_ahead) else m
            forward = max(m.forward_rise, rising.forward_rise or 0)
            worst = max(worst, held + not_yet_moved[b] + forward)
            backward = twin if b in staying else m
            # (no backward phase: the backward never reached the block's outputs, a
            # frozen block's or one run without gradients; what the backward does
            # after it is in the phase of the block before)
            if backward.rise is not None:
                rise = backward.rise
                if b in moved_ahead and twin.rise is not None:
                    rise = max(rise, twin.rise + m.fetched_bytes - m.staying)
                worst = max(worst, held + rise + ahead[b])
            held += m.bytes + (m.staying if b in staying else 0) + made.get(self.blocks[b], 0)
        worst = max(worst, held + max(m.head for m in chosen))
        if staying or any(ahead):
            # Copied back ahead, a block's tensors are on the device at the start of
            # its backward, where the measuring run copied them back at their first
            # use: what else is alive at that moment differs (by one activation
            # gradient for a stack of LSTM blocks). The bound below covers it.
            worst = max(worst, self._peak_from_transients(staying, ahead))
        return worst

    def _copied_ahead(self, staying: set[int]) -> list[int]:
        """Per block, the host bytes of earlier offloaded calls copied back ahead of
        use while the backward runs it (see :attr:`predicted_peak`)."""
        chosen = self.chosen
        k = self.offload.prefetch if self.offload is not None else 0
        offloaded = [b for b, m in enumerate(chosen) if m.option.offload]
        ahead = [0] * len(chosen)
        if k == 0 or not offloaded:
            return ahead
        moved = [b for b in offloaded if b not in staying]  # the calls copied out, in order
        started = len(offloaded)
        for b in reversed(range(len(chosen))):  # the backward's order
            if chosen[b].option.offload:
                started = offloaded.index(b)
            # calls whose backward has started: offloaded[started:]; copied back ahead
            # and not yet used: offloaded[started - k : started] that were moved
            ahead[b] = sum(chosen[j].fetched_bytes for j in offloaded[max(0, started - k):started] if j in moved)
        return ahead

    def _moved_late(self, moved: set[int]) -> list[int]:
        """Per block, the device bytes earlier offloaded calls still hold in its
        forward, not yet copied out: call ``n``'s tensors leave when the offloaded
        call ``n + prefetch`` packs its first, so the forwards of the blocks after
        call ``n``'s up to that call's (whose first pack may follow its peak) hold
        them (see :attr:`predicted_peak`)."""
        chosen = self.chosen
        k = self.offload.prefetch if self.offload is not None else 0
        offloaded = [b for b, m in enumerate(chosen) if m.option.offload]
        late = [0] * len(chosen)
        for i, b in enumerate(offloaded):
            if b not in moved or i + k >= len(offloaded):
                continue
            for c in range(b + 1, offloaded[i + k] + 1):
                late[c] += chosen[b].staying
        return late

    def _peak_from_transients(self, staying: set[int], ahead: list[int]) -> int:
        chosen = self.chosen
        if not staying and not any(ahead):
            return self.predicted_bytes + max(m.transient for m in chosen)
        held = self.predicted_bytes - self._staying()
        worst = 0
        for b in reversed(range(len(chosen))):
            transient = self._resident_twin(b).transient if b in staying else chosen[b].transient
            staying_held = sum(chosen[j].staying for j in staying if j <= b)
            worst = max(worst, transient + staying_held + ahead[b])
        return held + worst

    def _resident_twin(self, b: int) -> Measured:
        """Block ``b``'s resident option with the save set of its chosen offloaded one."""
        return _twin(self.table[b], self.chosen[b]) or self.chosen[b]

    @property
    def no_remat_peak(self) -> int | None:
        """The step peak without any checkpoint (what a fraction peak budget scales)."""
        if not any(m.transient for opts in self.table for m in opts):
            return None
        return self.with_choices([0] * len(self.table)).predicted_peak

    @property
    def predicted_seconds(self) -> float:
        """Predicted added step time of the plan (0.0: no time predicted)."""
        return sum(m.seconds for m in self.chosen)

    @property
    def host_bytes(self) -> int:
        """Host bytes the plan's offloaded blocks occupy until the backward (the
        last ``prefetch`` offloaded blocks' stay on the device and take none)."""
        staying = set(self.staying_blocks())
        return sum(m.host_bytes for b, m in enumerate(self.chosen) if m.option.offload and b not in staying)

    @property
    def recompute_flops(self) -> int:
        """FLOPs the plan's recomputes add to every step."""
        return sum(m.flops for m in self.chosen)

    @property
    def cost(self) -> tuple[int, int, int]:
        """What the solver minimizes, summed over the blocks: (ns, FLOPs, ops)."""
        return tuple(sum(m.cost[i] for m in self.chosen) for i in range(3))

    @property
    def recompute_ops(self) -> int:
        """aten ops the plan's recomputes add to every step."""
        return sum(m.ops for m in self.chosen)

    @property
    def no_remat_bytes(self) -> int:
        """Activation bytes without any checkpoint (what a fraction budget scales)."""
        shared = {key: n for options in self.table for key, n in options[0].shared}
        return self.base_bytes + sum(options[0].bytes for options in self.table) + sum(shared.values())

    @property
    def options(self) -> dict[str, Option]:
        """The chosen option of each block."""
        return {name: m.option for name, m in zip(self.blocks, self.chosen)}

    def frontier(self) -> list[Point]:
        """Every plan that no other beats on both bytes and recompute cost; bytes
        include the base."""
        if self._frontier is None:
            points = frontier(
                [[(m.bytes, m.cost) for m in opts] for opts in self.table], *self._staying_table(),
                shared=self._shared_table(),
            )
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

    def _staying_table(self) -> tuple[list[list[int | None]] | None, int]:
        """For the solver: per option its staying bytes (None: not offloaded), and
        how many offloaded blocks stay on the device."""
        if self.offload is None or not any(m.option.offload for opts in self.table for m in opts):
            return None, 0
        return [
            [m.staying if m.option.offload else None for m in opts] for opts in self.table
        ], self.offload.prefetch

    def _shared_table(self) -> Shared | None:
        """For the solver: the tensors several blocks' options may keep, and which
        each option keeps (None: no option keeps one)."""
        sizes = {key: n for opts in self.table for m in opts for key, n in m.shared}
        if not sizes:
            return None
        keeps = [[frozenset(key for key, _ in m.shared) for m in opts] for opts in self.table]
        staying = [
            [
                frozenset(key for key, _ in (*m.shared, *(_twin(opts, m) or m).shared)) if m.option.offload else None
                for m in opts
            ]
            for opts in self.table
        ]
        return Shared(sizes, keeps, staying)

    @property
    def minimum_bytes(self) -> int:
        """The fewest activation bytes any policy in the search space holds."""
        return self.frontier()[0].bytes

    # ---------------------------------------------------------------- re-solving

    def for_budget(self, budget: Budget | None, peak_budget: Budget | None = None) -> RematPlan:
        """The cheapest plan for another budget, from the same measurements (no run).
        ``peak_budget``: a budget on the step peak too (a fraction of the step peak
        without remat, bytes or ``"auto"``; needs a table measured with peaks)."""
        if budget is None and peak_budget is None:
            raise ValueError(
                "RematPlan.for_budget: budget=None bounds nothing; pass a budget on the "
                "bytes after the forward, on the step peak (peak_budget=), or both."
            )
        budget_bytes = self._unlimited() if budget is None else resolve_budget(budget, self.no_remat_bytes)
        peak_bytes = None
        if peak_budget is not None:
            if self.no_remat_peak is None:
                raise ValueError(
                    "RematPlan.for_budget: this plan's options were measured without the step "
                    "peak; plan with plan_remat(..., peak_budget=...) to choose under one."
                )
            peak_bytes = resolve_budget(peak_budget, self.no_remat_peak, "peak_budget")
        shaped = self.with_choices(self.choices)
        shaped.budget_bytes, shaped.peak_budget_bytes = budget_bytes, peak_bytes
        fitting = shaped.fitting()
        if not fitting:
            if peak_bytes is None or self.cheapest_choices(budget_bytes, None) is None:
                raise InfeasibleBudgetError(_infeasible(budget, budget_bytes, self))
            raise InfeasibleBudgetError(_infeasible_peak(peak_budget, peak_bytes, budget_bytes, self))
        shaped.choices = list(fitting[0])
        return shaped

    def _unlimited(self) -> int:
        """A bytes budget no plan reaches (``budget=None``: only the peak counts)."""
        shared = {key: n for opts in self.table for m in opts for key, n in m.shared}
        return self.base_bytes + (self.checkpoint_base_bytes or 0) + 2 * (
            sum(max(m.bytes for m in opts) for opts in self.table) + sum(shared.values())
        )

    def with_choices(self, choices: Sequence[int]) -> RematPlan:
        """This plan with other options chosen (same table and budgets)."""
        return RematPlan(
            self.blocks, self.table, list(choices), self.base_bytes, self.budget_bytes,
            self.candidates, None, self._model, self._frontier, list(self.rng_free),
            self.checkpoint_base_bytes, offload=self.offload,
            peak_budget_bytes=self.peak_budget_bytes, time_profile=self.time_profile,
            refused=self.refused,
        )

    def cheapest_choices(self, budget_bytes: int, peak_bytes: int | None) -> list[int] | None:
        """The choices of the cheapest plan within both budgets (None: none fits)."""
        probe = self.with_choices(self.choices)
        probe.budget_bytes, probe.peak_budget_bytes = budget_bytes, peak_bytes
        fitting = probe.fitting()
        return list(fitting[0]) if fitting else None

    def fitting(self) -> list[tuple[int, ...]]:
        """The choices of the frontier's plans within this plan's budgets, cheapest
        first. Without a peak budget these are the frontier's points within the
        bytes budget (the frontier counts the last offloaded blocks' staying bytes
        exactly). With one, one frontier per level ``e`` (options whose
        :attr:`Measured.level` exceeds ``e`` left out) is searched, and each
        point's :attr:`predicted_peak` is checked (at most the bytes plus the
        largest level of the chosen options, so every plan is on the frontier of
        its own level)."""
        if self.peak_budget_bytes is None:
            fitting = [p for p in self.frontier() if p.bytes <= self.budget_bytes]
            return [p.choices for p in reversed(fitting)]
        levels: list[int | None] = [None]
        if self.peak_budget_bytes is not None:
            levels = sorted({m.level for opts in self.table for m in opts})
        found: dict[tuple[int, ...], tuple] = {}
        for level in levels:
            points = frontier([
                [(m.bytes, m.cost) if level is None or m.level <= level else None for m in opts]
                for opts in self.table
            ], *self._staying_table(), shared=self._shared_table())
            for p in points:
                if p.choices in found:
                    continue
                candidate = self.with_choices(p.choices)
                kept = candidate.predicted_bytes
                if kept > self.budget_bytes:
                    continue
                peak = candidate.predicted_peak
                if self.peak_budget_bytes is not None and peak is not None and peak > self.peak_budget_bytes:
                    continue
                found[p.choices] = (p.cost, kept, p.choices)
        return [key[2] for key in sorted(found.values())]

    def next_plans(self, groups: Sequence[Sequence[int]]) -> list[RematPlan]:
        """Plans to try when this one, run whole, does not hold what its blocks'
        options add up to: the next cheapest plans within the budget, then the
        cheapest within it whose blocks of each group (``groups``: block indices)
        share one option -- each group's options were measured with all its blocks
        at that option, so such a plan holds what its table says."""
        out = [
            self.with_choices(c) for c in self.fitting() if list(c) != self.choices
        ][: MAX_PLAN_RUNS - 2]
        per_group = frontier([
            [
                (sum(self.table[b][k].bytes for b in g),
                 tuple(sum(self.table[b][k].cost[i] for b in g) for i in range(3)))
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
            peak = candidate.predicted_peak
            if (
                candidate.predicted_bytes <= self.budget_bytes
                and (self.peak_budget_bytes is None or peak is None or peak <= self.peak_budget_bytes)
                and (uniform is None or candidate.cost < uniform.cost)
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
            frozenset(n for n, o in self.options.items() if o.offload),
            self.offload,
            self.host_bytes,
        )

    def apply(self, model: nn.Module | None = None) -> list[str]:
        """Install the plan with ``apply_remat`` (one call: the chosen blocks are
        checkpointed, the chosen submodules of each run as SAVE regions). ``model``:
        the planned model by default (required after :meth:`load`). Returns the
        checkpointed block names."""
        model = self._resolve_model(model)
        refuse_applied_remat(model)
        self._check_blocks(model)
        self.offloader = install(model, self.config())
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
        entries = [m for opts in self.table for m in opts]
        # a reader that knows no offloaded option (no shared output, no copy back
        # larger than its host bytes) must refuse such a plan
        if any(m.back_bytes for m in entries):
            version = FORMAT_VERSION
        elif any(m.shared for m in entries):
            version = _SHARED_FORMAT
        else:
            version = _OFFLOAD_FORMAT if any(m.option.offload for m in entries) else 1
        return {
            "format": version,
            "blocks": self.blocks,
            "table": [[m.to_json() for m in opts] for opts in self.table],
            "choices": self.choices,
            "base_bytes": self.base_bytes,
            "budget_bytes": self.budget_bytes,
            "candidates": self.candidates,
            "measured_bytes": self.measured_bytes,
            "rng_free": self.rng_free,
            "checkpoint_base_bytes": self.checkpoint_base_bytes,
            "offload": None if self.offload is None else self.offload.to_json(),
            "peak_budget_bytes": self.peak_budget_bytes,
            "measured_peak": self.measured_peak,
            "time_profile": self.time_profile,
            **({"refused": self.refused} if self.refused else {}),
        }

    def save(self, path: str | Path) -> None:
        """Write the plan and its measurements as JSON."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @staticmethod
    def from_json(data: dict) -> RematPlan:
        if data.get("format") not in (1, _OFFLOAD_FORMAT, _SHARED_FORMAT, FORMAT_VERSION):
            raise ValueError(
                f"RematPlan.load: format {data.get('format')!r} is not one this version reads "
                f"(1 to {FORMAT_VERSION}); plan again with this version of torch_remat."
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
            offload=OffloadOptions.from_json(data.get("offload")),
            peak_budget_bytes=data.get("peak_budget_bytes"),
            measured_peak=data.get("measured_peak"),
            time_profile=data.get("time_profile"),
            refused=dict(data.get("refused", {})),
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


def check_budget(budget: Budget | None, name: str, caller: str) -> None:
    """Refuse what is not a budget, naming the argument (``name``) and the function
    (``caller``), before anything runs. None passes (no bound)."""
    if budget is None or isinstance(budget, str) and budget == "auto":
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(
            f"{caller}: {name} must be a fraction (float), bytes (int) or 'auto', got {budget!r}."
        )
    if isinstance(budget, float) and not budget >= 0:  # (NaN too)
        raise ValueError(
            f"{caller}: {name} as a fraction must be >= 0 (0.3: 30 % of the bytes "
            f"without remat), got {budget}."
        )
    if isinstance(budget, int) and budget < 0:
        raise ValueError(f"{caller}: {name} in bytes must be >= 0, got {budget}.")


def resolve_budget(budget: Budget, no_remat_bytes: int, name: str = "budget",
                   caller: str = "RematPlan.for_budget") -> int:
    """Bytes of a budget: a float is a fraction of ``no_remat_bytes``, an int is bytes,
    ``"auto"`` is the free CUDA memory less ``AUTO_MARGIN`` of the total. A fraction
    too large for the bytes to be a number (``float('inf')``) fits anything."""
    check_budget(budget, name, caller)
    if isinstance(budget, float):
        value = budget * no_remat_bytes
        return int(value) if value < _ANY_BYTES else _ANY_BYTES
    if isinstance(budget, int):
        return budget
    if not torch.cuda.is_available():
        raise ValueError(
            f"{caller}: {name}='auto' reads the free CUDA memory, and no CUDA device "
            "is available; on CPU pass a fraction of the no-remat bytes "
            f"(e.g. {name}=0.3) or a number of bytes (int)."
        )
    free, total = torch.cuda.mem_get_info()
    return max(0, free - int(AUTO_MARGIN * total))


# More bytes than any device holds: what an infinite fraction budget resolves to.
_ANY_BYTES = 2**62


def _infeasible_peak(budget: Budget, budget_bytes: int, kept_budget: int, plan: RematPlan) -> str:
    probe = plan.with_choices(plan.choices)
    probe.budget_bytes, probe.peak_budget_bytes = kept_budget, 1 << 62
    low = min(plan.with_choices(c).predicted_peak or 0 for c in probe.fitting())
    full = plan.no_remat_peak or 1
    return (
        f"plan_remat: peak_budget {budget!r} ({budget_bytes:,} B) is below the lowest step "
        f"peak a plan is predicted to reach, {low:,} B ({format_bytes(low)}, {low / full:.3f} of "
        f"the {full:,} B step peak without remat). Raise peak_budget to at least {low:,} B "
        f"(or {low / full:.3f}), "
        + ("" if plan.offload is not None else "offer offload (offload=True), ")
        + "or add candidates/blocks."
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
    offload: OffloadOptions | None = None,
    peaks: bool = False,
) -> tuple[int, int, list[list[Measured]]]:
    """Run every option of every group once; ``(base bytes without checkpoints, base
    bytes with some, per-block options)``. ``measure``: how one configuration is run
    (``_measure.measure`` on real tensors, ``_fake.measure_fake`` for a forecast).
    ``offload``: each checkpoint option of a group is measured offloaded too (its
    twins follow the group's resident options in the table). ``peaks``: record each
    run's transient (its ``peak_bytes`` less its bytes after the forward)."""

    def _transient(got: Any) -> int:
        peak = getattr(got, "peak_bytes", None) if peaks else None
        return 0 if peak is None else max(0, peak - sum(got.bytes_by_block.values()))

    def _rises(got: Any) -> dict[str, dict[str, int | None]]:
        """Per block, its phases' rises in this run (see ``Measured.rise``)."""
        phases = getattr(got, "phase_peaks", None) if peaks else None
        if not phases:
            return {b: {} for b in blocks}
        by_block = got.bytes_by_block
        head = phases.get(HEAD)
        head = None if head is None else head - sum(by_block.values())
        held, out = by_block[BASE], {}
        for b in blocks:
            backward, forward = phases.get(("backward", b)), phases.get(("forward", b))
            out[b] = {
                "rise": None if backward is None else backward - held,
                "forward_rise": None if forward is None else forward - held,
                "head": head,
            }
            held += by_block[b]
        return out

    measure(model, args, loss_fn, Placement(), blocks)  # warm-up: lazy state, first-call caches
    off = measure(model, args, loss_fn, Placement(), blocks)
    table: dict[str, list[Measured]] = {
        b: [Measured(OFF, off.bytes_by_block[b], 0, 0, transient=_transient(off), **rises)]
        for b, rises in _rises(off).items()
    }
    # per block, beside each table entry: what the run that measured it found of the
    # blocks' kept outputs and who kept them (None: a refused option's)
    outputs: dict[str, list[dict | None]] = {b: [getattr(off, "outputs", {})] for b in blocks}
    bases: list[int] = []
    refused: dict[str, str] = {}

    def run(group: Group, option: Option) -> None:
        offloaded = frozenset(group.blocks) if option.offload else frozenset()
        try:
            got = measure(
                model, args, loss_fn,
                Placement(dict.fromkeys(group.blocks, option.save), rng_free, offloaded, offload),
                blocks,
            )
        except REFUSED_OPTION_ERRORS as e:
            if not option.save:  # a full checkpoint: the block cannot be checkpointed at all
                raise
            refused[f"{group.blocks[0]}: {option.label}"] = first_line(e)
            for b in group.blocks:
                table[b].append(_REFUSED)
                outputs[b].append(None)
            return
        bases.append(got.bytes_by_block[BASE])
        host = getattr(got, "host_by_block", {})
        back = getattr(got, "back_by_block", {})
        rises = _rises(got)
        for b in group.blocks:  # an offloaded option's staying bytes: _staying_as_twins
            table[b].append(
                Measured(option, got.bytes_by_block[b], got.flops_by_block[b], got.ops_by_block[b],
                         host.get(b, 0), _transient(got), **rises[b],
                         # (recorded where it differs: host_bytes stands for it otherwise)
                         back_bytes=back.get(b, 0) if back.get(b, 0) != host.get(b, 0) else 0)
            )
            outputs[b].append(getattr(got, "outputs", {}))

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
            if any(m is _REFUSED for m in ms):  # never on the frontier
                return _NEVER, (_NEVER, _NEVER)
            return sum(m.bytes for m in ms), (sum(m.flops for m in ms), sum(m.ops for m in ms))

        single = [summed(2 + u) for u in range(len(group.units))]
        for option in group.predicted_options(single, summed(1)):
            run(group, option)
    for b in blocks:
        pairs = [(m, o) for m, o in zip(table[b], outputs[b]) if m is not _REFUSED]
        table[b], outputs[b] = [m for m, _ in pairs], [o for _, o in pairs]
    if offload is not None:
        for group in groups:
            for m in list(table[group.blocks[0]][1:]):
                if m.option.save:  # a full checkpoint keeps nothing that moves
                    run(group, m.option.offloaded())
    shared = shared_outputs([o for b in blocks for o in outputs[b] if o is not None])
    if shared:
        for b in blocks:
            table[b] = [_with_shared(m, b, o, shared) for m, o in zip(table[b], outputs[b])]
    if offload is not None:
        for b in blocks:
            table[b] = _staying_as_twins(table[b])
    base = off.bytes_by_block[BASE]
    return base, max(bases, default=base), [table[b] for b in blocks], refused


def shared_outputs(runs: Sequence[dict[OutputKey, tuple[int, frozenset[str]]]]) -> dict[OutputKey, int]:
    """The blocks' outputs that plans hold once however many options keep them,
    with their bytes, from every run's kept outputs and their holders (``runs``:
    ``Measurement.outputs``, one per run): those that some run does not keep and
    that some run has a block other than their maker keep. An output every run
    keeps (a block's hidden state, which the next block's first op saves or its
    checkpoint keeps as an input) is held in every plan and counted for its maker,
    as the runs measured it; one only its maker ever keeps adds as its options do."""
    seen: dict[OutputKey, int] = {}
    others: set[OutputKey] = set()
    for run in runs:
        for key, (n, holders) in run.items():
            seen.setdefault(key, n)
            if any(h != key[0] for h in holders):
                others.add(key)
    return {key: n for key, n in seen.items() if key in others and not all(key in run for run in runs)}


def _with_shared(
    m: Measured, block: str, found: dict[OutputKey, tuple[int, frozenset[str]]], shared: dict[OutputKey, int]
) -> Measured:
    """``m`` (measured for ``block`` in a run that found ``found``) with the
    ``shared`` outputs it keeps in :attr:`Measured.shared`, and those ``block``
    made taken out of its bytes (counted once per plan, through the options that
    keep them)."""
    keeps = tuple(sorted((key, n) for key, (n, holders) in found.items() if key in shared and block in holders))
    made = sum(n for key, (n, _) in found.items() if key in shared and key[0] == block)
    return dataclasses.replace(m, bytes=m.bytes - made, shared=keeps)


# The engine's refusals of an option's SAVE regions on a model (a SAVE region's
# output modified in place after it returns, an output the replay reads but nothing
# kept, a replay that differs from its forward): that option is left out.
REFUSED_OPTION_ERRORS = (
    remat.SavedTensorModifiedError, remat.PlaceholderReadError, remat.RecomputeMismatchError
)
_NEVER = 2**62


def first_line(e: BaseException) -> str:
    """The error's type and first sentence."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text.split('. ')[0].rstrip('.')}"


def _staying_as_twins(options: list[Measured]) -> list[Measured]:
    """An offloaded option's ``staying`` bytes: what its resident twin (same save
    set, measured before it) holds beyond it, since a call left on the device holds
    what the twin holds. (The storages the move freed can count less, where a moved
    tensor's storage is also held elsewhere: GPT-2 with its key/value cache on,
    whose cache holds the key and value the offloader moves.)"""
    out = []
    for m in options:
        twin = _twin(options, m) if m.option.offload else None
        out.append(m if twin is None else dataclasses.replace(m, staying=max(0, twin.bytes - m.bytes)))
    return out


def _twin(options: list[Measured], m: Measured) -> Measured | None:
    """The measured option among ``options`` that is ``m``'s resident twin (the same
    save set, nothing offloaded); None if it was not measured."""
    return next((o for o in options if o.option == m.option.resident), None)


def plan_remat(
    model: nn.Module,
    example_args: Any,
    loss_fn: LossFn = lambda out: out.sum(),
    budget: Budget | None = 0.5,
    *,
    blocks: BlockSelector = None,
    candidates: Candidates = None,
    per_rank: bool = False,
    verify: bool = True,
    peak_budget: Budget | None = None,
    offload: bool | OffloadOptions | None = None,
    profile: Any = None,
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
            on every rank; a mismatch on any rank raises the same error on every
            rank (with ``per_rank`` too, and so does a budget one rank cannot meet).
        peak_budget: a budget on the step peak as well: the most device bytes the
            step's own storages hold at once, forward and backward (a fraction of
            the step peak without remat, bytes, or ``"auto"``). Every option's run
            then measures its peak in each phase of the step (a block's forward,
            the head, a block's backward), and a plan's predicted peak is composed
            from the phases of its options' runs (``RematPlan.predicted_peak``);
            the verifying run measures the real one: a plan
            whose measured peak exceeds the budget is replaced by the cheapest
            plan predicted to fit with that excess taken off the budget (at most
            ``MAX_PLAN_RUNS`` runs). ``budget=None``: only the peak is bounded.
        offload: True (or an :class:`OffloadOptions`): each checkpoint option with
            SAVE regions is also measured with what they keep (their saves for
            backward and the outputs the replay reads) moved to host memory by an
            :class:`~torch_remat.offload.ActivationOffloader`; ``plan.apply()``
            installs one for the blocks the plan offloads. The options are then
            compared by predicted added time (recompute plus exposed copies, see
            ``profile``), and peaks are measured.
        profile: the device profile times are predicted for: a
            ``_time.DeviceProfile``, the name of a published one (``"H100 SXM"``),
            or None: calibrated on the model's device when ``offload`` asks for
            times. Given, the solver minimizes predicted time (then FLOPs, ops).

    Raises :class:`InfeasibleBudgetError` (naming the minimum achievable bytes) when
    no policy fits. The model is returned unchanged; ``plan.apply()`` installs it.
    """
    if budget is None and peak_budget is None:
        raise ValueError(
            "plan_remat: budget=None bounds nothing; pass a budget on the bytes after the "
            "forward (budget=0.3), on the step peak (peak_budget=0.5), or both."
        )
    check_budget(budget, "budget", "plan_remat")
    check_budget(peak_budget, "peak_budget", "plan_remat")
    refuse_applied_remat(model)
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    names = select_blocks(model, blocks)
    groups = group_blocks(model, names, candidates, args)
    settle(model, args, loss_fn)
    order: list[str] = []
    rng_free = blocks_drawing_no_random_numbers(model, args, names, order=order)
    names = in_call_order(names, order)
    offload_options = resolve_offload(offload)
    peaks = peak_budget is not None or offload_options is not None
    base, checkpoint_base, table, refused = measure_table(
        model, args, loss_fn, names, groups, frozenset(rng_free),
        measure=functools.partial(measure, peak=True) if peaks else measure,
        offload=offload_options, peaks=peaks,
    )
    time_profile = None
    if profile is not None or offload_options is not None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        dtype = compute_dtype(model)
        timing = resolve_profile(profile, device, dtype)
        table = timed(table, block_groups(names, groups), timing, dtype, offload_options)
        time_profile = timing.name
    measured = RematPlan(
        names, table, [0] * len(names), base, 0,
        {g.blocks[0]: dict(zip(g.candidates, g.kinds)) for g in groups}, None, weakref.ref(model),
        rng_free=rng_free, checkpoint_base_bytes=checkpoint_base, offload=offload_options,
        time_profile=time_profile, refused=refused,
    )
    plan, error = _solve_or_error(measured, budget, peak_budget)
    if not per_rank:
        plan, error = _distributed.agree(measured, plan, error)
    else:
        # each rank plans for itself, but all go on or all raise: the verifying run
        # below is collective, and a rank raising alone leaves the others in it
        error = _distributed.agree_on_verification(error)
    if error is not None:
        raise InfeasibleBudgetError(error)
    if verify:
        def run(candidate: RematPlan) -> dict[str, int]:
            got = measure(model, args, loss_fn, candidate.config(), names, peak=peaks, measuring=False)
            candidate.measured_peak = got.peak_bytes
            return got.bytes_by_block

        if not _distributed.in_group():
            plan, mismatch = verified_plan(plan, block_groups(names, groups), run)
            if mismatch is None and plan.peak_budget_bytes is not None:
                plan, mismatch = _within_peak(measured, plan, budget, block_groups(names, groups), run)
        else:
            # Verified as chosen: a run of another plan on one rank alone would
            # wait forever in a collective of the sharded forward.
            by_block = run(plan)
            plan.measured_bytes = sum(by_block.values())
            mismatch = None
            if plan.measured_bytes != plan.predicted_bytes:
                mismatch = _report.mismatch_message(plan, by_block)
            elif (
                plan.peak_budget_bytes is not None and plan.measured_peak is not None
                and plan.measured_peak > plan.peak_budget_bytes
            ):
                mismatch = (
                    f"plan_remat: the chosen plan, installed and run, peaked at "
                    f"{plan.measured_peak:,} B, over the peak budget of {plan.peak_budget_bytes:,} B "
                    f"(predicted {plan.predicted_peak:,} B); under a process group the plan is "
                    "verified as chosen. Lower peak_budget by the difference, or plan with "
                    "per_rank=True on one process to find a plan that fits."
                )
            mismatch = _distributed.agree_on_verification(mismatch)
        if mismatch is not None:
            raise PlanMismatchError(mismatch)
    return plan


def in_call_order(names: Sequence[str], order: Sequence[str], where: str = "plan_remat") -> list[str]:
    """``names`` in the order the forward first called them (``order``). The plan's
    blocks are in forward order: the last ``prefetch`` offloaded blocks, which stay
    on the device, are the last called. A block the forward did not call is refused:
    every option of it measures nothing, so a plan could not say what it holds in a
    step that calls it, nor which offloaded block is really the last called."""
    uncalled = [n for n in names if n not in order]
    if uncalled:
        raise ValueError(_uncalled_blocks_message(where, uncalled, [n for n in order if n in names]))
    rank = {n: i for i, n in enumerate(order)}
    return sorted(names, key=rank.__getitem__)


def _uncalled_blocks_message(where: str, uncalled: Sequence[str], called: Sequence[str]) -> str:
    listed = ", ".join(repr(n) for n in uncalled[:8]) + (f" and {len(uncalled) - 8} more" if len(uncalled) > 8 else "")
    return (
        f"{where}: the example forward never called block{'s' if len(uncalled) > 1 else ''} {listed} "
        f"({len(called)} of {len(called) + len(uncalled)} blocks ran). Each block's options are "
        "measured in that forward, so a block it skips cannot be planned: the plan would not "
        "say what the block holds in a step that calls it, and an offloaded plan would leave the "
        "wrong block on the device. A block skipped at random (layerdrop: a config's `layerdrop` "
        "or `encoder_layerdrop` above 0 in training mode) is planned with the skipping off (set "
        "it to 0 for the planning call: a step that skips blocks then holds less than the plan); "
        "a block this forward never calls is left out, with a predicate naming the called ones: "
        f"blocks=lambda m: m in {{model.get_submodule(n) for n in {list(called)!r}}}."
    )


def block_groups(names: Sequence[str], groups: Sequence[Group]) -> list[list[int]]:
    """The indices in ``names`` of each group's blocks."""
    return [[names.index(b) for b in g.blocks] for g in groups]


def _solve_or_error(
    measured: RematPlan, budget: Budget | None, peak_budget: Budget | None = None
) -> tuple[RematPlan, str | None]:
    try:
        return measured.for_budget(budget, peak_budget), None
    except InfeasibleBudgetError as e:
        return measured, str(e)


_FULL = Option(True)
"""A full checkpoint: no SAVE region, nothing offloaded."""


def _within_peak(
    measured: RematPlan, plan: RematPlan, budget: Budget | None, groups: Sequence[Sequence[int]], run: Any
) -> tuple[RematPlan, str | None]:
    """``plan`` if its measured step peak is within its peak budget; else the
    cheapest plan predicted to fit once the measured excess over the prediction is
    taken off the peak budget, verified in turn (at most ``MAX_PLAN_RUNS`` tries)."""
    limit = plan.peak_budget_bytes
    target = limit
    for _ in range(MAX_PLAN_RUNS):
        if plan.measured_peak is None or plan.measured_peak <= limit:
            return plan, None
        excess = plan.measured_peak - (plan.predicted_peak or plan.measured_peak)
        target -= max(excess, plan.measured_peak - limit, 1)
        if target <= 0:
            break
        try:
            candidate = measured.for_budget(budget, target)
        except InfeasibleBudgetError:
            break
        candidate.peak_budget_bytes = limit
        candidate, mismatch = verified_plan(candidate, groups, run)
        if mismatch is not None:
            return candidate, mismatch
        plan = candidate
    if plan.measured_peak is not None and plan.measured_peak <= limit:
        return plan, None
    # Last: every block fully checkpointed, nothing offloaded, where the bytes budget
    # allows it: the plan whose peak is predicted with the fewest assumptions (an
    # offloaded plan's is a model, see predicted_peak), found to fit where the
    # corrections above, led by offloaded plans' predictions, had not tried it.
    full = [next((i for i, m in enumerate(opts) if m.option == _FULL), None) for opts in measured.table]
    if None not in full and full != plan.choices:
        candidate = measured.with_choices(full)
        candidate.budget_bytes, candidate.peak_budget_bytes = plan.budget_bytes, limit
        if candidate.predicted_bytes <= plan.budget_bytes:
            candidate, mismatch = verified_plan(candidate, groups, run)
            if mismatch is None and candidate.measured_peak is not None and candidate.measured_peak <= limit:
                return candidate, None
    return plan, (
        f"plan_remat: the chosen plan, installed and run, peaked at {plan.measured_peak:,} B, "
        f"over the peak budget of {limit:,} B (predicted {plan.predicted_peak:,} B), and no "
        "plan tried fits it: "
        + "; ".join(f"{n}: {o.label}" for n, o in plan.options.items())
        + f". Raise peak_budget (this plan ran in {plan.measured_peak:,} B)"
        + ("" if plan.offload is not None else ", or offer offload (offload=True)")
        + ". (verify=False would install a plan on its prediction alone; run as here, "
        "this one exceeds the budget.)"
    )

