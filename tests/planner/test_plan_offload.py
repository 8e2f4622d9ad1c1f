"""Offload as a planner option, the budget on the step peak, and the time
objective: plans that offload are exact, hold the device bytes they predict, stay
within the peak budget as an independent allocator count measures it, and are
chosen by predicted time."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers import second_step_peak
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import torch_remat as remat
from torch_remat.integrations import remove_remat
from torch_remat.integrations.planner import (
    InfeasibleBudgetError,
    PlanMismatchError,
    RematPlan,
    activation_bytes,
    forecast_remat,
    plan_remat,
)
from torch_remat.integrations.planner._offload import OffloadOptions, timed
from torch_remat.integrations.planner._space import Option
from torch_remat.integrations.planner._time import DeviceProfile, exposed_copy_seconds
from torch_remat.integrations.planner.plan import Measured
from torch_remat.offload import ActivationOffloader

# Compute so slow that moving a tensor costs less than recomputing a matmul, and
# so fast that it never does: the time model, not the bytes, decides.
SLOW_COMPUTE = DeviceProfile("slow compute", {"float32": 1e8}, 1e10, 1e10, overlap_copies=False)
SLOW_LINK = DeviceProfile("slow link", {"float32": 1e15}, 1e12, 1e3, overlap_copies=False)
EVERY_TENSOR = OffloadOptions(min_bytes=0)
UP = ["up"]  # one candidate: few options to measure

class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, d: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP(d) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _model_and_input(seed: int = 0) -> tuple[Stack, torch.Tensor]:
    torch.manual_seed(seed)
    return Stack(), torch.randn(8, 16, 32, requires_grad=True)


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _independent_step_peak(model: nn.Module, x: torch.Tensor) -> int:
    return second_step_peak(model, x)


def _peak_applied(plan: RematPlan, model: nn.Module, x: torch.Tensor) -> int:
    """The step peak of ``model`` with ``plan`` installed (removed after)."""
    plan.apply(model)
    try:
        return _independent_step_peak(model, x)
    finally:
        remove_remat(model)


def test_an_offload_plan_is_exact_and_holds_the_device_bytes_it_predicts():
    model, x = _model_and_input()
    reference = _grads(model, x)
    plan = plan_remat(model, (x,), budget=0.3, offload=EVERY_TENSOR, profile=SLOW_COMPUTE, candidates=UP)
    offloaded = [n for n, o in plan.options.items() if o.offload]
    assert offloaded, plan
    assert plan.measured_bytes == plan.predicted_bytes <= plan.budget_bytes
    # the offloaded blocks' tensors are in host memory, not in the device bytes
    assert plan.host_bytes > 0
    assert all(m.bytes < next(t for t in opts if t.option == m.option.resident).bytes
               for m, opts in zip(plan.chosen, plan.table) if m.option.offload and m.host_bytes)
    plan.apply()
    try:
        got = _grads(model, x)
        stats = plan.offloader.stats
        # it moved tensors of the offloaded blocks only, and brought them all back
        assert sum(stats.offloaded_bytes.values()) > 0
        assert stats.offloaded_bytes == stats.fetched_bytes
        assert stats.resident_pool_full == 0
    finally:
        remove_remat(model)
    assert all(torch.equal(a, b) for a, b in zip(reference, got))


def test_the_offloader_a_plan_installs_moves_only_the_offloaded_blocks_tensors():
    model, x = _model_and_input()
    every_call = OffloadOptions(prefetch=0, min_bytes=0)  # no call left on the device
    plan = plan_remat(model, (x,), budget=0.3, offload=every_call, profile=SLOW_COMPUTE, candidates=UP)
    table = plan.table
    # block 0's SAVE region offloaded, the other blocks' left resident
    up = next(i for i, m in enumerate(table[0]) if m.option == Option(True, ("up",)))
    up_off = next(i for i, m in enumerate(table[0]) if m.option == Option(True, ("up",), True))
    mixed = plan.with_choices([up_off] + [up] * (len(plan.blocks) - 1))
    resident = plan.with_choices([up] * len(plan.blocks))
    kept = {}
    for name, candidate in (("mixed", mixed), ("resident", resident)):
        candidate.apply(model)
        try:
            kept[name] = activation_bytes(model, (x,), lambda out: out.sum())
            if candidate is mixed:
                assert mixed.offloader.checkpoints == ("blocks.0",)
                moved = sum(mixed.offloader.stats.offloaded_bytes.values())
                # the count includes the host buffers the forward made: take them out
                kept[name] -= mixed.offloader.pool.allocated_bytes
        finally:
            remove_remat(model)
    # what block 0's SAVE region keeps moved, and nothing else did: the device
    # holds exactly that much less, as the plan predicts
    assert moved == table[0][up_off].host_bytes > 0
    assert kept["resident"] - kept["mixed"] == table[0][up_off].staying > 0
    assert kept["mixed"] == mixed.predicted_bytes
    assert kept["resident"] == resident.predicted_bytes


def test_offload_is_chosen_by_predicted_time():
    model, x = _model_and_input()
    # copies far cheaper than recompute: the tight budget is met by moving tensors
    cheap_copies = plan_remat(model, (x,), budget=0.3, offload=EVERY_TENSOR, profile=SLOW_COMPUTE, candidates=UP)
    assert any(o.offload for o in cheap_copies.options.values())
    assert cheap_copies.recompute_flops == 0
    # copies far dearer than recompute: the same budget is met by recomputing
    dear_copies = plan_remat(model, (x,), budget=0.3, offload=EVERY_TENSOR, profile=SLOW_LINK, candidates=UP)
    assert not any(o.offload for o in dear_copies.options.values())
    assert dear_copies.recompute_flops > 0
    # and the predicted time is what decided: each is the cheaper on its profile
    assert cheap_copies.predicted_seconds < SLOW_COMPUTE.compute_seconds(dear_copies.recompute_flops, 0, "float32")


def test_a_plan_keeps_the_step_peak_within_the_peak_budget_as_measured():
    model, x = _model_and_input()
    reference = _grads(model, x)
    for offload in (None, EVERY_TENSOR):
        plan = plan_remat(model, (x,), budget=None, peak_budget=0.6, offload=offload, profile=SLOW_COMPUTE, candidates=UP)
        assert plan.peak_budget_bytes == int(0.6 * plan.no_remat_peak)
        assert plan.measured_peak is not None and plan.measured_peak <= plan.peak_budget_bytes
        plan.apply()
        try:
            independent = _independent_step_peak(model, x)
            got = _grads(model, x)
        finally:
            remove_remat(model)
        assert independent <= plan.peak_budget_bytes, (offload, independent, plan)
        assert all(torch.equal(a, b) for a, b in zip(reference, got))
    # without a checkpoint the step peaks higher than the budget allowed
    remove_remat(model)
    assert _independent_step_peak(model, x) > plan.peak_budget_bytes


def test_a_peak_budget_no_plan_reaches_is_refused_naming_the_lowest_peak():
    model, x = _model_and_input()
    with pytest.raises(InfeasibleBudgetError, match=r"peak_budget 0\.01 .* lowest step peak") as plain:
        plan_remat(model, (x,), budget=None, peak_budget=0.01, candidates=UP)
    assert "offer offload (offload=True)" in str(plain.value)
    # with offload already among the options, the way out does not suggest it again
    with pytest.raises(InfeasibleBudgetError, match=r"lowest step peak") as offered:
        plan_remat(model, (x,), budget=None, peak_budget=0.01, candidates=UP,
                   offload=OffloadOptions(min_bytes=0), profile=SLOW_COMPUTE)
    assert "offload=True" not in str(offered.value)


def test_an_offload_plan_round_trips_through_json_and_applies_to_a_fresh_model(tmp_path):
    model, x = _model_and_input()
    plan = plan_remat(model, (x,), budget=0.3, offload=EVERY_TENSOR, profile=SLOW_COMPUTE, candidates=UP)
    plan.save(tmp_path / "plan.json")
    loaded = RematPlan.load(tmp_path / "plan.json")
    assert loaded.options == plan.options and loaded.offload == plan.offload
    assert loaded.predicted_bytes == plan.predicted_bytes
    assert loaded.predicted_seconds == plan.predicted_seconds
    fresh, _ = _model_and_input()
    reference = _grads(fresh, x)
    loaded.apply(fresh)
    try:
        got = _grads(fresh, x)
        assert sum(loaded.offloader.stats.offloaded_bytes.values()) > 0
    finally:
        remove_remat(fresh)
    assert all(torch.equal(a, b) for a, b in zip(reference, got))


def test_the_time_of_an_offloaded_option_is_its_recompute_and_its_exposed_copies():
    def m(option, flops, host):
        return Measured(option, 0, flops, 1, host_bytes=host)

    full, full_off = Option(True), Option(True, (), True)
    table = [[m(Option(False), 0, 0), m(full, 1000, 0), m(full_off, 1000, 500)] for _ in range(3)]
    out = timed(table, [[0, 1, 2]], SLOW_COMPUTE, torch.float32, OffloadOptions(prefetch=1))
    recompute = 1000 / 1e8
    assert out[0][1].seconds == pytest.approx(recompute)
    forward, backward, copy = [recompute] * 3, [3 * recompute] * 3, [500 / 1e10] * 3
    exposed = exposed_copy_seconds(forward, backward, copy, prefetch=1, overlap=False)
    assert exposed == pytest.approx(4 * 500 / 1e10)  # two calls move, out and back
    assert [row[2].seconds for row in out] == pytest.approx([recompute + exposed / 3] * 3)


def test_only_a_checkpoint_can_be_offloaded_and_options_say_so():
    with pytest.raises(ValueError, match="only a checkpoint"):
        Option(False, (), True)
    assert Option(True, ("up",), True).label == "checkpoint, save up, offloaded"
    assert Option.from_json(Option(True, (), True).to_json()) == Option(True, (), True)
    with pytest.raises(TypeError, match="offload must be"):
        plan_remat(Stack(), torch.randn(2, 4, 32), budget=0.5, offload="yes")


def test_a_profile_from_a_second_import_of_the_planner_is_refused_saying_so():
    # From a source checkout the planner also imports as `integrations.planner`: a
    # DeviceProfile made there is another class, which was refused as "not a
    # DeviceProfile" while printing one.
    from integrations.planner._time import DeviceProfile as Other

    other = Other("other", {"float32": 1e12}, 1e12, 1e10)
    with pytest.raises(TypeError, match="imported under two names"):
        plan_remat(Stack(), torch.randn(2, 4, 32), budget=0.5, offload=True, profile=other)


def test_an_offloader_moves_only_the_checkpoints_it_is_given():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    offloader = ActivationOffloader(1 << 20, prefetch=0, min_bytes=0, kinds=tuple(remat.SavedTensorKind),
                                    checkpoints=["moved"])

    def body(t):
        return remat.region(lambda u: lin(u).relu(), "lin", recompute=False)(t)

    a = remat.checkpoint(region_name="moved", saved_tensors_hooks=offloader)(body)
    b = remat.checkpoint(region_name="kept", saved_tensors_hooks=offloader)(body)
    b(a(x)).sum().backward()
    assert sum(offloader.stats.offloaded_bytes.values()) > 0
    moved_before = dict(offloader.stats.offloaded_bytes)
    b(x).sum().backward()
    assert offloader.stats.offloaded_bytes == moved_before


def test_the_forecast_of_offloaded_options_equals_their_measurement():
    model, x = _model_and_input()
    plan = plan_remat(model, (x,), budget=0.3, offload=EVERY_TENSOR, profile=SLOW_COMPUTE, candidates=UP)
    forecast = forecast_remat(model, (x,), budget=0.3, offload=EVERY_TENSOR, profile=SLOW_COMPUTE,
                              candidates=UP)
    assert any(m.option.offload for opts in forecast.plan.table for m in opts)
    for name, real, fake in zip(plan.blocks, plan.table, forecast.plan.table):
        assert [m.option for m in fake] == [m.option for m in real], name
        # device bytes, host bytes, what stays, recompute: as measured on real tensors
        assert [(m.bytes, m.host_bytes, m.staying, m.flops, m.ops) for m in fake] == [
            (m.bytes, m.host_bytes, m.staying, m.flops, m.ops) for m in real
        ], name
    assert forecast.plan.options == plan.options
    assert forecast.plan.predicted_bytes == forecast.plan.measured_bytes == plan.measured_bytes
    assert forecast.policies["plan"].predicted_seconds(SLOW_COMPUTE, torch.float32) == plan.predicted_seconds
    with pytest.raises(ValueError, match="offload needs a device profile"):
        forecast_remat(model, (x,), budget=0.3, offload=True)


@functools.cache
def _measured_table() -> RematPlan:
    model, x = _model_and_input()
    plan = plan_remat(model, (x,), budget=0.5, offload=OffloadOptions(prefetch=1, min_bytes=0),
                      profile=SLOW_COMPUTE, candidates=["up", "down"], verify=False)
    return plan


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_assignment_of_keep_recompute_and_offload_gives_bitwise_equal_gradients(data):
    measured = _measured_table()
    choices = [data.draw(st.integers(0, len(opts) - 1), label=name)
               for name, opts in zip(measured.blocks, measured.table)]
    plan = measured.with_choices(choices)
    model, x = _model_and_input()
    reference = _grads(model, x)
    plan.apply(model)
    try:
        got = _grads(model, x)
        moved = plan.offloader is not None and sum(plan.offloader.stats.offloaded_bytes.values())
    finally:
        remove_remat(model)
    assert all(torch.equal(a, b) for a, b in zip(reference, got)), plan.options
    # the offloader moved exactly what the plan says goes to the host (the last
    # prefetch offloaded blocks stay)
    assert (moved or 0) == plan.host_bytes, plan.options


class Narrow(nn.Module):
    """A residual MLP of its own width: blocks of different widths are groups of one."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Narrow(32, h) for h in (128, 96, 160, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_copies_of_blocks_in_groups_of_one_are_not_free():
    # each block is its own group, so no group has more blocks than prefetch: their
    # copies must still cost what the whole model's timeline exposes
    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(8, 16, 32)
    plan = plan_remat(model, x, budget=0.3, offload=EVERY_TENSOR, profile=SLOW_LINK, candidates=UP)
    assert not any(o.offload for o in plan.options.values()), plan
    slow = plan_remat(model, x, budget=0.3, offload=EVERY_TENSOR, profile=SLOW_COMPUTE, candidates=UP)
    for opts in slow.table:
        for m in opts:
            if m.option.offload and m.host_bytes:
                resident = next(t for t in opts if t.option == m.option.resident)
                assert m.seconds > resident.seconds, m


