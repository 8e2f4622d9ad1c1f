"""W1: a GPT block stack under every checkpointing mode.

One checkpoint per block. Per mode: bytes alive after the forward and the step's
peak (allocator events), FLOPs of the whole step including recompute
(``FlopCounterMode``), the aten op count, and the step time as a ratio against
``torch.utils.checkpoint`` (interleaved rounds, median). The s=1024 variant reports
no AC against Megatron-style recompute only (bytes and FLOPs; no timing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import torch

from benchmarks import modes as M
from benchmarks.gpt import GPTConfig, GPTStack
from benchmarks.measure import (
    StepBytes,
    StepCounts,
    measure_step,
    preallocate_grads,
    time_ratio,
    time_samples,
)
from benchmarks.report import Check, Table, WorkloadResult, within

FULL = GPTConfig(d_model=256, n_heads=4, seq_len=256, batch=8, n_layers=4, attention_dropout=0.1)
LONG = GPTConfig(d_model=256, n_heads=4, seq_len=1024, batch=8, n_layers=4, attention_dropout=0.1)
# Tiny sizes keep s/d and n_heads*s/d of the full sizes, so the byte and FLOP
# ratios are comparable.
QUICK = GPTConfig(d_model=64, n_heads=4, seq_len=64, batch=2, n_layers=2, attention_dropout=0.1)
QUICK_LONG = GPTConfig(
    d_model=32, n_heads=4, seq_len=128, batch=2, n_layers=2, attention_dropout=0.1
)

MODES = [
    M.NO_AC,
    M.TORCH_CHECKPOINT,
    M.SAC_MATMULS,
    M.SAC_LINEARS,
    M.REMAT_FULL,
    M.REMAT_SAVE_LINEARS,
    M.REMAT_SAVE_MATMULS,
    M.REMAT_MEGATRON,
    M.REMAT_MEGATRON_REBUILD,
]
_MODE_BY_NAME = {m.name: m for m in MODES}
# The six modes are timed; the two added only to pair save sets exactly
# (SAC mm/addmm, remat save matmuls) are not, to keep W1 under a minute. W2 times
# both save-set pairs.
TIMED_MODES = [
    M.NO_AC,
    M.TORCH_CHECKPOINT,
    M.SAC_MATMULS,
    M.REMAT_FULL,
    M.REMAT_SAVE_LINEARS,
    M.REMAT_MEGATRON,
]
TIME_ROUNDS = 10



def _gradients(stack: GPTStack, x: torch.Tensor, forward: Callable[[], torch.Tensor]) -> list:
    """Gradients of one step from zero, with the same dropout draws in every mode."""
    for t in [*stack.parameters(), x]:
        t.grad.zero_()
    torch.manual_seed(1234)
    forward().backward()
    return [t.grad.clone() for t in [*stack.parameters(), x]]


def _measure_modes(
    cfg: GPTConfig, modes: list[M.Mode], *, timed: bool, check_gradients: bool
) -> tuple[dict[str, StepBytes], dict[str, StepCounts], dict, dict[str, bool]]:
    torch.manual_seed(0)
    stack = GPTStack(cfg)
    x = stack.example_input()
    preallocate_grads(stack, x)

    def forward() -> torch.Tensor:
        return stack(x).sum()

    rng = cfg.attention_dropout > 0
    byte_results: dict[str, StepBytes] = {}
    count_results: dict[str, StepCounts] = {}
    same_gradients: dict[str, bool] = {}
    reference = None
    for mode in modes:
        M.install(stack, mode, rng=rng)
        count_results[mode.name], byte_results[mode.name] = measure_step(forward)
        if check_gradients:
            grads = _gradients(stack, x, forward)
            reference = reference or grads
            same_gradients[mode.name] = all(map(torch.equal, grads, reference))
    times = {}
    if timed:

        def step() -> None:
            forward().backward()

        timed_modes = [m for m in TIMED_MODES if m in modes]
        samples = time_samples(
            {m.name: step for m in timed_modes},
            rounds=TIME_ROUNDS,
            setup=lambda name: M.install(stack, _MODE_BY_NAME[name], rng=rng),
        )
        times = {m.name: time_ratio(samples, m.name, M.TORCH_CHECKPOINT.name) for m in timed_modes}
    return byte_results, count_results, times, same_gradients


def _gradient_check(same_gradients: dict[str, bool]) -> list[Check]:
    if not same_gradients:
        return []
    differ = [name for name, same in same_gradients.items() if not same]
    return [
        Check(
            "every mode computes bitwise the same gradients as no AC (same dropout draws)",
            "gradients",
            f"differ: {differ}" if differ else f"equal in all {len(same_gradients)} modes",
            not differ,
        )
    ]


def _extra(counts: dict[str, StepCounts], name: str, op: str | None = None) -> int:
    base, c = counts[M.NO_AC.name], counts[name]
    if op is None:
        return c.flops_step - base.flops_step
    return c.flops_by_op.get(op, 0) - base.flops_by_op.get(op, 0)


def _table(
    title: str,
    modes: list[M.Mode],
    b: dict[str, StepBytes],
    c: dict[str, StepCounts],
    times: dict,
) -> Table:
    base_b, base_c = b[M.NO_AC.name], c[M.NO_AC.name]
    columns = [
        "mode",
        "live after fwd (B)",
        "vs no AC",
        "peak step (B)",
        "FLOPs step",
        "extra FLOPs",
        "aten ops",
    ]
    if times:
        columns.append("time / torch.ckpt [q1, q3]")
    rows = []
    for m in modes:
        bb, cc = b[m.name], c[m.name]
        row = [
            m.name,
            bb.live_after_forward,
            bb.live_after_forward / base_b.live_after_forward,
            bb.peak_step,
            cc.flops_step,
            f"{100 * (cc.flops_step - base_c.flops_step) / base_c.flops_step:+.2f}%",
            cc.ops_step,
        ]
        if times:
            t = times.get(m.name)
            row.append(
                "not timed"
                if t is None
                else f"{t.ratio:.3f} [{t.ratio_low:.2f}, {t.ratio_high:.2f}]"
            )
        rows.append(row)
    notes = [f"{m.name}: {m.description}" for m in modes]
    if times:
        notes.append(
            f"time: median over {TIME_ROUNDS} interleaved rounds of the per-round ratio, "
            "quartiles in brackets"
        )
    return Table(title, columns, rows, notes)


def _megatron_flop_checks(c: dict[str, StepCounts], label: str) -> list[Check]:
    """Megatron-style recomputes no linear layer, and of the attention core only
    QK^T: early stop ends the replay when AV saves its inputs, before it runs. With
    ``rebuild="always"`` the replay also runs AV, to rebuild proj's input, as
    Megatron's own attention-core recompute does."""
    # QK^T and AV have equal FLOPs; the forward runs each once per block.
    qk = c[M.NO_AC.name].flops_forward_by_op.get("aten.bmm", 0) // 2
    checks = []
    for mode, bmms, what in (
        (M.REMAT_MEGATRON, 1, "only QK^T"),
        (M.REMAT_MEGATRON_REBUILD, 2, "QK^T and AV"),
    ):
        meg = mode.name
        extra_lin = _extra(c, meg, "aten.addmm") + _extra(c, meg, "aten.mm")
        extra_bmm = _extra(c, meg, "aten.bmm")
        checks.append(
            Check(
                f"{meg} recomputes no linear-layer FLOPs, {what} ({label})",
                "flops",
                f"extra addmm+mm {extra_lin:,}, extra bmm {extra_bmm:,} (QK^T forward {qk:,})",
                extra_lin == 0 and extra_bmm == bmms * qk,
            )
        )
    return checks


