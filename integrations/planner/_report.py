"""How a plan reads: its table, its Pareto table, and the hand-written policies it
is compared with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch_remat._integration import format_bytes

if TYPE_CHECKING:
    from .plan import RematPlan

DEFAULT_BUDGETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def _rows(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        .rstrip()
        for r in rows
    ]


def _regions(option, candidates: dict[str, str]) -> str:
    if not option.checkpoint:
        return "no checkpoint (everything kept)"
    save = ", ".join(option.save) or "-"
    recompute = ", ".join(p for p in candidates if p not in option.save and not _inside(p, option.save))
    text = f"SAVE: {save} | RECOMPUTE: " + (f"{recompute} and the rest" if recompute else "the rest")
    return text + " | OFFLOAD: what it keeps" if getattr(option, "offload", False) else text


def _inside(path: str, outer: Sequence[str]) -> bool:
    return any(path.startswith(o + ".") for o in outer)


def _candidates_of(plan: RematPlan, block: str) -> dict[str, str]:
    """Candidates of ``block``: those of the first block of its group."""
    index = plan.blocks.index(block)
    for first, cands in plan.candidates.items():
        if [m.option for m in plan.table[plan.blocks.index(first)]] == [
            m.option for m in plan.table[index]
        ]:
            return cands
    return {}


def format_plan(plan: RematPlan) -> str:
    full, b = plan.no_remat_bytes, plan.budget_bytes
    fb = format_bytes
    bounded = b != plan._unlimited()
    lines = [
        f"remat plan for {len(plan.blocks)} blocks: budget {fb(b)} ({b:,} B, "
        f"{b / full:.3f} of {fb(full)} without remat)" if bounded else
        f"remat plan for {len(plan.blocks)} blocks: no budget on the bytes after the forward "
        f"({fb(full)} without remat)",
        f"  predicted {fb(plan.predicted_bytes)} ({plan.predicted_bytes:,} B, "
        f"{plan.predicted_bytes / full:.3f}), recompute {plan.recompute_flops:,} FLOPs and "
        f"{plan.recompute_ops:,} aten ops per step"
        + (
            ""
            if plan.measured_bytes is None
            else f"; measured {plan.measured_bytes:,} B"
            + (" (equal)" if plan.measured_bytes == plan.predicted_bytes else " (DIFFERENT)")
        ),
    ]
    if plan.peak_budget_bytes is not None or plan.predicted_peak is not None:
        pb = plan.peak_budget_bytes
        lines.append(
            f"  step peak: predicted {plan.predicted_peak:,} B"
            + ("" if plan.measured_peak is None else f", measured {plan.measured_peak:,} B")
            + ("" if pb is None else f"; peak budget {fb(pb)} ({pb:,} B"
               + (f", {pb / plan.no_remat_peak:.3f} of {plan.no_remat_peak:,} B without remat)"
                  if plan.no_remat_peak else ")"))
        )
    if plan.time_profile is not None:
        offloaded = [n for n, o in plan.options.items() if o.offload]
        lines.append(
            f"  predicted added time on {plan.time_profile}: {plan.predicted_seconds * 1e3:.3f} ms per step"
            + (f"; offloaded to host: {', '.join(offloaded)} ({plan.host_bytes:,} B, prefetch "
               f"{plan.offload.prefetch})" if offloaded else "; nothing offloaded")
        )
    by_reason: dict[str, list[str]] = {}
    for what, why in plan.refused.items():
        by_reason.setdefault(why, []).append(what)
    for why, options in by_reason.items():
        more = f" and {len(options) - 1} more option(s) with that region" if len(options) > 1 else ""
        lines.append(f"  refused on this model: {options[0]}{more} ({why})")
    if plan.replaced is not None:
        r = plan.replaced
        lines.append(
            f"  (the budget's cheapest plan, {'; '.join(f'{n}: {o.label}' for n, o in r.options.items())}, "
            f"held {r.measured_bytes:,} B when run, not the {r.predicted_bytes:,} B its blocks' "
            "options add up to: its blocks keep each other's tensors depending on their options. "
            "Chosen instead: the cheapest of the other plans tried that held what it predicts.)"
        )
    lines.append("")
    rows = [["block", "policy", "bytes", "recompute FLOPs", "ops"]]
    for name, m in zip(plan.blocks, plan.chosen):
        rows.append([name, _regions(m.option, _candidates_of(plan, name)), f"{m.bytes:,}",
                     f"{m.flops:,}", f"{m.ops:,}"])
    staying = plan._staying()
    if staying:
        rows.append([f"(the last {plan.offload.prefetch} offloaded, left on the device)", "",
                     f"{staying:,}", "0", "0"])
    shared = plan.shared_kept()
    if shared:
        makers = ", ".join(dict.fromkeys(block for block, _ in shared))
        rows.append([f"(outputs of {makers} the options above keep, held once)", "",
                     f"{sum(shared.values()):,}", "0", "0"])
    rows.append(["(outside blocks)", "", f"{plan.base_for(plan.choices):,}", "0", "0"])
    rows.append(["total", "", f"{plan.predicted_bytes:,}", f"{plan.recompute_flops:,}",
                 f"{plan.recompute_ops:,}"])
    lines += ["  " + r for r in _rows(rows, {2, 3, 4})]
    if plan.time_profile is None:
        lines.append("  (time is not predicted: recompute cost is measured as FLOPs and aten ops)")
    else:
        lines.append(
            f"  (time predicted on {plan.time_profile}: recompute FLOPs at its peak FLOP/s, plus "
            "the offloaded copies' exposed time; the solver minimizes it, then FLOPs, then ops)"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class ParetoRow:
    budget: float
    """Fraction of the no-remat activation bytes."""
    budget_bytes: int
    bytes: int | None
    """The cheapest fitting plan's bytes (None: no plan fits)."""
    flops: int | None
    ops: int | None


