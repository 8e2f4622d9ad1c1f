"""plan_remat: measured bytes equal predictions, budgets, the exact solver, the
Pareto curve, gradients, files and the printed table, on small float64 models."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import recorded_replays
from torch_remat.integrations import (
    InfeasibleBudgetError,
    RematPlan,
    plan_remat,
    remat_module_names,
    remove_remat,
    save_region_names,
)
from torch_remat.integrations.planner import activation_bytes
from torch_remat.integrations.planner import plan as plan_module


class Block(nn.Module):
    """Pre-LN MLP block with dropout: candidates ln, fc1, fc2 (leaves with parameters)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d, dtype=torch.float64)
        self.fc1 = nn.Linear(d, 4 * d, dtype=torch.float64)
        self.fc2 = nn.Linear(4 * d, d, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.fc1(self.ln(x))), 0.2, self.training)
        return x + self.fc2(h)


class Net(nn.Module):
    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d, dtype=torch.float64)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 2, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Each planning runs a dozen tiny steps; on a shared machine a second intra-op
    thread only adds waiting to them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def planned(one_thread):
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(16, 8, dtype=torch.float64)
    plan = plan_remat(model, x, loss_fn, budget=0.5)
    return model, x, plan


def _measured_with(plan: RematPlan, model: nn.Module, x: torch.Tensor) -> int:
    plan.apply(model)
    try:
        return activation_bytes(model, (x,), loss_fn)
    finally:
        remove_remat(model)


