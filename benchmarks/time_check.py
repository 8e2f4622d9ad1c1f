"""Time check: the planner's time model against measured added step time.

For W1's GPT stack at three sizes and each option (no remat, full checkpoint, the
SAVE-region policies, and SAVE policies whose kept tensors the
``ActivationOffloader`` moves to host memory), on the device present:

* **predicted** added step time, from measured parts: per checkpoint, what its call
  adds over the same block called plainly (``_time.checkpoint_overhead_seconds``:
  each block alone on its input from a plain forward, forward then backward, the
  least of ``--repeats`` runs of each; the first block's forward as the step's
  first, after a backward, each later block's after an untimed forward of its own,
  as in the step where it follows the forward of the block before it; ``--flush-mib`` evicts the caches between a
  block's forward and backward, default off), summed over the checkpoints, plus the
  exposed copy time (offloaded bytes per checkpoint call over the calibrated host
  link, ``_time.exposed_copy_seconds`` with the offloader's prefetch). A block
  alone is the last call of its step, which prefetch 1 keeps resident, so its
  parts hold the offloader's bookkeeping and no copies.
* **measured** added step time: whole steps, the options interleaved in an order
  rotated every round (``--rounds``), each on its own copy of the stack installed
  once, the garbage collector off;
  ``_time.added_step_seconds``: the mean of the option's fastest fifth of steps
  minus no remat's (the least-disturbed steps: on a shared machine other work only
  adds; a fifth moves less between runs than the minimum, ``--fastest 0``).
  The 25 % quantile's difference is printed beside it.

On CPU every clock is the thread's CPU time (``time.thread_time``, one intra-op
thread), so other processes on the shared cores do not enter, and glibc's malloc is
told to keep freed memory (``keep_freed_memory``; ``--system-malloc`` leaves it at
its defaults, under which no remat, holding the most, page-faults its activations
back in every step).

Prints per size a table with the ratio predicted/measured, both rankings, and
whether the size meets the bar: every option within 15 % and the rankings equal.
Options whose measured added times lie closer than the measurement resolves (the
largest disagreement between the even and the odd rounds) are ordered by noise:
the check also says whether the rankings agree on every pair it does tell apart.

    python -m benchmarks.time_check [--rounds N] [--repeats N] [--flush-mib N] [--quick] [--system-malloc]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
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
from torch_remat.integrations.planner import _time
from torch_remat.offload import ActivationOffloader

SIZES = [
    GPTConfig(d_model=64, n_heads=4, seq_len=64, batch=4, n_layers=4, attention_dropout=0.1),
    GPTConfig(d_model=96, n_heads=4, seq_len=96, batch=4, n_layers=4, attention_dropout=0.1),
    GPTConfig(d_model=128, n_heads=4, seq_len=128, batch=4, n_layers=4, attention_dropout=0.1),
]
QUICK_SIZES = [GPTConfig(d_model=64, n_heads=4, seq_len=64, batch=2, n_layers=2, attention_dropout=0.1)]
PREFETCH = 1
FASTEST = 0.2
"""A whole step's time is the mean of the fastest fifth of its rounds
(``_time.fastest_mean``): a step of 10 to 60 ms is rarely undisturbed on shared cores."""


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
    forward_s: float
    """Per-checkpoint forward overheads, summed over the step's checkpoints."""
    backward_s: float
    """Per-checkpoint backward overheads (the replay included), summed."""
    copy_s: float
    offloaded_bytes: int
    measured_s: float
    measured_halves_s: tuple[float, float]
    """The same from the even rounds and from the odd rounds."""

    @property
    def predicted_s(self) -> float:
        return self.forward_s + self.backward_s + self.copy_s


def block_inputs(stack: GPTStack, x: torch.Tensor) -> list[torch.Tensor]:
    """The tensor each block receives in a plain forward (no graph)."""
    out = []
    with torch.no_grad():
        h = x
        for b in stack.blocks:
            out.append(h.clone())
            h = b(h)
    return out


