"""Diagnostics names shared with upstream torch-remat 0.2.2, with its contracts:
``memory_snapshot_annotate`` (a per-tensor labeller from a CUDA memory snapshot,
the ``annotate=`` of the reports), ``discover_autograd_roots`` (live tensors with
a ``grad_fn``, FakeTensors skipped) and ``is_placeholder``."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import UnseenLog

import torch_remat as remat

D = torch.float64


def snapshot_of(*blocks):
    return {"segments": [{"device": 0, "blocks": list(blocks)}]}


def block(t, frames, state="active_allocated"):
    st = t.untyped_storage()
    return {"state": state, "address": st.data_ptr(), "size": st.nbytes(), "frames": frames}


MODEL_FRAMES = [
    {"filename": "/site-packages/torch/nn/functional.py", "line": 9, "name": "linear"},
    {"filename": "/pkg/torch_remat/engine/frame.py", "line": 5, "name": "run_region"},
    {"filename": "/work/model/attn.py", "line": 42, "name": "forward"},
]


# --------------------------------------------------------- memory_snapshot_annotate


def test_the_labeller_maps_a_storage_and_every_view_of_it_to_its_allocation_site():
    t = torch.arange(16, dtype=torch.float32)
    decoy = {"state": "active_allocated", "address": 1, "size": 1, "frames": MODEL_FRAMES}
    annotate = remat.memory_snapshot_annotate(snapshot_of(decoy, block(t, MODEL_FRAMES)))
    assert annotate(t) == "attn.py:42 forward"
    assert annotate(t[4:8]) == "attn.py:42 forward"
    assert annotate(t.view(4, 4).t()) == "attn.py:42 forward"


def test_the_labeller_returns_none_for_uncovered_tensors_and_inactive_blocks():
    t = torch.zeros(8)
    assert remat.memory_snapshot_annotate(snapshot_of())(t) is None
    assert remat.memory_snapshot_annotate({})(t) is None
    inactive = snapshot_of(block(t, MODEL_FRAMES, state="inactive"))
    assert remat.memory_snapshot_annotate(inactive)(t) is None
    other = torch.zeros(8)
    assert remat.memory_snapshot_annotate(snapshot_of(block(other, MODEL_FRAMES)))(t) is None


def test_the_labeller_falls_back_to_the_innermost_frame_when_all_are_library_frames():
    t = torch.zeros(4)
    frames = [{"filename": "/x/torch/_ops.py", "line": 9, "name": "call"}]
    assert remat.memory_snapshot_annotate(snapshot_of(block(t, frames)))(t) == "_ops.py:9"
    assert remat.memory_snapshot_annotate(snapshot_of(block(t, [])))(t) is None


def test_blocks_without_an_address_lie_where_the_block_before_ended():
    # a segment's blocks tile it in order; a snapshot may give only the segment's
    # address (as label_memory_snapshot accepts)
    t = torch.zeros(64)
    start = t.untyped_storage().data_ptr()
    free = {"state": "inactive", "size": 256}
    held = {"state": "active_allocated", "size": t.untyped_storage().nbytes(), "frames": MODEL_FRAMES}
    snap = {"segments": [{"device": 0, "address": start - 256, "blocks": [free, held]}]}
    annotate = remat.memory_snapshot_annotate(snap)
    assert annotate(t) == "attn.py:42 forward"
    assert annotate(torch.zeros(4)) is None


def _kept_by_a_save_region():
    kept = []
    x = torch.randn(3, 4, dtype=D, requires_grad=True)

    def fn(x):
        p = remat.region(lambda t: t.mul(2).exp(), "proj", recompute=False)(x)
        kept.append(p)
        return p.sum()

    return remat.checkpoint(region_name="layers.0")(fn)(x), kept[0]


def test_the_labeller_is_the_annotate_of_the_saved_tensors_report():
    loss, kept = _kept_by_a_save_region()
    annotate = remat.memory_snapshot_annotate(snapshot_of(block(kept, MODEL_FRAMES)))
    text = remat.format_saved_tensors_report(loss, annotate=annotate)
    (row,) = [line for line in text.splitlines() if "saved.0" in line]
    assert row.endswith("@ attn.py:42 forward")
    buf = io.StringIO()
    remat.print_saved_tensors_report(loss, file=buf, annotate=annotate)
    assert "@ attn.py:42 forward" in buf.getvalue()
    assert "@ attn.py" not in remat.format_saved_tensors_report(loss)
    loss.backward()


def test_the_annotate_of_the_current_memory_report_and_of_the_oom_report():
    texts = []

    def fn(x):
        p = remat.region(lambda t: t.mul(2).exp(), "proj", recompute=False)(x)
        if not remat.is_recomputing():
            label = remat.memory_snapshot_annotate(snapshot_of(block(p, MODEL_FRAMES)))
            texts.append(remat.format_current_memory_report(annotate=label))
            texts.append(remat.format_oom_saved_tensors_report(annotate=label))
            buf = io.StringIO()
            remat.print_current_memory_report(file=buf, annotate=label)
            texts.append(buf.getvalue())
        return p.sum()

    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    remat.checkpoint(region_name="c")(fn)(x).backward()
    assert len(texts) == 3
    for text in texts:
        assert "@ attn.py:42 forward" in text


def test_an_annotate_that_is_not_callable_is_refused():
    with pytest.raises(TypeError, match="annotate"):
        remat.format_saved_tensors_report(annotate="attn.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
def test_without_cuda_taking_a_snapshot_raises_a_clear_error():
    with pytest.raises(remat.RematError, match="memory_snapshot_annotate.*snapshot"):
        remat.memory_snapshot_annotate()


def test_the_in_place_block_labelling_is_kept_under_its_own_name():
    loss, kept = _kept_by_a_save_region()
    snapshot = snapshot_of(block(kept, []))
    assert remat.diagnostics.label_memory_snapshot(snapshot, device_type="cpu") is snapshot
    assert snapshot["segments"][0]["blocks"][0]["remat"] == [  # named as the report's row
        {"checkpoint": "layers.0", "region": "proj", "tensor": "saved.0 (output at idx 0)", "nbytes": 96}
    ]
    loss.backward()


# ---------------------------------------------------------- discover_autograd_roots


def test_discovered_roots_are_the_live_tensors_with_a_grad_fn():
    leaf = torch.randn(3, requires_grad=True)
    intermediate = leaf * 2
    loss = (intermediate * 3).sum()
    plain = torch.randn(3)
    roots = remat.discover_autograd_roots()
    assert all(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in roots)
    ids = {id(t) for t in roots}
    assert id(intermediate) in ids and id(loss) in ids
    assert id(leaf) not in ids and id(plain) not in ids
    # ... and they are what the saved-tensors report takes as roots.
    assert "MulBackward0" in remat.format_saved_tensors_report(roots)


def test_discovered_roots_skip_fake_tensors_and_the_reports_never_touch_them():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.randn(3, requires_grad=True) * 2
    with FakeTensorMode():
        fake = torch.randn(3, requires_grad=True) * 2
    assert fake.grad_fn is not None
    ids = {id(t) for t in remat.discover_autograd_roots()}
    assert id(real) in ids and id(fake) not in ids
    # Everything alive, with a fake graph alive under a dead FakeTensorMode.
    assert "saved for backward" in remat.format_saved_tensors_report()
    del fake


# -------------------------------------------------------------------- is_placeholder


def test_is_placeholder_is_true_for_a_skipped_save_output_and_its_views_during_the_replay():
    seen = UnseenLog()

    def fn(x):
        y = remat.region(lambda t: t * 2, "mul", recompute=False)(x)  # y is not kept
        seen.append((remat.is_recomputing(), remat.is_placeholder(y), remat.is_placeholder(y[1:])))
        u = x.exp()  # exp saves u: dropped, so backward replays up to here
        return y.sum() + u.sum()

    x = torch.randn(4, dtype=D, requires_grad=True)
    remat.checkpoint(region_name="c")(fn)(x).backward()
    assert seen == [(False, False, False), (True, True, True)]
    assert remat.is_placeholder(torch.ones(2)) is False
    assert "is_placeholder" in remat.__all__


# ------------------------------------------------- save_for_backward(ctx, mapping)


class NamedExp(torch.autograd.Function):
    """Saves its result through upstream's form, one mapping of names to tensors."""

    @staticmethod
    def forward(ctx, x):
        e = torch.exp(x)
        remat.save_for_backward(ctx, {"e": e})
        return e

    @staticmethod
    def backward(ctx, g):
        (e,) = ctx.saved_tensors
        return g * e


