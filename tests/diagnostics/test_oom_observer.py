"""remat.oom_observer / remat.attach_oom_observer."""

import gc
import io
import warnings

import pytest
import torch

import torch_remat as remat
from torch_remat.diagnostics import saved_report as _saved_report


@pytest.fixture(autouse=True)
def _no_graphs_left_from_other_tests():
    gc.collect()


def sq_block(x):
    return remat.region(lambda t: t * t, "sq", recompute=False)(x).tanh()


def test_observer_prints_the_request_and_every_live_graph_without_a_loss_handle():
    # Graphs other tests left alive (if any) are part of "every live graph" too.
    before = remat.saved_tensors_report().total_bytes
    x = torch.randn(4, 4, requires_grad=True).clone()  # not a leaf: billed
    y = remat.checkpoint(region_name="layers.0")(sq_block)(x)
    out = io.StringIO()
    remat.oom_observer(0, 3 * 2**30, 80 * 2**30, 2**20, file=out)
    text = out.getvalue()
    assert text == (
        "torch_remat: CUDA out of memory on device 0: a request for 3.00 GiB failed "
        "(1.00 MiB free of 80.00 GiB usable on the device)\n"
        + remat.format_saved_tensors_report()
        + "\n"
    )
    assert remat.saved_tensors_report().total_bytes - before == 64  # tanh's result is dropped
    assert "layers.0: 64 B resident in 1 storage(s)\nlayers.0::sq: 64 B\n" in text
    assert "  64 B  saved.0, saved.1  (4, 4)  float32\n" in text
    del y


def test_observer_names_the_checkpoint_and_region_running_when_memory_ran_out():
    out = io.StringIO()

    def oom_inside(t):
        remat.oom_observer(1, 512, 0, 0, file=out)
        return t * t

    def block(x):
        return remat.region(oom_inside, "attn", recompute=False)(x)

    remat.checkpoint(region_name="layers.3")(block)(torch.randn(2, requires_grad=True))
    assert out.getvalue().splitlines()[:2] == [
        "torch_remat: CUDA out of memory on device 1: a request for 512 B failed "
        "(0 B free of 0 B usable on the device)",
        "while running checkpoint 'layers.3' (forward), region 'attn'",
    ]


def test_observer_never_raises_and_prints_a_failure_line(monkeypatch):
    def broken(roots=None):
        raise RuntimeError("graph walk exploded")

    monkeypatch.setattr(_saved_report, "saved_tensors_report", broken)
    out = io.StringIO()
    assert remat.oom_observer(0, 1024, 0, 0, file=out) is None
    assert out.getvalue() == (
        "torch_remat: OOM observer failed while building its report (RuntimeError: graph "
        "walk exploded); the allocator's request for 1024 bytes on device 0 failed\n"
    )


def test_observer_survives_a_broken_output_stream(monkeypatch):
    class Broken(io.StringIO):
        def write(self, s):
            raise OSError("stderr closed")

    assert remat.oom_observer(0, 1, 0, 0, file=Broken()) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_attach_without_cuda_warns_and_returns_false():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert remat.attach_oom_observer() is False
    (w,) = caught
    assert w.category is RuntimeWarning
    # the same on a CPU-only build and on a CUDA build without a GPU: what matters is
    # the device
    assert str(w.message) == (
        "torch_remat.attach_oom_observer: not attached, no CUDA device is available. The observer hooks the "
        "CUDA caching allocator; elsewhere catch torch.OutOfMemoryError and call "
        "remat.print_saved_tensors_report()."
    )


def test_attach_registers_with_the_allocator(monkeypatch):
    attached = []
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch._C, "_cuda_attach_out_of_memory_observer", attached.append, raising=False
    )
    assert remat.attach_oom_observer() is True
    assert attached == [remat.oom_observer]