def check_size(
    cfg: GPTConfig, profile: _time.DeviceProfile, rounds: int, repeats: int, flush_bytes: int = 0,
    bursts: int = 5, fastest: float = FASTEST,
) -> tuple[list[Row], float]:
    torch.manual_seed(0)
    stack = GPTStack(cfg)
    x = stack.example_input()
    preallocate_grads(stack, x)
    rng = cfg.attention_dropout > 0
    M.install(stack, M.NO_AC, rng=rng)
    # Plain copies of the blocks (same weights, no regions): what each checkpoint
    # call is compared with, apart from the stack whose policy the options set.
    plain = [copy.deepcopy(b) for b in stack.blocks]
    inputs = block_inputs(stack, x)

    def step() -> None:
        stack(x).sum().backward()

    # In the step, the other blocks run between a block's forward and its backward
    # (all but the last); with flush_bytes, a flush stands in for their cache traffic.
    between = None
    if flush_bytes:
        flush = _time.CacheFlush(flush_bytes)
        between = {f"blocks.{i}": flush for i in range(cfg.n_layers - 1)}

    # Predicted: measured in parts, per checkpoint (each block called alone), in
    # `bursts` bursts spread over the whole-step rounds; each part is the median of
    # its bursts (a burst disturbed by other work on the shared cores is outvoted).
    def measure_parts() -> dict[str, tuple[float, float, float, int]]:
        got: dict[str, tuple[float, float, float, int]] = {}
        for option in OPTIONS:
            got[option.name] = parts_of(option)
        return got

    def parts_of(option: TimedOption) -> tuple[float, float, float, int]:
        offloader = _install(stack, option, rng=rng)
        if option.mode.kind == "none":
            return (0.0, 0.0, 0.0, 0)
        step()  # warm up
        # The first checkpoint of a step runs after a backward, the others after the
        # forward of the one before them (``warm``).
        parts = {f"blocks.{i}": (plain[i], call) for i, call in enumerate(stack.block_calls)}
        part_inputs = {f"blocks.{i}": h for i, h in enumerate(inputs)}
        first = {"blocks.0": parts.pop("blocks.0")}
        # A part (a block's forward or backward, 1 to 10 ms) is often undisturbed:
        # its least run.
        costs = _time.checkpoint_overhead_seconds(first, part_inputs, repeats=repeats, between=between)
        # (and receives the block before's output, an intermediate result, where the
        # first receives the step's leaf input)
        costs |= _time.checkpoint_overhead_seconds(
            parts, part_inputs, repeats=repeats, between=between, warm=True, history=True
        )
        fwd = sum(c.forward for c in costs.values())
        bwd = sum(c.backward for c in costs.values())
        copy_s, moved = 0.0, 0
        if offloader is not None:
            # Alone, a call is the last of its step and keeps its tensors (prefetch
            # 1), so the parts above hold the offloader's bookkeeping, not copies.
            offloader.events.clear()
            step()
            out = _offloaded_bytes_per_call(offloader, cfg.n_layers)
            moved = sum(out)
            zeros = [0.0] * cfg.n_layers
            copies = [profile.copy_seconds(b) for b in out]
            copy_s = _time.exposed_copy_seconds(
                zeros, zeros, copies, copies, prefetch=PREFETCH, overlap=profile.overlap_copies
            )
        return (fwd, bwd, copy_s, moved)

    # Measured: whole steps, options interleaved. Each option steps its own copy of
    # the stack (same weights), installed once, as a training loop runs one
    # configuration: switching one stack's policy every round rebinds the blocks'
    # attributes, so each checkpoint's first call of the step found its module-state
    # capture stale and walked the modules again (0.3 to 0.7 ms per step at d=64,
    # which no steady-state step spends and the parts do not include).
    stepped: dict[str, Callable[[], None]] = {}
    for option in OPTIONS:
        own = copy.deepcopy(stack)
        preallocate_grads(own, x)
        _install(own, option, rng=rng)
        stepped[option.name] = (lambda own=own: own(x).sum().backward())

    samples: dict[str, list[float]] = {o.name: [] for o in OPTIONS}
    burst_parts = []
    for b in range(bursts):
        burst_parts.append(measure_parts())
        chunk = rounds // bursts + (1 if b < rounds % bursts else 0)
        for name, xs in thread_samples(stepped, rounds=chunk, setup=lambda name: None).items():
            samples[name].extend(xs)
    predicted = {
        o.name: tuple(statistics.median(p[o.name][i] for p in burst_parts) for i in range(3))
        + (burst_parts[-1][o.name][3],)
        for o in OPTIONS
    }
    added = _time.added_step_seconds(samples, "no remat", fastest=fastest)
    halves = [
        _time.added_step_seconds({n: xs[h::2] for n, xs in samples.items()}, "no remat", fastest=fastest)
        for h in (0, 1)
    ]
    rows = [
        Row(
            o.name, *predicted[o.name][:3], predicted[o.name][3], added[o.name],
            (halves[0][o.name], halves[1][o.name]),
        )
        for o in OPTIONS
    ]
    return rows, min(samples["no remat"])


