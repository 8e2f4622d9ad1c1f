"""Code written for the upstream torch-remat 0.2.2 API under ``torch.compile``.

Regions around a custom ``autograd.Function``'s ``apply`` (flash-attention
wrappers, fused kernels) inside a compiled checkpoint, region wrappers built
eagerly and called in compiled code, and checkpoints created inside compiled code
without a ``region_name``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bitwise_equal, grads
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.checkpoint import CheckpointPolicy

import torch_remat as remat

DTYPE = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class MatExp(torch.autograd.Function):
    """y = exp(x @ w); saves y and w for its own backward."""

    @staticmethod
    def forward(ctx, x, w):
        y = (x @ w).exp()
        ctx.save_for_backward(y, w)
        return y

    @staticmethod
    def backward(ctx, g):
        y, w = ctx.saved_tensors
        return (g * y) @ w.t(), None


def body(x, w, recompute):
    h = x.sin()
    y = remat.region(MatExp.apply, "attn", recompute=recompute)(h, w)
    return y.cos()


def compiled_loss(recompute, backend, fullgraph):
    def loss(x, w):
        return remat.checkpoint(region_name="blk")(body)(x, w, recompute).sum()

    return torch.compile(loss, backend=backend, fullgraph=fullgraph)


def holds_the_checkpoint(counter):
    """The compiled graphs hold the checkpoint: compiled backward replays no Python,
    so this, not a replay, says remat took part."""
    targets = {n.target for gm in counter.graphs for n in gm.graph.nodes}
    return torch.ops.higher_order.tag_activation_checkpoint in targets


def inputs():
    torch.manual_seed(0)
    x = torch.randn(8, 16, dtype=DTYPE, requires_grad=True)
    w = (torch.randn(16, 16, dtype=DTYPE) * 0.1).requires_grad_()
    return x, w


def forward_graphs():
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, _example_inputs):
        graphs.append(gm)
        return gm

    return aot_autograd(fw_compiler=keep, bw_compiler=lambda gm, _: gm), graphs


def saved_nodes(forward: torch.fx.GraphModule) -> list[torch.fx.Node]:
    outputs = forward.graph.find_nodes(op="output")[0].args[0]
    return [n for n in outputs[1:] if isinstance(n, torch.fx.Node)]


@pytest.mark.parametrize("recompute", [False, True])
def test_a_function_apply_region_compiles_as_one_graph_with_fullgraph(recompute):
    x, w = inputs()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = compiled_loss(recompute, counter, fullgraph=True)
    actual = grads([], [x, w], compiled)
    expected = grads([], [x, w], lambda x, w: body(x, w, recompute).sum())
    assert counter.frame_count == 1 and holds_the_checkpoint(counter)
    assert_bitwise_equal(actual, expected, replays=0)


def test_without_fullgraph_a_function_apply_region_is_compiled_not_run_eagerly():
    x, w = inputs()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    actual = grads([], [x, w], compiled_loss(False, backend, fullgraph=False))
    # The checkpoint, with the Function inside it, is part of a compiled graph.
    assert len(graphs) > 0
    targets = {n.target for gm in graphs for n in gm.graph.nodes}
    assert torch.ops.higher_order.tag_activation_checkpoint in targets
    assert_bitwise_equal(actual, grads([], [x, w], lambda x, w: body(x, w, False).sum()), replays=0)


def test_the_partitioner_keeps_a_save_function_region_and_recomputes_a_recompute_one():
    saved = {}
    for recompute in (False, True):
        torch._dynamo.reset()
        backend, graphs = forward_graphs()
        x, w = inputs()
        compiled_loss(recompute, backend, fullgraph=True)(x, w).backward()
        saved[recompute] = [
            (n.meta.get("custom", {}).get("remat_region"), n.meta.get("recompute"))
            for n in saved_nodes(graphs[0])
            if n.op == "call_function"
        ]
    # SAVE: the Function's own saved activation (exp) is kept, tagged with the region.
    assert saved[False] == [("attn", CheckpointPolicy.MUST_SAVE)]
    # RECOMPUTE: nothing computed inside the checkpoint is kept (only its inputs).
    assert saved[True] == []


class EagerWrapperBlock(torch.nn.Module):
    """Region wrappers built once, eagerly, in ``__init__`` and called in forward."""

    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16, dtype=DTYPE) * 0.1)
        self.attn = remat.region(MatExp.apply, "attn", recompute=recompute)
        self.act = remat.region(torch.tanh, "act", recompute=True)

    def forward(self, x):
        return self.act(self.attn(x.sin(), self.w)).cos()


@pytest.mark.parametrize("recompute", [False, True])
def test_an_eagerly_constructed_region_wrapper_compiles_with_fullgraph(recompute):
    torch.manual_seed(0)
    block = EagerWrapperBlock(recompute)
    x = torch.randn(8, 16, dtype=DTYPE, requires_grad=True)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda x: remat.checkpoint(region_name="blk")(block)(x).sum(),
        backend=counter,
        fullgraph=True,
    )
    actual = grads(list(block.parameters()), [x], compiled)
    expected = grads(list(block.parameters()), [x], lambda x: block(x).sum())
    assert counter.frame_count == 1 and holds_the_checkpoint(counter)
    assert_bitwise_equal(actual, expected, replays=0)


class _CoreAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d)) v with a hand-written backward: the shape of a
    flash-attention wrapper (saves q, k, v and the probabilities)."""

    @staticmethod
    def forward(ctx, q, k, v):
        p = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1)
        ctx.save_for_backward(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, g):
        q, k, v, p = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        dv = p.transpose(-2, -1) @ g
        dp = g @ v.transpose(-2, -1)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        return ds @ k, ds.transpose(-2, -1) @ q, dv


