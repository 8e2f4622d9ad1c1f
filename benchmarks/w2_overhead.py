"""W2: an overhead-bound stack, where per-op Python cost decides the step time.

12 tiny blocks (d=64, s=16) on one thread: each aten op does almost no arithmetic,
so the time a checkpointing mode spends per op in Python shows directly. SAC runs
a ``TorchDispatchMode`` that sees every aten op in forward and recompute;
torch_remat has no dispatch mode, only saved-tensor hooks and one Python call per
region. Each SAVE-region mode is paired with the SAC mode that saves the same
matmuls, so both do the same arithmetic (checked by the FLOP counts).

The model has no dropout, so ``torch.utils.checkpoint``/SAC run with
``preserve_rng_state=False`` and remat with no state hooks: neither side copies RNG
state it does not need.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from benchmarks import modes as M
from benchmarks.gpt import GPTConfig, GPTStack
from benchmarks.measure import measure_step, preallocate_grads, time_ratio, time_samples
from benchmarks.report import Check, Table, WorkloadResult

FULL = GPTConfig(d_model=64, n_heads=4, seq_len=16, batch=4, n_layers=12)
QUICK = GPTConfig(d_model=16, n_heads=2, seq_len=8, batch=2, n_layers=3)
THREADS = 1
ROUNDS = 20
STEPS_PER_SAMPLE = 3

MODES = [
    M.NO_AC,
    M.TORCH_CHECKPOINT,
    M.REMAT_FULL,
    M.SAC_MATMULS,
    M.REMAT_SAVE_MATMULS,
    M.SAC_LINEARS,
    M.REMAT_SAVE_LINEARS,
    M.REMAT_SAVE_MATMULS_KEEP,
    M.REMAT_SAVE_LINEARS_KEEP,
]
# (mode, peer, bound): the targets on the step-time ratio.
TIME_TARGETS = [
    (M.REMAT_FULL, M.TORCH_CHECKPOINT, 1.10),
    (M.REMAT_SAVE_MATMULS, M.SAC_MATMULS, 0.6),
    (M.REMAT_SAVE_LINEARS, M.SAC_LINEARS, 0.6),
]
# (mode, peer, bound): what rebuilding saves of replayed arguments costs in time
# (a longer replay and its bookkeeping) against keeping them: at most 3 % aimed.
REBUILD_COSTS = [
    (M.REMAT_SAVE_MATMULS, M.REMAT_SAVE_MATMULS_KEEP, 1.03),
    (M.REMAT_SAVE_LINEARS, M.REMAT_SAVE_LINEARS_KEEP, 1.03),
]


def run(quick: bool) -> WorkloadResult:
    cfg = QUICK if quick else FULL
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    stack = GPTStack(cfg)
    x = stack.example_input()
    preallocate_grads(stack, x)
    by_name = {m.name: m for m in MODES}

    def forward() -> torch.Tensor:
        return stack(x).sum()

    def step() -> None:
        forward().backward()

    counts, byte_results = {}, {}
    for mode in MODES:
        M.install(stack, mode, rng=False)
        counts[mode.name], byte_results[mode.name] = measure_step(forward)

    times = {}
    if not quick:
        samples = time_samples(
            {m.name: step for m in MODES},
            rounds=ROUNDS,
            steps_per_sample=STEPS_PER_SAMPLE,
            setup=lambda name: M.install(stack, by_name[name], rng=False),
        )
        times = {m.name: time_ratio(samples, m.name, M.TORCH_CHECKPOINT.name) for m in MODES}
        pair_times = {
            (m.name, p.name): time_ratio(samples, m.name, p.name)
            for m, p, _ in TIME_TARGETS + REBUILD_COSTS
        }

    columns = ["mode", "FLOPs step", "aten ops step", "live after fwd (B)"]
    if times:
        columns += ["step (ms)", "time / torch.ckpt [q1, q3]"]
    rows = []
    for m in MODES:
        c, b = counts[m.name], byte_results[m.name]
        row = [m.name, c.flops_step, c.ops_step, b.live_after_forward]
        if times:
            t = times[m.name]
            row += [1e3 * t.median_step_s, f"{t.ratio:.3f} [{t.ratio_low:.2f}, {t.ratio_high:.2f}]"]
        rows.append(row)
    tables = [
        Table(
            f"W2 overhead-bound: {cfg.n_layers} blocks, d={cfg.d_model} s={cfg.seq_len} "
            f"batch={cfg.batch} heads={cfg.n_heads}, {THREADS} thread",
            columns,
            rows,
            [f"{m.name}: {m.description}" for m in MODES],
        )
    ]

    checks = []
    for mode, peer, _ in TIME_TARGETS:
        a, b = counts[mode.name], counts[peer.name]
        checks.append(
            Check(
                f"{mode.name} does the same matmul FLOPs as {peer.name} (fair time pair)",
                "flops",
                f"{a.flops_step:,} vs {b.flops_step:,}",
                a.flops_step == b.flops_step,
            )
        )
    for mode, peer, _ in REBUILD_COSTS:
        a, b = counts[mode.name], counts[peer.name]
        ab, bb = byte_results[mode.name].live_after_forward, byte_results[peer.name].live_after_forward
        checks.append(
            Check(
                f"{mode.name} holds fewer bytes than {peer.name}, for the same FLOPs",
                "bytes",
                f"live after fwd {ab:,} vs {bb:,}; FLOPs {a.flops_step:,} vs {b.flops_step:,}",
                ab < bb and a.flops_step == b.flops_step,
            )
        )
    if times:
        pair_rows = []
        for mode, peer, bound in TIME_TARGETS + REBUILD_COSTS:
            t = pair_times[(mode.name, peer.name)]
            pair_rows.append(
                [
                    f"{mode.name} / {peer.name}",
                    f"{t.ratio:.3f}",
                    f"[{t.ratio_low:.3f}, {t.ratio_high:.3f}]",
                    f"<= {bound}",
                ]
            )
            checks.append(
                Check(
                    f"step time {mode.name} / {peer.name} <= {bound}",
                    "time",
                    f"{t.ratio:.3f} (median of {t.rounds} rounds, quartiles "
                    f"{t.ratio_low:.3f}-{t.ratio_high:.3f})",
                    t.ratio <= bound,
                )
            )
        tables.append(
            Table(
                "W2 step-time ratios of the target pairs (same rounds, interleaved)",
                ["pair", "median ratio", "quartiles", "target"],
                pair_rows,
            )
        )

    return WorkloadResult(
        name="W2",
        title="overhead-bound stack, step-time ratios",
        config={
            **asdict(cfg),
            "threads": THREADS,
            "rounds": ROUNDS,
            "steps_per_sample": STEPS_PER_SAMPLE,
        },
        tables=tables,
        checks=checks,
        data={
            m.name: {
                "counts": asdict(counts[m.name]),
                "bytes": asdict(byte_results[m.name]),
                **({"time": asdict(times[m.name])} if times else {}),
            }
            for m in MODES
        },
    )
