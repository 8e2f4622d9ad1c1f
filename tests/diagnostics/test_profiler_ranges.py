"""Profiler ranges for forward, recompute and regions."""

import torch
from torch.profiler import ProfilerActivity, profile

import torch_remat as remat
from torch_remat.engine.context import profiler_range


def block(x):
    h = remat.region(torch.exp, "exp", recompute=True)(x)
    h = remat.region(torch.sin, "sin", recompute=False)(h)
    return h.cos()


def test_forward_recompute_and_regions_appear_in_the_trace():
    x = torch.randn(8, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = remat.checkpoint(region_name="layers.0")(block)(x)
        out.sum().backward()
    names = [e.name for e in prof.events() if e.name.startswith("remat.")]
    assert names.count("remat.forward:layers.0") == 1
    assert names.count("remat.recompute:layers.0") == 1
    # "exp" runs in forward and again in the recompute; "sin" (SAVE) only in forward
    assert names.count("remat.region:layers.0::exp") == 2
    assert names.count("remat.region:layers.0::sin") == 1


def test_no_range_object_is_made_without_a_profiler():
    assert profiler_range("remat.forward:x") is profiler_range("remat.region:x::y")
