"""``apply_remat(auto_wrap_policy=...)`` in the forms frameworks pass it: a set or a
list of module classes (torchtune, Lightning) as well as torch's policies."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from tests.helpers import assert_bitwise_equal, grads, recorded_replays
from torch_remat.integrations import RematConfig, apply_remat, remove_remat


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        return x + self.o(torch.tanh(self.q(x)))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = Attn(d)
        self.mlp = MLP(d)

    def forward(self, x):
        return self.mlp(self.attn(x))


class Net(nn.Module):
    def __init__(self, d=8, n=3):
        super().__init__()
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _net():
    torch.manual_seed(0)
    return Net().double()



@pytest.mark.parametrize("save", [nn.Linear, MLP])
def test_nested_checkpoints_with_save_modules_are_exact(save):
    # layers and their attention both checkpointed: the attention's checkpoint runs
    # again in each layer's replay, and must keep what it kept in the forward
    reference = _net()
    model = _net()
    names = apply_remat(
        model, check_fn=lambda m: isinstance(m, (Layer, Attn)), remat=RematConfig(save_modules=save)
    )
    assert "layers.0" in names and "layers.0.attn" in names
    x = torch.randn(4, 8, dtype=torch.float64)
    expected = grads(list(reference.parameters()), [], lambda: reference(x).square().sum())
    with recorded_replays() as replayed:
        actual = grads(list(model.parameters()), [], lambda: model(x).square().sum())
    assert_bitwise_equal(actual, expected)
    assert "layers.0" in replayed


@pytest.mark.parametrize("form", [set, frozenset, list, tuple])
def test_a_collection_of_classes_selects_what_module_wrap_policy_selects(form):
    model = _net()
    want = apply_remat(model, auto_wrap_policy=ModuleWrapPolicy({Layer, MLP}))
    remove_remat(model)
    got = apply_remat(model, auto_wrap_policy=form([Layer, MLP]))
    assert got == want
    assert "layers.0" in got and "layers.0.mlp" in got and "layers.0.attn" not in got
    # what is selected is checkpointed: backward replays each selected module
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with recorded_replays() as replayed:
        model(x).sum().backward()
    assert sorted(replayed) == sorted(got)


def test_a_set_of_classes_checkpoints_exactly():
    model = _net()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    params = list(model.parameters())
    ref = grads(params, [x], lambda x: model(x).pow(2).sum())
    assert apply_remat(model, auto_wrap_policy={Layer}) == ["layers.0", "layers.1", "layers.2"]
    assert_bitwise_equal(ref, grads(params, [x], lambda x: model(x).pow(2).sum()))


def test_a_collection_holding_something_else_than_module_classes_is_refused():
    model = _net()
    with pytest.raises(TypeError, match=r"auto_wrap_policy.*module classes.*'layers'"):
        apply_remat(model, auto_wrap_policy={Layer, "layers"})
    with pytest.raises(TypeError, match=r"auto_wrap_policy.*module classes"):
        apply_remat(model, auto_wrap_policy=[Layer(8)])


def test_an_empty_collection_is_refused():
    with pytest.raises(ValueError, match=r"auto_wrap_policy.*empty"):
        apply_remat(_net(), auto_wrap_policy=set())
