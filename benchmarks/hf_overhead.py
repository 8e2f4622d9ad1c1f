"""Per-layer CPU cost of checkpointing a stock transformers model.

A tiny Llama (decoder layers of width 64, one thread), small enough that the
Python work each checkpointed layer call does shows in the step time:

* no checkpointing;
* transformers' own gradient checkpointing (``gradient_checkpointing_enable`` with
  ``use_reentrant=False``: ``torch.utils.checkpoint`` around each decoder layer);
* ``apply_remat`` on the decoder layers (full checkpoint, no regions).

Before timing, both checkpointed modes' gradients are compared with the plain
model's with ``torch.equal``. The steps are interleaved per round
(``benchmarks.measure.time_samples``); each ratio is the median per-round ratio.

Also printed: what ``ModuleState.capture`` costs per layer call, walked (the first
call of a layer, and every call where something the walk read changed) and reused
(the later calls of an unchanged layer, ``module_state._Reuse``): transformers
wraps each layer's ``forward`` in decorators, whose closures the walk reads.

    python benchmarks/hf_overhead.py [--rounds 30] [--layers 4] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.measure import preallocate_grads, time_ratio, time_samples
from torch_remat.engine import module_state
from torch_remat.integrations import apply_remat

THREADS = 1
STEPS_PER_SAMPLE = 3


def _models(layers: int, width: int) -> dict[str, torch.nn.Module]:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=128, use_cache=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config)
    models = {"no checkpointing": plain}
    for name in ("transformers checkpointing", "apply_remat"):
        model = transformers.LlamaForCausalLM(config)
        model.load_state_dict(plain.state_dict())
        models[name] = model
    models["transformers checkpointing"].gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    apply_remat(models["apply_remat"], check_fn=lambda m: type(m).__name__ == "LlamaDecoderLayer")
    for model in models.values():
        model.train()
    return models


def _grads(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(ids).logits.sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def capture_costs(layer_call, calls: int) -> tuple[float, float]:
    """Median seconds of a walked and of a reused capture per layer call:
    ``layer_call(i)`` runs one step; the capture's ``memo.reuse`` is dropped before
    every other call, so that one walks and the next reuses."""
    walked: list[float] = []
    reused: list[float] = []
    capture = module_state.ModuleState.capture

    def timed(fn, unwritten, leaves=(), memo=None):
        start = time.perf_counter()
        state = capture(fn, unwritten, leaves, memo)
        took = time.perf_counter() - start
        (reused if timed.reusing else walked).append(took)
        return state

    timed.reusing = False
    module_state.ModuleState.capture = staticmethod(timed)
    try:
        for i in range(calls):
            timed.reusing = bool(i % 2)
            layer_call(timed.reusing)
    finally:
        module_state.ModuleState.capture = staticmethod(capture)
    return statistics.median(walked), statistics.median(reused)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="2 layers, 10 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.rounds = 2, 10
    torch.set_num_threads(THREADS)
    models = _models(args.layers, args.width)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = _grads(models["no checkpointing"], ids)
    for name in ("transformers checkpointing", "apply_remat"):
        got = _grads(models[name], ids)
        if not all(torch.equal(a, b) for a, b in zip(expected, got)):
            print(f"{name}: gradients differ from no checkpointing", file=sys.stderr)
            return 1
    for model in models.values():
        preallocate_grads(model)

    steps = {name: (lambda m=m: m(ids).logits.sum().backward()) for name, m in models.items()}
    for step in steps.values():
        step()
    samples = time_samples(steps, rounds=args.rounds, steps_per_sample=STEPS_PER_SAMPLE)
    print(
        f"tiny Llama, {args.layers} decoder layers of width {args.width}, batch 2 x 16 tokens, "
        f"{THREADS} thread (median of {args.rounds} interleaved rounds; quartiles of the "
        "per-round ratio)"
    )
    plain = statistics.median(samples["no checkpointing"])
    print(f"  no checkpointing            {plain * 1e3:7.2f} ms per step")
    for name in ("transformers checkpointing", "apply_remat"):
        step_s = statistics.median(samples[name])
        print(
            f"  {name:27s} {step_s * 1e3:7.2f} ms per step, adds "
            f"{(step_s - plain) * 1e3 / args.layers:.3f} ms per layer"
        )
    r = time_ratio(samples, "apply_remat", "transformers checkpointing")
    print(
        f"  apply_remat / transformers checkpointing: {r.ratio:.3f}x "
        f"[{r.ratio_low:.3f}, {r.ratio_high:.3f}]"
    )

    remat_model = models["apply_remat"]
    memos = [layer.forward._checkpointed.capture_memo for layer in remat_model.model.layers]

    def layer_call(reuse: bool) -> None:
        if not reuse:
            # (what the walk compares is unchanged; dropping the memos forces walks)
            for memo in memos:
                memo.reuse = None
        remat_model(ids).logits.sum().backward()

    # (every layer captures per step: the medians are per layer call)
    walked, reused = capture_costs(layer_call, 2 * max(args.rounds // 2, 5))
    print(
        f"  module-state capture per layer call: walked {walked * 1e6:.1f} us, "
        f"reused {reused * 1e6:.1f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