def report(cfg: GPTConfig, rows: list[Row], step_s: float | None = None) -> tuple[bool, bool, float]:
    """Prints the size's table and verdicts; returns (rankings agree where the
    measurement tells options apart, every option within 15 %, the worst error)."""
    print(
        f"\nd={cfg.d_model} s={cfg.seq_len} b={cfg.batch} layers={cfg.n_layers}"
        + (f"  (no-remat step {step_s * 1e3:.1f} ms)" if step_s else "")
    )
    print(
        f"{'option':26} {'fwd ms':>7} {'bwd ms':>7} {'copy ms':>7} {'pred ms':>8} {'meas ms':>8}"
        f" {'pred/meas':>9} {'halves ms':>13} {'offloaded':>10}"
    )
    worst = 0.0
    for r in rows:
        ratio = r.predicted_s / r.measured_s if r.measured_s > 0 else float("nan")
        if r.name != "no remat":
            worst = max(worst, abs(ratio - 1) if ratio == ratio else 1.0)
        h0, h1 = r.measured_halves_s
        print(
            f"{r.name:26} {r.forward_s * 1e3:7.2f} {r.backward_s * 1e3:7.2f} {r.copy_s * 1e3:7.2f}"
            f" {r.predicted_s * 1e3:8.2f} {r.measured_s * 1e3:8.2f} {ratio:9.3f}"
            f" {h0 * 1e3:6.2f} {h1 * 1e3:6.2f} {r.offloaded_bytes:10d}"
        )
    predicted = {r.name: r.predicted_s for r in rows}
    measured = {r.name: r.measured_s for r in rows}
    # What the measurement can tell apart: the most the even and the odd rounds
    # disagree on any option's added time.
    resolution = max(abs(r.measured_halves_s[0] - r.measured_halves_s[1]) for r in rows)
    strict = _time.rankings_agree(predicted, measured, 0.0)
    resolved = _time.rankings_agree(predicted, measured, resolution)
    print("predicted ranking:", " < ".join(_time.ranking(predicted)))
    print("measured ranking: ", " < ".join(_time.ranking(measured)))
    within = worst <= 0.15
    print(
        f"rankings equal: {strict}; equal where options lie more than {resolution * 1e3:.2f} ms apart"
        f" (the halves' largest disagreement): {resolved}; worst |pred/meas - 1| = {worst:.3f}"
        f" (within 15 %: {within}); bar met: {strict and within}"
        + ("" if strict or not (resolved and within) else "; met up to the measurement's ties")
    )
    return resolved, within, worst


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse (as PyTorch's CUDA caching
    allocator does on a GPU): a fixed mmap threshold of 32 MiB (its largest) and no
    trimming. With its defaults, freed blocks go back to the OS, and a step holding
    more than the previous one freed page-faults them in again: an allocator cost
    the time model leaves out, larger the more memory an option holds. False where
    there is no glibc ``mallopt``."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return bool(
        mallopt(m_mmap_threshold, 32 << 20) and mallopt(m_trim_threshold, 1 << 30) and mallopt(m_top_pad, 64 << 20)
    )


def main(argv: list[str] | None = None) -> int:
    # One intra-op thread: the cores are shared, and a step's time then depends less
    # on what else runs.
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=60, help="interleaved rounds of whole steps")
    p.add_argument("--repeats", type=int, default=13, help="repeats of each checkpoint's parts")
    p.add_argument("--bursts", type=int, default=5, help="bursts of parts spread over the rounds (median)")
    p.add_argument(
        "--flush-mib", type=int, default=0, help="flush this many MiB between a block's forward and backward"
    )
    p.add_argument(
        "--fastest", type=float, default=FASTEST,
        help="a step's time is the mean of this fraction of its fastest rounds (0: the minimum)",
    )
    p.add_argument("--quick", action="store_true", help="one tiny size, for a smoke run")
    p.add_argument(
        "--system-malloc", action="store_true", help="leave glibc's malloc at its defaults (see keep_freed_memory)"
    )
    args = p.parse_args(argv)
    kept = False if args.system_malloc else keep_freed_memory()
    print(f"malloc keeps freed memory: {kept}")
    profile = _time.calibrate("cpu")
    print(
        f"profile {profile.name}: float32 {profile.flops['float32'] / 1e9:.1f} GFLOP/s, memory "
        f"{profile.memory_bandwidth / 1e9:.2f} GB/s, host link {profile.host_link_bandwidth / 1e9:.2f} GB/s,"
        f" copies overlap compute: {profile.overlap_copies}"
    )
    ok = True
    for cfg in QUICK_SIZES if args.quick else SIZES:
        rows, step_s = check_size(
            cfg, profile, args.rounds, args.repeats, args.flush_mib << 20, args.bursts, args.fastest
        )
        resolved, within, _ = report(cfg, rows, step_s)
        ok = ok and resolved and within
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
