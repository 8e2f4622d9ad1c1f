"""W6: the memory-budget planner on the W1 GPT stack, against hand policies and
``torch.compile``'s ``activation_memory_budget``.

The planner measures its options once; for every budget its plan is installed and
measured again here with W1's own tools (``measure_step``: profiler bytes alive
after the forward, ``FlopCounterMode`` FLOPs of the whole step), so "predicted"
and "measured" come from different code. Hand policies (``apply_remat`` with fixed
save sets on every block) are measured the same way. ``torch.compile`` runs the
whole step with the ``aot_eager`` backend and the min-cut partitioner under each
budget; its bytes come from the same profiler ledger, its FLOPs from
``FlopCounterMode`` run inside the compiled forward and backward graphs (a dispatch
mode around a compiled call would make it run eagerly).
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn

from benchmarks.gpt import GPTStack
from benchmarks.measure import measure_step, preallocate_grads, step_bytes
from benchmarks.report import Check, Table, WorkloadResult
from benchmarks.w1_gpt_stack import FULL, QUICK
from torch_remat.integrations import (
    InfeasibleBudgetError,
    RematConfig,
    apply_remat,
    plan_remat,
    remove_remat,
)

BUDGETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
QUICK_COMPILE_BUDGETS = (0.1, 1.0)
"""Each compiled budget costs a compilation; quick mode compiles two."""

HAND_POLICIES = {
    "full checkpoint": None,
    "save linears": nn.Linear,
    "Megatron-style": (nn.Linear, nn.LayerNorm),
}
"""``save_modules`` of each hand policy (Megatron-style: every linear and norm kept,
the attention core and GELU replayed)."""


def _measure(stack: GPTStack, x: torch.Tensor) -> tuple[int, int]:
    """(bytes alive after the forward, step FLOPs) with what ``stack`` carries now."""
    counts, b = measure_step(lambda: stack(x).sum())
    return b.live_after_forward, counts.flops_step


def _compiled(stack: GPTStack, x: torch.Tensor, budget: float) -> tuple[int, int]:
    """(bytes after the forward, step FLOPs) of the step compiled under ``budget``."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.utils.flop_counter import FlopCounterMode

    state = {"count": False, "flops": 0}

    def compiler(gm, _example_inputs):
        def run(args):
            if not state["count"]:
                return gm(*args)
            with FlopCounterMode(display=False) as counter:
                out = gm(*args)
            state["flops"] += counter.get_total_flops()
            return out

        run._boxed_call = True
        return run

    backend = aot_autograd(
        fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition
    )
    torch._dynamo.reset()
    with functorch_config.patch(activation_memory_budget=budget):
        step = torch.compile(lambda: stack(x).sum(), backend=backend)
        step().backward()  # compiles
        nbytes = step_bytes(step).live_after_forward
        state["count"] = True
        step().backward()
    torch._dynamo.reset()
    return nbytes, state["flops"]


