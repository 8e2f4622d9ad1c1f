"""remat.collect_trace / remat.trace_scope: the configured region hierarchy."""

import threading

import torch
from helpers import kept_bytes, recorded_replays

import torch_remat as remat
from torch_remat.diagnostics import OpTrace, ScopeTrace


def sin_cos(x):
    a = remat.region(torch.sin, "sin", recompute=False)(x)
    return remat.region(torch.cos, "cos", recompute=True)(a)


SEED_TRACE = "torch_remat trace\nscope [test_flag]\n  sin: save\n  cos: recompute"


def test_trace_of_a_scope_inside_a_checkpoint_matches_the_readme():
    x = torch.randn(3, requires_grad=True)
    with remat.collect_trace() as trace:
        fn = remat.trace_scope(sin_cos, "scope", metadata="test_flag")
        out = remat.checkpoint(region_name="layer")(fn)(x)
    assert trace.format() == SEED_TRACE
    # the checkpoint keeps what its SAVE region saves (sin's output, which cos saves)
    assert kept_bytes(out) == {"layer": {"sin": 12}}
    out.sum().backward()
    assert trace.format() == SEED_TRACE


def test_trace_of_a_checkpoint_inside_a_scope_is_the_same():
    x = torch.randn(3, requires_grad=True)
    with remat.collect_trace() as trace:
        out = remat.trace_scope(remat.checkpoint(region_name="layer")(sin_cos), "scope", "test_flag")(x)
    assert kept_bytes(out) == {"layer": {"sin": 12}}
    assert trace.format() == SEED_TRACE


def test_regions_outside_checkpoints_are_traced_with_their_configuration():
    x = torch.randn(3)
    with remat.collect_trace() as trace:
        remat.trace_scope(sin_cos, "scope", metadata="test_flag")(x)
    assert trace.format() == SEED_TRACE


def test_recompute_is_not_recorded():
    x = torch.randn(3, requires_grad=True)

    def block(x):
        h = remat.region(torch.exp, "exp", recompute=True)(x)
        return remat.region(torch.sin, "sin", recompute=False)(h).cos()

    with remat.collect_trace() as trace, recorded_replays() as replayed:
        out = remat.checkpoint(region_name="layer")(block)(x)
        out.sum().backward()  # recomputes "exp" inside the trace block
    assert replayed == ["layer"]
    assert x.grad is not None
    assert trace.format() == "torch_remat trace\nexp: recompute\nsin: save"


def test_nested_regions_and_scopes_are_indented_by_two_spaces():
    def inner(x):
        return remat.region(torch.sin, "softmax", recompute=False)(x)

    def block(x):
        a = remat.region(inner, "attn", recompute=False)(x)
        b = remat.trace_scope(lambda t: remat.region(torch.cos, "mlp", recompute=True)(t), "ffn")(a)
        return b

    x = torch.randn(3, requires_grad=True)
    with remat.collect_trace(checkpoints=True) as trace:
        remat.checkpoint(region_name="layers.0")(block)(x)
    assert trace.format() == (
        "torch_remat trace\n"
        "layers.0: checkpoint\n"
        "  attn: save\n"
        "    softmax: save\n"
        "  ffn\n"
        "    mlp: recompute"
    )
    assert trace.to_dict()[0]["children"][1] == {
        "kind": "scope",
        "name": "ffn",
        "metadata": None,
        "children": [{"kind": "recompute", "name": "mlp", "metadata": None, "children": []}],
    }


def test_nothing_is_recorded_outside_the_block_or_in_other_threads():
    x = torch.randn(3, requires_grad=True)
    other = []
    with remat.collect_trace(checkpoints=True) as trace:
        t = threading.Thread(
            target=lambda: other.append(remat.checkpoint(region_name="t")(sin_cos)(x))
        )
        t.start()
        t.join()
    remat.checkpoint(region_name="after")(sin_cos)(x)
    assert other and trace.format() == "torch_remat trace"
    # while the same call in the block's thread is recorded, the checkpoint with it
    with remat.collect_trace(checkpoints=True) as here:
        remat.checkpoint(region_name="here")(sin_cos)(x)
    assert here.format() == "torch_remat trace\nhere: checkpoint\n  sin: save\n  cos: recompute"


def test_empty_trace_and_scope_without_trace_are_plain():
    with remat.collect_trace() as trace:
        pass
    assert str(trace) == "torch_remat trace"
    assert torch.equal(remat.trace_scope(torch.sin, "s")(torch.ones(2)), torch.ones(2).sin())


def test_entries_list_op_and_scope_traces_as_upstream_names_them():
    x = torch.randn(3, requires_grad=True)
    with remat.collect_trace() as trace:
        fn = remat.trace_scope(sin_cos, "scope", metadata="test_flag")
        remat.region(torch.exp, "exp", recompute=False)(remat.checkpoint(region_name="layer")(fn)(x))
    assert trace.entries == [
        ScopeTrace(
            name="scope",
            metadata="test_flag",
            entries=[OpTrace(name="sin", recompute=False), OpTrace(name="cos", recompute=True)],
        ),
        OpTrace(name="exp", recompute=False),
    ]
    # checkpoints shown in the text (checkpoints=True) are not entries: their regions are
    with remat.collect_trace(checkpoints=True) as with_checkpoints:
        remat.checkpoint(region_name="layer")(sin_cos)(x)
    assert with_checkpoints.entries == [
        OpTrace(name="sin", recompute=False), OpTrace(name="cos", recompute=True)
    ]
    assert with_checkpoints.format() == "torch_remat trace\nlayer: checkpoint\n  sin: save\n  cos: recompute"
