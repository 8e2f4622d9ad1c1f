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