@dataclass
class ParetoTable:
    rows: list[ParetoRow]
    no_remat_bytes: int

    def format(self) -> str:
        table = [["budget", "budget (B)", "plan bytes", "plan / no remat", "recompute FLOPs", "ops"]]
        for r in self.rows:
            if r.bytes is None:
                table.append([f"{r.budget:.2f}", f"{r.budget_bytes:,}", "infeasible", "", "", ""])
            else:
                table.append([f"{r.budget:.2f}", f"{r.budget_bytes:,}", f"{r.bytes:,}",
                              f"{r.bytes / self.no_remat_bytes:.3f}", f"{r.flops:,}", f"{r.ops:,}"])
        return "\n".join(_rows(table, {1, 2, 3, 4, 5}))

    def __str__(self) -> str:
        return self.format()


def pareto_table(plan: RematPlan, budgets: Sequence[float] | None) -> ParetoTable:
    from ._solve import cheapest_within

    points = plan.frontier()
    full = plan.no_remat_bytes
    rows = []
    for f in DEFAULT_BUDGETS if budgets is None else budgets:
        budget_bytes = int(f * full)
        p = cheapest_within(points, budget_bytes)
        rows.append(
            ParetoRow(f, budget_bytes, None, None, None)
            if p is None
            else ParetoRow(f, budget_bytes, p.bytes, p.cost[1], p.cost[2])
        )
    return ParetoTable(rows, full)


def hand_save_sets(candidates: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """The hand policies as save sets over a block's candidates: a full checkpoint;
    the linear layers saved; Megatron-style (every candidate leaf saved: linears and
    norms; the attention core and activations replayed)."""
    paths = list(candidates)
    leaves = tuple(p for p in paths if not any(q.startswith(p + ".") for q in paths))
    return {
        "full checkpoint": (),
        "save linears": tuple(p for p in paths if candidates[p] == "Linear"),
        "Megatron-style": leaves,
    }


def hand_policies(plan: RematPlan) -> dict[str, tuple[int, int, int]]:
    """``(bytes, FLOPs, ops)`` of each hand policy applied to every block, from the
    measured table (policies whose save set was not measured are left out)."""
    choices: dict[str, list[int]] = {}
    names = None
    for block, options in zip(plan.blocks, plan.table):
        sets = hand_save_sets(_candidates_of(plan, block))
        names = list(sets) if names is None else names
        for name in list(names):
            found = [i for i, m in enumerate(options) if m.option.checkpoint and m.option.save == sets[name]]
            if not found:
                names.remove(name)
                continue
            choices.setdefault(name, []).append(found[0])
    out = {}
    for name in names or []:
        policy = plan.with_choices(choices[name])
        out[name] = (policy.predicted_bytes, policy.recompute_flops, policy.recompute_ops)
    return out


def mismatch_message(plan: RematPlan, measured_by_block: dict[str, int] | None = None) -> str:
    """Why the installed plan failed its verification: the totals, and (given the
    measured bytes by block, ``""`` for outside the blocks) each block whose bytes
    differ from its chosen option's."""
    differing = ""
    if measured_by_block is not None:
        staying = set(plan.staying_blocks())
        made = plan._shared_kept_by_maker()  # counted for their makers, as runs count
        rows = [
            (name, measured_by_block.get(name, 0),
             m.bytes + (m.staying if b in staying else 0) + made.get(name, 0), m.option.label)
            for b, (name, m) in enumerate(zip(plan.blocks, plan.chosen))
        ]
        rows.append(("(outside blocks)", measured_by_block.get("", 0), plan.base_for(plan.choices), ""))
        lines = [
            f"{name} ({label}): measured {got:,} B, predicted {want:,} B ({got - want:+,} B)"
            if label else f"{name}: measured {got:,} B, predicted {want:,} B ({got - want:+,} B)"
            for name, got, want, label in rows
            if got != want
        ]
        if lines:
            differing = " Differing: " + "; ".join(lines) + "."
    return (
        f"plan_remat: the chosen plan, installed and run, held {plan.measured_bytes:,} B "
        f"after the forward, not the predicted {plan.predicted_bytes:,} B.{differing} The "
        "blocks' bytes interact in a way per-block measurement does not capture (a block "
        "keeping its neighbour's output, say). Plan: "
        + "; ".join(f"{n}: {o.label}" for n, o in plan.options.items())
        + ". Pass blocks= with coarser blocks (a block with the neighbour whose output it "
        "keeps), or verify=False to install the plan on its prediction alone (it holds "
        "the measured bytes above, not the predicted)."
    )
