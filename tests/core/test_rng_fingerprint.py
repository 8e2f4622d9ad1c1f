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


def _public(g: torch.Generator) -> bytes:
    return bytes(g.get_state().untyped_storage())


def test_in_place_reader_is_found_on_the_tested_builds():
    # (the layout of CPUGeneratorImpl on torch 2.13 and 2.15: a build where it moved
    # falls back to get_state(), which the tests below cover too)
    from torch_remat import _compat

    assert _compat.cpu_generator_reader(torch.default_generator) is not None
    assert rng._find_cpu_reader() is not None


def test_in_place_reader_changes_exactly_when_get_state_does():
    from torch_remat import _compat

    g = torch.Generator()
    g.manual_seed(3)
    read = _compat.cpu_generator_reader(g)
    assert read is not None
    steps = [
        lambda: None,
        lambda: torch.randn(1, generator=g, dtype=torch.float64),  # caches a normal sample
        lambda: None,
        lambda: torch.randn(1, generator=g, dtype=torch.float64),  # uses it: only the cache moves
        lambda: g.set_state(g.get_state()),
        lambda: torch.rand(5, generator=g),
        lambda: torch.bernoulli(torch.full((7,), 0.5), generator=g),
        lambda: torch.randperm(900, generator=g),  # past a twist of the generator
        lambda: g.manual_seed(3),
        lambda: g.set_state(_state_after_a_draw(g)),
    ]
    for i, step in enumerate(steps):
        fp, public = read(), _public(g)
        step()
        assert (read() != fp) == (_public(g) != public), f"step {i}"


def _state_after_a_draw(g: torch.Generator) -> torch.Tensor:
    other = torch.Generator()
    other.set_state(g.get_state())
    torch.rand(1, generator=other)
    return other.get_state()


def test_fingerprint_falls_back_to_get_state_where_the_layout_is_unknown(monkeypatch):
    cpu = rng.DefaultGenerator(torch.device("cpu"))
    monkeypatch.setattr(rng, "_cpu_reader", [None])
    before = cpu.fingerprint()
    assert isinstance(before, bytes) and cpu.fingerprint() == before
    torch.rand(1)
    assert cpu.fingerprint() != before


def test_a_draw_in_the_forward_is_still_seen_with_the_in_place_reader():
    # the RNG guard refuses a replay that draws other numbers than its forward did
    import torch_remat as remat
    from torch_remat import RecomputeMismatchError

    assert rng._find_cpu_reader() is not None
    def noisy(x):
        return x * torch.rand_like(x)

    x = torch.randn(4, requires_grad=True)
    f = remat.checkpoint(region_name="noisy")(noisy)
    y = f(x)
    try:
        y.sum().backward()
    except RecomputeMismatchError as e:
        assert "noisy" in str(e)
    else:
        raise AssertionError("a replay drawing other numbers than its forward was not refused")


def test_finding_the_in_place_reader_runs_no_op_a_callers_mode_sees(monkeypatch):
    # the layout is found at the first fingerprint, which may run inside a dispatch
    # mode (gradient_checkpoint_scope's recording) or a torch.device block
    monkeypatch.setattr(rng, "_cpu_reader", [])
    with _Ops() as ops:
        rng.DefaultGenerator(torch.device("cpu")).fingerprint()
    assert ops.seen == []
    assert rng._cpu_reader[0] is not None
    monkeypatch.setattr(rng, "_cpu_reader", [])
    with torch.device("meta"):
        rng.DefaultGenerator(torch.device("cpu")).fingerprint()
    assert rng._cpu_reader[0] is not None
