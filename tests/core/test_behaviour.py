"""What remat.checkpoint does, one behaviour per test."""

import gc
import threading
import weakref

import pytest
import torch
from helpers import Block, UnseenCounter, UnseenLog, assert_bitwise_equal, grads, recorded_replays

import torch_remat as remat


def test_save_bodies_run_once_and_recompute_regions_twice():
    runs = {"save": UnseenLog(), "recompute": UnseenLog()}

    def save_body(x):
        runs["save"].append(remat.is_recomputing())
        return x.exp()

    def recompute_body(x):
        runs["recompute"].append(remat.is_recomputing())
        return x.sin()

    def fn(x):
        h = remat.region(save_body, "s", recompute=False)(x)
        return remat.region(recompute_body, "r", recompute=True)(h).tanh()

    x = torch.randn(5, requires_grad=True)
    out = remat.checkpoint(region_name="c")(fn)(x)
    assert runs == {"save": [False], "recompute": [False]}
    out.sum().backward()
    assert runs == {"save": [False], "recompute": [False, True]}


def test_is_recomputing_only_inside_recompute():
    seen = UnseenLog()

    def fn(x):
        seen.append(remat.is_recomputing())
        return x.sin().exp()  # exp saves its result: needs a recompute

    assert remat.is_recomputing() is False
    x = torch.randn(3, requires_grad=True)
    out = remat.checkpoint(region_name="c")(fn)(x)
    assert remat.is_recomputing() is False
    out.sum().backward()
    assert seen == [False, True]
    assert remat.is_recomputing() is False


def test_regions_outside_a_checkpoint_are_plain_calls():
    calls = []
    f = remat.region(lambda t: calls.append(1) or t.sin(), "sin", recompute=False)
    x = torch.randn(3, requires_grad=True)
    f(x).sum().backward()
    assert calls == [1]
    assert torch.equal(x.grad, x.detach().cos())
    assert remat.recompute_needs_tensor(x) is x


def test_no_grad_and_inference_mode_run_the_function_once():
    calls = UnseenLog()

    def fn(x):
        calls.append(1)
        return remat.region(torch.sin, "s", recompute=False)(x).cos().cos()

    ckpt = remat.checkpoint(region_name="c")(fn)
    x = torch.randn(3)
    with torch.no_grad():
        assert torch.equal(ckpt(x), x.sin().cos().cos())
    with torch.inference_mode():
        assert torch.equal(ckpt(x), x.sin().cos().cos())
    assert calls == [1, 1]
    # with gradients on, the same checkpoint runs it again in backward (for the second cos)
    ckpt(x.requires_grad_()).sum().backward()
    assert calls == [1, 1, 1, 1]


class CounterHook(UnseenCounter):
    """A user counter advanced by the function (like an RNG offset), in state remat
    does not record by itself, with the hook that snapshots and restores it."""

    __slots__ = ()

    def snapshot(self):
        return self.value

    def restore(self, state):
        self.value = state


def _counter_fn(counter, seen, body_runs=None):
    """``body_runs``, if given, lists for each run of the SAVE body whether backward
    was replaying it."""

    def body(t):
        if body_runs is not None:
            body_runs.append(remat.is_recomputing())
        counter.value += 10
        return t.exp()

    def fn(x):
        seen.append(counter.value)
        counter.value += 1
        h = remat.region(body, "s", recompute=False)(x)
        seen.append(counter.value)
        counter.value += 1
        return (h * x).sin()

    return fn


def test_state_hook_makes_recompute_see_forward_values():
    counter, seen, body_runs = CounterHook(), UnseenLog(), UnseenLog()
    fn = _counter_fn(counter, seen, body_runs)
    x = torch.randn(3, requires_grad=True)
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="c", recompute_state_hooks=(counter,))(fn)(x)
    counter.value = 100  # the caller moves on
    out.sum().backward()
    assert replayed == ["c"]
    # forward saw 0 then 11 (the SAVE body added 10); the replay sees the same, the
    # 11 restored by the hook where the replay skips the SAVE body
    assert seen == [0, 11, 0, 11]
    assert body_runs == [False]
    assert counter.value == 100  # caller's state restored after the recompute

    # Without the hook the same replay starts from the caller's 100 instead.
    seen.clear()
    counter.value = 0
    out = remat.checkpoint(region_name="c")(fn)(x)
    counter.value = 100
    out.sum().backward()
    assert seen == [0, 11, 100, 101]


