"""Step time against upstream torch-remat 0.2.2, both packages in one process.

Upstream and this package share the import name ``torch_remat``. The released
wheel is fetched with pip (``pip download --no-deps torch-remat==0.2.2``, or a
wheel or unpacked directory named by ``TORCH_REMAT_UPSTREAM``), unpacked into a
cache directory, and its absolute imports renamed to ``torch_remat_upstream``, so
the two load side by side and every mode is timed interleaved with its peer in the
same rounds (``benchmarks.measure.time_samples``).

Workloads:

* W2 (``benchmarks/w2_overhead.py``: 12 tiny GPT blocks, one thread), full
  checkpoint and SAVE regions around the four linears;
* W3 many regions: the W3 chain (``benchmarks/w3_sqrt_chain.py``) at its quick
  size, 64 x (Linear + Tanh) in 8 checkpointed segments, every Linear a SAVE
  region (64 regions per step).

Both sides run the same user code: the GPT blocks and the chain call
``remat.region`` / ``remat.recompute_needs_tensor`` through a module attribute
that each sample points at its package. Gradients of the two are compared with
``torch.equal`` before timing.

    python benchmarks/upstream_compare.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch_remat as remat
from benchmarks import gpt as gpt_module
from benchmarks import modes as M
from benchmarks.gpt import GPTStack
from benchmarks.measure import preallocate_grads, time_ratio, time_samples
from benchmarks.w2_overhead import FULL as W2_FULL
from benchmarks.w2_overhead import STEPS_PER_SAMPLE, THREADS

VERSION = "0.2.2"
NAME = "torch_remat_upstream"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torch_remat_bench"

# (mode, bound): the step-time ratio this package aims at against upstream.
TARGETS = {"W2 full": 0.90, "W2 save linears": 0.70, "W3 many regions": 0.70}


def _wheel() -> Path:
    given = os.environ.get("TORCH_REMAT_UPSTREAM")
    if given:
        return Path(given)
    found = sorted(CACHE.glob(f"torch_remat-{VERSION}-*.whl"))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE),
         f"torch-remat=={VERSION}"],
        check=True,
    )
    return sorted(CACHE.glob(f"torch_remat-{VERSION}-*.whl"))[0]


def load_upstream() -> Any:
    """Upstream's package, imported as ``torch_remat_upstream``."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    source = _wheel()
    root = CACHE / f"renamed-{VERSION}"
    target = root / NAME
    if not target.exists():
        with tempfile.TemporaryDirectory() as tmp:
            if source.is_dir():
                package = source / "torch_remat" if (source / "torch_remat").is_dir() else source
            else:
                with zipfile.ZipFile(source) as z:
                    z.extractall(tmp)
                package = Path(tmp) / "torch_remat"
            target.mkdir(parents=True)
            for path in package.glob("*.py"):
                text = re.sub(r"\btorch_remat\b", NAME, path.read_text())
                (target / path.name).write_text(text)
    sys.path.insert(0, str(root))
    return importlib.import_module(NAME)


class _Uses:
    """Points the user code's ``remat`` at one package for a sample."""

    def __init__(self, package: Any) -> None:
        self.package = package

    def __call__(self) -> None:
        gpt_module.remat = self.package


def _w2(upstream: Any) -> tuple[dict, dict, dict]:
    torch.manual_seed(0)
    base = GPTStack(W2_FULL)
    x = base.example_input()
    steps, setups, params = {}, {}, {}
    # upstream keeps a SAVE output only for a region consumer or
    # recompute_needs_tensor, not for an op that saves it, and replays to the end:
    # the GELU reads fc1's
    # output, the residual add fc2's, so both sides name them
    save_linears = replace(M.SAVE_LINEARS, keep=M.SAVE_LINEARS.keep | {"fc1", "fc2"})
    for label, policy in (("full", M.REMAT_FULL.policy), ("save linears", save_linears)):
        for side, package in (("ours", remat), ("upstream", upstream)):
            # Each mode steps its own copy of the stack (same weights), set up once,
            # as a training loop runs one configuration: one stack switched between
            # modes would rebind the blocks' attributes every sample.
            stack = copy.deepcopy(base)
            preallocate_grads(stack, x)
            gpt_module.remat = package
            for b in stack.blocks:
                b.set_policy(policy)
            stack.block_calls = [
                package.checkpoint(region_name=f"blocks.{i}")(b) for i, b in enumerate(stack.blocks)
            ]
            name = f"W2 {label} [{side}]"
            steps[name] = (lambda stack=stack: stack(x).sum().backward())
            setups[name] = _Uses(package)
            params[name] = list(stack.parameters())
    return steps, setups, params

