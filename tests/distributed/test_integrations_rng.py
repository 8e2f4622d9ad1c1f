"""integrations.rng: the stock per-rank RNG state hooks (one process)."""

from __future__ import annotations

import pytest
import torch
from dist_models import MLPBlock, assert_grads_equal, param_grads, tiny_net
from helpers import recorded_replays

from torch_remat.integrations import (
    DeviceRNGStateHook,
    RematConfig,
    apply_remat,
    default_rng_state_hooks,
    local_device,
)


def _is_block(module):
    return isinstance(module, MLPBlock)


def test_cpu_hook_restores_the_default_generator_absolutely():
    hook = DeviceRNGStateHook("cpu")
    state = hook.snapshot()
    first = torch.rand(5)
    torch.rand(100)
    hook.restore(state)
    assert torch.equal(torch.rand(5), first)
    hook.restore(state)  # a snapshot can be restored any number of times
    assert torch.equal(torch.rand(5), first)
    assert state.numel() == 5056  # the Mersenne Twister state snapshotted each time


def test_local_device_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_device() == torch.device("cpu")
    (hook,) = default_rng_state_hooks()
    assert hook.device == torch.device("cpu")


def test_local_device_is_cuda_local_rank_modulo_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert local_device() == torch.device("cuda", 2)
    monkeypatch.setenv("LOCAL_RANK", "5")  # one process per GPU with 4 visible
    assert local_device() == torch.device("cuda", 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_hook_without_cuda_is_refused():
    with pytest.raises(ValueError, match="CUDA is not available"):
        DeviceRNGStateHook("cuda:0")


def test_unsupported_device_type_is_refused():
    with pytest.raises(ValueError, match="device type 'meta' is not supported"):
        DeviceRNGStateHook("meta")


def _step(model, x, *, retain_graph=False):
    torch.manual_seed(5)
    loss = model(x).pow(2).sum()
    loss.backward(retain_graph=retain_graph)
    return loss


def test_recompute_does_not_move_the_callers_generator():
    x = torch.randn(4, 16, dtype=torch.float64)
    plain = tiny_net(dropout=0.3)
    _step(plain, x)
    after_plain = torch.rand(4)
    model = tiny_net(dropout=0.3)
    apply_remat(model, check_fn=_is_block)
    with recorded_replays() as replayed:
        _step(model, x)
    assert sorted(replayed) == ["layers.0", "layers.1"]  # each replay draws dropout again
    assert torch.equal(torch.rand(4), after_plain)


def test_second_backward_with_retain_graph_replays_dropout_identically():
    x = torch.randn(4, 16, dtype=torch.float64)
    model = tiny_net(dropout=0.3)
    apply_remat(model, check_fn=_is_block, remat=RematConfig(determinism_check="bitwise"))
    with recorded_replays() as replayed:
        loss = _step(model, x, retain_graph=True)
    first = param_grads(model)
    model.zero_grad()
    loss.backward()
    assert sorted(replayed) == ["layers.0", "layers.0", "layers.1", "layers.1"]  # per backward
    assert_grads_equal(first, param_grads(model))


class CountingHook:
    def __init__(self):
        self.value = 0
        self.restored = []

    def snapshot(self):
        return self.value

    def restore(self, state):
        self.restored.append(state)
        self.value = state


def test_extra_state_hooks_follow_the_rng_hook():
    model = tiny_net()
    extra = CountingHook()
    apply_remat(model, check_fn=_is_block, remat=RematConfig(recompute_state_hooks=(extra,)))
    hooks = model.layers[0].forward.state_hooks
    assert isinstance(hooks[0], DeviceRNGStateHook) and hooks[1] is extra
    # the replays restore the extra state too
    with recorded_replays() as replayed:
        _step(model, torch.randn(4, 16, dtype=torch.float64))
    assert sorted(replayed) == ["layers.0", "layers.1"]
    assert len(extra.restored) == 4  # per replay: the forward's state, then the caller's