class TitanLayer(torch.nn.Module):
    """A torchtitan-style transformer layer: the attention core is a SAVE region
    around a Function.apply, the projections and the MLP are recomputed."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.RMSNorm(dim, dtype=DTYPE)
        self.wqkv = torch.nn.Linear(dim, 3 * dim, bias=False, dtype=DTYPE)
        self.wo = torch.nn.Linear(dim, dim, bias=False, dtype=DTYPE)
        self.norm2 = torch.nn.RMSNorm(dim, dtype=DTYPE)
        self.w1 = torch.nn.Linear(dim, 4 * dim, bias=False, dtype=DTYPE)
        self.w2 = torch.nn.Linear(4 * dim, dim, bias=False, dtype=DTYPE)

    def attention(self, x):
        b, s, d = x.shape
        qkv = remat.region(self.wqkv, "qkv", recompute=True)(self.norm1(x))
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in qkv.chunk(3, -1))
        o = remat.region(_CoreAttention.apply, "sdpa", recompute=False)(q, k, v)
        o = remat.recompute_needs_tensor(o)  # read by bare code (the reshape) in the replay
        return self.wo(o.transpose(1, 2).reshape(b, s, d))

    def forward(self, x):
        h = x + self.attention(x)
        mlp = remat.region(lambda t: self.w2(torch.nn.functional.silu(self.w1(t))), "mlp", recompute=True)
        return h + mlp(self.norm2(h))


def test_torchtitan_style_layers_with_a_function_attention_compile_fullgraph_bitwise_equal_to_eager():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(TitanLayer() for _ in range(2))
    x = torch.randn(2, 6, 16, dtype=DTYPE, requires_grad=True)

    def model(x, checkpointed):
        for i, layer in enumerate(layers):
            x = remat.checkpoint(region_name=f"layers.{i}")(layer)(x) if checkpointed else layer(x)
        return x.square().mean()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x: model(x, True), backend=counter, fullgraph=True)
    params = list(layers.parameters())
    actual = grads(params, [x], compiled)
    assert counter.frame_count == 1
    assert_bitwise_equal(actual, grads(params, [x], lambda x: model(x, False)), replays=0)
    # ... and equal to the eager checkpoint as well, which replays each layer.
    assert_bitwise_equal(actual, grads(params, [x], lambda x: model(x, True)), replays=2)


class NamedExp(torch.autograd.Function):
    """exp saved through upstream's ``remat.save_for_backward(ctx, {name: t})``."""

    @staticmethod
    def forward(ctx, x):
        e = torch.exp(x)
        remat.save_for_backward(ctx, {"e": e})
        return e

    @staticmethod
    def backward(ctx, g):
        (e,) = ctx.saved_tensors
        return g * e


def test_a_function_naming_its_saves_with_a_mapping_compiles_fullgraph():
    x, w = inputs()

    def block(x, w):
        return remat.region(NamedExp.apply, "exp", recompute=False)(x @ w).sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda x, w: remat.checkpoint(region_name="blk")(block)(x, w), backend=counter, fullgraph=True
    )
    actual = grads([], [x, w], compiled)
    assert counter.frame_count == 1 and holds_the_checkpoint(counter)
    assert_bitwise_equal(actual, grads([], [x, w], block), replays=0)


def test_inductor_compiles_a_function_apply_region_with_gradients_close_to_eager():
    x, w = inputs()
    counter = CompileCounterWithBackend("inductor")
    compiled = compiled_loss(False, counter, fullgraph=True)
    loss, actual = grads([], [x, w], compiled)
    assert holds_the_checkpoint(counter)
    expected_loss, expected = grads([], [x, w], lambda x, w: body(x, w, False).sum())
    # Inductor fuses and reorders float arithmetic: close, not bitwise.
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=1e-12)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
