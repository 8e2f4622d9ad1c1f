"""gradient_checkpoint_scope in bytes, measured with the profiler's memory events
(tests/conftest.py): what stays resident after the forward, what the replay
allocates during backward, and that everything is released without the garbage
collector.

Every tensor here is float64 with N elements (8000 B) unless said otherwise; the
loss is 8 B.
"""

import contextlib
import gc

import pytest
import torch
import torch.nn.functional as F

import torch_remat as remat
from torch_remat.scope.hooks import hook_stack

N = 1000
T = 8 * N  # bytes of one tensor
LOSS = 8
RNG_STATE = torch.get_rng_state().numel()  # 5056 B: one CPU generator state


@pytest.fixture(autouse=True)
def _no_garbage_collection():
    # Byte counts must not depend on when gc frees garbage of earlier tests, and
    # nothing here may rely on gc: collect once, then keep it off for the test.
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def leaves(n):
    return [torch.randn(N, dtype=torch.float64, requires_grad=True) for _ in range(n)]


def scope_or_not(use):
    return remat.gradient_checkpoint_scope() if use else contextlib.nullcontext()


def profile_backward(loss):
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        loss.backward()
    replays = [e for e in prof.events() if e.name == "remat.scope.replay"]
    net = sum(e.self_cpu_memory_usage for e in prof.events())
    return replays, net


def test_scope_intermediates_are_freed_after_forward_and_recomputed_in_backward(memory_probe):
    # The seed's scenario: h and x are created in the scope and saved by ops inside
    # (x = h * b saves h) and after it (sin saves x).
    a, b = leaves(2)
    resident = {}
    for use in (False, True):
        with memory_probe() as fwd:
            with scope_or_not(use):
                h = a.exp()
                x = h * b
            loss = x.sin().sum()
            del h, x
        resident[use] = fwd.bytes
        if not use:
            loss.backward()
            del loss
    assert resident[False] == 2 * T + LOSS  # h and x kept for backward
    assert resident[True] == LOSS  # neither: only recipes are stored
    a.grad = b.grad = None
    replays, net = profile_backward(loss)
    # One replay recreates both (exp and mul), held until backward has used them ...
    assert [e.cpu_memory_usage for e in replays] == [2 * T]
    # ... and freed after: what remains is a.grad and b.grad.
    assert net == 2 * T
    assert hook_stack() == []


def test_view_of_a_scope_output_taken_outside_is_not_stored_in_full(memory_probe):
    # The original design does not know the view and stores it, keeping all of x.
    a = leaves(1)[0]
    c = torch.randn(10, dtype=torch.float64, requires_grad=True)
    with memory_probe() as fwd:
        with remat.gradient_checkpoint_scope():
            x = a.exp()
        v = x[100:110]  # a view of x made after the scope
        loss = (v * c).sum()  # saves v: the scope's recipe plus the view's geometry
        del x, v
    assert fwd.bytes == LOSS
    replays, _ = profile_backward(loss)
    assert [e.cpu_memory_usage for e in replays] == [T]  # x recomputed, then viewed
    expected = a.detach().exp()[100:110]
    assert torch.equal(c.grad, expected)


def test_sibling_scopes_alive_together_are_both_dropped_and_both_recomputed(memory_probe):
    a, b = leaves(2)
    with memory_probe() as fwd:
        with remat.gradient_checkpoint_scope():
            x1 = a.exp()
        with remat.gradient_checkpoint_scope():
            x2 = b.exp()
        loss = (x1 * x2).sum()
        del x1, x2
    assert fwd.bytes == LOSS
    replays, net = profile_backward(loss)
    assert [e.cpu_memory_usage for e in replays] == [T, T]
    assert net == 2 * T  # a.grad and b.grad


def test_nested_scopes_drop_what_both_created(memory_probe):
    a, b = leaves(2)
    with memory_probe() as fwd:
        with remat.gradient_checkpoint_scope():
            with remat.gradient_checkpoint_scope():
                x = a.exp()
            y = x * b
        loss = y.sin().sum()
        del x, y
    assert fwd.bytes == LOSS
    replays, _ = profile_backward(loss)
    assert [e.cpu_memory_usage for e in replays] == [2 * T]


def test_random_op_costs_one_generator_state(memory_probe):
    # Without the scope: exp's result, dropout's mask (float64 noise on CPU) and its
    # output, 24,008 B. All are scope tensors: recomputed, not stored. What the scope
    # keeps for the replay is the CPU generator's state before the draw.
    a = leaves(1)[0]
    with memory_probe() as fwd:
        with remat.gradient_checkpoint_scope():
            x = F.dropout(a.exp(), 0.5)
        loss = x.sin().sum()
        del x
    assert fwd.bytes == RNG_STATE + LOSS
    loss.backward()


def test_release_is_deterministic_without_the_garbage_collector(memory_probe):
    # The original design removes its hook when gc happens to clear a tensor
    # attribute. Here: the hook leaves the stack the moment the last scope tensor
    # dies, and the recorded ops (holding the scope's input) die with the graph.
    a, c = leaves(2)
    gc.collect()
    gc.disable()
    try:
        with memory_probe() as probe:
            a2 = a * 2  # the scope's input: held by the recorded ops for the replay
            with remat.gradient_checkpoint_scope():
                x = a2.exp()
            loss = (x * c).sum()
            assert len(hook_stack()) == 1
            del x
            assert hook_stack() == []  # removed right here, not at some gc
            del a2  # still held by the scope's record, which the graph holds
            loss.backward()
            del loss  # graph, recipes and record go; a2 goes with them
        assert probe.bytes == 2 * T  # a.grad and c.grad, nothing else
    finally:
        gc.enable()
