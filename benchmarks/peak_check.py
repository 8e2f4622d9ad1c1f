"""Forecast step peaks against real CPU steps, per policy and micro-batch.

For each case and each policy ``forecast_remat`` lists (no remat, the hand
policies, the plan), the forecast's ``peak_bytes`` next to the peak of a real
step with the same configuration installed: the most bytes the step's own
storages held at once, from just before the forward to just after the backward
(gradients start as None), from the profiler's allocator events in time order (as
``tests/conftest.py``'s ``MemoryProbe.peak``).

    python benchmarks/peak_check.py [case ...] [--batches 2,4,8]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpt import GPTConfig, GPTStack  # noqa: E402
from torch_remat.integrations import remove_remat  # noqa: E402
from torch_remat.integrations.planner import forecast_remat  # noqa: E402
from torch_remat.integrations.planner._measure import Placement, install  # noqa: E402


def allocator_peak(prof: Any) -> int:
    """Running net bytes of the allocator events, in time order: the most at once."""
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def real_step_peak(
    model: nn.Module, args: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor],
    config: Placement, warmup: bool = True,
) -> int:
    """The peak of one real step of ``model`` with ``config`` installed: the step's
    own storages, forward and backward, gradients None at the start."""
    install(model, config)
    try:
        if warmup:  # lazy state (first-call caches) out of the measured step
            loss_fn(model(*args)).backward()
        for p in model.parameters():
            p.grad = None
        gc.collect()
        was = gc.isenabled()
        gc.disable()
        try:
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            ) as prof:
                loss = loss_fn(model(*args))
                loss.backward()
                del loss
        finally:
            if was:
                gc.enable()
        return allocator_peak(prof)
    finally:
        remove_remat(model)
        for p in model.parameters():
            p.grad = None


class Autocast(nn.Module):
    """``inner``'s forward under CPU autocast (bf16)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(*args)


@dataclass
class Case:
    name: str
    model: nn.Module
    make_args: Callable[[int], tuple]
    loss_fn: Callable[[Any], torch.Tensor]
    kwargs: dict
    outer_autocast: bool = False
    """Forecast and real step both inside ``torch.autocast("cpu", bfloat16)``
    (backward included), rather than the forward alone."""


def _sum(out: Any) -> torch.Tensor:
    return out.float().sum()


def _logits_sum(out: Any) -> torch.Tensor:
    return out.logits.sum()


def _hidden_sum(out: Any) -> torch.Tensor:
    return out.last_hidden_state.sum()


W1 = GPTConfig(d_model=32, n_heads=4, seq_len=32, batch=2, n_layers=2, attention_dropout=0.1)
W1_WIDE = GPTConfig(d_model=256, n_heads=4, seq_len=128, batch=2, n_layers=2,
                    attention_dropout=0.1)
"""Wider, where CPU kernels take other paths (bf16 matmul through oneDNN)."""


class LSTMBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lstm, self.fc = nn.LSTM(d, d, batch_first=True), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.lstm(x)[0]))


def case(name: str) -> Case:
    torch.manual_seed(0)
    gpt_kwargs = dict(budget=0.3, candidates=["qkv", "fc1", "fc2"])
    if name == "w1_bf16_outer":
        c = case("w1")
        c.name, c.outer_autocast = name, True
        return c
    if name == "llama_bf16_outer":
        c = case("llama")
        c.name, c.outer_autocast = name, True
        return c
    if name in ("w1", "w1_bf16", "w1_wide", "w1_wide_bf16"):
        cfg = W1_WIDE if "wide" in name else W1
        stack = GPTStack(cfg)

        def w1_args(b: int) -> tuple:
            return (torch.randn(b, cfg.seq_len, cfg.d_model, requires_grad=True),)

        bf16 = name.endswith("bf16")
        model = Autocast(stack) if bf16 else stack
        kwargs = dict(gpt_kwargs)
        if bf16:
            kwargs["candidates"] = ["*qkv", "*fc1", "*fc2"]
            kwargs["blocks"] = [type(stack.blocks[0])]
        return Case(name, model, w1_args, _sum, kwargs)
    if name == "lstm":
        model = nn.Sequential(LSTMBlock(), LSTMBlock())
        return Case(name, model, lambda b: (torch.randn(b, 10, 16),), _sum, dict(budget=1.0))
    if name == "bn_conv":
        model = nn.Sequential(*[
            nn.Sequential(nn.Conv1d(8, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU())
            for _ in range(2)
        ])
        return Case(name, model, lambda b: (torch.randn(b, 8, 32),), _sum, dict(budget=1.0))
    import transformers

    def ids(b: int) -> tuple:
        g = torch.Generator().manual_seed(b)
        return (torch.randint(0, 128, (b, 16), generator=g),)

    decoder = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, use_cache=False,
    )
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**decoder))
        return Case(name, model, ids, _logits_sum, dict(budget=1.0))
    if name == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**decoder))
        return Case(name, model, ids, _logits_sum, dict(budget=1.0))
    if name == "mistral":
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**dict(decoder, use_cache=True))
        )
        return Case(name, model, ids, _logits_sum, dict(budget=1.0))
    if name == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                                         use_cache=False)
        return Case(name, transformers.GPT2LMHeadModel(config), ids, _logits_sum,
                    dict(budget=1.0))
    if name == "bert":
        config = transformers.BertConfig(
            hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
            vocab_size=128,
        )
        return Case(name, transformers.BertModel(config), ids, _hidden_sum, dict(budget=1.0))
    raise ValueError(f"unknown case {name!r}")


CASES = ("w1", "w1_bf16", "w1_wide", "w1_wide_bf16", "w1_bf16_outer", "llama_bf16_outer", "bert", "gpt2", "llama", "qwen2", "mistral", "lstm", "bn_conv")


def check(name: str, batches: Sequence[int]) -> list[tuple]:
    """``(case, batch, policy, forecast peak, real peak)`` rows."""
    c = case(name)
    rows = []
    for b in batches:
        args = c.make_args(b)
        with contextlib.ExitStack() as stack:
            if c.outer_autocast:
                stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            forecast = forecast_remat(c.model, args, c.loss_fn, **c.kwargs)
            for policy in forecast.policies.values():
                real = real_step_peak(c.model, args, c.loss_fn, policy.config)
                rows.append((name, b, policy.name, policy.peak_bytes, real))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=list(CASES))
    parser.add_argument("--batches", default="2,4,8")
    parser.add_argument("--threads", type=int, default=1)
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    batches = [int(b) for b in ns.batches.split(",")]
    print(f"{'case':<16} {'batch':>5} {'policy':<16} {'forecast':>12} {'real':>12} {'real/fc':>8}")
    worst = 0.0
    for name in ns.cases:
        for cname, b, policy, fc, real in check(name, batches):
            ratio = real / fc if fc else float("inf")
            worst = max(worst, ratio)
            print(f"{cname:<16} {b:>5} {policy:<16} {fc:>12,} {real:>12,} {ratio:>8.4f}",
                  flush=True)
    print(f"largest real/forecast: {worst:.4f}")


if __name__ == "__main__":
    main()
