"""``apply_remat`` with ``saved_tensors_hooks`` (an offloader) and with a save
module called twice in one block (distinct region names through name_scope)."""

import copy

import torch
from helpers import assert_bitwise_equal, grads
from torch import nn

import torch_remat as remat
from torch_remat.integrations import RematConfig, apply_remat
from torch_remat.integrations.apply import apply_remat_to_blocks
from torch_remat.offload import ActivationOffloader

D = torch.float64


class Proj(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 32, dtype=D)
        self.down = nn.Linear(32, 8, dtype=D)

    def forward(self, x):
        # exp's (4, 32) float64 result (1024 B) is saved twice: by exp and by down
        return self.down(self.up(x).exp())


class Shared(nn.Module):
    """A block that applies one sub-module twice."""

    def __init__(self):
        super().__init__()
        self.proj = Proj()

    def forward(self, x):
        return self.proj(self.proj(x).sin()).tanh()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Shared() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def grads_of(model):
    x = torch.randn(4, 8, dtype=D, generator=torch.Generator().manual_seed(1))
    return grads(list(model.parameters()), [], lambda: model(x))


def test_a_save_module_called_twice_gets_a_second_region_name_and_exact_gradients():
    reference = Net()
    model = copy.deepcopy(reference)
    apply_remat(
        model,
        check_fn=lambda m: isinstance(m, Shared),
        remat=RematConfig(save_modules=Proj, rng_state_hooks=False),
    )
    x = torch.randn(4, 8, dtype=D)
    with remat.collect_trace() as trace:
        model(x)
    assert trace.format().splitlines()[1:3] == ["proj: save", "call1/proj: save"]
    assert_bitwise_equal(grads_of(model), grads_of(reference))


def test_apply_remat_hands_the_offloader_to_every_checkpoint():
    reference = Net()
    model = copy.deepcopy(reference)
    off = ActivationOffloader(1 << 20, prefetch=1, min_bytes=1024)
    apply_remat(
        model,
        check_fn=lambda m: isinstance(m, Shared),
        remat=RematConfig(save_modules=Proj, rng_state_hooks=False, saved_tensors_hooks=off),
    )
    assert_bitwise_equal(grads_of(model), grads_of(reference))
    # Per call 2 x 1024 B move (the (4, 8) region arguments are below min_bytes,
    # the weights are parameters); two of three blocks move (prefetch=1 keeps the
    # last one on the device).
    assert off.stats.offloaded_bytes == {"proj": 4096, "call1/proj": 4096}
    assert off.stats.fetched_bytes == off.stats.offloaded_bytes
    assert off.held_tensors() == 0


def test_remat_config_forwards_saved_tensors_hooks():
    model = Net()
    off = ActivationOffloader(1 << 20, prefetch=0, min_bytes=1024)
    config = RematConfig(save_modules=Proj, rng_state_hooks=False, saved_tensors_hooks=off)
    assert apply_remat_to_blocks(model, Shared, config) == ["layers.0", "layers.1", "layers.2"]
    grads_of(model)
    assert off.stats.offloaded_bytes == {"proj": 6144, "call1/proj": 6144}
    assert off.held_tensors() == 0
