"""Gradients under remat equal gradients without it, bitwise, for every
SAVE/RECOMPUTE assignment."""

import itertools

import pytest
import torch
from helpers import BLOCK_REGIONS, Block, UnseenLog, assert_bitwise_equal, grads

import torch_remat as remat

ASSIGNMENTS = list(itertools.product([False, True], repeat=len(BLOCK_REGIONS)))


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    return Block(dim=16, heads=2, dropout=0.2)


@pytest.mark.parametrize("saves", ASSIGNMENTS, ids=lambda s: "".join("S" if v else "R" for v in s))
def test_transformer_block_gradients_are_bitwise_equal(block, saves):
    block.save = dict(zip(BLOCK_REGIONS, saves))
    params = list(block.parameters())
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    hook = remat.CPURNGStateHook()
    ckpt = remat.checkpoint(region_name="layers.0", recompute_state_hooks=(hook,))(block)
    expected = grads(params, [x], lambda x: (block(x) ** 2).sum(), seed=7)
    block.runs = runs = UnseenLog()
    actual = grads(params, [x], lambda x: (ckpt(x) ** 2).sum(), seed=7)
    block.runs = None
    assert_bitwise_equal(actual, expected)
    assert actual.replays == ["layers.0"]
    # Every region ran in the forward; the replay ran again the RECOMPUTE ones (each
    # saves a tensor backward needs) and no SAVE body.
    assert [region for region, replaying in runs if not replaying] == list(BLOCK_REGIONS)
    assert [region for region, replaying in runs if replaying] == [
        name for name in BLOCK_REGIONS if not block.save[name]
    ]


def test_two_blocks_in_sequence_with_mixed_policies():
    torch.manual_seed(0)
    b0, b1 = Block(dropout=0.1), Block(dropout=0.1)
    b0.save.update(attention=True, mlp=True)
    b1.save.update(qkv=True, out_proj=True)
    params = list(b0.parameters()) + list(b1.parameters())
    hook = remat.CPURNGStateHook()
    c0 = remat.checkpoint(region_name="layers.0", recompute_state_hooks=(hook,))(b0)
    c1 = remat.checkpoint(region_name="layers.1", recompute_state_hooks=(hook,))(b1)
    x = torch.randn(3, 4, 16, dtype=torch.float64, requires_grad=True)
    expected = grads(params, [x], lambda x: b1(b0(x)).tanh().sum(), seed=3)
    actual = grads(params, [x], lambda x: c1(c0(x)).tanh().sum(), seed=3)
    assert_bitwise_equal(actual, expected)


def test_dropout_without_state_hook_is_refused_rather_than_replayed_with_another_mask(block):
    # The RNG hook test above could pass vacuously if dropout were off; without the
    # hook the replay would draw another dropout mask, so backward refuses it.
    block.save = dict.fromkeys(BLOCK_REGIONS, False)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    loss = (remat.checkpoint(region_name="layers.0")(block)(x) ** 2).sum()
    with pytest.raises(remat.RecomputeMismatchError, match="CPURNGStateHook"):
        loss.backward()