@pytest.mark.parametrize("prefetch", [0, 1, 3, 10])
def test_offering_offload_never_makes_a_budget_infeasible_or_a_plan_dearer(prefetch):
    model, x = _model_and_input()
    resident = plan_remat(model, (x,), budget=1.0, profile=SLOW_COMPUTE, candidates=UP, verify=False)
    offered = plan_remat(model, (x,), budget=1.0, offload=OffloadOptions(prefetch=prefetch, min_bytes=0),
                         profile=SLOW_COMPUTE, candidates=UP, verify=False)
    checked = []
    for fraction in (0.05, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5):
        try:
            without = resident.for_budget(fraction)
        except InfeasibleBudgetError:
            continue
        checked.append(fraction)
        with_offload = offered.for_budget(fraction)
        assert with_offload.cost <= without.cost, fraction
        assert with_offload.predicted_bytes <= with_offload.budget_bytes
        # the Pareto table reads the same frontier as for_budget
        (row,) = offered.pareto([fraction]).rows
        assert row.bytes == with_offload.predicted_bytes, fraction
        # and what it predicts is what the plan holds once installed
        with_offload.apply(model)
        try:
            kept = activation_bytes(model, (x,), lambda out: out.sum())
            if with_offload.offloader is not None:
                kept -= with_offload.offloader.pool.allocated_bytes
        finally:
            remove_remat(model)
        assert kept == with_offload.predicted_bytes, (prefetch, fraction, with_offload.options)
    # not vacuous: checkpoints without offload fit at least three of these budgets
    assert len(checked) >= 3, checked