def test_save_for_backward_takes_one_mapping_of_names_as_upstream_does():
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    texts = []

    def fn(x):
        y = remat.region(NamedExp.apply, "exp", recompute=False)(x)
        if not remat.is_recomputing():
            texts.append(remat.format_current_memory_report())
        return y.sum()

    remat.checkpoint(region_name="c")(fn)(x).backward()
    assert torch.equal(x.grad, x.detach().exp())
    (row,) = [line for line in texts[0].splitlines() if "(3, 4)" in line]
    assert " e " in row and "saved.0" not in row
    with pytest.raises(TypeError, match="mapping"):
        remat.save_for_backward(object(), {"a": torch.ones(1)}, b=torch.ones(1))


# ------------------------------------------------------ upstream's module paths


def test_upstream_module_paths_of_the_labeller_and_the_region_registry():
    from torch_remat._annotate import (
        _alloc_site_from_frames,
        _memory_snapshot,
        clear_memory_snapshot_cache,
        memory_snapshot_annotate,
    )
    from torch_remat._region import _live_regions

    assert memory_snapshot_annotate is remat.memory_snapshot_annotate
    assert _alloc_site_from_frames(MODEL_FRAMES) == "attn.py:42 forward"
    assert _alloc_site_from_frames(None) is None
    clear_memory_snapshot_cache()
    first = _memory_snapshot()
    assert _memory_snapshot() is first
    assert _memory_snapshot(refresh=True) is not first
    remat.clear_memory_snapshot_cache()
    assert _memory_snapshot() is not first

    loss, _kept = _kept_by_a_save_region()
    assert "layers.0" in remat.format_saved_tensors_report()
    _live_regions.clear()  # the reports forget the checkpoint calls made so far
    assert "layers.0" not in remat.format_saved_tensors_report()
    loss.backward()


def test_a_model_file_of_this_machine_in_a_directory_named_torch_remat_is_a_user_frame(tmp_path):
    model = tmp_path / "torch_remat" / "model.py"  # e.g. a checkout of this repository
    model.parent.mkdir()
    model.write_text("")
    t = torch.zeros(4)
    frames = [
        {"filename": torch.__file__, "line": 1, "name": "call"},
        {"filename": str(model), "line": 7, "name": "forward"},
    ]
    assert remat.memory_snapshot_annotate(snapshot_of(block(t, frames)))(t) == "model.py:7 forward"


def test_print_saved_tensors_report_takes_upstreams_roots_keyword():
    loss, _kept = _kept_by_a_save_region()
    by_roots, by_loss = io.StringIO(), io.StringIO()
    remat.print_saved_tensors_report(roots=[loss], file=by_roots)
    remat.print_saved_tensors_report(loss, file=by_loss)
    assert by_roots.getvalue() == by_loss.getvalue() and "layers.0" in by_loss.getvalue()
    with pytest.raises(TypeError, match="roots"):
        remat.print_saved_tensors_report(loss, roots=[loss])
    loss.backward()