BUDGETS = [0.45, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
"""Fractions from about the minimum this model can reach (0.43) to everything."""


def test_measured_bytes_after_apply_equal_the_prediction_at_every_budget(planned):
    model, x, plan = planned
    mixed = 0
    for budget in BUDGETS:
        p = plan.for_budget(budget)
        assert _measured_with(p, model, x) == p.predicted_bytes, budget
        mixed += len({m.option for m in p.chosen}) > 1
    assert mixed > 0, "some budget must mix options across identical blocks"


def test_predicted_bytes_never_exceed_a_feasible_budget(planned):
    _, _, plan = planned
    for budget in BUDGETS:
        p = plan.for_budget(budget)
        assert p.predicted_bytes <= p.budget_bytes == int(budget * plan.no_remat_bytes)


def test_plan_remat_verifies_the_chosen_plan_by_measuring_it(planned):
    _, _, plan = planned
    assert plan.measured_bytes == plan.predicted_bytes


def test_an_integer_budget_is_bytes(planned):
    _, _, plan = planned
    target = plan.for_budget(0.5).predicted_bytes
    p = plan.for_budget(target)
    assert p.budget_bytes == target and p.predicted_bytes == target


def test_an_infeasible_budget_raises_naming_the_minimum_achievable(planned):
    _, _, plan = planned
    low = plan.minimum_bytes
    assert plan.for_budget(low).predicted_bytes == low
    with pytest.raises(InfeasibleBudgetError, match=f"minimum achievable activation memory of {low:,} B"):
        plan.for_budget(low - 1)


def test_plan_remat_raises_for_an_infeasible_budget_before_changing_the_model():
    torch.manual_seed(0)
    model = Net(n=2)
    with pytest.raises(InfeasibleBudgetError, match="minimum achievable"):
        plan_remat(model, torch.randn(4, 8, dtype=torch.float64), loss_fn, budget=0.1)
    assert remat_module_names(model) == [] and save_region_names(model) == []


def test_recompute_cost_never_rises_as_the_budget_grows(planned):
    _, _, plan = planned
    rows = plan.pareto([i / 100 for i in range(101)]).rows
    feasible = [(r.flops, r.ops) for r in rows if r.bytes is not None]
    assert len(feasible) > 50
    assert all(a >= b for a, b in zip(feasible, feasible[1:]))
    assert feasible[-1] == (0, 0)  # the whole budget: nothing recomputed


def test_the_solver_finds_the_cheapest_combination_of_measured_options(planned):
    _, _, plan = planned
    combos = list(itertools.product(*(range(len(t)) for t in plan.table)))
    for budget in BUDGETS:
        p = plan.for_budget(budget)
        best = min(
            (sum(t[i].flops for t, i in zip(plan.table, c)), sum(t[i].ops for t, i in zip(plan.table, c)))
            for c in combos
            if plan.base_bytes + sum(t[i].bytes for t, i in zip(plan.table, c)) <= p.budget_bytes
        )
        assert (p.recompute_flops, p.recompute_ops) == best


def test_the_plan_never_costs_more_than_a_hand_policy_that_fits(planned):
    _, _, plan = planned
    hand = plan.hand_policies()
    assert set(hand) == {"full checkpoint", "save linears", "Megatron-style"}
    for nbytes, flops, ops in hand.values():
        p = plan.for_budget(nbytes)
        assert (p.recompute_flops, p.recompute_ops) <= (flops, ops)


def test_gradients_under_the_plan_equal_no_checkpointing_bitwise(planned):
    model, x, plan = planned
    model = copy.deepcopy(model)
    x = x.clone().requires_grad_()

    def grads():
        for t in [*model.parameters(), x]:
            t.grad = None
        torch.manual_seed(7)
        loss_fn(model(x)).backward()
        return [t.grad.clone() for t in [*model.parameters(), x]]

    reference = grads()
    for budget in (0.45, 0.6):
        plan.for_budget(budget).apply(model)
        assert remat_module_names(model)
        assert all(map(torch.equal, grads(), reference))
        remove_remat(model)


def test_planning_leaves_gradients_buffers_and_rng_as_they_were():
    torch.manual_seed(0)
    model = Net(n=2)
    model.inp = nn.Sequential(nn.Linear(8, 8, dtype=torch.float64), nn.BatchNorm1d(8, dtype=torch.float64))
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    for t in [*model.parameters(), x]:
        t.grad = torch.full_like(t, 3.0)
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    with recorded_replays() as replayed:
        plan_remat(model, x, loss_fn, budget=1.0)
    # its measurements replayed the blocks, whose backward writes gradients too
    assert sorted(set(replayed)) == ["layers.0", "layers.1"]
    assert all(torch.equal(t.grad, torch.full_like(t, 3.0)) for t in [*model.parameters(), x])
    assert all(map(torch.equal, model.buffers(), buffers))
    assert torch.equal(torch.get_rng_state(), rng)
    assert remat_module_names(model) == []


def test_apply_installs_the_chosen_checkpoints_and_save_regions(planned):
    model, _, plan = planned
    p = plan.for_budget(0.6)
    p.apply(model)
    try:
        assert remat_module_names(model) == [n for n, o in p.options.items() if o.checkpoint]
        expected = sorted(f"{n}.{s}" for n, o in p.options.items() for s in o.save)
        assert sorted(save_region_names(model)) == expected
    finally:
        remove_remat(model)


def test_a_saved_plan_loads_and_applies_the_same_policy(planned, tmp_path):
    model, x, plan = planned
    plan.save(tmp_path / "plan.json")
    loaded = RematPlan.load(tmp_path / "plan.json")
    assert loaded.to_json() == plan.to_json()
    copy_of_model = copy.deepcopy(model)
    loaded.apply(copy_of_model)
    plan.apply(model)
    try:
        assert remat_module_names(copy_of_model) == remat_module_names(model)
        assert save_region_names(copy_of_model) == save_region_names(model)
    finally:
        remove_remat(model)
    with pytest.raises(ValueError, match="pass the model"):
        loaded.apply()


def test_planning_twice_gives_the_same_plan(planned):
    model, x, plan = planned
    again = plan_remat(model, x, loss_fn, budget=0.5)
    assert again.to_json() == plan.to_json()


def test_budget_auto_on_cpu_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device.*budget=0.3"):
        plan_module.resolve_budget("auto", 1000)


def test_budget_auto_is_the_free_cuda_memory_less_the_margin(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (6_000, 10_000))
    assert plan_module.resolve_budget("auto", 1) == 6_000 - int(plan_module.AUTO_MARGIN * 10_000)


def test_a_bad_budget_is_refused_with_its_type():
    with pytest.raises(TypeError, match="fraction .*bytes .*'auto'"):
        plan_module.resolve_budget("half", 100)
    with pytest.raises(TypeError):
        plan_module.resolve_budget(True, 100)


def test_blocks_given_as_names_are_refused_with_what_blocks_takes():
    # before: isinstance() arg 2 must be a type, a tuple of types, or a union
    model = Net(n=2)
    with pytest.raises(TypeError, match=r"plan_remat: blocks must hold module classes only, got \['layers.0'\]"):
        plan_remat(model, (torch.randn(4, 8, dtype=torch.float64),), budget=1.0, blocks=["layers.0"])


def test_candidates_by_glob_and_class_restrict_the_options():
    torch.manual_seed(0)
    model = Net(n=2)
    x = torch.randn(4, 8, dtype=torch.float64)
    by_glob = plan_remat(model, x, loss_fn, budget=1.0, candidates=["fc*"], verify=False)
    by_class = plan_remat(model, x, loss_fn, budget=1.0, candidates=[nn.LayerNorm], verify=False)
    assert by_glob.candidates == {"layers.0": {"fc1": "Linear", "fc2": "Linear"}}
    assert by_class.candidates == {"layers.0": {"ln": "LayerNorm"}}
    # no checkpoint, then the subsets: {}, {fc1}, {fc2}, {fc1, fc2}
    assert [m.option.save for m in by_glob.table[0]] == [(), (), ("fc1",), ("fc2",), ("fc1", "fc2")]
    # each option was measured with its checkpoint: saving fc1 spares the replay's flops
    assert [m.flops for m in by_glob.table[0]] == [0, 2048, 0, 2048, 0]


def test_the_table_shows_every_block_and_the_totals(planned):
    _, _, plan = planned
    text = str(plan)
    for name, m in zip(plan.blocks, plan.chosen):
        assert name in text and f"{m.bytes:,}" in text
    assert f"{plan.predicted_bytes:,} B" in text and f"measured {plan.measured_bytes:,} B (equal)" in text


def test_plan_remat_refuses_a_model_with_remat_applied(planned):
    model, x, plan = planned
    plan.apply(model)
    try:
        with pytest.raises(ValueError, match="remove_remat"):
            plan_remat(model, x, loss_fn)
    finally:
        remove_remat(model)


def test_plot_draws_a_png_of_the_pareto_curve(planned, tmp_path):
    pytest.importorskip("matplotlib")
    _, _, plan = planned
    path = plan.plot(tmp_path / "pareto.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"budget": -0.5}, ValueError, r"plan_remat: budget as a fraction must be >= 0"),
        ({"budget": float("nan")}, ValueError, r"plan_remat: budget as a fraction must be >= 0"),
        ({"budget": 0.5, "peak_budget": -1}, ValueError, r"plan_remat: peak_budget in bytes must be >= 0"),
        ({"budget": 0.5, "peak_budget": "half"}, TypeError, r"plan_remat: peak_budget must be a fraction"),
        ({"budget": torch.tensor(0.5)}, TypeError, r"plan_remat: budget must be a fraction"),
    ],
)
def test_a_bad_budget_is_refused_before_anything_runs_naming_the_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        plan_remat(Net(), torch.randn(16, 8, dtype=torch.float64), loss_fn, **kwargs)


def test_an_infinite_fraction_budget_fits_anything_and_for_budget_needs_a_bound(planned):
    _, _, plan = planned
    assert plan_module.resolve_budget(float("inf"), 1000) >= 2**62
    assert plan_module.resolve_budget(1e308, 10**9) >= 2**62
    unbounded = plan.for_budget(float("inf"))
    assert unbounded.recompute_flops == 0  # no remat: the cheapest plan
    with pytest.raises(ValueError, match="RematPlan.for_budget: budget=None bounds nothing"):
        plan.for_budget(None)
    with pytest.raises(ValueError, match="RematPlan.for_budget: peak_budget in bytes must be >= 0"):
        plan_module.resolve_budget(-3, 10, "peak_budget")