def run(quick: bool) -> WorkloadResult:
    cfg = QUICK if quick else FULL
    torch.manual_seed(0)
    stack = GPTStack(cfg)
    x = stack.example_input()
    preallocate_grads(stack, x)
    base_bytes, base_flops = _measure(stack, x)

    # Default candidates (ln1, qkv, proj, ln2, fc1, fc2): 2**6 + 1 options per block.
    plan = plan_remat(stack, x, budget=1.0, verify=False)
    hand = {}
    for name, save in HAND_POLICIES.items():
        apply_remat(
            stack, check_fn=lambda m: m in set(stack.blocks), remat=RematConfig(save_modules=save)
        )
        nbytes, flops = _measure(stack, x)
        hand[name] = (nbytes, flops - base_flops)
        remove_remat(stack)

    rows, data, checks_equal, checks_hand, costs = [], {}, [], [], []
    compile_budgets = QUICK_COMPILE_BUDGETS if quick else BUDGETS
    compiled = {b: _compiled(stack, x, b) for b in compile_budgets}
    for budget in BUDGETS:
        limit = int(budget * plan.no_remat_bytes)
        try:
            p = plan.for_budget(budget)
        except InfeasibleBudgetError:
            p = None
        if p is None:
            measured = (None, None)
        else:
            p.apply(stack)
            nbytes, flops = _measure(stack, x)
            remove_remat(stack)
            measured = (nbytes, flops - base_flops)
            checks_equal.append(
                (budget, p.predicted_bytes, nbytes, p.recompute_flops, flops - base_flops)
            )
            costs.append(p.recompute_flops)
            fitting = {n: f for n, (b, f) in hand.items() if b <= limit}
            checks_hand.append((budget, p.recompute_flops, fitting))
        cb = compiled.get(budget)
        rows.append(
            [
                f"{budget:.2f}",
                limit,
                "infeasible" if p is None else p.predicted_bytes,
                "" if measured[0] is None else measured[0],
                "" if p is None else p.recompute_flops,
                "" if measured[1] is None else measured[1],
                ", ".join(n for n, (b, _) in hand.items() if b <= limit) or "-",
                "" if cb is None else cb[0],
                "" if cb is None else f"{cb[0] / base_bytes:.3f}" + (" > budget" if cb[0] > limit else ""),
                "" if cb is None else cb[1] - base_flops,
            ]
        )
        data[str(budget)] = {
            "budget_bytes": limit,
            "plan": None if p is None else {
                "predicted_bytes": p.predicted_bytes,
                "measured_bytes": measured[0],
                "recompute_flops": p.recompute_flops,
                "measured_extra_flops": measured[1],
                "options": {n: o.label for n, o in p.options.items()},
            },
            "compile": None if cb is None else {"bytes": cb[0], "extra_flops": cb[1] - base_flops},
        }
    data["hand_policies"] = {n: {"bytes": b, "extra_flops": f} for n, (b, f) in hand.items()}
    data["no_remat"] = {"bytes": base_bytes, "flops_step": base_flops}
    data["minimum_bytes"] = plan.minimum_bytes
    data["measured_options"] = plan.to_json()  # RematPlan.from_json(...).plot(path) redraws

    compile_bytes = [compiled[b][0] for b in compile_budgets]
    compile_flops = [compiled[b][1] for b in compile_budgets]
    over = [b for b in compile_budgets if compiled[b][0] > int(b * base_bytes)]
    non_monotone = [
        compile_budgets[i + 1]
        for i in range(len(compile_budgets) - 1)
        if compile_bytes[i + 1] < compile_bytes[i] or compile_flops[i + 1] > compile_flops[i]
    ]
    checks = [
        Check(
            "planner: measured bytes after plan.apply() equal the prediction at every feasible budget",
            "bytes",
            f"{sum(a == b for _, a, b, _, _ in checks_equal)}/{len(checks_equal)} equal",
            all(a == b for _, a, b, _, _ in checks_equal),
        ),
        Check(
            "planner: measured recompute FLOPs (step FLOPs minus no AC) equal the prediction",
            "flops",
            f"{sum(a == b for _, _, _, a, b in checks_equal)}/{len(checks_equal)} equal",
            all(a == b for _, _, _, a, b in checks_equal),
        ),
        Check(
            "planner: recompute FLOPs never rise as the budget grows",
            "flops",
            " >= ".join(f"{c:,}" for c in costs),
            all(a >= b for a, b in zip(costs, costs[1:])),
        ),
        Check(
            "planner: never more recompute FLOPs than a hand policy that fits the same budget",
            "flops",
            "; ".join(
                f"{b}: {f:,} vs " + (", ".join(f"{n} {v:,}" for n, v in fit.items()) or "none fits")
                for b, f, fit in checks_hand
            ),
            all(f <= v for _, f, fit in checks_hand for v in fit.values()),
        ),
    ]
    table = Table(
        f"W6 planner on the W1 stack (d={cfg.d_model} s={cfg.seq_len} layers={cfg.n_layers}, "
        f"no AC {base_bytes:,} B after forward; minimum plan {plan.minimum_bytes:,} B)",
        [
            "budget", "budget (B)", "plan predicted (B)", "plan measured (B)", "plan recompute FLOPs",
            "measured extra FLOPs", "hand policies fitting", "compile bytes", "compile / no AC",
            "compile extra FLOPs",
        ],
        rows,
        [
            "hand policies: " + "; ".join(f"{n}: {b:,} B, {f:,} extra FLOPs" for n, (b, f) in hand.items()),
            f"torch.compile (aot_eager, min-cut partitioner, activation_memory_budget): budgets "
            f"where its bytes exceed the budget: {over or 'none'}; where it is not monotone "
            f"(bytes fall or FLOPs rise as the budget grows): {non_monotone or 'none'}",
        ],
    )
    return WorkloadResult(
        name="W6",
        title="memory-budget planner vs hand policies vs torch.compile activation_memory_budget",
        config={**asdict(cfg), "candidates": plan.candidates[plan.blocks[0]]},
        tables=[table],
        checks=checks,
        data=data,
    )
