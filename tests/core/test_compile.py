"""remat.checkpoint under torch.compile: one graph, regions as partitioner tags.

Compiling is slow on a shared CPU, so the models are tiny and tests that look at
the same compiled graph share one module-scoped compile. Every test resets Dynamo
afterwards so no cache leaks into other tests.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CounterHook, SavedBytes, assert_bitwise_equal, grads
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.checkpoint import CheckpointPolicy

import torch_remat as remat

DTYPE = torch.float64


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class TwoRegionBlock(torch.nn.Module):
    """x -> [a: SAVE] -> sin -> [b: SAVE or RECOMPUTE] -> cos, with keyword
    arguments and a container output."""

    def __init__(self, save_b: bool = True) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32, dtype=DTYPE)
        self.b = torch.nn.Linear(32, 64, dtype=DTYPE)
        self.save_b = save_b

    def forward(self, x, *, scale):
        h = remat.region(lambda t: torch.tanh(self.a(t)), "a", recompute=False)(x)
        remat.recompute_needs_tensor(h)
        h = h.sin() * scale
        y = remat.region(lambda t: torch.tanh(self.b(t)), "b", recompute=not self.save_b)(h)
        return {"out": y.cos(), "aux": [h]}


def holds_the_checkpoint(counter):
    """The graphs ``counter`` compiled hold a checkpoint (compiled backward replays
    no Python, so the graph, not a replay, says remat took part)."""
    return torch.ops.higher_order.tag_activation_checkpoint in {n.target for gm in counter.graphs for n in gm.graph.nodes}


def loss_of(out):
    return out["out"].sum() + out["aux"][0].sum()


def checkpointed(block):
    return lambda x: loss_of(remat.checkpoint(region_name="layers.0")(block)(x, scale=2.0))


def forward_graph_capture():
    """An aot_eager-like backend that keeps the partitioned forward graphs."""
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, _example_inputs):
        graphs.append(gm)
        return gm

    return aot_autograd(fw_compiler=keep, bw_compiler=lambda gm, _: gm), graphs


def saved_nodes(forward: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The forward's outputs that are saved for backward: the rest after the
    user outputs (here: the loss)."""
    outputs = forward.graph.find_nodes(op="output")[0].args[0]
    return [n for n in outputs[1:] if isinstance(n, torch.fx.Node)]