def test_without_state_hook_recompute_sees_other_values():
    counter, seen = CounterHook(), UnseenLog()
    x = torch.randn(3, requires_grad=True)
    out = remat.checkpoint(region_name="c")(_counter_fn(counter, seen))(x)
    out.sum().backward()
    # The replay starts from where the forward left the counter (12), and the skipped
    # SAVE body restores nothing: it sees 12, then 13, where the forward saw 0 and 11.
    assert seen == [0, 11, 12, 13]


def test_second_backward_with_retain_graph_replays_identically():
    counter, seen = CounterHook(), UnseenLog()
    x = torch.randn(3, requires_grad=True)
    out = remat.checkpoint(region_name="c", recompute_state_hooks=(counter,))(_counter_fn(counter, seen))(x)
    out.sum().backward(retain_graph=True)
    g1 = x.grad.clone()
    x.grad = None
    out.sum().backward()
    assert torch.equal(g1, x.grad)
    assert seen == [0, 11, 0, 11, 0, 11]


def test_several_state_hooks_are_independent():
    a, b = CounterHook(), CounterHook()
    seen = UnseenLog()

    def fn(x):
        seen.append((a.value, b.value))
        a.value += 1
        h = remat.region(lambda t: (b.__setattr__("value", b.value + 5), t.exp())[1], "s", recompute=False)(x)
        seen.append((a.value, b.value))
        return (h * x).sin()

    x = torch.randn(3, requires_grad=True)
    out = remat.checkpoint(region_name="c", recompute_state_hooks=(a, b))(fn)(x)
    a.value, b.value = 50, 60
    out.sum().backward()
    assert seen == [(0, 0), (1, 5), (0, 0), (1, 5)]
    assert (a.value, b.value) == (50, 60)


def test_early_stop_skips_trailing_ops_that_save_nothing():
    def runs(**opts):
        leading, trailing = UnseenLog(), UnseenLog()

        def fn(x):
            leading.append(remat.is_recomputing())
            h = x.sin()  # saves x (static: an input) — no replay needed for it
            h = h.exp()  # saves its result: needs the replay
            trailing.append(remat.is_recomputing())
            return h + 1  # saves nothing

        x = torch.randn(3, requires_grad=True)
        with recorded_replays() as replayed:
            out = remat.checkpoint(region_name="c", **opts)(fn)(x)
        out.sum().backward()
        assert replayed == ["c"]
        return leading, trailing

    leading, trailing = runs()
    assert leading == [False, True]  # the replay ran ...
    assert trailing == [False]  # ... and stopped inside exp
    # without early stop the replay of the same function runs the trailing ops
    assert runs(early_stop=False) == ([False, True], [False, True])


def test_early_stop_lets_the_op_whose_save_completed_the_set_run_first():
    # rrelu saves its noise tensor before its kernel draws into it. When that save
    # completed the set, the replay stopped inside it: the kernel never ran and
    # backward read unwritten memory (torch.utils.checkpoint does the same).
    def fn(x):
        return torch.nn.functional.rrelu(x.exp(), training=True)

    x = torch.randn(64, requires_grad=True)
    weights = torch.arange(64.0)
    torch.manual_seed(3)
    (expected,) = torch.autograd.grad((fn(x) * weights).sum(), x)
    torch.manual_seed(3)
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="c", recompute_state_hooks=(remat.CPURNGStateHook(),))(fn)(x)
        (got,) = torch.autograd.grad((out * weights).sum(), x)
    assert replayed == ["c"]
    assert torch.equal(got, expected)


def test_a_replay_waiting_to_stop_stops_at_a_read_of_an_output_nothing_kept():
    # After rrelu (the op that completed the set) the replay runs on until the next
    # save; a read of a SAVE output nothing kept, which the forward made and the
    # replay need not, is where it stops instead of refusing the read.
    def fn(x):
        a = remat.region(torch.cos, "cos", recompute=False)(x)
        h = torch.nn.functional.rrelu(x.exp(), training=True)
        scale = sum(a.tolist())  # a Python read the replay never needs to repeat
        return h * scale

    x = torch.randn(8, requires_grad=True)
    torch.manual_seed(1)
    (expected,) = torch.autograd.grad(fn(x).sum(), x)
    torch.manual_seed(1)
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="c", recompute_state_hooks=(remat.CPURNGStateHook(),))(fn)(x)
        (got,) = torch.autograd.grad(out.sum(), x)
    assert replayed == ["c"]
    assert torch.equal(got, expected)


