"""PyTorch's saved-tensor hook mechanics (seed 004) around remat.checkpoint and
gradient_checkpoint_scope: offloading with save_on_cpu, disabled hooks, compiled
autograd, and torch.compile inside a checkpoint.

Compiled-autograd tests compile once each (a few seconds); they reset Dynamo and
compiled autograd afterwards so no cache leaks into other tests.
"""

import contextlib
import gc

import pytest
import torch
from helpers import CountingSaveOnCpu, assert_bitwise_equal, grads

import torch_remat as remat
from torch_remat.scope.hooks import hook_stack

D = torch.float64


@pytest.fixture
def compiled_autograd():
    from torch._dynamo import compiled_autograd as ca

    yield ca
    ca.reset()
    torch._dynamo.reset()


# ----------------------------------------------------------------- save_on_cpu


def test_save_on_cpu_around_a_checkpoint_offloads_what_the_checkpoint_keeps():
    w = torch.randn(6, 6, dtype=D, requires_grad=True)
    x = torch.randn(3, 6, dtype=D, requires_grad=True)

    def fn(x):
        # The SAVE region saves x, w and exp's result p (all (3, 6) but w).
        p = remat.region(lambda t: (t @ w).exp(), "proj", recompute=False)(x)
        remat.recompute_needs_tensor(p)  # the replayed sin reads it
        return p.sin().tanh()  # sin saves p (kept); tanh saves its result (dropped)

    expected = grads([w], [x], lambda x: fn(x).sum())
    offload = CountingSaveOnCpu()

    def run(x):
        with offload:
            return remat.checkpoint(region_name="c")(fn)(x).sum()

    actual = grads([w], [x], run)
    assert_bitwise_equal(actual, expected)
    # Offloaded: the checkpoint's input x (packed at its start, as torch's checkpoint
    # saves its inputs), the SAVE region's saves (x, w, p) and p once more as the
    # tensor the checkpoint keeps for its replay. Not offloaded: tanh's result, which
    # is not stored at all but recomputed in backward.
    assert sorted(offload.offloaded) == sorted([(3, 6), (3, 6), (6, 6), (3, 6), (3, 6)])


def test_save_on_cpu_inside_a_checkpoint_offloads_in_forward_and_in_the_replay():
    x = torch.randn(4, dtype=D, requires_grad=True)
    offload = CountingSaveOnCpu()

    def fn(x):
        with offload:
            h = x.sin().exp()  # sin saves x, exp saves h: offloaded, not dropped
        return h.tanh()  # dropped and recomputed

    expected = grads([], [x], lambda x: fn(x).sum())
    offload.offloaded.clear()
    actual = grads([], [x], lambda x: remat.checkpoint(region_name="c")(fn)(x).sum())
    assert_bitwise_equal(actual, expected)
    # The replay re-enters save_on_cpu: its two saves are offloaded again (and thrown
    # away with the replay's graph) before tanh's result is refilled.
    assert offload.offloaded == [(4,), (4,)] * 2


# ------------------------------------------------------ disable_saved_tensors_hooks


def test_scope_under_disabled_hooks_raises_with_the_users_message():
    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in my transform"):
        with pytest.raises(remat.RematError, match="disabled.*no hooks in my transform"):
            with remat.gradient_checkpoint_scope():
                x.sin()
    assert hook_stack() == []


def test_disabling_hooks_while_a_scope_tensor_is_alive_fails_in_pytorch():
    # The scope's hook stays on the stack while its tensors live, and PyTorch refuses
    # to disable hooks over a non-empty stack (torch.func.grad/vjp do this too).
    x = torch.randn(3, requires_grad=True)
    with remat.gradient_checkpoint_scope():
        y = x.sin()
    with pytest.raises(RuntimeError, match="no hooks in my transform"):
        with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in my transform"):
            pass
    del y
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in my transform"):
        pass


# ------------------------------------------------------------ compiled autograd

B, DIM, K = 64, 64, 3  # each activation 64 * 64 * 8 = 32768 B
ACT = B * DIM * 8