class Reordered(nn.Module):
    """Blocks registered in another order than the forward calls them."""

    def __init__(self) -> None:
        super().__init__()
        self.late = Narrow(32, 64)  # registered first, called last
        self.early = Narrow(32, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(self.early(x))


def test_the_blocks_that_stay_on_the_device_are_the_last_called():
    torch.manual_seed(0)
    model, x = Reordered(), torch.randn(8, 16, 32, requires_grad=True)
    plan = plan_remat(model, (x,), budget=0.3, blocks=Narrow, candidates=UP, offload=EVERY_TENSOR,
                      profile=SLOW_COMPUTE, verify=False)
    assert plan.blocks == ["early", "late"]  # forward order, not registration order
    plan.apply()
    try:
        kept = activation_bytes(model, (x,), lambda out: out.sum()) - (
            plan.offloader.pool.allocated_bytes if plan.offloader is not None else 0
        )
    finally:
        remove_remat(model)
    assert kept == plan.predicted_bytes <= plan.budget_bytes


FAST_LINK = DeviceProfile("fast link", {"float32": 1e8}, 1e10, 1e12, overlap_copies=True)


class Recurrent(nn.Module):
    """An LSTM block: the LSTM's saves are large next to what its SAVE regions keep
    alone, so where offloaded blocks are copied back matters to the peak."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm, self.lstm, self.proj = nn.LayerNorm(d), nn.LSTM(d, d, batch_first=True), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.norm(x))
        return x + self.proj(h).tanh()


class RecurrentStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Recurrent() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("prefetch", [1, 2])
def test_with_prefetch_the_predicted_peak_bounds_the_measured_one_for_every_placement(prefetch):
    # The offloaded options are measured with prefetch 0; with prefetch >= 1 the
    # last blocks stay (their backward copies nothing back) and earlier blocks are
    # copied back ahead of use. The prediction was 29 % under the measured peak
    # for a stack of three offloaded LSTM blocks, and a third over for one that stays.
    torch.manual_seed(0)
    model, x = RecurrentStack(), torch.randn(4, 16, 32, requires_grad=True)
    plan = plan_remat(model, (x,), budget=None, peak_budget=0.99, offload=OffloadOptions(prefetch=prefetch, min_bytes=0),
                      profile=FAST_LINK, verify=False)
    def index(offload: bool) -> int:  # the checkpoint saving all three, offloaded or not
        return next(i for i, m in enumerate(plan.table[0])
                    if set(m.option.save) == {"lstm", "norm", "proj"} and m.option.offload == offload)

    resident, moved = index(False), index(True)
    placements = [[moved] * 3] + [[moved if b == k else resident for b in range(3)] for k in range(3)]
    for choices in placements:
        candidate = plan.with_choices(choices)
        measured = _peak_applied(candidate, model, x)
        predicted = candidate.predicted_peak
        if len(candidate.staying_blocks()) == sum(c == moved for c in choices):
            # every offloaded block stays: the plan runs as its resident twin
            assert measured == predicted, (prefetch, choices)
        assert measured <= predicted <= 1.05 * measured, (prefetch, choices, measured, predicted)


class Gated(nn.Module):
    """A GRU block: its cells save gate chunks of one tensor (views with gaps),
    which come back from the host spanning the gaps again."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.gru, self.norm, self.proj = nn.GRU(d, d, batch_first=True), nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(self.gru(x)[0]))


class GatedStack(RecurrentStack):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.blocks = nn.ModuleList(Gated() for _ in range(3))


@pytest.mark.parametrize("placement", [
    # (save set, offloaded) per block; None: no checkpoint
    ((("norm",), False), (("gru",), True), (("gru",), True)),
    ((("gru", "norm", "proj"), False), (("gru", "norm", "proj"), True), (("gru", "norm"), True)),
    ((("gru", "proj"), True), None, (("gru",), True)),
], ids=["resident-then-two-offloaded", "mixed-saves", "offloaded-around-a-plain-block"])
def test_with_prefetch_the_predicted_peak_of_a_gru_stack_is_never_under_the_measured(placement):
    # Three things the prediction missed with prefetch 1, each measured here:
    # copies back of gate chunks span the gaps the host copy left out (139,776 B
    # on the device for 116,224 B moved), and every tensor of a call still held
    # when the backward starts comes back, used or not; an offloaded call's
    # tensors stay on the device until the next offloaded call packs. The
    # prediction was up to 18 % under the measured peak (277,256 B measured,
    # 228,104 B predicted for the first placement).
    torch.manual_seed(0)
    model, x = GatedStack(), torch.randn(4, 16, 32, requires_grad=True)
    plan = plan_remat(model, (x,), budget=None, peak_budget=0.99, offload=OffloadOptions(prefetch=1, min_bytes=0),
                      profile=FAST_LINK, verify=False)

    def index(b: int, chosen: tuple | None) -> int:
        if chosen is None:
            return next(i for i, m in enumerate(plan.table[b]) if not m.option.checkpoint)
        return next(i for i, m in enumerate(plan.table[b])
                    if m.option.checkpoint and sorted(m.option.save) == sorted(chosen[0]) and m.option.offload == chosen[1])

    candidate = plan.with_choices([index(b, c) for b, c in enumerate(placement)])
    assert candidate.staying_blocks() == [2]
    for b in (0, 1):  # the moved blocks' gate chunks come back larger than they left
        if placement[b] is not None and placement[b][1]:
            assert candidate.chosen[b].fetched_bytes > candidate.chosen[b].host_bytes
    measured = _peak_applied(candidate, model, x)
    assert measured <= candidate.predicted_peak <= 1.6 * measured, (measured, candidate.predicted_peak)


def test_copies_back_larger_than_moved_are_forecast_as_measured_and_saved_in_a_format_older_readers_refuse(tmp_path):
    torch.manual_seed(0)
    model, x = GatedStack(), torch.randn(4, 16, 32, requires_grad=True)
    every = OffloadOptions(prefetch=1, min_bytes=0)
    plan = plan_remat(model, (x,), budget=0.5, offload=every, profile=FAST_LINK, verify=False)
    forecast = forecast_remat(model, (x,), budget=0.5, offload=every, profile=FAST_LINK)
    for name, real, fake in zip(plan.blocks, plan.table, forecast.plan.table):
        assert [(m.option, m.host_bytes, m.back_bytes) for m in fake] == [
            (m.option, m.host_bytes, m.back_bytes) for m in real
        ], name
    assert any(m.back_bytes > m.host_bytes for opts in plan.table for m in opts)
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["format"] == 4  # a reader that counts host bytes as the copies back refuses it
    loaded = RematPlan.load(tmp_path / "plan.json")
    assert loaded.table == plan.table and loaded.predicted_peak == plan.predicted_peak
    data["format"] = 5
    with pytest.raises(ValueError, match="format 5 is not one this version reads"):
        RematPlan.from_json(data)


def test_with_prefetch_a_peak_budget_is_planned_and_held_without_a_mismatch():
    # Under-predicted peaks made the verifying run exceed the budget for every plan
    # it tried: PlanMismatchError, where a plan within 0.7 of the peak exists.
    torch.manual_seed(0)
    model, x = RecurrentStack(), torch.randn(4, 16, 32, requires_grad=True)
    reference = _grads(model, x)
    plan = plan_remat(model, (x,), budget=None, peak_budget=0.7, offload=OffloadOptions(prefetch=1, min_bytes=0),
                      profile=FAST_LINK)
    assert plan.measured_peak <= plan.peak_budget_bytes
    plan.apply()
    try:
        assert _independent_step_peak(model, x) <= plan.peak_budget_bytes
        assert all(torch.equal(a, b) for a, b in zip(reference, _grads(model, x)))
    finally:
        remove_remat(model)


def test_a_verified_peak_over_the_budget_is_refused_with_a_planning_error(monkeypatch):
    import torch_remat.integrations.planner.plan as plan_module

    real = plan_module.measure

    def peaks_higher_when_installed(*args, **kwargs):
        got = real(*args, **kwargs)
        if kwargs.get("measuring", True) is False and got.peak_bytes is not None:
            got.peak_bytes += 10**7  # the installed plan peaks far over any prediction
        return got

    monkeypatch.setattr(plan_module, "measure", peaks_higher_when_installed)
    model, x = _model_and_input()
    with pytest.raises(PlanMismatchError, match="over the peak budget"):
        plan_remat(model, (x,), budget=None, peak_budget=0.9, candidates=UP)


def test_when_no_corrected_plan_fits_the_peak_budget_every_block_fully_checkpointed_is_tried(monkeypatch):
    # The corrections follow the offloaded plans' predictions (a model, up to 11 %
    # under on LSTM stacks): where each corrected plan still offloaded and ran over,
    # PlanMismatchError was raised though every block fully checkpointed fits.
    import torch_remat.integrations.planner.plan as plan_module

    real = plan_module.measure

    def only_full_checkpoints_fit(model, args, loss_fn, config, blocks, **kwargs):
        got = real(model, args, loss_fn, config, blocks, **kwargs)
        every_block_full = not config.offloaded and all(config.checkpointed.get(b) == () for b in blocks)
        if kwargs.get("measuring", True) is False and not every_block_full and got.peak_bytes is not None:
            got.peak_bytes += 10**7  # any other installed plan peaks far over
        return got

    monkeypatch.setattr(plan_module, "measure", only_full_checkpoints_fit)
    model, x = _model_and_input()
    reference = _grads(model, x)
    plan = plan_remat(model, (x,), budget=None, peak_budget=0.7, offload=EVERY_TENSOR, profile=SLOW_COMPUTE,
                      candidates=UP)
    assert [o.label for o in plan.options.values()] == ["full checkpoint"] * len(plan.blocks)
    assert plan.measured_peak <= plan.peak_budget_bytes
    plan.apply()
    try:
        assert all(torch.equal(a, b) for a, b in zip(reference, _grads(model, x)))
    finally:
        remove_remat(model)


def test_a_plan_needs_some_budget():
    model, x = _model_and_input()
    with pytest.raises(ValueError, match="budget=None bounds nothing"):
        plan_remat(model, (x,), budget=None)


def test_planning_with_a_calibrated_profile_leaves_the_callers_generators_where_they_were():
    # offload= without profile= calibrates the device; its matmul operands must not
    # come from the default generator, or the training after the plan would draw
    # other dropout masks than without remat.
    model, x = _model_and_input()
    state = torch.default_generator.get_state()
    plan_remat(model, (x,), budget=0.3, offload=EVERY_TENSOR, candidates=UP)
    assert torch.equal(torch.default_generator.get_state(), state)


class _Skipping(Stack):
    """A stack whose forward skips some blocks (a layer dropped, a layer a setting
    turns off)."""

    def __init__(self, skip: tuple[int, ...]) -> None:
        super().__init__(depth=3)
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                x = block(x)
        return x


@pytest.mark.parametrize("planner", ["plan_remat", "forecast_remat"])
def test_a_block_the_forward_never_calls_is_refused_naming_it_and_the_blocks_to_pass(planner):
    # Offloaded, a never-called last block was taken for the last offloaded call
    # (left on the device), so the block really called last was predicted to keep
    # nothing: both planners' verifying runs held 36,868 B against 20,484 B
    # predicted, and for_budget on a plan measured at another budget returned that
    # plan unverified.
    torch.manual_seed(0)
    model, x = _Skipping(skip=(2,)), torch.randn(2, 16, 32)
    plan = functools.partial(plan_remat if planner == "plan_remat" else forecast_remat, model, (x,))
    with pytest.raises(ValueError, match=rf"{planner}: the example forward never called block 'blocks\.2' \(2 of 3"):
        plan(budget=0.3, candidates=UP, offload=EVERY_TENSOR, profile=SLOW_COMPUTE)
    with pytest.raises(ValueError, match=r"layerdrop.*blocks=lambda m: m in \{model\.get_submodule\(n\) for n in \['blocks\.0', 'blocks\.1'\]\}"):
        plan(budget=0.3, candidates=UP)


def test_the_called_blocks_named_by_the_refusal_are_planned_with_offload_as_predicted():
    torch.manual_seed(0)
    model, x = _Skipping(skip=(2,)), torch.randn(2, 16, 32, requires_grad=True)
    called = nn.ModuleList(model.blocks[:2])  # (block 2 gets no gradient)
    reference = _grads_of(model, called, x)
    plan = plan_remat(
        model, (x,), budget=0.3, blocks=lambda m: m in {model.get_submodule(n) for n in ["blocks.0", "blocks.1"]}, candidates=UP,
        offload=EVERY_TENSOR, profile=SLOW_COMPUTE,
    )
    assert any(o.offload for o in plan.options.values())
    assert plan.measured_bytes == plan.predicted_bytes <= plan.budget_bytes
    plan.apply(model)
    try:
        held = activation_bytes(model, (x,), lambda out: out.sum()) - plan.offloader.pool.allocated_bytes
        assert held == plan.predicted_bytes
        for a, b in zip(_grads_of(model, called, x), reference, strict=True):
            assert torch.equal(a, b)
    finally:
        remove_remat(model)


def _grads_of(model: nn.Module, called: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).sum().backward()
    return [p.grad.clone() for p in called.parameters()] + [x.grad.clone()]


def test_a_block_skipped_at_random_in_the_planning_forward_is_refused():
    # layerdrop: the skip is drawn from the generator in the stack's forward
    class LayerDrop(Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                if torch.rand(()) >= 0.5:
                    x = block(x)
            return x

    torch.manual_seed(0)
    model, x = LayerDrop(depth=6), torch.randn(2, 16, 32)
    with pytest.raises(ValueError, match="never called block.*layerdrop"):
        plan_remat(model, (x,), budget=0.3, candidates=UP)


class _Uneven(nn.Module):
    """MLP blocks of four widths (dropout in each): offloaded blocks move unequal
    amounts, and what a move frees on the device is less than what it copies."""

    def __init__(self, d: int = 32, widths: tuple[int, ...] = (16, 128, 48, 200)) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, h), nn.GELU(), nn.Linear(h, d), nn.Dropout(0.1)) for h in widths
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_on_uneven_blocks_copied_back_ahead_the_predicted_peak_is_never_under_the_measured():
    # A block copied back ahead of its backward has all its copies on the device as
    # that backward starts, where the measuring run (prefetch 0) made each at its
    # first use, some after the phase's peak: the prediction was up to 4.4 % under
    # the measured peak (a plan at the lowest peak the planner named ran 3,264 B
    # over it).
    torch.manual_seed(0)
    model, x = _Uneven().train(), torch.randn(2, 12, 32, requires_grad=True)
    plan = plan_remat(model, (x,), budget=None, peak_budget=0.99, offload=EVERY_TENSOR, profile="H100 SXM", verify=False)
    placements = [c for c in _some_placements(plan, 40) if any(plan.table[b][i].option.offload for b, i in enumerate(c))]
    assert len(placements) >= 12
    for choices in placements[:12]:
        candidate = plan.with_choices(choices)
        measured = _peak_applied(candidate, model, x)
        assert measured <= candidate.predicted_peak <= 1.10 * measured, (choices, measured, candidate.predicted_peak)


