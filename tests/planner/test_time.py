"""The time model's logic: copy overlap arithmetic, rankings, the profile table,
calibration, per-checkpoint recompute and overhead timing, the added-time
estimator (no timed assertions)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import recorded_replays

import torch_remat as remat
from torch_remat.integrations.planner import _time


def test_synchronous_copies_are_all_exposed_except_the_last_k_calls():
    # three calls, prefetch 1: calls 0 and 1 move, out and back
    assert _time.exposed_copy_seconds(
        [1, 1, 1], [2, 2, 2], [3, 3, 3], prefetch=1, overlap=False
    ) == pytest.approx(12)
    assert _time.exposed_copy_seconds(
        [1, 1, 1], [2, 2, 2], [3, 3, 3], prefetch=3, overlap=False
    ) == 0


def test_overlapped_copies_are_exposed_only_beyond_the_compute_they_hide_behind():
    # copies shorter than the compute between issue and use: all hidden
    assert _time.exposed_copy_seconds([1, 1, 1], [2, 2, 2], [0.5] * 3, prefetch=1) == 0
    # copies of 3 s behind 1 s forward and 2 s backward calls, one copy stream:
    # out 1..4, 4..7; back 7..10 (call 1, needed at 5), 10..13 (call 0, needed at 12)
    assert _time.exposed_copy_seconds([1, 1, 1], [2, 2, 2], [3, 3, 3], prefetch=1) == pytest.approx(6)


def test_a_longer_prefetch_distance_hides_more():
    fwd, bwd, copy = [1.0] * 6, [2.0] * 6, [2.5] * 6
    exposed = [_time.exposed_copy_seconds(fwd, bwd, copy, prefetch=k) for k in (0, 1, 2)]
    assert exposed[0] > exposed[1] > exposed[2]


def test_copy_lists_must_match_the_calls():
    with pytest.raises(ValueError, match="one entry per checkpoint call"):
        _time.exposed_copy_seconds([1, 1], [1], [1, 1], prefetch=1)


def test_ranking_orders_by_added_time():
    assert _time.ranking({"full": 3.0, "none": 0.0, "save": 1.5}) == ["none", "save", "full"]


@pytest.mark.parametrize("name", sorted(_time.PROFILES))
def test_published_profiles_are_consistent_and_cite_their_sources(name):
    p = _time.PROFILES[name]
    assert p.name == name
    for key in ("flops", "memory_bandwidth", "host_link_bandwidth", "memory_bytes"):
        assert p.sources[key].startswith("https://"), key
    assert p.peak_flops(torch.bfloat16) > p.peak_flops(torch.float32) > 0
    assert p.memory_bandwidth > p.host_link_bandwidth > 0
    assert p.memory_bytes >= 24e9 and p.overlap_copies
    # roofline: a matmul-heavy op is compute bound, a copy memory bound
    assert p.compute_seconds(1e12, 1e6, "bfloat16") == pytest.approx(1e12 / p.flops["bfloat16"])
    assert p.compute_seconds(1, 1e9, "bfloat16") == pytest.approx(1e9 / p.memory_bandwidth)


def test_a_profile_without_the_dtype_says_which_it_has():
    with pytest.raises(KeyError, match="float64.*bfloat16"):
        _time.PROFILES["H100 SXM"].peak_flops(torch.float64)


def test_calibration_returns_positive_finite_figures():
    p = _time.calibrate("cpu", matmul_size=64, copy_bytes=1 << 16, repeats=2)
    figures = [p.flops["float32"], p.memory_bandwidth, p.host_link_bandwidth]
    assert all(math.isfinite(f) and f > 0 for f in figures)
    assert not p.overlap_copies  # CPU copies into the pool are synchronous
    assert set(p.sources) == {"flops", "memory_bandwidth", "host_link_bandwidth"}


def _stack(checkpointed: bool):
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2)]
    calls = [
        remat.checkpoint(region_name=f"layers.{i}")(m) if checkpointed else m for i, m in enumerate(layers)
    ]
    x = torch.randn(4, 8, requires_grad=True)

    def step():
        h = x
        for c in calls:
            h = c(h)
        h.sum().backward()

    return step


def test_recompute_time_is_attributed_to_each_checkpoint_and_nothing_without_remat():
    timed = _time.recompute_seconds(_stack(True), repeats=1)
    assert set(timed) == {"layers.0", "layers.1"}
    assert all(s > 0 for s in timed.values())
    assert _time.recompute_seconds(_stack(False), repeats=1) == {}


def test_the_forecast_table_shows_each_policys_predicted_added_time_on_a_profile():
    from benchmarks.gpt import GPTConfig, GPTStack
    from torch_remat.integrations.planner import forecast_remat

    torch.manual_seed(0)
    stack = GPTStack(GPTConfig(d_model=32, n_heads=4, seq_len=32, batch=2, n_layers=2))
    x = stack.example_input()
    forecast = forecast_remat(stack, x, budget=0.3, candidates=["qkv", "fc1", "fc2"], profile="H100 SXM")
    h100 = _time.PROFILES["H100 SXM"]
    assert forecast.profile is h100 and forecast.dtype == torch.float32
    table = forecast.format(by_block=False)
    assert "predicted added time (H100 SXM)" in table
    # the hand policies stay in the table, each with its predicted time
    assert {"no remat", "full checkpoint", "save linears", "plan"} <= set(forecast.policies)
    for p in forecast.policies.values():
        seconds = p.predicted_seconds(h100, torch.float32)
        assert seconds == p.flops / h100.flops["float32"]
        line = next(line for line in table.splitlines() if line.strip().startswith(p.name + " "))
        assert f"{seconds * 1e3:,.3f} ms" in line
    assert forecast.policies["no remat"].predicted_seconds(h100, "float32") == 0
    assert forecast.policies["full checkpoint"].predicted_seconds(h100, "float32") > 0
    with pytest.raises(ValueError, match="no device profile 'H1000'"):
        forecast_remat(stack, x, budget=0.3, profile="H1000")


def test_checkpoint_cost_is_its_forward_plus_its_backward():
    cost = _time.CheckpointCost(forward=0.25, backward=1.5)
    assert cost.seconds == pytest.approx(1.75)


def test_added_step_time_is_each_options_quantile_minus_the_baselines():
    samples = {"none": [3.0, 1.0, 2.0], "full": [5.0, 4.0, 9.0], "save": [2.5, 1.5, 3.5]}
    # default: the minimum (the least-disturbed step of each)
    assert _time.added_step_seconds(samples, "none") == pytest.approx({"none": 0, "full": 3, "save": 0.5})
    # quantiles interpolate between order statistics: the median, and a quarter
    assert _time.added_step_seconds(samples, "none", quantile=0.5) == pytest.approx(
        {"none": 0, "full": 3, "save": 0.5}
    )
    assert _time.added_step_seconds(samples, "none", quantile=0.25)["full"] == pytest.approx(4.5 - 1.5)
    with pytest.raises(ValueError, match="quantile"):
        _time.added_step_seconds(samples, "none", quantile=1.5)
    with pytest.raises(KeyError, match="baseline"):
        _time.added_step_seconds(samples, "sac")


def test_the_fastest_mean_averages_the_fastest_fraction_of_the_runs():
    runs = [5.0, 1.0, 9.0, 2.0, 3.0, 7.0, 4.0, 8.0, 6.0, 10.0]
    assert _time.fastest_mean(runs) == 1.0  # the minimum
    assert _time.fastest_mean(runs, 0.2) == pytest.approx(1.5)  # 1 and 2
    assert _time.fastest_mean(runs, 0.25) == pytest.approx(2.0)  # a fraction rounds up: 1, 2, 3
    assert _time.fastest_mean(runs, 1.0) == pytest.approx(5.5)
    assert _time.fastest_mean([4.0], 0.2) == 4.0  # at least one run
    with pytest.raises(ValueError, match="fraction"):
        _time.fastest_mean(runs, -0.1)
    with pytest.raises(ValueError, match="no samples"):
        _time.fastest_mean([], 0.2)
    samples = {"none": runs, "full": [x + 3 for x in runs]}
    added = _time.added_step_seconds(samples, "none", fastest=0.2)
    assert added == pytest.approx({"none": 0.0, "full": 3.0})
    with pytest.raises(ValueError, match="not both"):
        _time.added_step_seconds(samples, "none", fastest=0.2, quantile=0.5)


def test_rankings_agree_on_every_pair_the_measurement_tells_apart():
    measured = {"full": 14.3, "save linears": 12.95, "save matmuls": 13.16, "megatron": 12.37}
    predicted = {"full": 14.5, "save linears": 13.75, "save matmuls": 13.46, "megatron": 12.33}
    # strictly, save linears and save matmuls are swapped
    assert not _time.rankings_agree(predicted, measured, 0.0)
    # they lie 0.21 apart: within a resolution of 0.3 either order agrees
    assert _time.rankings_agree(predicted, measured, 0.3)
    # but a pair the measurement does tell apart must keep its order
    swapped = dict(predicted, full=12.0)
    assert not _time.rankings_agree(swapped, measured, 0.3)
    assert _time.rankings_agree(measured, measured, 0.0)
    with pytest.raises(ValueError, match="options differ"):
        _time.rankings_agree({"full": 1.0}, measured, 0.3)


def test_checkpoint_overhead_is_measured_per_checkpoint_for_a_tiny_model():
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2)]
    calls = {
        f"layers.{i}": (m, remat.checkpoint(region_name=f"layers.{i}")(m)) for i, m in enumerate(layers)
    }
    inputs = {name: torch.randn(4, 8) for name in calls}
    flushed = []
    between = {"layers.0": lambda: flushed.append(1)}
    with recorded_replays() as replayed:
        costs = _time.checkpoint_overhead_seconds(calls, inputs, repeats=2, between=between)
    assert set(costs) == {"layers.0", "layers.1"}
    # the backward measured is the checkpoint's: each run (a warm-up, 2 repeats) replays it
    assert replayed == ["layers.0"] * 3 + ["layers.1"] * 3
    for cost in costs.values():
        assert isinstance(cost, _time.CheckpointCost)
        assert math.isfinite(cost.forward) and math.isfinite(cost.backward)
        assert cost.seconds == cost.forward + cost.backward
    # run between forward and backward, for both calls: a warm-up each and 2 repeats each
    assert len(flushed) == 2 + 2 * 2
    # the inputs stay as they were (each run gets a fresh leaf)
    assert all(not x.requires_grad and x.grad is None for x in inputs.values())


def test_a_warm_overhead_runs_each_timed_forward_after_an_untimed_one_of_the_same_call():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    entered: list[str] = []
    calls = {"layers.0": (_counted(layer, "plain", entered), _counted(remat.checkpoint()(layer), "remat", entered))}
    inputs = {"layers.0": torch.randn(4, 8)}
    with recorded_replays() as replayed:
        _time.checkpoint_overhead_seconds(calls, inputs, repeats=2, warm=True)
    # every run (a warm-up, 2 repeats) of each call is a forward after one of its own
    assert entered.count("plain") == entered.count("remat") == 2 * 3
    assert all(entered[i] == entered[i + 1] for i in range(0, len(entered), 2))
    # the untimed forward's graph is dropped: only the timed ones are replayed
    assert len(replayed) == 3
    entered.clear()
    _time.checkpoint_overhead_seconds(calls, inputs, repeats=2)
    assert entered.count("plain") == entered.count("remat") == 3


def test_an_overhead_with_history_hands_each_call_an_intermediate_result_as_a_later_block_receives():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    got: list[torch.Tensor] = []

    def seen(fn):
        def call(x):
            got.append(x)
            return fn(x)

        return call

    calls = {"layers.0": (seen(layer), seen(remat.checkpoint()(layer)))}
    inputs = {"layers.0": torch.randn(4, 8)}
    with recorded_replays() as replayed:
        _time.checkpoint_overhead_seconds(calls, inputs, repeats=2, history=True)
    assert len(got) == 2 * 3 and len(replayed) == 3
    # a tensor with autograd history, not a leaf, equal to the input given
    assert all(x.requires_grad and x.grad_fn is not None and torch.equal(x, inputs["layers.0"]) for x in got)
    got.clear()
    _time.checkpoint_overhead_seconds(calls, inputs, repeats=2)
    assert all(x.requires_grad and x.grad_fn is None for x in got)


def _counted(fn, label: str, entered: list[str]):
    def call(x):
        entered.append(label)
        return fn(x)

    return call


def test_a_cache_flush_rewrites_its_buffer():
    flush = _time.CacheFlush(1 << 10)
    flush()
    first = int(flush.buffer[0])
    flush()
    assert flush.buffer.numel() == 1 << 10 and int(flush.buffer[0]) == (first + 1) % 256
