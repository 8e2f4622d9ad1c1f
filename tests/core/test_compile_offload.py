"""Offload regions and a checkpoint's memory budget under torch.compile.

A checkpoint given an ``ActivationOffloader`` as ``saved_tensors_hooks=`` compiles:
the ops of the SAVE regions its ``regions=`` patterns match are tagged
``MUST_CPU_OFFLOAD``, and the partitioned forward graph copies their saved outputs
to the host (``prims.device_put(..., cpu)``), the backward graph copies them back.
``remat.checkpoint(memory_budget=b)`` traces its body under torch's
``region_activation_memory_budget(b)``. Models are tiny: compiling is slow here.
"""

from __future__ import annotations

import pytest
import torch
from helpers import SavedBytes, assert_bitwise_equal, grads
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

import torch_remat as remat
from torch_remat.offload import ActivationOffloader

DTYPE = torch.float64
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class AttnThenMlp(torch.nn.Module):
    """x -> [attn: SAVE] tanh(linear) -> sin -> [mlp: SAVE] tanh(linear) -> cos -> sum."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32, dtype=DTYPE)
        self.b = torch.nn.Linear(32, 16, dtype=DTYPE)

    def forward(self, x):
        h = remat.region(lambda t: torch.tanh(self.a(t)), "attn", recompute=False)(x)
        y = remat.region(lambda t: torch.tanh(self.b(t)), "mlp", recompute=False)(h.sin())
        return y.cos().sum()


def graph_capture():
    """aot_eager (its partitioner, no compiler) keeping the partitioned forward and
    backward graphs."""
    graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}

    def keeper(kind):
        def keep(gm, _example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm)

        return keep

    backend = aot_autograd(
        fw_compiler=keeper("forward"),
        bw_compiler=keeper("backward"),
        partition_fn=min_cut_rematerialization_partition,
    )
    return backend, graphs


def region_of(node: torch.fx.Node) -> str | None:
    return (node.meta.get("custom") or {}).get("remat_region")


def host_copies(graph: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [
        n
        for n in graph.graph.nodes
        if n.target is torch.ops.prims.device_put.default and n.args[1] == CPU
    ]


def offloader() -> ActivationOffloader:
    return ActivationOffloader(1 << 20, prefetch=0, min_bytes=0, regions=["attn"])


@pytest.fixture(scope="module")
def offload_run():
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = AttnThenMlp()
    x = torch.randn(4, 16, dtype=DTYPE, requires_grad=True)
    params = list(block.parameters())
    ckpt = remat.checkpoint(region_name="layers.0", saved_tensors_hooks=offloader())(block)
    backend, graphs = graph_capture()
    step = torch.compile(ckpt, backend=backend, fullgraph=True)
    compiled = grads(params, [x], step)
    loss = step(x)
    report = remat.saved_tensors_report(loss)
    loss.backward()
    eager_offloader = offloader()
    eager = grads(
        params, [x], remat.checkpoint(region_name="layers.0", saved_tensors_hooks=eager_offloader)(block)
    )
    plain = grads(params, [x], block)
    yield dict(
        compiled=compiled, eager=eager, plain=plain, graphs=graphs, report=report,
        eager_offloaded=dict(eager_offloader.stats.offloaded_bytes),
    )
    torch._dynamo.reset()


def test_an_offloaded_save_region_compiles_fullgraph_with_gradients_bitwise_equal_to_eager(offload_run):
    # the eager offloader did move region attn's saves: the two runs agree on a real offload
    assert set(offload_run["eager_offloaded"]) == {"attn"}
    assert_bitwise_equal(offload_run["eager"], offload_run["compiled"], replays=1)
    assert_bitwise_equal(offload_run["plain"], offload_run["compiled"], replays=0)


def test_the_forward_graph_copies_the_offloaded_regions_saves_to_the_host_and_backward_copies_them_back(
    offload_run,
):
    forward = offload_run["graphs"]["forward"][0]
    copies = host_copies(forward)
    # the saved output of region attn (its tanh) goes to the host; mlp's stays put
    assert [(region_of(n.args[0]), n.args[0].target) for n in copies] == [
        ("attn", torch.ops.aten.tanh.default)
    ]
    outputs = forward.graph.find_nodes(op="output")[0].args[0]
    assert copies[0] in outputs  # what the forward hands its backward is the host copy
    saved_mlp = [n for n in outputs[1:] if isinstance(n, torch.fx.Node) and region_of(n) == "mlp"]
    assert torch.ops.aten.tanh.default in {n.target for n in saved_mlp}
    (backward,) = offload_run["graphs"]["backward"]
    reloads = [n for n in backward.graph.nodes if n.target is torch.ops.prims.device_put.default]
    assert [n.args[0].name for n in reloads] == [copies[0].name]


def test_the_compiled_report_names_the_offloaded_region(offload_run):
    (block,) = offload_run["report"].checkpoints
    rows = {region.label: [row.name for row in region.rows] for region in block.regions}
    assert rows["layers.0::attn"] == ["tanh (compiled, offloaded to host)"]
    assert rows["layers.0::mlp"] == ["tanh_1 (compiled)"]


def test_an_offloader_below_min_bytes_keeps_the_region_on_the_device():
    block = AttnThenMlp()
    x = torch.randn(4, 16, dtype=DTYPE, requires_grad=True)
    keeps = ActivationOffloader(1 << 20, prefetch=0, min_bytes=4 * 32 * 8 + 1, regions=["attn"])
    backend, graphs = graph_capture()
    ckpt = remat.checkpoint(region_name="layers.0", saved_tensors_hooks=keeps)(block)
    loss = torch.compile(ckpt, backend=backend, fullgraph=True)(x)
    (checkpoint,) = remat.saved_tensors_report(loss).checkpoints
    rows = {region.label: [row.name for row in region.rows] for region in checkpoint.regions}
    loss.backward()
    assert host_copies(graphs["forward"][0]) == []
    # the checkpoint keeps region attn's save, on the device, not offloaded
    assert rows["layers.0::attn"] == ["tanh (compiled)"]


@pytest.mark.parametrize("checkpoints", [["layers.1"], ["layers.*"]])
def test_an_offloaders_checkpoints_patterns_pick_the_compiled_checkpoints_as_they_do_eagerly(checkpoints):
    # a plan that offloads some blocks and keeps others on the device installs one
    # offloader whose checkpoints= name the offloaded ones
    block = AttnThenMlp()
    x = torch.randn(4, 16, dtype=DTYPE, requires_grad=True)

    def offloads() -> ActivationOffloader:
        return ActivationOffloader(1 << 20, prefetch=0, min_bytes=0, regions=["attn"], checkpoints=checkpoints)

    eager = offloads()
    remat.checkpoint(region_name="layers.0", saved_tensors_hooks=eager)(block)(x).backward()
    backend, graphs = graph_capture()
    ckpt = remat.checkpoint(region_name="layers.0", saved_tensors_hooks=offloads())(block)
    loss = torch.compile(ckpt, backend=backend, fullgraph=True)(x)
    (checkpoint,) = remat.saved_tensors_report(loss).checkpoints
    rows = {region.label: [row.name for row in region.rows] for region in checkpoint.regions}
    loss.backward()
    moved = checkpoints == ["layers.*"]
    assert bool(eager.stats.offloaded_bytes) is moved
    assert len(host_copies(graphs["forward"][0])) == moved
    assert rows["layers.0::attn"] == ["tanh (compiled, offloaded to host)" if moved else "tanh (compiled)"]


# ---------------------------------------------------------------- memory budget


class Chain(torch.nn.Module):
    """Bare code (no region): what the partitioner keeps is the budget's to decide."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 64, dtype=DTYPE)
        self.b = torch.nn.Linear(64, 64, dtype=DTYPE)
        self.c = torch.nn.Linear(64, 16, dtype=DTYPE)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h.sin()))
        return self.c(h.cos()).sum()