def test_early_stop_false_replays_everything():
    trailing = UnseenLog()

    def fn(x):
        h = x.sin().exp()
        trailing.append(remat.is_recomputing())
        return h + 1

    x = torch.randn(3, requires_grad=True)
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="c", early_stop=False)(fn)(x)
    out.sum().backward()
    assert replayed == ["c"]
    assert trailing == [False, True]
    # with early stop (the default) the replay of the same function stops before them
    trailing.clear()
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="c")(fn)(x)
    out.sum().backward()
    assert replayed == ["c"]
    assert trailing == [False]


def test_all_saves_kept_means_no_recompute():
    def calls_with(recompute_exp):
        calls = UnseenLog()

        def fn(x):
            calls.append(remat.is_recomputing())
            y = remat.region(torch.exp, "exp", recompute=recompute_exp)(x)
            return y.sin()  # saves y: kept when it is a SAVE region's output

        x = torch.randn(3, requires_grad=True)
        remat.checkpoint(region_name="c")(fn)(x).sum().backward()
        return calls

    assert calls_with(recompute_exp=True) == [False, True]  # exp's result is dropped
    assert calls_with(recompute_exp=False) == [False]  # every save kept: no replay


def _train_in_thread(seed, results, key):
    # No dropout: torch's CPU generator is shared by all threads, so the threads'
    # draws would interleave in any order.
    gen = torch.Generator().manual_seed(seed)
    block = Block(dim=16, heads=2, dropout=0.0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    block.save.update(attention=True, mlp=True)
    params = list(block.parameters())
    x = torch.randn(2, 6, 16, dtype=torch.float64, generator=gen).requires_grad_()
    ckpt = remat.checkpoint(region_name=f"t{seed}")(block)
    out = []
    for _ in range(5):
        expected = grads(params, [x], lambda x: block(x).square().sum(), seed=seed)
        actual = grads(params, [x], lambda x: ckpt(x).square().sum(), seed=seed)
        out.append((expected, actual))
    results[key] = out


def test_two_threads_training_at_once_both_get_exact_gradients():
    results = {}
    threads = [threading.Thread(target=_train_in_thread, args=(s, results, s)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) == {1, 2}
    for pairs in results.values():
        for expected, actual in pairs:
            assert_bitwise_equal(actual, expected)


def test_nothing_is_retained_after_backward():
    block = Block(dim=8, heads=2, dropout=0.0)
    block.save.update(qkv=True, mlp=True)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    refs = UnseenLog()

    # every region output (kept or not) and the block output
    for name in ("attn_norm", "qkv", "out_proj", "mlp_norm", "mlp"):
        getattr(block, name).register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o)))
    gc.collect()
    gc.disable()  # prove that freeing does not wait for the cycle collector
    try:
        out = remat.checkpoint(region_name="c")(block)(x * 1.0)
        refs.append(weakref.ref(out))
        out.sum().backward()
        del out
        # 5 region outputs and the block's; the replay ran again the 3 RECOMPUTE
        # modules (attn_norm, out_proj, mlp_norm)
        assert len(refs) == 6 + 3
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_live_bytes_stay_constant_over_20_steps(memory_probe):
    torch.manual_seed(0)
    block = Block(dim=8, heads=2, dropout=0.1)
    block.save.update(attention=True, mlp_norm=True)
    hook = remat.CPURNGStateHook()
    ckpt = remat.checkpoint(region_name="c", recompute_state_hooks=(hook,))(block)
    opt = torch.optim.SGD(block.parameters(), lr=1e-3)
    x = torch.randn(2, 4, 8, dtype=torch.float64)

    def step():
        opt.zero_grad(set_to_none=False)
        ckpt(x).square().sum().backward()
        opt.step()

    for _ in range(3):
        step()  # warm-up: grads and optimizer state exist from here on
    with memory_probe() as probe, recorded_replays() as replayed:
        for _ in range(20):
            step()
    assert probe.bytes == 0
    assert replayed == ["c"] * 20