def _w3(upstream: Any) -> tuple[dict, dict, dict]:
    torch.manual_seed(0)
    n, width, batch, k = 64, 64, 32, 8
    layers = nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(width, width), nn.Tanh())])
    x = torch.randn(batch, width)
    preallocate_grads(layers)
    per = n // k
    steps, setups = {}, {}
    params = list(layers.parameters())
    for side, package in (("ours", remat), ("upstream", upstream)):
        def segment(j: int, package: Any = package):
            mods = list(layers[2 * j * per: 2 * (j + 1) * per])
            regions = [
                package.region(m, f"linear.{i}", recompute=False) if isinstance(m, nn.Linear) else m
                for i, m in enumerate(mods)
            ]

            def run(h: torch.Tensor) -> torch.Tensor:
                for r in regions:
                    h = r(h)
                    if r is not regions[-1] and not isinstance(r, nn.Module):
                        package.recompute_needs_tensor(h)  # the Tanh reads it in the replay
                return h

            return package.checkpoint(region_name=f"segments.{j}")(run)

        segments = [segment(j) for j in range(k)]

        def step(segments: list = segments) -> None:
            h = x
            for s in segments:
                h = s(h)
            h.sum().backward()

        name = f"W3 many regions [{side}]"
        steps[name], setups[name] = step, _Uses(package)
    return steps, setups, {name: params for name in steps}


def _grads(step, params) -> list[torch.Tensor]:
    for p in params:
        p.grad.zero_()
    step()
    return [p.grad.clone() for p in params]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    upstream = load_upstream()
    w2_steps, w2_setups, w2_params = _w2(upstream)
    w3_steps, w3_setups, w3_params = _w3(upstream)
    steps = {**w2_steps, **w3_steps}
    setups = {**w2_setups, **w3_setups}
    params = {**w2_params, **w3_params}
    # the two sides must compute the same gradients before their times mean anything
    for name in steps:
        setups[name]()
        steps[name]()  # warm-up
    for name in [n for n in steps if n.endswith("[ours]")]:
        peer = name.replace("[ours]", "[upstream]")
        setups[name]()
        ours = _grads(steps[name], params[name])
        setups[peer]()
        theirs = _grads(steps[peer], params[peer])
        if not all(torch.equal(a, b) for a, b in zip(ours, theirs)):
            print(f"{name}: gradients differ from upstream's", file=sys.stderr)
            return 1
    samples = time_samples(
        steps, rounds=args.rounds, steps_per_sample=STEPS_PER_SAMPLE,
        setup=lambda name: setups[name](),
    )
    gpt_module.remat = remat
    print(f"step time against upstream torch-remat {VERSION} (median of {args.rounds} "
          "interleaved rounds; quartiles of the per-round ratio)")
    ok = True
    for label, bound in TARGETS.items():
        r = time_ratio(samples, f"{label} [ours]", f"{label} [upstream]")
        met = r.ratio <= bound
        ok &= met
        print(f"  {label:18s} {r.ratio:.3f}x  [{r.ratio_low:.3f}, {r.ratio_high:.3f}]  "
              f"ours {r.median_step_s * 1e3:.2f} ms, upstream "
              f"{r.peer_median_step_s * 1e3:.2f} ms per step"
              f"  target <= {bound:.2f}: {'met' if met else 'NOT met'}")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
