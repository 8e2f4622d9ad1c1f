"""Reports show SAVE-region saves the replay rebuilds as such, and their totals stay
the bytes actually held."""

import io

import torch

import torch_remat as remat

ROW = 2048  # one (8, 32) float64 tensor


def _lin():
    return torch.nn.Linear(32, 32, bias=False, dtype=torch.float64)


def test_saved_tensors_report_counts_rebuilt_saves_apart_and_totals_the_held_bytes(memory_probe):
    lin = _lin()

    def fn(x):
        return remat.region(lin, "proj", recompute=False)(x.tanh())  # saves tanh(x): rebuilt

    base = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    with memory_probe() as probe:
        x = base.clone()
        out = remat.checkpoint(region_name="c")(fn)(x)
        del x
    report = remat.saved_tensors_report(out)
    # x (kept for the replay) is all the checkpoint holds; the output is the caller's.
    assert report.checkpoint_bytes == probe.bytes - ROW == ROW
    text = report.format()
    assert "1 save(s) rebuilt on recompute, 2.00 KiB not held" in text
    assert report.checkpoints[0].to_dict()["rebuilt_bytes"] == ROW


def test_memory_report_during_the_forward_counts_a_save_not_yet_rebuilt():
    lin = _lin()
    text = io.StringIO()

    def fn(x):
        y = remat.region(lin, "proj", recompute=False)(x.tanh())
        if not remat.is_recomputing():
            remat.print_current_memory_report(file=text)
        return y

    remat.checkpoint(region_name="c")(fn)(torch.randn(8, 32, dtype=torch.float64, requires_grad=True))
    lines = text.getvalue().splitlines()
    # Until the forward ends the region still holds tanh(x); the header counts it.
    assert lines[0] == "c: 2.00 KiB resident in 1 storage(s)"
    assert "(argument 0, rebuilt on recompute)" in lines[2]


def test_memory_report_flags_a_saved_view_that_pins_a_larger_storage():
    text = io.StringIO()

    def body(t):
        return (t * 2)[:2].sin()  # sin saves a (2, 32) view of the (8, 32) product

    def fn(x):
        y = remat.region(body, "narrow", recompute=False)(x)
        if not remat.is_recomputing():
            remat.print_current_memory_report(file=text)
        return y

    x = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    remat.checkpoint(region_name="c")(fn)(x)
    assert "saved.0 (pins 2.00 KiB, uses 512 B)" in text.getvalue()
