"""W3: the sqrt(n) chain. n x (Linear + Tanh) checkpointed in k equal segments.

After the forward only the k segment inputs are alive; backward recomputes one
segment (n/k activations) at a time. The step's peak is therefore about
(k + n/k) activations and is smallest at k = sqrt(n) (Chen et al., 2016). Measured
for ``remat.checkpoint`` and ``torch.utils.checkpoint`` per segment, with exact
allocator bytes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import torch_remat as remat
from benchmarks.measure import StepBytes, preallocate_grads, step_bytes
from benchmarks.report import Check, Table, WorkloadResult


@dataclass(frozen=True)
class ChainConfig:
    n_layers: int
    """n: Linear + Tanh pairs."""
    width: int
    batch: int


FULL = ChainConfig(n_layers=64, width=512, batch=256)
QUICK = ChainConfig(n_layers=16, width=64, batch=32)


def _segment_calls(
    layers: nn.Sequential, k: int, impl: str
) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    n = len(layers) // 2
    per = n // k
    segments = [layers[2 * j * per : 2 * (j + 1) * per] for j in range(k)]
    if impl == "remat":
        return [
            remat.checkpoint(region_name=f"segments.{j}")(seg) for j, seg in enumerate(segments)
        ]
    return [
        functools.partial(torch_checkpoint, seg, use_reentrant=False, preserve_rng_state=False)
        for seg in segments
    ]


def run(quick: bool) -> WorkloadResult:
    cfg = QUICK if quick else FULL
    n = cfg.n_layers
    torch.manual_seed(0)
    layers = nn.Sequential(
        *[m for _ in range(n) for m in (nn.Linear(cfg.width, cfg.width), nn.Tanh())]
    )
    x = torch.randn(cfg.batch, cfg.width)
    preallocate_grads(layers)
    activation = cfg.batch * cfg.width * 4
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n and n % k == 0]

    def measure(calls: list[Callable[[torch.Tensor], torch.Tensor]]) -> StepBytes:
        def forward() -> torch.Tensor:
            h = x
            for call in calls:
                h = call(h)
            return h.sum()

        return step_bytes(forward, warmup=False)

    layers(x).sum().backward()  # warm-up; nothing outlives a step (checked below)
    base = measure([layers])
    rows, data = [], {"no AC": asdict(base)}
    steps: dict[str, dict[int, StepBytes]] = {"remat": {}, "torch": {}}
    for k in ks:
        for impl in ("remat", "torch"):
            steps[impl][k] = b = measure(_segment_calls(layers, k, impl))
            data[f"{impl} k={k}"] = asdict(b)
        r, t = steps["remat"][k], steps["torch"][k]
        rows.append(
            [k, r.live_after_forward, r.peak_step, f"{r.peak_step / activation:.2f}", t.peak_step]
        )
    peaks = {impl: {k: b.peak_step for k, b in per_k.items()} for impl, per_k in steps.items()}
    table = Table(
        f"W3 sqrt(n) chain: {n} x (Linear({cfg.width}) + Tanh), batch {cfg.batch}, "
        f"k checkpointed segments (no AC: live {base.live_after_forward:,} B, "
        f"peak {base.peak_step:,} B)",
        [
            "k",
            "remat live after fwd (B)",
            "remat peak step (B)",
            "peak / activation",
            "torch.ckpt peak step (B)",
        ],
        rows,
        [
            f"activation = one {cfg.batch}x{cfg.width} fp32 tensor = {activation:,} B; "
            "parameter gradients are preallocated, so peaks are activations and "
            "transient buffers."
        ],
    )
    best = {impl: min(p, key=p.get) for impl, p in peaks.items()}
    all_steps = [base, *steps["remat"].values(), *steps["torch"].values()]
    root = math.isqrt(n)
    checks = [
        Check(
            f"the remat bytes curve over k has its minimum at k = sqrt({n}) = {root}",
            "bytes",
            f"argmin k = {best['remat']}",
            best["remat"] == root,
        ),
        Check(
            "remat and torch.utils.checkpoint have the same peak for every k (within 1%)",
            "bytes",
            ", ".join(f"k={k}: {peaks['remat'][k]:,}/{peaks['torch'][k]:,}" for k in ks),
            all(abs(peaks["remat"][k] - peaks["torch"][k]) <= 0.01 * peaks["torch"][k] for k in ks),
        ),
        Check(
            "every step frees all it allocated",
            "bytes",
            f"held after backward: max {max(b.live_after_backward for b in all_steps):,} B",
            all(b.live_after_backward == 0 for b in all_steps),
        ),
    ]
    return WorkloadResult(
        name="W3",
        title="sqrt(n) chain, bytes over the number of segments",
        config={**asdict(cfg), "k": ks},
        tables=[table],
        checks=checks,
        data=data,
    )