def test_the_lowest_peak_an_infeasible_budget_names_is_planned_within_it():
    torch.manual_seed(0)
    model, x = _Uneven().train(), torch.randn(2, 12, 32, requires_grad=True)
    torch.manual_seed(1)  # (the dropout's draws)
    reference = _grads(model, x)
    plan = functools.partial(plan_remat, model, (x,), budget=0.6, offload=EVERY_TENSOR, profile="H100 SXM")
    with pytest.raises(InfeasibleBudgetError, match=r"at least ([0-9,]+) B") as error:
        plan(peak_budget=0.5)
    lowest = int(__import__("re").search(r"at least ([0-9,]+) B", str(error.value)).group(1).replace(",", ""))
    chosen = plan(peak_budget=lowest)
    assert chosen.measured_peak <= lowest
    chosen.apply()
    try:
        assert _independent_step_peak(model, x) <= lowest
        torch.manual_seed(1)
        for a, b in zip(_grads(model, x), reference, strict=True):
            assert torch.equal(a, b)
    finally:
        remove_remat(model)


def _some_placements(plan: RematPlan, n: int) -> list[list[int]]:
    import itertools
    import random

    every = [list(c) for c in itertools.product(*[range(len(o)) for o in plan.table])]
    random.Random(0).shuffle(every)
    return every[:n]
