"""W8: forecast a Llama-3-8B-shaped stack per rank, on this machine, in seconds.

    python benchmarks/w8_forecast_8b.py            # FSDP2 on 8 and 64 ranks, FSDP2 x TP 8 on 64
    python benchmarks/w8_forecast_8b.py --layouts fsdp8

The stack: 32 blocks of d_model 4096, 32 query heads and 8 KV heads of 128 (GQA),
a SwiGLU MLP of 14336, RMSNorm, sequence 8192, micro-batch 1; the vocabulary
(embedding and output head) is left out: the input is the first block's hidden
state and the loss reads the last block's output. Rotary embeddings are left out
too (they hold no parameters; on this stack they would add their cos/sin
products to what each block saves). Parameters are fp32, sharded by FSDP2, and
all-gathered in bf16 (``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``), so activations are bf16; Adam's two fp32 states.

The model is built on the meta device and forecast with
``forecast_remat(..., layout=Layout(...))``: the real ``fully_shard`` and
``parallelize_module`` run for one rank on a fake process group, on fake tensors,
so nothing of the model is allocated. Each layout's plan is chosen for an 80 GiB
device (the budget: what is left of 80 GiB after the rank's parameters,
gradients and optimizer state and a 25% margin for the step's transients);
``--max-batch`` also searches each policy's largest micro-batch; the table also predicts
each policy's added step time on an H100 SXM profile. Printed per layout: the
forecast, its wall time and the process's peak RSS (``--tracemalloc``: also the
peak of Python's traced allocations, which slows the run).

``--offload``: offload joins the options (each save set also measured with what
its SAVE regions keep moved to host memory, prefetch 1, tensors of 1 MiB and up),
the plan is chosen by predicted added time on the H100 SXM profile, and the plans
for a range of budgets are printed from the same measurements, next to full
checkpoint and Megatron-style.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import time
import tracemalloc

os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_remat.integrations.planner import (  # noqa: E402
    InfeasibleBudgetError,
    Layout,
    OffloadOptions,
    forecast_remat,
)

D, HEADS, KV_HEADS, FFN, SEQ, LAYERS = 4096, 32, 8, 14336, 8192, 32
HEAD_DIM = D // HEADS
DEVICE_MEMORY = 80 * 2**30
PROFILE = "H100 SXM"
"""The 80 GiB device profile of the "predicted added time" column (published
figures, ``integrations.planner._time.PROFILES``; activations are bf16)."""
MARGIN = 0.25


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(D, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(D, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(D, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them
        q = self.wq(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, FFN, bias=False)
        self.w3 = nn.Linear(D, FFN, bias=False)
        self.w2 = nn.Linear(FFN, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(D, eps=1e-5)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(D, eps=1e-5)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Stack(nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def tp_plan(layers: int = LAYERS) -> dict:
    """Megatron's column/row split with sequence parallel norms: each block takes
    and returns this rank's slice of the sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {}
    for i in range(layers):
        p = f"layers.{i}"
        for norm, inner, cols, row in (
            ("attention_norm", "attention", ("wq", "wk", "wv"), "wo"),
            ("ffn_norm", "feed_forward", ("w1", "w3"), "w2"),
        ):
            plan[f"{p}.{norm}"] = SequenceParallel()
            plan[f"{p}.{inner}"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            for c in cols:
                plan[f"{p}.{inner}.{c}"] = ColwiseParallel()
            plan[f"{p}.{inner}.{row}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def layout(name: str) -> Layout:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if name == "fsdp8":
        return Layout(8, fully_shard_kwargs=mp)
    if name == "fsdp64":
        return Layout(64, fully_shard_kwargs=mp)
    if name == "fsdp8xtp8":
        return Layout(64, fsdp=8, tp=8, tp_plan=tp_plan(), fully_shard_kwargs=mp)
    raise ValueError(name)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def budget_for(lay: Layout) -> int:
    """Kept-activation bytes for the plan: 80 GiB less this rank's parameters,
    gradients (fp32, as sharded) and Adam's state, less the margin."""
    per_rank = 4 * (
        LAYERS * (2 * D + D * HEADS * HEAD_DIM * 2 + 2 * D * KV_HEADS * HEAD_DIM + 3 * D * FFN)
    ) // (lay.fsdp_size * lay.tp)
    fixed = per_rank * (1 + 1 + 2)  # parameters, gradients, two Adam states
    return int(DEVICE_MEMORY * (1 - MARGIN)) - fixed


OFFLOAD_BUDGETS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7)
"""Fractions of the no-remat bytes the ``--offload`` run plans for."""


def run(name: str, max_batch: bool, trace: bool, offload: bool = False) -> None:
    lay = layout(name)
    with torch.device("meta"):
        model = Stack()
    seq = SEQ // lay.tp  # sequence parallel: each rank's forward gets its slice
    x = torch.empty(1, seq, D, dtype=torch.bfloat16, device="meta")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if trace:
        tracemalloc.start()
    t0 = time.perf_counter()
    forecast = forecast_remat(
        model, x, loss_fn, budget_for(lay), blocks=Block,
        candidates=[Attention, FeedForward], layout=lay,
        device_memory=DEVICE_MEMORY if max_batch else None,
        profile=PROFILE, compute_dtype=torch.bfloat16,
        offload=OffloadOptions(prefetch=1) if offload else None,
    )
    wall = time.perf_counter() - t0
    traced = ""
    if trace:
        traced = f"; tracemalloc peak {tracemalloc.get_traced_memory()[1] / 2**20:.1f} MiB"
        tracemalloc.stop()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(forecast.format(by_block=False))
    print(f"  forecast in {wall:.1f} s{' (under tracemalloc)' if trace else ''}; peak RSS of "
          f"the process {rss / 2**10:.0f} MiB (+{(rss - rss0) / 2**10:.0f} MiB over the "
          f"forecast){traced}", flush=True)
    if offload:
        print_budgets(forecast)
    print()


def print_budgets(forecast) -> None:
    """The plans for :data:`OFFLOAD_BUDGETS` from the forecast's measurements."""
    plan = forecast.plan
    full = plan.no_remat_bytes
    # the same measurements without the offloaded options
    resident = dataclasses.replace(
        plan, table=[[m for m in opts if not m.option.offload] for opts in plan.table],
        choices=[0] * len(plan.blocks), offload=None, _frontier=None,
    )
    print(f"\n  plans by budget (offload among the options; added time on {PROFILE}):")
    rows = [("budget", "kept after forward", "on the host", "recompute FLOPs", "added time",
             "without offload", "blocks")]
    for fraction in OFFLOAD_BUDGETS:
        try:
            without = f"{resident.for_budget(fraction).predicted_seconds * 1e3:.1f} ms"
        except InfeasibleBudgetError:
            without = "infeasible"
        try:
            p = plan.for_budget(fraction)
        except InfeasibleBudgetError:
            rows.append((f"{fraction:.2f}", "infeasible", "", "", "", without, ""))
            continue
        kinds: dict[str, int] = {}
        for option in p.options.values():
            kinds[option.label] = kinds.get(option.label, 0) + 1
        rows.append((
            f"{fraction:.2f}", f"{p.predicted_bytes:,}", f"{p.host_bytes:,}", f"{p.recompute_flops:,}",
            f"{p.predicted_seconds * 1e3:.1f} ms", without,
            "; ".join(f"{n} x {k}" for k, n in kinds.items()),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(c.rjust(w) if 0 < i < 6 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    print(f"  (of {full:,} B without remat)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="fsdp8,fsdp64,fsdp8xtp8")
    p.add_argument("--max-batch", action="store_true",
                   help="also search each policy's largest micro-batch for 80 GiB (more runs)")
    p.add_argument("--offload", action="store_true",
                   help="offload among the options; plans for a range of budgets")
    p.add_argument("--tracemalloc", action="store_true",
                   help="trace Python's allocations too (their peak; slows the run 2-4x)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"W8: Llama-3-8B-shaped stack (d={D}, {HEADS} heads, {KV_HEADS} KV heads, "
          f"FFN {FFN} SwiGLU, seq {SEQ}, {LAYERS} layers, no vocabulary), micro-batch 1, "
          "bf16 activations, fp32 parameters; plans for an 80 GiB device", flush=True)
    for name in args.layouts.split(","):
        run(name, args.max_batch, args.tracemalloc, args.offload)


if __name__ == "__main__":
    main()
