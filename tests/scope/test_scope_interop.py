"""gradient_checkpoint_scope next to remat.checkpoint and the user's own saved-tensor
hooks: exact gradients, and in bytes what each combination keeps.

Tensors are float64 with N elements (8000 B). ``+ 16`` in the byte counts is the
scalar loss (8 B) and the wrapped number 2 of ``x = a * 2``, which MulBackward saves
(8 B); ``RNG`` is one CPU generator state (5056 B).
"""

import contextlib
import gc

import pytest
import torch
from helpers import CountingSaveOnCpu, assert_bitwise_equal, grads

import torch_remat as remat
from torch_remat.scope.hooks import hook_stack

N = 1000
T = 8 * N
D = torch.float64
RNG = torch.get_rng_state().numel()


def scope_or_not(use):
    return remat.gradient_checkpoint_scope() if use else contextlib.nullcontext()


def checkpoint(fn):
    return remat.checkpoint(region_name="c", recompute_state_hooks=(remat.CPURNGStateHook(),))(fn)


@pytest.fixture(autouse=True)
def _no_garbage_collection():
    # Byte counts must not depend on when gc frees garbage of earlier tests, and
    # nothing here may rely on gc: collect once, then keep it off for the test.
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def leaves(n, size=N):
    return [torch.randn(size, dtype=D, requires_grad=True) for _ in range(n)]


def test_scope_in_recomputed_code_of_a_checkpoint_changes_nothing(memory_probe):
    # The checkpoint stores nothing there anyway; a scope would only keep its inputs
    # (here h) for a second replay. It joins the checkpoint instead.
    a, w = leaves(2)

    def fn(x, use):
        h = x.exp()
        with scope_or_not(use):
            g = torch.nn.functional.dropout(h.sin(), 0.5).tanh()
        return g * w

    resident = {}
    for use in (False, True):
        with memory_probe() as fwd:
            x = a * 2
            loss = checkpoint(lambda x, use=use: fn(x, use))(x).sum()
            del x
        resident[use] = fwd.bytes
        loss.backward()
        del loss
    # The checkpoint's input x and its state hook's entry snapshot, with or without.
    assert resident[True] == resident[False] == T + RNG + 16
    expected = grads([a, w], [], lambda: fn(a * 2, False).sum(), seed=0)
    actual = grads([a, w], [], lambda: checkpoint(lambda x: fn(x, True))(a * 2).sum(), seed=0)
    assert_bitwise_equal(actual, expected)
    assert hook_stack() == []


def test_scope_inside_a_save_region_recomputes_what_it_creates(memory_probe):
    a, w = leaves(2)

    def fn(x, use):
        def body(t):
            with scope_or_not(use):
                h = (t * w).exp()  # mul saves t and w; exp saves h
                g = h.sin()  # saves h
            return g

        g = remat.region(body, "proj", recompute=False)(x)
        remat.recompute_needs_tensor(g)  # kept for the replay of tanh
        return g.tanh()

    resident = {}
    for use in (False, True):
        with memory_probe() as fwd:
            x = a * 2
            loss = remat.checkpoint(region_name="c")(lambda x, use=use: fn(x, use))(x).sum()
            del x
        resident[use] = fwd.bytes
        a.grad = w.grad = None
        loss.backward()
        del loss
    # Without the scope the region keeps x, h and g. With it, h and g (scope tensors)
    # are recipes; x, read by the scope, is kept (once: region and scope share it).
    assert resident[False] == 3 * T + 16
    assert resident[True] == T + 16
    expected = grads([a, w], [], lambda: fn(a * 2, False).sum())
    actual = grads(
        [a, w], [], lambda: remat.checkpoint(region_name="c")(lambda x: fn(x, True))(a * 2).sum()
    )
    assert_bitwise_equal(actual, expected)
    assert hook_stack() == []


def test_checkpoint_inside_a_scope(memory_probe):
    a, w = leaves(2)

    def block(x):
        h = remat.region(lambda t: (t * w).exp(), "proj", recompute=False)(x)
        remat.recompute_needs_tensor(h)  # the replayed dropout reads it
        return torch.nn.functional.dropout(h, 0.2).sin()

    def loss_fn(use, ck):
        with scope_or_not(use):
            x = a * 2
            y = (checkpoint(block) if ck else block)(x)
        return (y * w).sum()

    resident = {}
    for use in (False, True):
        with memory_probe() as fwd:
            loss = loss_fn(use, True)
        resident[use] = fwd.bytes
        loss.backward()
        del loss
    # Without the scope: x and h (the SAVE region's saves) and y (saved by y * w),
    # plus the checkpoint's state-hook snapshot (taken at entry and after the region;
    # the region draws no random numbers, so both are one stored state). With it x, h
    # and y are scope tensors: recipes. The scope adds the generator state the
    # dropout saw, for its own replay.
    assert resident[False] == 3 * T + RNG + 16
    assert resident[True] == RNG + RNG + 16
    expected = grads([a, w], [], lambda: loss_fn(False, False), seed=3)
    actual = grads([a, w], [], lambda: loss_fn(True, True), seed=3)
    assert_bitwise_equal(actual, expected)
    assert hook_stack() == []


