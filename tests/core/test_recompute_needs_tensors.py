"""``remat.recompute_needs_tensor`` with several tensors (torchtitan's model code
passes the outputs of attention, MLP and MoE blocks in one call)."""

import pytest
import torch
from helpers import assert_bitwise_equal, grads

import torch_remat as remat

D = torch.float64


def test_one_tensor_is_returned_as_itself():
    t = torch.randn(3)
    assert remat.recompute_needs_tensor(t) is t


def test_several_tensors_are_returned_as_a_tuple_outside_a_checkpoint():
    a, b, c = torch.randn(2), torch.randn(3), torch.randn(4)
    out = remat.recompute_needs_tensor(a, b, c)
    assert type(out) is tuple and len(out) == 3
    assert out[0] is a and out[1] is b and out[2] is c


def test_no_tensor_returns_an_empty_tuple():
    assert remat.recompute_needs_tensor() == ()


def test_a_non_tensor_argument_is_named_by_its_position():
    with pytest.raises(TypeError, match=r"argument 2 of 3 .*list"):
        remat.recompute_needs_tensor(torch.randn(2), [torch.randn(2)], torch.randn(2))


def test_several_outputs_kept_in_one_call_replay_with_exact_gradients():
    w = torch.randn(5, 5, dtype=D, requires_grad=True)
    x = torch.randn(2, 5, dtype=D, requires_grad=True)

    def fn(x):
        a = remat.region(lambda t: (t @ w).exp(), "a", recompute=False)(x)
        b = remat.region(lambda t: (t @ w).sin(), "b", recompute=False)(x)
        a, b = remat.recompute_needs_tensor(a, b)
        return (a + b).tanh()  # bare code reads both in the replay

    expected = grads([w], [x], lambda x: fn(x).sum())
    actual = grads([w], [x], lambda x: remat.checkpoint(region_name="c")(fn)(x).sum())
    assert_bitwise_equal(actual, expected)