def budget_run(budget: float) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Chain()
    x = torch.randn(8, 16, dtype=DTYPE, requires_grad=True)
    params = list(block.parameters())
    ckpt = remat.checkpoint(region_name="layers.0", memory_budget=budget)(block)
    backend, graphs = graph_capture()
    step = torch.compile(ckpt, backend=backend, fullgraph=True)
    saved = SavedBytes(block)

    def run(x):
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            return step(x)

    actual = grads(params, [x], run)
    return dict(saved=saved.total, graphs=graphs, actual=actual, expected=grads(params, [x], block))


def test_a_checkpoints_memory_budget_changes_what_the_compiled_forward_saves_and_stays_bitwise():
    runs = {budget: budget_run(budget) for budget in (0.5, 1.0)}
    for run in runs.values():
        assert_bitwise_equal(run["actual"], run["expected"], replays=0)
    # 1: the partitioner's runtime-optimized choice; 0.5 makes it recompute more
    # (without the budget reaching it, both would save the same)
    assert runs[0.5]["saved"] < runs[1.0]["saved"]
    # torch's budget annotation is on the traced body's nodes
    forward = runs[0.5]["graphs"]["forward"][0]
    budgets = {
        (n.meta.get("custom") or {}).get(torch.fx.traceback.MEMORY_BUDGET_ANNOTATION_KEY)
        for n in forward.graph.nodes
        if n.op == "call_function"
    }
    assert budgets == {0.5}


