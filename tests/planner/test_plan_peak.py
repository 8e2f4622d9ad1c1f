"""The step peak a plan predicts, composed from the runs that measured its blocks'
options: in each phase of the step (a block's forward, the head, a block's backward)
a run's peak less the bytes then held by the blocks before that block carries over
to every plan choosing the same option for it. Checked against real steps on stacks
whose blocks differ (two structures, uneven widths), where the peak of one block's
backward depends on what the blocks before it hold."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from helpers import second_step_peak
from torch import nn

from torch_remat.integrations import remove_remat
from torch_remat.integrations.planner import forecast_remat, plan_remat


class _MLP(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _ReluInPlace(nn.Module):
    """``up``'s output goes through an in-place ReLU, which saves its result: with
    ``up`` a SAVE region, its output is updated after the region returned."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu_(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, hidden: list[int], d: int = 32, block: type = _MLP) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(d, h) for h in hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


MODELS = {
    # two structures, the narrow ones first and last; uneven hidden sizes; a frozen
    # first block (fine-tuning), whose backward never runs
    "narrow-then-wide": ([64, 64, 256, 256], 16),
    "wide-then-narrow": ([256, 256, 64, 64], 16),
    "uneven": ([33, 100, 7], 64),
    "first-frozen": ([64, 128, 64], 16),
    # before: the checkpoint held up's output for relu_'s backward, although the
    # replay makes it again, and no report counted it: up to 17 % under
    "relu-in-place": ([32, 32, 32], 256),
}


def _model(name: str) -> tuple[nn.Module, torch.Tensor]:
    hidden, batch = MODELS[name]
    torch.manual_seed(0)
    model = _Stack(hidden, block=_ReluInPlace if name == "relu-in-place" else _MLP)
    if name == "first-frozen":
        model.blocks[0].requires_grad_(False)
        return model, torch.randn(batch, 32)
    return model, torch.randn(batch, 32, requires_grad=True)


def _step_peak(model: nn.Module, x: torch.Tensor) -> int:
    return second_step_peak(model, x)


def _placements(plan, n: int) -> list[list[int]]:
    every = list(itertools.product(*[range(len(o)) for o in plan.table]))
    random.Random(0).shuffle(every)
    blocks = len(plan.table)
    return [[0] * blocks, [1] * blocks] + [list(c) for c in every[:n]]


@pytest.mark.parametrize("forecast", [False, True], ids=["plan_remat", "forecast_remat"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_placements_step_peak_is_predicted_as_a_real_step_peaks(name, forecast):
    # Before, each option's transient was its run's peak less all the bytes held
    # after the forward, whichever block's backward the peak came in: 6.6 % to 9 %
    # under the real peak with every block fully checkpointed, up to 8.6 % over
    # for other placements; with a frozen first block (no backward phase of its
    # own) the composition fell back to that: 9.7 % under.
    model, x = _model(name)
    if forecast:
        plan = forecast_remat(model, (x,), budget=None, peak_budget=1.0).plan
    else:
        plan = plan_remat(model, (x,), budget=None, peak_budget=1.0, verify=False)
    for choices in _placements(plan, 6):
        candidate = plan.with_choices(choices)
        candidate.apply(model)
        try:
            measured = _step_peak(model, x)
        finally:
            remove_remat(model)
        assert candidate.predicted_peak == measured, (choices, candidate.predicted_peak, measured)


def test_a_peak_budget_on_blocks_of_two_structures_is_planned_and_held_as_predicted():
    model, x = _model("narrow-then-wide")
    reference = plan_remat(model, (x,), budget=None, peak_budget=1.0, verify=False)
    lowest = min(reference.with_choices(c).predicted_peak for c in _placements(reference, 40))
    budget = (lowest + reference.no_remat_peak) // 2
    plan = plan_remat(model, (x,), budget=None, peak_budget=budget)
    assert plan.replaced is None  # the first plan chosen held what it predicted
    assert plan.measured_peak == plan.predicted_peak <= budget
    plan.apply()
    try:
        assert _step_peak(model, x) <= budget
    finally:
        remove_remat(model)
