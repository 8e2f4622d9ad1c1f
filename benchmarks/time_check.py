"""Time check: the planner's time model against measured added step time.

For W1's GPT stack at three sizes and each option (no remat, full checkpoint, the
SAVE-region policies, and SAVE policies whose kept tensors the
``ActivationOffloader`` moves to host memory), on the device present:

* **predicted** added step time = recompute time (each checkpoint's replayed aten
  ops, timed in their own run, ``_time.recompute_seconds``) + exposed copy time
  (offloaded bytes per checkpoint call over the calibrated host link, through
  ``_time.exposed_copy_seconds`` with the offloader's prefetch);
* **measured** added step time = step time minus the no-remat step time, median
  over interleaved rounds of the per-round difference (quartiles as the spread).
  On CPU both clocks are the step thread's CPU time (``time.thread_time``, one
  intra-op thread), so other processes on the shared cores do not enter.

Prints per size a table with the ratio predicted/measured and both rankings.

    python -m benchmarks.time_check [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import torch_remat as remat
from benchmarks import modes as M
from benchmarks.gpt import GPTConfig, GPTStack
from benchmarks.measure import preallocate_grads
from integrations.planner import _time
from torch_remat.offload import ActivationOffloader

SIZES = [
    GPTConfig(d_model=128, n_heads=4, seq_len=128, batch=8, n_layers=4, attention_dropout=0.1),
    GPTConfig(d_model=192, n_heads=4, seq_len=192, batch=8, n_layers=4, attention_dropout=0.1),
    GPTConfig(d_model=256, n_heads=4, seq_len=256, batch=8, n_layers=4, attention_dropout=0.1),
]
QUICK_SIZES = [GPTConfig(d_model=64, n_heads=4, seq_len=64, batch=2, n_layers=2, attention_dropout=0.1)]
PREFETCH = 1


@dataclass(frozen=True)
class TimedOption:
    name: str
    mode: M.Mode
    offload: bool = False


OPTIONS = [
    TimedOption("no remat", M.NO_AC),
    TimedOption("full checkpoint", M.REMAT_FULL),
    TimedOption("save linears", M.REMAT_SAVE_LINEARS),
    TimedOption("save matmuls", M.REMAT_SAVE_MATMULS),
    TimedOption("Megatron-style", M.REMAT_MEGATRON),
    TimedOption("save linears + offload", M.REMAT_SAVE_LINEARS, offload=True),
    TimedOption("save matmuls + offload", M.REMAT_SAVE_MATMULS, offload=True),
]


def _install(stack: GPTStack, option: TimedOption, *, rng: bool) -> ActivationOffloader | None:
    M.install(stack, option.mode, rng=rng)
    if not option.offload:
        return None
    offloader = ActivationOffloader(
        1 << 32, prefetch=PREFETCH, min_bytes=0, kinds=tuple(remat.SavedTensorKind), record_events=True
    )
    hooks = (remat.CPURNGStateHook(),) if rng else ()
    stack.block_calls = [
        remat.checkpoint(
            region_name=f"blocks.{i}",
            recompute_state_hooks=hooks,
            rebuild=option.mode.rebuild,
            saved_tensors_hooks=offloader,
        )(b)
        for i, b in enumerate(stack.blocks)
    ]
    return offloader


def _offloaded_bytes_per_call(offloader: ActivationOffloader, n_calls: int) -> list[int]:
    """Bytes one step copied out (its events only), per checkpoint call in forward
    order; the first call of the step is the lowest group ordinal."""
    per: dict[int, int] = {}
    for e in offloader.events or []:
        if e.what == "offload":
            per[e.group] = per.get(e.group, 0) + e.nbytes
    if not per:
        return [0] * n_calls
    first = min(per)
    return [per.get(first + n, 0) for n in range(n_calls)]


def thread_samples(
    steps: dict[str, Callable[[], None]], *, rounds: int, setup: Callable[[str], None]
) -> dict[str, list[float]]:
    """CPU seconds of this thread per step, per option, options interleaved in an
    order rotated every round. The thread's CPU time, not wall time: other
    processes on the shared cores then stretch a step's wall time but not what the
    step itself computes (one intra-op thread: ``main`` sets it)."""
    names = list(steps)
    out: dict[str, list[float]] = {n: [] for n in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                setup(name)
                t0 = time.thread_time()
                steps[name]()
                out[name].append(time.thread_time() - t0)
            gc.collect()
    finally:
        gc.enable()
    return out


@dataclass
class Row:
    name: str
    recompute_s: float
    copy_s: float
    offloaded_bytes: int
    measured_s: float
    spread: tuple[float, float]

    @property
    def predicted_s(self) -> float:
        return self.recompute_s + self.copy_s


def check_size(cfg: GPTConfig, profile: _time.DeviceProfile, rounds: int) -> list[Row]:
    torch.manual_seed(0)
    stack = GPTStack(cfg)
    x = stack.example_input()
    preallocate_grads(stack, x)
    rng = cfg.attention_dropout > 0

    def step() -> None:
        stack(x).sum().backward()

    predicted: dict[str, tuple[float, float, int]] = {}
    for option in OPTIONS:
        offloader = _install(stack, option, rng=rng)
        step()  # warm up
        recompute = sum(_time.recompute_seconds(step, repeats=3).values())
        copy_s, moved = 0.0, 0
        if offloader is not None:
            offloader.events.clear()
            step()
            out = _offloaded_bytes_per_call(offloader, cfg.n_layers)
            moved = sum(out)
            zeros = [0.0] * cfg.n_layers
            copy = [profile.copy_seconds(b) for b in out]
            copy_s = _time.exposed_copy_seconds(
                zeros, zeros, copy, copy, prefetch=PREFETCH, overlap=profile.overlap_copies
            )
        predicted[option.name] = (recompute, copy_s, moved)

    by_name = {o.name: o for o in OPTIONS}
    installed: dict[str, Callable] = {}

    def setup(name: str) -> None:
        if name not in installed:
            _install(stack, by_name[name], rng=rng)
            installed[name] = list(stack.block_calls)
        for b in stack.blocks:
            b.set_policy(by_name[name].mode.policy)
        stack.block_calls = installed[name]

    samples = thread_samples({o.name: step for o in OPTIONS}, rounds=rounds, setup=setup)
    base = samples["no remat"]
    rows = []
    for option in OPTIONS:
        diffs = [a - b for a, b in zip(samples[option.name], base)]
        q = statistics.quantiles(diffs, n=4)
        recompute, copy_s, moved = predicted[option.name]
        rows.append(Row(option.name, recompute, copy_s, moved, statistics.median(diffs), (q[0], q[2])))
    return rows


def report(cfg: GPTConfig, rows: list[Row], step_s: float | None = None) -> tuple[bool, bool, float]:
    print(
        f"\nd={cfg.d_model} s={cfg.seq_len} b={cfg.batch} layers={cfg.n_layers}"
        + (f"  (no-remat step {step_s * 1e3:.1f} ms)" if step_s else "")
    )
    print(
        f"{'option':26} {'recompute ms':>12} {'copy ms':>8} {'pred ms':>8} {'meas ms':>8}"
        f" {'meas q1..q3 ms':>16} {'pred/meas':>9} {'offloaded':>10}"
    )
    worst = 0.0
    for r in rows:
        ratio = r.predicted_s / r.measured_s if r.measured_s > 0 else float("nan")
        if r.name != "no remat":
            worst = max(worst, abs(ratio - 1) if ratio == ratio else 1.0)
        print(
            f"{r.name:26} {r.recompute_s * 1e3:12.2f} {r.copy_s * 1e3:8.2f} {r.predicted_s * 1e3:8.2f}"
            f" {r.measured_s * 1e3:8.2f} {r.spread[0] * 1e3:7.2f}..{r.spread[1] * 1e3:7.2f}"
            f" {ratio:9.3f} {r.offloaded_bytes:10d}"
        )
    pred_rank = _time.ranking({r.name: r.predicted_s for r in rows})
    meas_rank = _time.ranking({r.name: r.measured_s for r in rows})
    same = pred_rank == meas_rank
    print("predicted ranking:", " < ".join(pred_rank))
    print("measured ranking: ", " < ".join(meas_rank))
    print(f"rankings equal: {same}; worst |pred/meas - 1| = {worst:.3f} (within 15 %: {worst <= 0.15})")
    return same, worst <= 0.15, worst


def main(argv: list[str] | None = None) -> int:
    # One intra-op thread: the cores are shared, and a step's time then depends less
    # on what else runs.
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="one tiny size, for a smoke run")
    args = p.parse_args(argv)
    profile = _time.calibrate("cpu")
    print(
        f"profile {profile.name}: float32 {profile.flops['float32'] / 1e9:.1f} GFLOP/s, memory "
        f"{profile.memory_bandwidth / 1e9:.2f} GB/s, host link {profile.host_link_bandwidth / 1e9:.2f} GB/s,"
        f" copies overlap compute: {profile.overlap_copies}"
    )
    ok = True
    for cfg in QUICK_SIZES if args.quick else SIZES:
        rows = check_size(cfg, profile, args.rounds)
        same, within, _ = report(cfg, rows)
        ok = ok and same and within
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
