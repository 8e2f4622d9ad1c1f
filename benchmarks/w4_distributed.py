"""W4: a tiny GPT under FSDP2 on 2 gloo ranks, per-rank bytes and step-time ratios.

Modes, each applied to the blocks before ``fully_shard`` (blocks, then the root):
no AC; torch's ``apply_activation_checkpointing`` (non-reentrant
``checkpoint_wrapper``); ``apply_remat``; ``apply_remat(remat=RematConfig(save_modules=nn.Linear))``,
which runs every linear layer inside a block as a SAVE region. Each rank measures
its own allocator bytes (profiler memory events) and times the modes interleaved
round by round against torch's wrapper, on one thread per rank.

The ranks are started with ``torch.multiprocessing.spawn`` from :func:`run` and
write their results as JSON, which the parent turns into the table.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.gpt import Block, GPTConfig
from benchmarks.report import Check, Table, WorkloadResult, within

WORLD_SIZE = 2
ROUNDS = 10
STEPS_PER_SAMPLE = 2
MODES = ["no AC", "torch apply_activation_checkpointing", "apply_remat", "apply_remat SAVE linears"]
PEER = "torch apply_activation_checkpointing"


@dataclass(frozen=True)
class TinyGPTConfig:
    block: GPTConfig
    vocab: int


FULL = TinyGPTConfig(
    GPTConfig(d_model=128, n_heads=4, seq_len=128, batch=4, n_layers=4, attention_dropout=0.1),
    vocab=512,
)
QUICK = TinyGPTConfig(
    GPTConfig(d_model=32, n_heads=2, seq_len=16, batch=2, n_layers=2, attention_dropout=0.1),
    vocab=64,
)


def _missing_integration() -> str | None:
    try:
        from torch_remat.integrations import apply_remat  # noqa: F401
    except ImportError as e:
        return (
            "torch_remat.integrations.apply_remat is missing (the FSDP2 adapters are not "
            f"available: {e}); W4 needs it."
        )
    return None


class TinyGPT(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        b = cfg.block
        self.tok = nn.Embedding(cfg.vocab, b.d_model)
        self.pos = nn.Embedding(b.seq_len, b.d_model)
        self.blocks = nn.ModuleList(Block(b) for _ in range(b.n_layers))
        self.norm = nn.LayerNorm(b.d_model)
        self.head = nn.Linear(b.d_model, cfg.vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _build(cfg: TinyGPTConfig, mode: str) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import fully_shard

    from torch_remat.integrations import RematConfig, apply_remat

    torch.manual_seed(0)  # the same weights on every rank and in every mode
    model = TinyGPT(cfg)

    def is_block(m: nn.Module) -> bool:
        return isinstance(m, Block)

    if mode == "torch apply_activation_checkpointing":
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
            ),
            check_fn=is_block,
        )
    elif mode == "apply_remat":
        apply_remat(model, check_fn=is_block)
    elif mode == "apply_remat SAVE linears":
        apply_remat(model, check_fn=is_block, remat=RematConfig(save_modules=nn.Linear))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _rank_main(rank: int, port: int, quick: bool, out_dir: str) -> None:
    import torch.distributed as dist

    from benchmarks.measure import step_bytes, time_ratio, time_samples

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        cfg = QUICK if quick else FULL
        g = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch
        shape = (cfg.block.batch, cfg.block.seq_len)
        idx = torch.randint(cfg.vocab, shape, generator=g)
        targets = torch.randint(cfg.vocab, shape, generator=g)
        models = {mode: _build(cfg, mode) for mode in MODES}
        results: dict[str, dict] = {}
        for mode, model in models.items():

            def forward(model: nn.Module = model) -> torch.Tensor:
                return model(idx, targets)

            forward().backward()  # FSDP2's lazy init; leaves .grad allocated
            dist.barrier()
            results[mode] = {"bytes": asdict(step_bytes(forward))}
        if not quick:

            def step(model: nn.Module) -> None:
                model(idx, targets).backward()

            samples = time_samples(
                {mode: functools.partial(step, m) for mode, m in models.items()},
                rounds=ROUNDS,
                steps_per_sample=STEPS_PER_SAMPLE,
                setup=lambda _: dist.barrier(),
            )
            for mode in MODES:
                results[mode]["time"] = asdict(time_ratio(samples, mode, PEER))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(quick: bool) -> WorkloadResult:
    cfg = QUICK if quick else FULL
    config = {**asdict(cfg.block), "vocab": cfg.vocab, "world_size": WORLD_SIZE}
    missing = _missing_integration()
    if missing is not None:
        print(f"W4 skipped: {missing}")
        return WorkloadResult("W4", "FSDP2 on 2 gloo ranks", config, skipped=missing)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(_free_port(), quick, out_dir), nprocs=WORLD_SIZE, join=True)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]

    columns = ["mode"]
    for r in range(WORLD_SIZE):
        columns += [f"rank{r} live after fwd (B)", f"rank{r} peak step (B)"]
    if not quick:
        columns += [f"rank{r} time / torch AC [q1, q3]" for r in range(WORLD_SIZE)]
    rows = []
    for mode in MODES:
        row: list[object] = [mode]
        for r in range(WORLD_SIZE):
            b = ranks[r][mode]["bytes"]
            row += [b["live_after_forward"], b["peak_step"]]
        if not quick:
            for r in range(WORLD_SIZE):
                t = ranks[r][mode]["time"]
                row.append(f"{t['ratio']:.3f} [{t['ratio_low']:.2f}, {t['ratio_high']:.2f}]")
        rows.append(row)
    b = cfg.block
    table = Table(
        f"W4 FSDP2 (fully_shard per block + root), {WORLD_SIZE} gloo ranks, tiny GPT: "
        f"d={b.d_model} s={b.seq_len} heads={b.n_heads} layers={b.n_layers} "
        f"batch/rank={b.batch} vocab={cfg.vocab}, 1 thread per rank",
        columns,
        rows,
    )

    def live(rank: int, mode: str) -> int:
        return ranks[rank][mode]["bytes"]["live_after_forward"]

    def peak(rank: int, mode: str) -> int:
        return ranks[rank][mode]["bytes"]["peak_step"]

    rs = range(WORLD_SIZE)
    checks = [
        Check(
            "apply_remat holds the same bytes as torch's apply_activation_checkpointing on "
            "every rank (within 1%, live after fwd and peak)",
            "bytes",
            "; ".join(
                f"rank{r}: live {live(r, 'apply_remat'):,} vs {live(r, PEER):,}, "
                f"peak {peak(r, 'apply_remat'):,} vs {peak(r, PEER):,}"
                for r in rs
            ),
            all(
                within(live(r, "apply_remat"), live(r, PEER), 0.01)
                and within(peak(r, "apply_remat"), peak(r, PEER), 0.01)
                for r in rs
            ),
        ),
        Check(
            "every mode is in a steady state: a step leaves the allocator where it began, "
            "on every rank",
            "bytes",
            "; ".join(
                f"rank{r} {mode}: net {ranks[r][mode]['bytes']['net_after_step']}"
                for r in rs
                for mode in MODES
                if ranks[r][mode]["bytes"]["net_after_step"]
            )
            or "net 0 everywhere",
            all(ranks[r][m]["bytes"]["net_after_step"] == 0 for r in rs for m in MODES),
        ),
    ]
    return WorkloadResult(
        name="W4",
        title=f"FSDP2 on {WORLD_SIZE} gloo ranks, per-rank bytes and step-time ratios",
        config={**config, "rounds": ROUNDS, "steps_per_sample": STEPS_PER_SAMPLE},
        tables=[table],
        checks=checks,
        data={f"rank{r}": ranks[r] for r in rs},
    )