def test_kwargs_non_tensor_args_and_container_outputs():
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def fn(x, scale, *, bias, mode="tanh"):
        h = remat.region(lambda t: {"a": t @ w, "n": 3}, "proj", recompute=False)(x)
        remat.recompute_needs_tensor(h["a"])
        act = getattr(torch, mode)(h["a"] * scale + bias)
        return {"out": act, "parts": [act.sin(), (act.cos(), h["n"])]}

    def loss_of(f):
        def loss(x, bias):
            o = f(x, 0.5, bias=bias, mode="sigmoid")
            return o["out"].sum() + o["parts"][0].sum() + o["parts"][1][0].sum() * o["parts"][1][1]

        return loss

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)
    expected = grads([w], [x, bias], loss_of(fn))
    actual = grads([w], [x, bias], loss_of(remat.checkpoint(region_name="c")(fn)))
    assert_bitwise_equal(actual, expected)


def test_frozen_inputs_still_give_parameter_gradients():
    # LoRA-style: the embedding output does not require grad; adapters do.
    emb = torch.nn.Embedding(10, 8, dtype=torch.float64).requires_grad_(False)
    base = torch.nn.Linear(8, 8, dtype=torch.float64).requires_grad_(False)
    lora_a = torch.randn(8, 2, dtype=torch.float64, requires_grad=True)
    lora_b = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)

    def fn(h):
        frozen = remat.region(base, "base", recompute=False)(h)
        remat.recompute_needs_tensor(frozen)
        return (frozen + h @ lora_a @ lora_b).tanh()

    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    expected = grads([lora_a, lora_b], [], lambda: fn(emb(ids)).sum())
    actual = grads([lora_a, lora_b], [], lambda: remat.checkpoint(region_name="c")(fn)(emb(ids)).sum())
    assert_bitwise_equal(actual, expected)
    assert actual[1][0] is not None


def test_tensors_captured_by_closure():
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 4) > 0.5

    def fn(x):
        h = (x @ w).masked_fill(mask, 0.0)
        h = remat.region(torch.tanh, "act", recompute=False)(h)
        remat.recompute_needs_tensor(h)
        return (h * w.sum()).exp()

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    expected = grads([w], [x], lambda x: fn(x).sum())
    actual = grads([w], [x], lambda x: remat.checkpoint(region_name="c")(fn)(x).sum())
    assert_bitwise_equal(actual, expected)


def test_nested_regions_are_named_outer_dot_inner():
    seen = []

    def inner(t):
        return t.exp()

    def outer(t):
        return remat.region(inner, "inner", recompute=True)(t).sin()

    def fn(x):
        h = remat.region(outer, "outer", recompute=True)(x)
        return remat.region(lambda t: t.cos(), "outer.inner", recompute=False)(h)

    x = torch.randn(3, requires_grad=True)
    try:
        remat.checkpoint(region_name="c")(fn)(x)
    except ValueError as e:
        seen.append(str(e))
    assert seen and "'outer.inner' is used twice" in seen[0]


def test_nested_checkpoint_gives_exact_gradients():
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    inner = remat.checkpoint(region_name="inner")(lambda t: (t @ w).tanh())

    def fn(x):
        h = remat.region(torch.exp, "exp", recompute=False)(x)
        remat.recompute_needs_tensor(h)
        return inner(h * 2).sin()

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    expected = grads([w], [x], lambda x: remat.region(torch.exp, "e", recompute=True)(x).mul(2).matmul(w).tanh().sin().sum())
    actual = grads([w], [x], lambda x: remat.checkpoint(region_name="outer")(fn)(x).sum())
    assert_bitwise_equal(actual, expected)


def _nested_stage(keep_while_recomputing: bool):
    """Two checkpointed blocks nested in a checkpointed stage; each block keeps its
    norms' outputs (SAVE regions) by recompute_needs_tensor, skipped under
    is_recomputing() unless ``keep_while_recomputing``: the stage's replay runs the
    blocks' forwards again, and skipping it there keeps other tensors than the
    forward did, of the same shapes."""
    g = torch.Generator().manual_seed(0)
    inp = torch.nn.Linear(8, 8, dtype=torch.float64)
    blocks = [
        torch.nn.ModuleDict(dict(n1=torch.nn.LayerNorm(8), f1=torch.nn.Linear(8, 8), n2=torch.nn.LayerNorm(8),
                                 f2=torch.nn.Linear(8, 8))).double()
        for _ in range(2)
    ]
    x0 = torch.randn(4, 8, dtype=torch.float64, generator=g)

    def save(mod, name, t):
        out = remat.region(mod, name, recompute=False)(t)
        if keep_while_recomputing or not remat.is_recomputing():
            remat.recompute_needs_tensor(out)
        return out

    def block(x, b):
        h = save(b["n1"], "n1", x).permute(1, 0).contiguous().permute(1, 0)
        x = x + b["f1"](h)
        return x + b["f2"](save(b["n2"], "n2", x))

    inner = [remat.checkpoint(region_name=f"stage.blocks.{i}")(block) for i in range(2)]

    def stage(x, nested):
        for i, b in enumerate(blocks):
            x = inner[i](x, b) if nested else block(x, b)
        return x

    params = list(inp.parameters()) + [p for b in blocks for p in b.parameters()]

    def loss(nested):
        x = inp(x0)
        out = remat.checkpoint(region_name="stage")(stage)(x, True) if nested else stage(x, False)
        return out.square().sum()

    return params, loss


