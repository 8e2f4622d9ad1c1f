"""The saved-tensors report of a compiled checkpoint: the compiled forward's saves
are named after the checkpoint and region they were traced in, bytes exact."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from helpers import SavedBytes

import torch_remat as remat
from torch_remat import _compat
from torch_remat.diagnostics.graph_saves import NOT_ATTRIBUTED
from torch_remat.engine import compiled as compiled_saves
from torch_remat.integrations import reports

DTYPE = torch.float64
COMPILED = "CompiledFunctionBackward"


class SaveThenRecompute(torch.nn.Module):
    """x -> [a: SAVE] tanh(linear) -> sin -> linear -> tanh -> sum."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32, dtype=DTYPE)
        self.b = torch.nn.Linear(32, 8, dtype=DTYPE)

    def forward(self, x):
        h = remat.region(lambda t: torch.tanh(self.a(t)), "a", recompute=False)(x)
        return torch.tanh(self.b(h.sin())).sum()


def compiled_loss(backend: str, outside=lambda x: 0.0):
    """The block checkpointed as ``layers.0`` plus ``outside(x)``, compiled."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = SaveThenRecompute()
    x = torch.randn(4, 16, dtype=DTYPE, requires_grad=True)
    step = torch.compile(
        lambda x: remat.checkpoint(region_name="layers.0")(block)(x) + outside(x),
        backend=backend,
        fullgraph=True,
    )
    saved = SavedBytes(block)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss = step(x)
    return loss, saved, x


@pytest.fixture(scope="module")
def aot_eager_run():
    loss, saved, x = compiled_loss("aot_eager")
    report = remat.saved_tensors_report(loss)
    yield report, saved, x, loss
    loss.backward()
    torch._dynamo.reset()


def test_compiled_saves_of_a_save_region_are_named_after_its_checkpoint_and_region(aot_eager_run):
    report = aot_eager_run[0]
    (block,) = report.checkpoints
    assert block.name == "layers.0"
    region = block.regions[-1]
    assert (region.label, region.nbytes) == ("layers.0::a", 4 * 32 * 8)
    assert [(row.name, row.meta.shape) for row in region.rows] == [("tanh (compiled)", (4, 32))]


def test_an_input_only_the_checkpoints_backward_reads_is_listed_as_its_input(aot_eager_run):
    report, _, x, _ = aot_eager_run
    (block,) = report.checkpoints
    inputs = block.regions[0]
    assert (inputs.label, inputs.nbytes) == ("layers.0::(inputs)", x.nbytes)
    assert [row.name for row in inputs.rows] == ["primals_1 (compiled)"]
    assert report.outside == []


def test_an_input_also_saved_for_code_outside_the_checkpoint_stays_outside_regions():
    loss, _, x = compiled_loss("aot_eager", outside=lambda x: (x * x).sum())
    try:
        report = remat.saved_tensors_report(loss)
        (block,) = report.checkpoints
        assert [(r.label, r.nbytes) for r in block.regions] == [("layers.0::a", 4 * 32 * 8)]
        assert [(g.node_type, g.nbytes) for g in report.outside] == [(COMPILED, x.nbytes)]
    finally:
        loss.backward()
        torch._dynamo.reset()


def test_the_report_total_equals_the_bytes_the_compiled_forward_saved(aot_eager_run):
    report, saved, x, _ = aot_eager_run
    assert report.total_bytes == saved.total == 4 * 32 * 8 + x.nbytes


def test_the_text_report_lists_the_compiled_region_under_its_checkpoint(aot_eager_run):
    text = aot_eager_run[0].format()
    assert "regions:\n  1.50 KiB  x1  layers.0  (2 storages)\n" in text
    assert "layers.0::(inputs): 512 B\n" in text
    assert "layers.0::a: 1.00 KiB\n" in text


def test_the_cross_rank_summary_counts_the_compiled_checkpoint_by_name(aot_eager_run):
    report, _, x, _ = aot_eager_run
    assert reports.rank_summary(report.to_dict()) == {
        "total": 4 * 32 * 8 + x.nbytes,
        "regions": [["layers.0", 4 * 32 * 8 + x.nbytes, 1], [reports.OUTSIDE_REGIONS, 0, 0]],
    }


def test_saves_that_do_not_match_their_graphs_record_are_reported_as_not_attributed(
    aot_eager_run, monkeypatch
):
    report, _, x, loss = aot_eager_run
    record = compiled_saves.compiled_saves_of(loss.grad_fn)
    wrong = dataclasses.replace(record.checked[-1], dtype=torch.float16)
    key = id(_compat.compiled_function_metadata(loss.grad_fn))
    ref, _ = compiled_saves._records[key]
    record = dataclasses.replace(record, checked=record.checked[:-1] + (wrong,))
    monkeypatch.setitem(compiled_saves._records, key, (ref, record))
    unattributed = remat.saved_tensors_report(loss)
    assert unattributed.checkpoints == []
    assert [(g.node_type, g.nbytes) for g in unattributed.outside] == [
        (f"{COMPILED} ({NOT_ATTRIBUTED})", report.total_bytes)
    ]


@pytest.mark.slow
def test_inductor_saves_are_attributed_like_aot_eager():
    loss, saved, x = compiled_loss("inductor")
    try:
        report = remat.saved_tensors_report(loss)
        (block,) = report.checkpoints
        assert [(r.label, r.nbytes) for r in block.regions] == [
            ("layers.0::(inputs)", x.nbytes),
            ("layers.0::a", 4 * 32 * 8),
        ]
        assert report.total_bytes == saved.total == 4 * 32 * 8 + x.nbytes
    finally:
        loss.backward()
        torch._dynamo.reset()


def test_a_compiled_graph_without_checkpoints_keeps_its_saves_outside_regions():
    torch._dynamo.reset()
    x = torch.randn(4, 16, dtype=DTYPE, requires_grad=True)
    loss = torch.compile(lambda x: x.sin().sum(), backend="aot_eager")(x)
    try:
        report = remat.saved_tensors_report(loss)
        assert report.checkpoints == []
        assert [(g.node_type, g.nbytes) for g in report.outside] == [(COMPILED, x.nbytes)]
    finally:
        torch._dynamo.reset()


def _scoped_twice(x):
    # one region name under two name scopes: two regions, as in eager
    with remat.name_scope("first"):
        a = remat.region(torch.exp, "r", recompute=False)(x)  # saves its output
    with remat.name_scope("second"):
        b = remat.region(lambda t: (t * 2).sin(), "r", recompute=False)(x)  # saves t * 2
    return (a + b).sum()


def _report_regions(loss) -> set[str]:
    report = remat.saved_tensors_report(loss)
    return {r.region for c in report.checkpoints for r in c.regions}


def test_name_scope_prefixes_survive_compile_in_the_report():
    torch._dynamo.reset()
    x = torch.randn(64, dtype=DTYPE, requires_grad=True)
    f = remat.checkpoint(region_name="c")(_scoped_twice)
    eager = f(x)
    eager_regions = _report_regions(eager)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    assert {"first/r", "second/r"} <= eager_regions
    assert {"first/r", "second/r"} <= _report_regions(compiled)
    assert torch.equal(eager, compiled)
    eager.backward()
    g = x.grad.clone()
    x.grad = None
    compiled.backward()
    assert torch.equal(x.grad, g)


# ------------------------------------------------- name_scope prefixes in compiled reports


def _scoped_block(w):
    """One sub-block (SAVE region ``up``) called under ``name_scope("a")`` and
    ``name_scope("b")``, then a SAVE region whose body opens a scope of its own."""

    def sub(x, n):
        h = remat.region(lambda t: (t @ w).tanh() * n, "up", recompute=False)(x)
        return h.sin()

    def body(t):
        with remat.name_scope("s"):
            u = remat.region(lambda v: v.exp() * v, "inner", recompute=False)(t)
        return remat.region(lambda v: v.cos() * v, "last", recompute=False)(u)

    def block(x):
        with remat.name_scope("a"):
            h = sub(x, 1.0)
        with remat.name_scope("b"):
            h = sub(h, 2.0)
        with remat.name_scope("c"):
            h = remat.region(body, "outer", recompute=False)(h)
        return h.sin().sum()

    return block


def _region_labels(loss):
    return [r.label for c in remat.saved_tensors_report(loss).checkpoints for r in c.regions]


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_report_names_regions_with_their_name_scope_prefixes_as_eager_does():
    w = torch.randn(8, 8, dtype=DTYPE, requires_grad=True)
    x = torch.randn(4, 8, dtype=DTYPE, requires_grad=True)
    step = remat.checkpoint(region_name="blk")(_scoped_block(w))
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    expected = ["blk::a/up", "blk::b/up", "blk::c/outer.s/inner", "blk::c/outer.last"]
    for scope in (None, "enc"):
        with remat.name_scope(scope) if scope else contextlib.nullcontext():
            eager_loss, compiled_loss_ = step(x), compiled(x)
        want = [label.replace("::", f"::{scope}/") if scope else label for label in expected]
        eager_labels, compiled_labels = _region_labels(eager_loss), _region_labels(compiled_loss_)
        # the compiled graph saves no region outputs of its own, so "c/outer"
        # itself (which holds only its output in eager) is absent there
        assert [label for label in eager_labels if not label.endswith("c/outer")] == want
        assert [label for label in compiled_labels if not label.endswith("(inputs)")] == want
        eager_loss.backward()
        compiled_loss_.backward()
