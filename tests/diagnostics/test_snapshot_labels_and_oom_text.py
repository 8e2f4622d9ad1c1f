"""label_memory_snapshot (on a synthetic snapshot of CPU storages), the snapshot
cache, discover_autograd_roots and format_oom_saved_tensors_report."""

import pytest
import torch

import torch_remat as remat
from torch_remat.diagnostics import alloc_sites

D = torch.float64


def kept_region(x):
    # exp saves its (3, 4) float64 result: 96 B kept by SAVE region "proj"
    return remat.region(lambda t: t.mul(2).exp(), "proj", recompute=False)(x).sum()


def synthetic_snapshot(t, pad=64):
    """One segment with a free block, then an active block holding ``t``'s storage."""
    st = t.untyped_storage()
    start = st.data_ptr()
    return {
        "segments": [
            {
                "device": 0,
                "address": start - pad,
                "blocks": [
                    {"address": start - pad, "size": pad, "state": "inactive"},
                    {"address": start, "size": st.nbytes(), "state": "active_allocated", "frames": []},
                ],
            }
        ]
    }


def checkpoint_keeping_exp(name):
    """A checkpoint whose SAVE region "proj" keeps exp's (3, 4) result; returns the
    loss and that result."""
    seen = []
    x = torch.randn(3, 4, dtype=D, requires_grad=True)

    def fn(x):
        p = remat.region(lambda t: t.mul(2).exp(), "proj", recompute=False)(x)
        seen.append(p)
        return p.sum()

    return remat.checkpoint(region_name=name)(fn)(x), seen[0]


def test_annotate_labels_the_block_holding_a_kept_tensor_with_checkpoint_region_and_name():
    loss, kept = checkpoint_keeping_exp("layers.0")
    snapshot = synthetic_snapshot(kept)
    assert remat.diagnostics.label_memory_snapshot(snapshot, device_type="cpu") is snapshot
    free, active = snapshot["segments"][0]["blocks"]
    assert "remat" not in free
    assert active["remat"] == [  # exp's result: saved, and the region's output
        {"checkpoint": "layers.0", "region": "proj", "tensor": "saved.0 (output at idx 0)", "nbytes": 96}
    ]
    loss.backward()


def test_labels_name_storages_as_the_report_rows_do_and_their_bytes_add_up_to_the_report():
    # "sq" keeps y (exp's result, saved for its backward and returned) on one
    # storage; "twice" saves y twice (y * y), a storage counted in "sq"
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    seen = []

    def fn(t):
        y = remat.region(lambda u: u.exp(), "sq", recompute=False)(t)
        seen.append(y)
        return remat.region(lambda u: u * u, "twice", recompute=False)(y).sum()

    loss = remat.checkpoint(region_name="layer.0")(fn)(x)
    snapshot = synthetic_snapshot(seen[0])
    remat.diagnostics.label_memory_snapshot(snapshot, device_type="cpu")
    labels = snapshot["segments"][0]["blocks"][1]["remat"]
    assert labels == [
        {"checkpoint": "layer.0", "region": "sq", "tensor": "saved.0 (output at idx 0)", "nbytes": 96},
        {"checkpoint": "layer.0", "region": "twice", "tensor": "saved.0, saved.1", "nbytes": 0},
    ]
    assert sum(lab["nbytes"] for lab in labels) == remat.saved_tensors_report(loss).total_bytes == 96
    loss.backward()


def test_annotate_leaves_blocks_of_other_devices_alone():
    loss, kept = checkpoint_keeping_exp("c")
    snapshot = synthetic_snapshot(kept)
    remat.diagnostics.label_memory_snapshot(snapshot)  # device_type="cuda": no CPU storage matches
    assert all("remat" not in b for b in snapshot["segments"][0]["blocks"])
    # ... though the same snapshot read as the CPU's has a block to label
    remat.diagnostics.label_memory_snapshot(snapshot, device_type="cpu")
    assert [b.get("remat", [{}])[0].get("checkpoint") for b in snapshot["segments"][0]["blocks"]] == [None, "c"]
    loss.backward()


def test_the_snapshot_is_reused_until_the_allocator_changes_or_the_cache_is_cleared(monkeypatch):
    taken = []
    epoch = [0]
    monkeypatch.setattr(alloc_sites, "_take_snapshot", lambda: taken.append(1) or {"segments": []})
    monkeypatch.setattr(alloc_sites, "_allocator_epoch", lambda: epoch[0])
    remat.clear_memory_snapshot_cache()
    first = alloc_sites.cached_snapshot()
    assert alloc_sites.cached_snapshot() is first and len(taken) == 1
    epoch[0] = 1  # a block was allocated or freed
    alloc_sites.cached_snapshot()
    assert len(taken) == 2
    remat.clear_memory_snapshot_cache()
    alloc_sites.cached_snapshot()
    assert len(taken) == 3
    remat.clear_memory_snapshot_cache()


def test_discovered_roots_are_the_live_tensors_with_a_grad_fn_losses_and_intermediates():
    # upstream's contract (issue 27): every live tensor with a grad_fn, not only
    # those no other graph reaches
    a = torch.randn(3, requires_grad=True)
    h = a.exp()  # alive, and reached from loss1's graph
    loss1 = (h * 2).sum()
    loss2 = a.sin().sum()
    ids = {id(t) for t in remat.discover_autograd_roots()}
    assert {id(loss1), id(loss2), id(h)} <= ids
    assert id(a) not in ids


def test_oom_text_names_the_checkpoint_an_exception_was_raised_in():
    x = torch.randn(3, 4, dtype=D, requires_grad=True)

    def fn(x):
        remat.region(lambda t: t.mul(2).exp(), "proj", recompute=False)(x)
        raise torch.OutOfMemoryError("simulated")

    with pytest.raises(torch.OutOfMemoryError) as info:
        remat.checkpoint(region_name="layers.3")(fn)(x)
    text = remat.format_oom_saved_tensors_report(info.value)
    assert text.splitlines()[0] == "while running checkpoint 'layers.3' (forward)"
    assert "saved for backward:" in text.splitlines()[1]


def test_oom_text_inside_a_region_names_it_and_lists_what_is_held():
    texts = []
    x = torch.randn(3, 4, dtype=D, requires_grad=True)

    def fn(x):
        h = kept_region(x)  # alive while 'b' runs (an output that died would free its saves)
        y = remat.region(lambda t: texts.append(remat.format_oom_saved_tensors_report()) or t.sin(), "b", recompute=False)(x)
        return y + h

    remat.checkpoint(region_name="c")(fn)(x)
    lines = texts[0].splitlines()
    assert lines[0] == "while running checkpoint 'c' (forward), region 'b'"
    assert "c::proj: 96 B" in lines


def test_oom_text_outside_checkpoints_has_no_running_line():
    assert not remat.format_oom_saved_tensors_report().startswith("while running")