def test_under_a_small_budget_dropout_keeps_its_forward_mask_and_a_save_region_is_kept():
    # A budget below 1 lets torch's knapsack recompute ops it otherwise bans, random
    # ones too: the dropout must stay saved, as must the SAVE region.
    lin = torch.nn.Linear(16, 16, dtype=DTYPE)

    def f(x):
        h = remat.region(lambda t: torch.tanh(lin(t)), "attn", recompute=False)(x)
        return torch.nn.functional.dropout(h.sin(), 0.5, training=True).cos().sum()

    x = torch.randn(8, 16, dtype=DTYPE, requires_grad=True)
    params = list(lin.parameters())
    ckpt = remat.checkpoint(region_name="layers.0", memory_budget=0.1)(f)
    backend, graphs = graph_capture()
    actual = grads(params, [x], torch.compile(ckpt, backend=backend, fullgraph=True), seed=3)
    # The same compiled code without the checkpoint draws the same mask from seed 3.
    expected = grads(params, [x], torch.compile(f, backend="aot_eager", fullgraph=True), seed=3)
    assert_bitwise_equal(actual, expected, replays=0)
    forward = graphs["forward"][0]
    # the small budget reached the partitioner: it is on the traced body's nodes
    budgets = {
        (n.meta.get("custom") or {}).get(torch.fx.traceback.MEMORY_BUDGET_ANNOTATION_KEY)
        for n in forward.graph.nodes
        if n.op == "call_function"
    }
    assert budgets == {0.1}
    outputs = forward.graph.find_nodes(op="output")[0].args[0]
    assert "attn" in {region_of(n) for n in outputs[1:] if isinstance(n, torch.fx.Node)}


