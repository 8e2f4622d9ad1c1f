"""Reports that must not mislead: FakeTensor graphs hold no memory."""

import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torch_remat import saved_tensors_report


def test_a_fake_tensor_graph_holds_no_resident_bytes_and_its_data_ptr_is_not_read():
    with FakeTensorMode():
        a = torch.randn(1024, 1024, requires_grad=True)
        loss = a.sin().exp().sum()  # sin saves a, exp its result: 4 MiB each (fake)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns on a FakeTensor's data_ptr
            report = saved_tensors_report(loss)
    assert report.total_bytes == 0


def test_the_report_says_what_torch_checkpoints_hold_that_it_cannot_count():
    from torch.utils.checkpoint import checkpoint

    w = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    h = torch.randn(256, 64, dtype=torch.float64, requires_grad=True) * 1
    for _ in range(3):
        h = checkpoint(lambda t: (t @ w).tanh(), h, use_reentrant=False)
    report = saved_tensors_report(h.sum())
    assert report.torch_checkpoint_saves == 3 * 3  # per call: mm saves both operands, tanh its result
    assert "not counted: 9 tensors saved inside torch.utils.checkpoint calls" in report.format()
    assert report.to_dict()["torch_checkpoint_saves"] == 9