def _megatron_rebuild_check(cfg: GPTConfig, b: dict[str, StepBytes], label: str) -> Check:
    """rebuild="always" holds exactly proj's input (b, s, d) fp32 per block less."""
    meg = b[M.REMAT_MEGATRON.name].live_after_forward
    rebuilt = b[M.REMAT_MEGATRON_REBUILD.name].live_after_forward
    per_block = cfg.batch * cfg.seq_len * cfg.d_model * 4
    return Check(
        f"Megatron-style with rebuild='always' holds proj's input less per block ({label})",
        "bytes",
        f"{rebuilt:,} vs {meg:,}: {meg - rebuilt:,} = {cfg.n_layers} x {per_block:,}",
        meg - rebuilt == cfg.n_layers * per_block,
    )


def run(quick: bool) -> WorkloadResult:
    cfg = QUICK if quick else FULL
    b, c, times, same_gradients = _measure_modes(cfg, MODES, timed=not quick, check_gradients=quick)
    base_b, base_c = b[M.NO_AC.name], c[M.NO_AC.name]
    tc, full = b[M.TORCH_CHECKPOINT.name], b[M.REMAT_FULL.name]
    meg_b = b[M.REMAT_MEGATRON.name]
    meg_extra = _extra(c, M.REMAT_MEGATRON.name)
    label = f"s={cfg.seq_len}, d={cfg.d_model}"

    checks = [
        *_gradient_check(same_gradients),
        Check(
            "remat full bytes equal torch.utils.checkpoint within 1% (live after fwd, peak)",
            "bytes",
            f"live {full.live_after_forward:,} vs {tc.live_after_forward:,}; "
            f"peak {full.peak_step:,} vs {tc.peak_step:,}",
            within(full.live_after_forward, tc.live_after_forward, 0.01)
            and within(full.peak_step, tc.peak_step, 0.01),
        ),
        Check(
            "remat full recomputes the same FLOPs as torch.utils.checkpoint",
            "flops",
            f"extra {_extra(c, M.REMAT_FULL.name):,} vs {_extra(c, M.TORCH_CHECKPOINT.name):,}",
            _extra(c, M.REMAT_FULL.name) == _extra(c, M.TORCH_CHECKPOINT.name),
        ),
    ]
    for remat_mode, sac_mode in (
        (M.REMAT_SAVE_MATMULS, M.SAC_MATMULS),
        (M.REMAT_SAVE_LINEARS, M.SAC_LINEARS),
    ):
        rb, sb = b[remat_mode.name], b[sac_mode.name]
        r_extra, s_extra = _extra(c, remat_mode.name), _extra(c, sac_mode.name)
        checks.append(
            Check(
                f"{remat_mode.name} recomputes exactly the matmul FLOPs {sac_mode.name} does"
                + (" (none)" if remat_mode is M.REMAT_SAVE_MATMULS else " (the attention bmm's)"),
                "flops",
                f"extra {r_extra:,} vs {s_extra:,}",
                r_extra == s_extra and (remat_mode is not M.REMAT_SAVE_MATMULS or r_extra == 0),
            )
        )
        checks.append(
            Check(
                f"{remat_mode.name} holds no more bytes than {sac_mode.name} (same save set)",
                "bytes",
                f"live after fwd {rb.live_after_forward:,} vs {sb.live_after_forward:,} "
                f"({rb.live_after_forward / sb.live_after_forward:.2f}x)",
                rb.live_after_forward <= sb.live_after_forward,
            )
        )
    checks += [
        Check(
            f"Megatron-style holds at most 0.85x the no-AC bytes ({label})",
            "bytes",
            f"{meg_b.live_after_forward / base_b.live_after_forward:.3f}x "
            f"({meg_b.live_after_forward:,} / {base_b.live_after_forward:,})",
            meg_b.live_after_forward <= 0.85 * base_b.live_after_forward,
        ),
        Check(
            f"Megatron-style costs at most 3% extra FLOPs ({label})",
            "flops",
            f"{100 * meg_extra / base_c.flops_step:.2f}% ({meg_extra:,} / {base_c.flops_step:,})",
            meg_extra <= 0.03 * base_c.flops_step,
        ),
        *_megatron_flop_checks(c, label),
        _megatron_rebuild_check(cfg, b, label),
        Check(
            "every mode frees by the end of the step all it allocated, and nothing older",
            "bytes",
            ", ".join(f"{k}: {v.live_after_backward}/{v.freed_from_before}" for k, v in b.items())
            + " (held after backward / freed from before)",
            all(v.live_after_backward == 0 and v.freed_from_before == 0 for v in b.values()),
        ),
    ]
    title = (
        f"W1 GPT stack, d={cfg.d_model} s={cfg.seq_len} heads={cfg.n_heads} "
        f"batch={cfg.batch} layers={cfg.n_layers} fp32, attention dropout "
        f"{cfg.attention_dropout}"
    )
    return WorkloadResult(
        name="W1",
        title="GPT block stack, every checkpointing mode",
        config={**asdict(cfg), "threads": torch.get_num_threads(), "time_rounds": TIME_ROUNDS},
        tables=[_table(title, MODES, b, c, times)],
        checks=checks,
        data=_data(b, c, times),
    )


