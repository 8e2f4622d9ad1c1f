"""W2's step in instructions: ``valgrind --tool=callgrind python benchmarks/w2_instructions.py MODE STEPS``.

Builds W2's full model (benchmarks/w2_overhead.py: 12 blocks, d=64, one thread),
installs one mode, runs two warm-up steps and then STEPS steps. Run it twice with
different STEPS under callgrind; the difference of the two instruction totals over
the difference of the step counts is the cost of one step, with start-up (importing
torch, building the model) cancelled. The garbage collector is off for the counted
steps and the .sh fixes the hash seed, so two runs of one tree agree: deterministic,
unlike a time on a shared machine: ``bash benchmarks/w2_instructions.sh`` does both runs per mode.
"""

from __future__ import annotations

import gc
import sys

import torch

from benchmarks import modes as M
from benchmarks.gpt import GPTStack
from benchmarks.measure import preallocate_grads
from benchmarks.w2_overhead import FULL, MODES, THREADS


def main(mode_name: str, steps: int) -> None:
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    stack = GPTStack(FULL)
    x = stack.example_input()
    preallocate_grads(stack, x)
    (mode,) = [m for m in MODES if m.name == mode_name]
    M.install(stack, mode, rng=False)
    stack(x).sum().backward()
    stack(x).sum().backward()
    # The collector off for the counted steps (the engine creates no reference
    # cycles), so that when it runs does not move the count between two runs.
    gc.collect()
    gc.freeze()
    gc.disable()
    for _ in range(steps):
        stack(x).sum().backward()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
