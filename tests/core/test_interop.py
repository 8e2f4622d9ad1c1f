"""remat.checkpoint next to autocast and the user's own saved-tensor hooks."""

import pytest
import torch
from helpers import Block, assert_bitwise_equal, grads, recorded_replays
from torch._dynamo.testing import CompileCounterWithBackend

import torch_remat as remat


def test_autocast_is_replayed_in_backward():
    torch.manual_seed(0)
    block = Block(dim=16, heads=2, dropout=0.0, dtype=torch.float32)
    block.save.update(qkv=True, mlp=True)
    params = list(block.parameters())
    x = torch.randn(2, 5, 16, requires_grad=True)

    def loss_of(f):
        def loss(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = f(x)
            return out.float().square().sum()  # backward runs outside autocast

        return loss

    expected = grads(params, [x], loss_of(block))
    actual = grads(params, [x], loss_of(remat.checkpoint(region_name="c")(block)))
    assert_bitwise_equal(actual, expected)


@pytest.mark.parametrize("forward_autocast", [False, True])
def test_a_backward_inside_autocast_replays_with_the_forwards_autocast(forward_autocast):
    # the forward ran with autocast off everywhere and the backward inside a CPU
    # autocast block, or the other way round: the replay runs as the forward ran
    torch.manual_seed(0)
    block = Block(dim=16, heads=2, dropout=0.0, dtype=torch.float32)
    params = list(block.parameters())
    x = torch.randn(2, 5, 16, requires_grad=True)

    def run(f):
        for p in [*params, x]:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=forward_autocast):
            out = f(x).float().square().sum()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not forward_autocast):
            out.backward()
        return [p.grad for p in [x, *params]]

    expected = run(block)
    with recorded_replays() as replayed:
        actual = run(remat.checkpoint(region_name="c")(block))
    assert replayed == ["c"]
    for e, a in zip(expected, actual):
        assert torch.equal(e, a)


class CountingHooks(torch.autograd.graph.saved_tensors_hooks):
    """An offloading-style hook: stores a copy, counts what it sees."""

    def __init__(self):
        self.packed, self.unpacked = [], 0

        def pack(t):
            self.packed.append(tuple(t.shape))
            return t.clone()

        def unpack(t):
            self.unpacked += 1
            return t

        super().__init__(pack, unpack)


def test_user_hooks_around_a_checkpoint_see_kept_tensors_only():
    w = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)

    def fn(x):
        h = remat.region(lambda t: (t @ w).exp(), "proj", recompute=False)(x)  # saves x, w, exp out
        remat.recompute_needs_tensor(h)
        return h.sin().tanh()  # saves h (kept output) and tanh's result (dropped)

    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    expected = grads([w], [x], lambda x: fn(x).sum())
    hooks = CountingHooks()

    def run(x):
        with hooks:
            return remat.checkpoint(region_name="c")(fn)(x).sum()

    actual = grads([w], [x], run)
    assert_bitwise_equal(actual, expected)
    # The checkpoint's input x (packed at its start), the SAVE region's three saves
    # and the kept output h go through the user's hooks, each unpacked once; the
    # dropped tanh result does not (it is recomputed instead).
    assert sorted(hooks.packed) == sorted([(3, 6), (3, 6), (6, 6), (3, 6), (3, 6)])
    assert hooks.unpacked == 5


def test_user_hooks_inside_the_function_keep_their_tensors():
    def fn(x):
        with torch.autograd.graph.save_on_cpu():
            h = x.sin().exp()  # saved by save_on_cpu, not dropped
        return h.tanh()  # dropped and recomputed

    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    expected = grads([], [x], lambda x: fn(x).sum())
    actual = grads([], [x], lambda x: remat.checkpoint(region_name="c")(fn)(x).sum())
    assert_bitwise_equal(actual, expected)


def test_recompute_needs_tensor_inside_the_save_region_body():
    def body(t):
        out = t.exp()
        remat.recompute_needs_tensor(out)  # marks the value this region returns
        return out

    def fn(x):
        return (remat.region(body, "exp", recompute=False)(x) + 1).sin()

    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    expected = grads([], [x], lambda x: fn(x).sum())
    actual = grads([], [x], lambda x: remat.checkpoint(region_name="c")(fn)(x).sum())
    assert_bitwise_equal(actual, expected)


def test_rng_hook_with_save_regions_between_draws():
    def fn(x):
        a = torch.nn.functional.dropout(x, 0.5)
        b = remat.region(lambda t: torch.nn.functional.dropout(t, 0.5).exp(), "drop", recompute=False)(a)
        remat.recompute_needs_tensor(b)
        return torch.nn.functional.dropout(b, 0.5).sin()

    x = torch.randn(64, dtype=torch.float64, requires_grad=True)
    hook = remat.CPURNGStateHook()
    expected = grads([], [x], lambda x: fn(x).sum(), seed=5)
    actual = grads(
        [], [x], lambda x: remat.checkpoint(region_name="c", recompute_state_hooks=(hook,))(fn)(x).sum(), seed=5
    )
    assert_bitwise_equal(actual, expected)


def test_torch_compile_around_a_checkpoint_traces_it_with_exact_gradients():
    lin = torch.nn.Linear(4, 4, dtype=torch.float64)

    def f(x):
        h = remat.region(lin, "lin", recompute=False)(torch.nn.functional.layer_norm(x, (4,)))
        remat.recompute_needs_tensor(h)
        return h.tanh()

    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(lambda x: remat.checkpoint(region_name="c")(f)(x).sum(), backend=counter)
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    expected = grads(list(lin.parameters()), [x], lambda x: f(x).sum())
    actual = grads(list(lin.parameters()), [x], compiled)
    assert torch.ops.higher_order.tag_activation_checkpoint in {n.target for gm in counter.graphs for n in gm.graph.nodes}
    # The recompute is part of the compiled backward, which re-runs no Python.
    assert_bitwise_equal(actual, expected, replays=0)


@pytest.mark.parametrize("where", ["backward outside", "backward inside", "weight read before"])
def test_a_forward_under_parametrize_cached_replays_with_the_cache_it_found(where):
    # Under parametrize.cached() a weight is computed at its first read, then served
    # from the cache. The replay ran without the cache (backward outside the block)
    # or with what the forward had added to it (backward inside): it computed other
    # weights and saved other tensors, which, all of one shape, went to the wrong
    # places: silently wrong gradients.
    from helpers import recorded_replays
    from torch.nn.utils import parametrize

    def run(ckpt):
        torch.manual_seed(0)
        lin = torch.nn.Linear(6, 6, bias=False, dtype=torch.float64)
        parametrize.register_parametrization(lin, "weight", torch.nn.Tanh())
        x = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)

        def body(h):
            return lin(lin(h).sin())

        fn = remat.checkpoint(region_name="cached")(body) if ckpt else body
        with recorded_replays() as replayed:
            with parametrize.cached():
                if where == "weight read before":
                    lin.weight  # noqa: B018 (fills the cache before the checkpoint)
                out = fn(x)
                if where != "backward outside":
                    out.sum().backward()
            if where == "backward outside":
                out.sum().backward()
        assert replayed == (["cached"] if ckpt else [])
        return [x.grad, lin.parametrizations.weight.original.grad]

    expected, got = run(False), run(True)
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