def run_long(quick: bool) -> WorkloadResult:
    cfg = QUICK_LONG if quick else LONG
    modes = [M.NO_AC, M.REMAT_MEGATRON, M.REMAT_MEGATRON_REBUILD]
    b, c, _, same_gradients = _measure_modes(cfg, modes, timed=False, check_gradients=quick)
    title = (
        f"W1 at s={cfg.seq_len}: d={cfg.d_model} heads={cfg.n_heads} batch={cfg.batch} "
        f"layers={cfg.n_layers}"
    )
    base_b, meg_b = b[M.NO_AC.name], b[M.REMAT_MEGATRON.name]
    checks = [
        *_gradient_check(same_gradients),
        *_megatron_flop_checks(c, f"s={cfg.seq_len}, d={cfg.d_model}"),
        _megatron_rebuild_check(cfg, b, f"s={cfg.seq_len}, d={cfg.d_model}"),
        Check(
            f"Megatron-style holds fewer bytes than no AC (s={cfg.seq_len}, reported)",
            "bytes",
            f"{meg_b.live_after_forward / base_b.live_after_forward:.3f}x",
            meg_b.live_after_forward < base_b.live_after_forward,
        ),
    ]
    return WorkloadResult(
        name="W1-long",
        title=f"GPT block stack at s={cfg.seq_len}: no AC vs Megatron-style",
        config=asdict(cfg),
        tables=[_table(title, modes, b, c, {})],
        checks=checks,
        data=_data(b, c, {}),
    )


def _data(b: dict, c: dict, times: dict) -> dict:
    return {
        name: {
            "bytes": asdict(b[name]),
            "counts": asdict(c[name]),
            **({"time": asdict(times[name])} if name in times else {}),
        }
        for name in b
    }
