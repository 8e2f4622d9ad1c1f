"""Tensors made under ``torch.inference_mode()`` (features from a frozen encoder, a
rotary table built during generation) read by a checkpointed function: an input,
a buffer, a tensor attribute, a module-level tensor, a closure tensor or a SAVE
region's argument. They have no version counter (reading one raises), and outside
inference mode nothing can update them in place, so remat holds them unchecked.
Before, each crashed the forward with torch's bare "Inference tensors do not track
version counter"."""

import pytest
import torch
from helpers import recorded_replays
from torch import nn

import torch_remat as remat

with torch.inference_mode():
    TABLE = torch.linspace(0.5, 1.5, 8)


class Head(nn.Module):
    """Reads an inference tensor from where ``source`` says."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source
        self.lin = nn.Linear(8, 8)
        with torch.inference_mode():
            table = torch.linspace(0.5, 1.5, 8)
        if source == "buffer":
            self.register_buffer("table", table)
        elif source == "attribute":
            self.table = table
        scale = table

        def closure_scale():
            return scale

        self.closure_scale = closure_scale

    def forward(self, feats):
        if self.source == "input":
            return torch.tanh(self.lin(feats.clone()))
        if self.source == "region argument":
            h = remat.region(lambda a, t: self.lin(a) + t, "shifted", recompute=False)(feats.clone(), TABLE)
            return torch.tanh(remat.recompute_needs_tensor(h))
        table = {"buffer": getattr(self, "table", None), "attribute": getattr(self, "table", None),
                 "global": TABLE, "closure": self.closure_scale()}[self.source]
        # (added, not multiplied: autograd refuses to save an inference tensor)
        return torch.tanh(self.lin(feats.clone()) + table)


@pytest.mark.parametrize("source", ["input", "buffer", "attribute", "global", "closure", "region argument"])
def test_an_inference_tensor_the_function_reads_trains_as_without_remat(source):
    torch.manual_seed(0)
    head = Head(source)
    with torch.inference_mode():
        feats = torch.randn(4, 8)
    grads = []
    for ckpt in (False, True):
        head.zero_grad(set_to_none=True)
        f = remat.checkpoint(region_name="head")(head) if ckpt else head
        with recorded_replays() as replayed:
            for _ in range(2):  # the second call reuses the capture where it can
                f(feats).square().sum().backward()
        assert replayed == (["head"] * 2 if ckpt else [])
        grads.append([p.grad for p in head.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