@pytest.mark.parametrize("budget", [0.5, 0.1])
def test_a_recompile_for_another_shape_keeps_the_dropout_mask_under_a_budget(budget):
    # Before: on the recompile with symbolic sizes torch's knapsack dropped the
    # native_dropout it must save (a multi-output op: no storage of its own, and
    # None was among the symbolic inputs' storages); backward drew a new mask
    # (gradients off by up to 10)
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16, dtype=DTYPE)
            self.fc2 = torch.nn.Linear(16, 8, dtype=DTYPE)

        def up(self, h):
            return torch.nn.functional.dropout(torch.tanh(self.fc1(h)), 0.25, self.training)

        def forward(self, x):
            a = remat.region(self.up, "up", recompute=False)(x)
            return self.fc2(torch.nn.functional.gelu(a + a.exp()))

    def run(checkpointed: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        block = Block()
        if checkpointed:
            block.forward = remat.checkpoint(region_name="blk", memory_budget=budget)(block.forward)
        block.compile(backend="aot_eager")
        torch.manual_seed(1)
        out = []
        for n in (10, 14):  # the second call recompiles with symbolic sizes
            x = torch.randn(n, 8, dtype=DTYPE, requires_grad=True)
            block(x).sum().backward()
            out.append(x.grad)
        return out + [p.grad for p in block.parameters()] + [torch.get_rng_state()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def test_a_budget_that_does_not_cover_the_compiled_graph_is_refused_naming_the_checkpoint():
    lin = torch.nn.Linear(16, 16, dtype=DTYPE)
    ckpt = remat.checkpoint(region_name="layers.0", memory_budget=0.5)(lambda t: lin(t).tanh())
    x = torch.randn(8, 16, dtype=DTYPE, requires_grad=True)
    # sin and sum run in the same graph, outside the checkpoint
    step = torch.compile(lambda x: ckpt(x.sin()).sum(), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"checkpoint 'layers.0' \(memory_budget=0.5\).*block.compile") as raised:
        step(x)
    assert "RematCompileError" in str(raised.value)


@pytest.mark.parametrize("case", ["batch norm", "float changed"])
def test_a_budget_refused_for_ops_torch_adds_itself_says_what_they_are_and_what_to_do(case):
    # Before: the advice was to compile the block by itself, which it already was
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8, dtype=DTYPE)
            self.bn = torch.nn.BatchNorm1d(8, dtype=DTYPE)
            self.scale = 1.0

        def forward(self, x):
            a = remat.region(lambda t: self.fc(t).tanh(), "up", recompute=False)(x)
            a = a + a.exp() * self.scale
            return (self.bn(a) if case == "batch norm" else a).sin()

    torch._dynamo.reset()
    block = Block()
    block.forward = remat.checkpoint(region_name="blk", memory_budget=0.5)(block.forward)
    block.compile(backend="aot_eager")
    expected = {"batch norm": "BatchNorm's running statistics", "float changed": "specialize_float = True"}
    with pytest.raises(Exception, match=r"'blk' \(memory_budget=0.5\)") as raised:
        for step in range(2):
            block.scale = 1.0 + step  # (a recompile on the second step)
            block(torch.randn(10, 8, dtype=DTYPE, requires_grad=True)).sum().backward()
    assert "RematCompileError" in str(raised.value)
    assert expected[case] in str(raised.value) and "torch added ops of its own" in str(raised.value)


def test_a_memory_budget_is_refused_eagerly_naming_the_checkpoint_and_the_option():
    ckpt = remat.checkpoint(region_name="layers.0", memory_budget=0.5)(torch.sin)
    x = torch.randn(4, dtype=DTYPE, requires_grad=True)
    with pytest.raises(remat.RematError, match=r"'layers.0'.*memory_budget"):
        ckpt(x)
    with torch.no_grad():  # nothing is saved: nothing to budget
        assert torch.equal(ckpt(x), torch.sin(x))


@pytest.mark.parametrize("bad", [1.5, -0.1, 0.0, True, "0.5"])
def test_a_memory_budget_outside_0_1_is_refused_when_the_checkpoint_is_built(bad):
    with pytest.raises((TypeError, ValueError), match="memory_budget must"):
        remat.checkpoint(region_name="layers.0", memory_budget=bad)


@pytest.mark.slow
def test_inductor_compiles_an_offloaded_region_with_gradients_close_and_the_report_naming_it():
    torch.manual_seed(0)
    block = AttnThenMlp()
    x = torch.randn(4, 16, dtype=DTYPE, requires_grad=True)
    params = list(block.parameters())
    ckpt = remat.checkpoint(region_name="layers.0", saved_tensors_hooks=offloader())(block)
    step = torch.compile(ckpt, backend="inductor", fullgraph=True)
    loss = step(x)
    (checkpoint,) = remat.saved_tensors_report(loss).checkpoints
    rows = {region.label: [row.name for row in region.rows] for region in checkpoint.regions}
    assert rows["layers.0::attn"] == ["tanh (compiled, offloaded to host)"]
    loss.backward()
    actual = [loss.detach(), *(t.grad.clone() for t in (*params, x))]
    expected_loss, expected = grads(params, [x], block)
    # Inductor fuses and reorders float arithmetic: close, not bitwise.
    for a, e in zip(actual, [expected_loss, *expected], strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 64, dtype=DTYPE)
        self.b = torch.nn.Linear(64, 16, dtype=DTYPE)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).sin())