def make_model():
    torch.manual_seed(0)
    ws = [torch.randn(DIM, DIM, dtype=D, requires_grad=True) for _ in range(K)]

    def block(k):
        def fn(x):
            h = remat.region(lambda t: t @ ws[k], "proj", recompute=False)(x)
            remat.recompute_needs_tensor(h)
            return h.sin().exp().tanh()  # exp's and tanh's results are dropped

        return fn

    def model(x, ck):
        for k in range(K):
            x = (remat.checkpoint(region_name=f"block{k}")(block(k)) if ck else block(k))(x)
        return x.sum()

    return ws, model


def backward_memory(loss):
    """Peak live bytes during ``loss.backward()`` and the live bytes at the start of
    each recompute, from the profiler's allocation events in time order.

    Only blocks allocated inside the profile count, and their frees: the CPU
    allocator also reports frees of blocks it saw during an earlier profile (an
    earlier test's garbage, dropped at any moment), which are not this backward's."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        loss.backward()
    events = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    allocs = sorted(
        (e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size)
        for e in events
        if type(e.extra_fields).__name__ == "_ExtraFields_Allocation"
    )
    starts = sorted(e.start_time_ns for e in events if e.name.startswith("remat.recompute:"))
    mine = set()
    live = peak = 0
    at_start = []
    i = 0
    for ts, ptr, nbytes in allocs:
        if nbytes > 0:
            mine.add(ptr)
        elif ptr in mine:
            mine.discard(ptr)
        else:
            continue
        while i < len(starts) and starts[i] <= ts:
            at_start.append(live)
            i += 1
        live += nbytes
        peak = max(peak, live)
    at_start += [live] * (len(starts) - i)
    return peak, at_start


def _walk(events):
    for e in events:
        yield e
        yield from _walk(e.children)


def test_backward_memory_ignores_frees_of_blocks_seen_by_an_earlier_profile():
    # An earlier test's tensor, allocated while that test profiled, dropped during
    # this backward (by a hook here, by the garbage collector in a real suite).
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ):
        junk = [torch.empty(640, dtype=D)]
    a = torch.randn(B, DIM, dtype=D, requires_grad=True)

    def drop_junk(grad):
        junk.clear()
        return grad

    y = a.exp()
    y.register_hook(drop_junk)
    # exp's backward output (ACT, kept as a.grad) and the loss's gradient (8 B); the
    # earlier profile's 5,120 B block is freed in between and not counted.
    assert backward_memory(y.sum()) == (ACT + 8, [])
    assert junk == []


def run_model(ca_compiler, compiled_autograd):
    # Garbage left by earlier tests would otherwise be freed (by gc) at any moment of
    # the measured backward and show up as a negative allocation.
    gc.collect()
    gc.disable()
    try:
        return _run_model(ca_compiler, compiled_autograd)
    finally:
        gc.enable()


def _run_model(ca_compiler, compiled_autograd):
    ws, model = make_model()
    x = torch.randn(B, DIM, dtype=D, generator=torch.Generator().manual_seed(1)).requires_grad_()
    ctx = compiled_autograd._enable(ca_compiler) if ca_compiler else contextlib.nullcontext()
    with ctx:
        loss = model(x, ck=True)
        peak, at_start = backward_memory(loss)
    reference_ws, reference = make_model()
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref, ck=False).backward()
    for w, w_ref in zip(ws, reference_ws):
        assert torch.equal(w.grad, w_ref.grad)
    assert torch.equal(x.grad, x_ref.grad)
    return peak, at_start


def test_compiled_autograd_graph_run_directly_unpacks_progressively(compiled_autograd):
    eager = run_model(None, compiled_autograd)
    direct = run_model(lambda graph: graph, compiled_autograd)
    # Each recompute starts with the previous blocks' recomputed tensors already
    # freed: live are the weight gradients of the finished blocks and the incoming
    # gradient (one ACT each; 8 B is the loss's gradient).
    assert eager == (6 * ACT + 8, [8, 2 * ACT + 8, 3 * ACT + 8])
    assert direct == eager


@pytest.mark.slow
def test_compiled_autograd_with_dynamo_gives_exact_gradients_but_not_progressive(
    compiled_autograd,
):
    # torch.compile(backend="aot_eager") compiling the compiled-autograd graph: the
    # unpack hooks run eagerly (torch_remat keeps Dynamo out of the replay), the
    # gradients are exact, but recomputed tensors stay alive until the end of the
    # graph, so the peak is that of storing everything (measured; the same holds for
    # torch.utils.checkpoint under Dynamo in this torch version).
    compiled = run_model(torch.compile(backend="aot_eager"), compiled_autograd)
    # Eager: peak 6 ACT, recomputes start at [0, 2, 3] ACT. Here every block's
    # recomputed and intermediate tensors (7 ACT) are still alive when the next
    # block recomputes.
    assert compiled == (23 * ACT + 8, [8, 7 * ACT + 8, 14 * ACT + 8])


@pytest.mark.slow
def test_scope_under_compiled_autograd_gives_exact_gradients(compiled_autograd):
    a = torch.randn(16, dtype=D, requires_grad=True)
    c = torch.randn(16, dtype=D, requires_grad=True)

    def loss(use):
        with remat.gradient_checkpoint_scope() if use else contextlib.nullcontext():
            x = a.exp().sin()
        return (x * c).tanh().sum()

    expected = grads([a, c], [], lambda: loss(False))
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        actual = grads([a, c], [], lambda: loss(True), scope=True)
    assert_bitwise_equal(actual, expected)
    assert hook_stack() == []


# ------------------------------------------------- torch.compile in a checkpoint


def test_compiled_function_inside_a_checkpoint_runs_in_forward_and_recompute():
    torch.manual_seed(0)
    w = torch.randn(16, 16, dtype=D, requires_grad=True)
    x = torch.randn(4, 16, dtype=D, requires_grad=True)

    def inner(t):
        return (t.sin().exp() @ w).tanh()

    compiled = torch.compile(inner, backend="aot_eager")

    def fn(t):
        return compiled(t).cos()

    try:
        expected = grads([w], [x], lambda x: fn(x).sum())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            actual = grads([w], [x], lambda x: remat.checkpoint(region_name="c")(fn)(x).sum())
        assert_bitwise_equal(actual, expected)
        names = [e.name for e in prof.events()]
        assert names.count("remat.recompute:c") == 1
        # The replay called the compiled function again (its AOT-autograd Function).
        assert sum("CompiledFunction" in n for n in names) >= 2
    finally:
        torch._dynamo.reset()


def test_compiled_function_called_inside_a_scope_runs_eagerly_with_exact_gradients():
    # Dynamo skips frames while a TorchDispatchMode (the scope's recording) is
    # active, so the function is recorded and replayed like eager code.
    a = torch.randn(8, dtype=D, requires_grad=True)
    w = torch.randn(8, dtype=D, requires_grad=True)

    def inner(t):
        return (t.exp() * w).sin()

    compiled = torch.compile(inner, backend="aot_eager")

    def loss(fn, use):
        with remat.gradient_checkpoint_scope() if use else contextlib.nullcontext():
            x = fn(a)
        return (x * w).tanh().sum()

    try:
        expected = grads([a, w], [], lambda: loss(inner, False))
        actual = grads([a, w], [], lambda: loss(compiled, True), scope=True)
        assert_bitwise_equal(actual, expected)
        assert hook_stack() == []
    finally:
        torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin")
def test_torch_compile_of_code_containing_a_scope():
    # Dynamo cannot trace the scope's hook-stack calls: it breaks the graph there
    # (warning once per builtin) and the block runs eagerly.
    a = torch.randn(8, dtype=D, requires_grad=True)
    w = torch.randn(8, dtype=D, requires_grad=True)

    def loss(use):
        with remat.gradient_checkpoint_scope() if use else contextlib.nullcontext():
            x = a.exp() * w
        return (x * w).sin().sum()

    try:
        expected = grads([a, w], [], lambda: loss(False))
        actual = grads([a, w], [], lambda: torch.compile(loss, backend="aot_eager")(True), scope=True)
        assert_bitwise_equal(actual, expected)
        assert hook_stack() == []
    finally:
        torch._dynamo.reset()
