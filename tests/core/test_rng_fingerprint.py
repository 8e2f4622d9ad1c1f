"""The CPU generator's fingerprint (which tells whether a checkpoint's forward drew
random numbers): it changes with every draw, needs no numpy, and runs no aten op, so
a dispatch mode around the checkpoint (gradient_checkpoint_scope's recording mode)
never sees the state tensor."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_remat.engine import rng


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_fingerprint_changes_with_each_draw_and_only_then():
    cpu = rng.DefaultGenerator(torch.device("cpu"))
    before = cpu.fingerprint()
    assert cpu.fingerprint() == before
    torch.rand(1)
    after_one = cpu.fingerprint()
    assert after_one != before
    torch.default_generator.set_state(cpu.get_state())
    assert cpu.fingerprint() == after_one


def test_fingerprint_runs_no_aten_op_under_a_dispatch_mode():
    with _Ops() as ops:
        rng.DefaultGenerator(torch.device("cpu")).fingerprint()
    assert ops.seen == []