def test_apply_remat_with_a_memory_budget_compiles_each_block_under_it_and_refuses_eager_calls():
    from torch_remat.integrations import RematConfig, apply_remat

    torch.manual_seed(0)
    model = torch.nn.Sequential(Layer(), Layer())
    x = torch.randn(8, 16, dtype=DTYPE, requires_grad=True)
    params = list(model.parameters())
    expected = grads(params, [x], lambda x: model(x).sum())
    apply_remat(model, check_fn=lambda m: isinstance(m, Layer), remat=RematConfig(memory_budget=0.5))
    with pytest.raises(remat.RematError, match=r"'0'.*memory_budget=0.5"):
        model(x)
    backend, graphs = graph_capture()
    for block in model:
        block.compile(backend=backend, fullgraph=True)
    actual = grads(params, [x], lambda x: model(x).sum())
    assert_bitwise_equal(actual, expected, replays=0)
    budgets = {
        (n.meta.get("custom") or {}).get(torch.fx.traceback.MEMORY_BUDGET_ANNOTATION_KEY)
        for forward in graphs["forward"]
        for n in forward.graph.nodes
        if n.op == "call_function"
    }
    assert len(graphs["forward"]) == 2 and budgets == {0.5}


def _budgets_of(graph: torch.fx.GraphModule) -> set:
    return {
        (n.meta.get("custom") or {}).get(torch.fx.traceback.MEMORY_BUDGET_ANNOTATION_KEY)
        for n in graph.graph.nodes
        if n.op == "call_function"
    }


def test_two_blocks_of_one_class_compile_each_under_its_own_budget():
    # The second block's compile sees the checkpoint's options change on the same
    # code: Dynamo's automatic dynamic made the budget a symbolic float, which the
    # annotation refused ("SymNodeVariable() is not a constant").
    torch.manual_seed(0)
    blocks = [Chain(), Chain()]
    x = torch.randn(8, 16, dtype=DTYPE, requires_grad=True)
    params = [p for b in blocks for p in b.parameters()]
    backend, graphs = graph_capture()
    calls = [
        torch.compile(remat.checkpoint(region_name=f"layers.{i}", memory_budget=budget)(b.forward),
                      backend=backend)
        for i, (b, budget) in enumerate(zip(blocks, (1.0, 0.5)))
    ]

    def plain(x):
        return blocks[0](x) + blocks[1](x.sin())

    def compiled(x):
        return calls[0](x) + calls[1](x.sin())

    assert_bitwise_equal(grads(params, [x], compiled), grads(params, [x], plain), replays=0)
    assert [_budgets_of(g) for g in graphs["forward"]] == [{1.0}, {0.5}]


def test_a_checkpoint_with_a_budget_or_an_offloader_compiles_with_dynamic_shapes():
    torch.manual_seed(0)
    block = AttnThenMlp()
    params = list(block.parameters())
    for option in ({"memory_budget": 0.5}, {"saved_tensors_hooks": offloader()}):
        torch._dynamo.reset()
        backend, graphs = graph_capture()
        step = torch.compile(remat.checkpoint(region_name="layers.0", **option)(block),
                             backend=backend, dynamic=True)
        for batch in (4, 6):
            x = torch.randn(batch, 16, dtype=DTYPE, requires_grad=True)
            assert_bitwise_equal(grads(params, [x], step), grads(params, [x], block), replays=0)
        forward = graphs["forward"][0]
        if "memory_budget" in option:
            assert _budgets_of(forward) == {0.5}
        else:
            assert host_copies(forward)  # attn's save moved to the host
