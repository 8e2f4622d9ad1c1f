"""checkpoint(determinism_check="bitwise"): the recompute must reproduce the forward."""

import pytest
import torch
import torch.nn.functional as F
from helpers import recorded_replays

import torch_remat as remat
from torch_remat import CPURNGStateHook
from torch_remat.engine import replay as _replay


def block(x):
    h = remat.region(lambda t: F.dropout(t.exp(), 0.5, training=True), "drop", recompute=True)(x)
    return remat.region(torch.sin, "sin", recompute=False)(h)


def test_dropout_without_its_rng_hook_is_caught():
    x = torch.randn(64, requires_grad=True)
    out = remat.checkpoint(region_name="layers.0", determinism_check="bitwise")(block)(x)
    with pytest.raises(remat.RecomputeMismatchError) as info:
        out.sum().backward()
    assert str(info.value).startswith(
        "torch_remat: determinism check failed for checkpoint 'layers.0': tensor #1 saved "
        "for backward by region 'drop' ((64,), float32) has different bits in the recompute "
        "than in the forward."
    )


def test_default_check_refuses_the_unhooked_dropout_naming_the_generator():
    # The bitwise check is no longer the only guard: the replay notices that it
    # draws from a generator no hook restored.
    x = torch.randn(64, requires_grad=True)
    out = remat.checkpoint(region_name="layers.0")(block)(x)
    with pytest.raises(remat.RecomputeMismatchError, match="CPU generator"):
        out.sum().backward()


def test_with_the_rng_hook_it_passes_and_gradients_are_exact():
    x = torch.randn(64, requires_grad=True)
    ref = x.detach().clone().requires_grad_()
    torch.manual_seed(1)
    block(ref).sum().backward()
    torch.manual_seed(1)
    with recorded_replays() as replayed:
        out = remat.checkpoint(
            region_name="layers.0",
            determinism_check="bitwise",
            recompute_state_hooks=(CPURNGStateHook(),),
        )(block)(x)
        out.sum().backward()
    assert replayed == ["layers.0"]  # the check compared a real replay's dropout mask
    assert torch.equal(x.grad, ref.grad)


def test_checksums_are_only_computed_when_asked(monkeypatch):
    calls = []
    real = _replay.checksum
    monkeypatch.setattr(_replay, "checksum", lambda t: calls.append(1) or real(t))
    hook = (CPURNGStateHook(),)
    x = torch.randn(64, requires_grad=True)
    remat.checkpoint(region_name="a", recompute_state_hooks=hook)(block)(x).sum().backward()
    assert calls == []
    remat.checkpoint(region_name="b", determinism_check="bitwise", recompute_state_hooks=hook)(
        block
    )(x).sum().backward()
    # exp's result, dropout's mask and the argument of region 'sin' (its save of it is
    # rebuilt by the replay), in forward and in recompute
    assert len(calls) == 6