def test_a_nested_checkpoint_keeping_the_same_tensors_in_the_recompute_is_exact():
    params, loss = _nested_stage(keep_while_recomputing=True)
    expected = grads(params, [], lambda: loss(False))
    with recorded_replays() as replayed:
        actual = grads(params, [], lambda: loss(True))
    assert_bitwise_equal(actual, expected)
    assert replayed[0] == "stage" and "stage.blocks.1" in replayed


def test_a_nested_checkpoint_keeping_other_tensors_in_the_recompute_is_refused():
    # (the same shapes: without the check the stage's replay handed backward the
    # wrong tensors, and gradients were off by up to 31)
    params, loss = _nested_stage(keep_while_recomputing=False)
    with pytest.raises(remat.RecomputeMismatchError, match="kept by nested checkpoint 'stage.blocks.0'"):
        loss(True).backward()


def test_partial_backward_then_full_backward():
    def fn(x):
        return x.sin().exp().tanh()

    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="c")(fn)(x)
    (g,) = torch.autograd.grad(out.sum(), x, retain_graph=True)
    out.sum().backward()
    assert replayed == ["c", "c"]  # each backward replays for itself
    assert torch.equal(g, x.grad)
    expected = torch.autograd.grad(fn(x).sum(), x)[0]
    assert torch.equal(g, expected)


def test_double_backward_is_exact():
    def fn(x):
        h = remat.region(torch.sin, "sin", recompute=False)(x)
        remat.recompute_needs_tensor(h)
        return h.exp() * x

    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    (g_ref,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
    (gg_ref,) = torch.autograd.grad(g_ref.sum(), x)
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="c")(fn)(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    # the second backward reads the forward's saves again, through the first's graph
    assert replayed == ["c", "c"]
    assert torch.equal(g, g_ref) and torch.equal(gg, gg_ref)


def _three_save_regions(dropout_in_middle):
    def fn(x):
        h = remat.region(torch.exp, "a", recompute=False)(x)
        mid = (lambda t: torch.nn.functional.dropout(t, 0.5)) if dropout_in_middle else torch.sin
        h = remat.region(mid, "b", recompute=False)(h)
        return remat.region(torch.exp, "c", recompute=False)(h)

    return fn


def test_unchanged_state_snapshots_are_stored_once(memory_probe):
    x = torch.randn(16, dtype=torch.float64, requires_grad=True)
    rng_state_bytes = torch.get_rng_state().numel()
    measured = {}
    for dropout in (False, True):
        for hooks in ((), (remat.CPURNGStateHook(),)):
            with memory_probe() as probe:
                out = remat.checkpoint(region_name="c", recompute_state_hooks=hooks)(
                    _three_save_regions(dropout)
                )(x)
            measured[dropout, bool(hooks)] = probe.bytes
            del out
    # no random numbers drawn: the entry snapshot is the only one stored
    assert measured[False, True] - measured[False, False] == rng_state_bytes
    # dropout in region b: entry and after-b snapshots; after-a and after-c are shared
    assert measured[True, True] - measured[True, False] == 2 * rng_state_bytes


def test_a_forward_that_raises_after_a_save_region_frees_everything(memory_probe):
    x = torch.randn(400, dtype=torch.float64, requires_grad=True)

    running = []

    def fn(x):
        h = remat.region(torch.exp, "exp", recompute=False)(x)  # saves its output
        remat.recompute_needs_tensor(h)
        running.append(remat.active_checkpoint().checkpoint)
        raise KeyError("boom")

    gc.disable()
    try:
        with memory_probe() as probe:
            try:
                remat.checkpoint(region_name="c")(fn)(x * 1.0)
            except KeyError:
                pass
    finally:
        gc.enable()
    assert running == ["c"]  # it raised inside the checkpoint, after its save was kept
    assert probe.bytes == 0