def test_scope_in_checkpoint_in_scope_gives_exact_gradients():
    a, w = leaves(2, size=16)

    def inner(x, use):
        h = x.exp()
        with scope_or_not(use):
            k = (h * w).sin()
        return k * h

    def loss_fn(use):
        with scope_or_not(use):
            f = checkpoint(lambda x: inner(x, use)) if use else (lambda x: inner(x, use))
            y = f(a * 2)
        return (y * w).tanh().sum()

    assert_bitwise_equal(
        grads([a, w], [], lambda: loss_fn(True)), grads([a, w], [], lambda: loss_fn(False))
    )
    assert hook_stack() == []


def test_checkpoint_replay_stopping_early_inside_a_scope_leaves_the_stack_clean():
    # Inside a checkpoint's replay the scope joins the checkpoint; the replay's early
    # stop is an exception that unwinds through the scope's exit.
    a = leaves(1, size=16)[0]

    def fn(x):
        with remat.gradient_checkpoint_scope():
            h = x.exp().sin()  # the last tensor backward needs: the replay stops here
            return h * 2

    actual = grads([a], [], lambda: checkpoint(fn)(a * 1).sum())
    expected = grads([a], [], lambda: fn(a * 1).sum())
    assert_bitwise_equal(actual, expected)
    assert hook_stack() == []


def test_save_on_cpu_around_a_scope_offloads_only_what_the_scope_did_not_create():
    a = torch.randn(3, 6, dtype=D, requires_grad=True)
    w, c = (
        torch.randn(6, 6, dtype=D, requires_grad=True),
        torch.randn(6, dtype=D, requires_grad=True),
    )
    offload = CountingSaveOnCpu()

    def loss_fn(use):
        with offload:
            with scope_or_not(use):
                h = (a @ w).exp()  # mm saves a (3, 6) and w (6, 6); exp saves h (3, 6)
            y = h * c  # saves h and c (6,): the user's hook is innermost here
        return y.sin().sum()  # saves y

    expected = grads([a, w, c], [], lambda: loss_fn(False))
    assert sorted(offload.offloaded) == sorted([(3, 6), (6, 6), (3, 6), (3, 6), (6,)])
    offload.offloaded.clear()
    actual = grads([a, w, c], [], lambda: loss_fn(True), scope=True)
    assert_bitwise_equal(actual, expected)
    # exp's save of h went to the scope (a recipe); mm's inputs were handed to the
    # user's hook; after the scope, h * c runs inside save_on_cpu: offloaded.
    assert sorted(offload.offloaded) == sorted([(3, 6), (6, 6), (3, 6), (6,)])


def test_hook_whose_last_tensor_dies_in_backward_leaves_at_the_next_scope_use():
    # save_on_cpu keeps a CPU tensor itself (Tensor.cpu() is a no-op on CPU), so the
    # graph holds the scope's h and frees it during backward. Backward runs under a
    # copy of the caller's hook stack that it restores afterwards, so the hook cannot
    # leave then; it leaves at this thread's next scope (or next save it sees).
    a, c = leaves(2, size=6)
    with torch.autograd.graph.save_on_cpu():
        with remat.gradient_checkpoint_scope():
            h = a.exp()
        y = h * c
    loss = y.sum()
    del h, y
    loss.backward()
    assert len(hook_stack()) == 1
    with remat.gradient_checkpoint_scope():
        pass
    assert hook_stack() == []


def _scoped_body(a, b, c, use):
    with (remat.gradient_checkpoint_scope() if use else contextlib.nullcontext()):
        x = (a + b).exp()
    return (x * c).sin().sum()


def test_under_torch_compile_the_scope_is_a_graph_break_and_still_replays():
    torch._dynamo.reset()
    a, b, c = (torch.randn(8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    compiled = torch.compile(_scoped_body, backend="eager")
    expected = torch.autograd.grad(_scoped_body(a, b, c, False), [a, b, c])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        actual = torch.autograd.grad(compiled(a, b, c, True), [a, b, c])
    assert sum(1 for e in prof.events() if e.name == "remat.scope.replay") == 1
    assert all(torch.equal(x, y) for x, y in zip(actual, expected))


def test_under_fullgraph_compile_the_scope_is_refused_naming_itself():
    torch._dynamo.reset()
    a, b, c = (torch.randn(8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    compiled = torch.compile(_scoped_body, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="gradient_checkpoint_scope runs eagerly only"):
        compiled(a, b, c, True)
