"""checkpoint(determinism_check="bitwise"): the recompute must reproduce the forward."""

import pytest
import torch
import torch.nn.functional as F
from helpers import UnseenCounter, recorded_replays

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


def test_an_lstm_workspace_is_compared_by_metadata_only():
    # oneDNN's LSTM saves a 1-D uint8 workspace whose padding it never writes: its
    # bits are whatever the allocator hands back, so comparing them failed replays
    # of an LSTM under the bitwise check. Here the memory the replay's workspace
    # reuses is filled with other bytes between the forward and the backward.
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(16, 16, batch_first=True)
    x = torch.randn(4, 12, 16, requires_grad=True)
    ref = x.detach().clone().requires_grad_()
    lstm(ref)[0].sum().backward()
    expected = {n: p.grad.clone() for n, p in lstm.named_parameters()}
    lstm.zero_grad()
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="lstm", determinism_check="bitwise")(
            lambda t: lstm(t)[0])(x)
        for fill in range(1, 9):
            torch.full((57344,), fill * 31, dtype=torch.uint8)
        out.sum().backward()
    assert replayed == ["lstm"]
    assert torch.equal(x.grad, ref.grad)
    assert all(torch.equal(p.grad, expected[n]) for n, p in lstm.named_parameters())


def test_a_byte_tensor_of_data_is_still_compared_by_its_bits():
    state = UnseenCounter()  # state remat does not record: the replay sees 1

    def scaled(t):
        mask = torch.full(t.shape, state.value + 1, dtype=torch.uint8)
        state.value += 1
        return remat.region(lambda a: a * mask, "mask", recompute=True)(t.exp())

    y = torch.randn(4, 8, requires_grad=True)
    out = remat.checkpoint(region_name="scaled", determinism_check="bitwise")(scaled)(y)
    with pytest.raises(remat.RecomputeMismatchError, match=r"\(\(4, 8\), uint8\) has different bits"):
        out.sum().backward()


def test_a_tensor_its_op_fills_after_saving_it_is_compared_once_filled():
    # rrelu saves its noise tensor, then draws into it: summed at the save, the
    # forward's and the replay's checksums were of unwritten memory, and differed.
    def fn(x):
        return torch.nn.functional.rrelu(x.exp(), training=True).sin()

    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(5)
    (expected,) = torch.autograd.grad(fn(x).sum(), x)
    torch.manual_seed(5)
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="c", determinism_check="bitwise",
                               recompute_state_hooks=(CPURNGStateHook(),))(fn)(x)
        for fill in range(1, 9):  # other bytes where the replay's noise may land
            torch.full((64,), fill * 1.5)
        (got,) = torch.autograd.grad(out.sum(), x)
    assert replayed == ["c"]
    assert torch.equal(got, expected)