def compile_and_measure(save_b: bool) -> dict:
    """The block compiled (aot_eager, fullgraph) with region b as SAVE or RECOMPUTE:
    saved bytes, the partitioned forward graph, and gradients compiled and eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = TwoRegionBlock(save_b)
    x = torch.randn(8, 16, dtype=DTYPE, requires_grad=True)
    backend, graphs = forward_graph_capture()
    compiled = torch.compile(checkpointed(block), backend=backend, fullgraph=True)
    saved = SavedBytes(block)
    params = list(block.parameters())

    def run(x):
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            return compiled(x)

    actual = grads(params, [x], run)
    expected = grads(params, [x], lambda x: loss_of(block(x, scale=2.0)))
    return dict(saved=saved.total, forward=graphs[0], actual=actual, expected=expected)


@pytest.fixture(scope="module")
def compiled_runs():
    runs = {save_b: compile_and_measure(save_b) for save_b in (True, False)}
    torch._dynamo.reset()
    return runs


def test_explain_shows_one_graph_and_no_break_for_a_block_with_save_and_recompute_regions():
    block = TwoRegionBlock(save_b=False)
    x = torch.randn(8, 16, dtype=DTYPE, requires_grad=True)
    explanation = torch._dynamo.explain(checkpointed(block))(x)
    assert explanation.graph_count == 1
    assert explanation.graph_break_count == 0
    # ... and that graph holds the checkpoint (not only the code around it).
    (graph,) = explanation.graphs
    targets = {n.target for n in graph.graph.nodes}
    assert torch.ops.higher_order.tag_activation_checkpoint in targets


def test_fullgraph_compile_gives_gradients_bitwise_equal_to_eager(compiled_runs):
    for save_b in (True, False):
        # compiled backward replays no Python: the checkpoint shows in the graph instead
        forward = compiled_runs[save_b]["forward"]
        assert any(n.meta.get("custom", {}).get("remat_checkpoint") == "layers.0" for n in forward.graph.nodes)
        assert_bitwise_equal(compiled_runs[save_b]["actual"], compiled_runs[save_b]["expected"], replays=0)


def test_toggling_a_region_to_recompute_saves_exactly_its_output_fewer_bytes(compiled_runs):
    output_of_b = 8 * 64 * DTYPE.itemsize
    assert compiled_runs[True]["saved"] - compiled_runs[False]["saved"] == output_of_b


def test_outputs_of_a_save_region_are_saved_as_must_save_nodes_named_after_the_region(
    compiled_runs,
):
    tags = {
        (n.meta.get("custom", {}).get("remat_region"), n.meta.get("recompute"))
        for n in saved_nodes(compiled_runs[True]["forward"])
        if n.op == "call_function"
    }
    assert tags == {("a", CheckpointPolicy.MUST_SAVE), ("b", CheckpointPolicy.MUST_SAVE)}
    for n in saved_nodes(compiled_runs[True]["forward"]):
        if n.op == "call_function":
            assert n.meta["custom"]["remat_checkpoint"] == "layers.0"


def test_a_recompute_region_saves_nothing_of_its_own(compiled_runs):
    regions = {
        n.meta.get("custom", {}).get("remat_region")
        for n in saved_nodes(compiled_runs[False]["forward"])
    }
    assert "b" not in regions


@pytest.mark.slow
def test_inductor_gives_gradients_close_to_eager():
    torch.manual_seed(0)
    block = TwoRegionBlock(save_b=True)
    x = torch.randn(8, 16, dtype=DTYPE, requires_grad=True)
    params = list(block.parameters())
    compiled = torch.compile(checkpointed(block), backend="inductor", fullgraph=True)
    loss, actual = grads(params, [x], compiled)
    expected_loss, expected = grads(params, [x], lambda x: loss_of(block(x, scale=2.0)))
    # Inductor fuses and reorders float arithmetic: close, not bitwise.
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=1e-12)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_dropout_in_a_compiled_checkpoint_with_the_stock_rng_hook_uses_the_forward_mask():
    lin = torch.nn.Linear(16, 16, dtype=DTYPE)

    def f(x):
        return torch.nn.functional.dropout(lin(x), 0.5, training=True).tanh()

    hook = remat.CPURNGStateHook()
    x = torch.randn(8, 16, dtype=DTYPE, requires_grad=True)
    params = list(lin.parameters())
    ckpt = remat.checkpoint(region_name="c", recompute_state_hooks=(hook,))(f)
    counter = CompileCounterWithBackend("aot_eager")
    actual = grads(params, [x], torch.compile(lambda x: ckpt(x).sum(), backend=counter), seed=3)
    assert holds_the_checkpoint(counter)
    # The same compiled code without the checkpoint draws the same mask from seed 3.
    expected = grads(params, [x], torch.compile(lambda x: f(x).sum(), backend="aot_eager"), seed=3)
    assert_bitwise_equal(actual, expected, replays=0)


def test_dropout_under_the_eager_backend_uses_the_forward_mask_in_backward():
    # The eager backend runs torch's checkpoint untraced: random ops must be saved.
    w = torch.randn(64, dtype=DTYPE, requires_grad=True)
    x = torch.randn(64, dtype=DTYPE)

    def f(w):
        return torch.nn.functional.dropout(x * w, 0.5, training=True).sin()

    ckpt = remat.checkpoint(region_name="c")(f)
    counter = CompileCounterWithBackend("eager")
    out = torch.compile(ckpt, backend=counter, fullgraph=True)(w)
    assert holds_the_checkpoint(counter)
    out.sum().backward()
    kept = (out != 0).to(DTYPE) * 2.0  # the forward's mask, scaled by 1 / (1 - p)
    expected = torch.cos(x * w.detach() * kept) * kept * x
    # A mask drawn anew in backward would differ in about half of the entries.
    torch.testing.assert_close(w.grad, expected, rtol=1e-12, atol=1e-12)


def test_a_user_state_hook_under_compile_raises_remat_compile_error_naming_the_checkpoint():
    ckpt = remat.checkpoint(region_name="layers.3", recompute_state_hooks=(CounterHook(),))(
        torch.sin
    )
    x = torch.randn(4, dtype=DTYPE, requires_grad=True)
    with pytest.raises(remat.RematCompileError, match=r"'layers.3'.*CounterHook"):
        torch.compile(ckpt, backend="aot_eager")(x)


def test_is_recomputing_is_false_in_compiled_code_and_traces_without_a_break():
    def f(x):
        # A constant False while Dynamo traces; backward re-runs no Python.
        return x.sin().cos() * (3.0 if remat.is_recomputing() else 1.0)

    x = torch.randn(4, dtype=DTYPE, requires_grad=True)
    ckpt = remat.checkpoint(region_name="c")(f)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x: ckpt(x).sum(), backend=counter, fullgraph=True)
    assert_bitwise_equal(grads([], [x], compiled), grads([], [x], lambda x: f(x).sum()), replays=0)
    assert holds_the_checkpoint(counter)  # traced as a checkpoint, not as plain code


def test_regions_in_a_compiled_block_inside_an_eager_checkpoint_are_plain_calls():
    # The compiled block is one autograd op to the eager checkpoint: it is replayed
    # whole, and its regions keep nothing of their own (compile around the
    # checkpoint to have them steer what is saved).
    lin = torch.nn.Linear(4, 4, dtype=DTYPE)

    def block(x):
        return remat.region(lin, "lin", recompute=False)(x.sin()).tanh()

    compiled_block = torch.compile(block, backend="aot_eager")
    x = torch.randn(2, 4, dtype=DTYPE, requires_grad=True)
    params = list(lin.parameters())
    with remat.collect_trace() as trace:
        actual = grads(
            params, [x], lambda x: remat.checkpoint(region_name="c")(compiled_block)(x).sum()
        )
    assert "lin" not in trace.format()
    assert_bitwise_equal(actual, grads(params, [x], lambda x: block(x).sum()))


def test_nested_regions_are_recorded_under_their_qualified_names():
    graphs = []

    def keep_graph(gm, _example_inputs):
        graphs.append(gm)
        return gm

    def attention(x):
        return remat.region(torch.exp, "softmax", recompute=False)(x.sin())

    def block(x):
        return remat.region(attention, "attn", recompute=False)(x).cos()

    x = torch.randn(4, dtype=DTYPE, requires_grad=True)
    torch.compile(remat.checkpoint(region_name="c")(block), backend=keep_graph, fullgraph=True)(x)
    regions = {
        (
            getattr(n.target, "__name__", n.target),
            n.meta["custom"].get("remat_checkpoint"),
            n.meta["custom"].get("remat_region"),
        )
        for module in graphs[0].modules()
        for n in getattr(module, "graph", torch.fx.Graph()).nodes
        if n.op in ("call_function", "call_method") and "custom" in n.meta
    }
    assert ("sin", "c", "attn") in regions
    assert ("exp", "c", "attn.softmax") in regions


def test_a_recompute_region_inside_a_save_region_is_refused_under_compile():
    def block(x):
        inner = remat.region(torch.sin, "inner", recompute=True)
        return remat.region(inner, "outer", recompute=False)(x)

    x = torch.randn(4, dtype=DTYPE, requires_grad=True)
    with pytest.raises(ValueError, match="'outer.inner'.*nested inside SAVE region 'outer'"):
        torch.compile(remat.checkpoint(region_name="c")(block), backend="aot_eager")(x)
