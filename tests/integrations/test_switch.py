"""torch_checkpointing_as_remat: code that calls torch's apply_activation_checkpointing
or checkpoint_wrapper itself (torchtune, Lightning), or builds a checkpointed function
with torch's curried checkpoint(**options)(fn), applies remat instead, also through
names it imported before the switch."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_cw
from torch.utils.checkpoint import checkpoint as imported_checkpoint

import torch_remat as remat
from tests.helpers import UnseenLog, assert_bitwise_equal, grads, recorded_replays
from torch_remat.integrations import remat_module_names, remove_remat, torch_checkpointing_as_remat


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d, dtype=torch.float64)
        self.fc2 = nn.Linear(2 * d, d, dtype=torch.float64)

    def forward(self, x):
        return x + self.fc2(F.dropout(torch.tanh(self.fc1(x)), 0.2, self.training))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(3)))


def _grads(model, x):
    return grads(list(model.parameters()), [], lambda: model(x).pow(2).sum(), seed=3)


def _replays(module):
    """The checkpoints one training step of ``module`` replays."""
    with recorded_replays() as replayed:
        module(torch.randn(4, 16, dtype=torch.float64)).sum().backward()
    return replayed


def test_torch_apply_activation_checkpointing_applies_remat_inside_the_switch_only():
    model = _net()
    x = torch.randn(4, 16, dtype=torch.float64)
    ref = _grads(model, x)
    names = [n for n, _ in model.named_parameters()]
    with torch_checkpointing_as_remat():
        torch_cw.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    assert remat_module_names(model) == ["0", "1", "2"]
    assert [n for n, _ in model.named_parameters()] == names
    assert_bitwise_equal(ref, _grads(model, x))
    remove_remat(model)
    torch_cw.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    assert remat_module_names(model) == []  # torch's own again, outside the switch
    assert any(isinstance(m, torch_cw.CheckpointWrapper) for m in model.modules())


def test_checkpoint_wrapper_returns_the_module_itself_with_remat():
    block = Block()
    with torch_checkpointing_as_remat():
        wrapped = torch_cw.checkpoint_wrapper(block)
    assert wrapped is block and remat_module_names(nn.Sequential(block)) == ["0"]
    assert _replays(block) == ["Block"]  # a checkpoint named after the module's class


def test_torchtune_set_activation_checkpointing_applies_remat():
    pytest.importorskip("torchtune")
    from torchtune import modules, training
    from torchtune.models.llama3 import llama3

    torch.manual_seed(0)
    model = llama3(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=16,
                   max_seq_len=32, intermediate_dim=32)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = grads(list(model.parameters()), [], lambda: model(tokens).sum())
    with torch_checkpointing_as_remat():
        training.set_activation_checkpointing(
            model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
        )
    assert remat_module_names(model) == ["layers.0", "layers.1"]
    assert_bitwise_equal(ref, grads(list(model.parameters()), [], lambda: model(tokens).sum()))
    from torchtune.training import memory

    assert memory.apply_activation_checkpointing is torch_cw.apply_activation_checkpointing


def test_torchtune_checkpoint_wrapper_imported_under_another_name_applies_remat():
    pytest.importorskip("torchtune")
    from torchtune.training import activations

    block = Block()
    with torch_checkpointing_as_remat():
        wrapped = activations.checkpoint_wrapper(block, "full", None)
    assert wrapped is block and remat_module_names(nn.Sequential(block)) == ["0"]
    # torchtune passes preserve_rng_state=False: a step that draws no dropout mask
    assert _replays(block.eval()) == ["Block"]
    assert activations.ptd_checkpoint_wrapper is torch_cw.checkpoint_wrapper


def test_lightning_fsdp_activation_checkpointing_applies_remat():
    pytest.importorskip("lightning")
    from lightning.fabric.strategies.fsdp import (
        _activation_checkpointing_kwargs,
        _setup_activation_checkpointing,
    )

    model = _net()
    x = torch.randn(4, 16, dtype=torch.float64)
    ref = _grads(model, x)
    with torch_checkpointing_as_remat():
        _setup_activation_checkpointing(model, _activation_checkpointing_kwargs(None, {Block}))
    assert remat_module_names(model) == ["0", "1", "2"]
    assert_bitwise_equal(ref, _grads(model, x))


# torch 2.15 added the curried form: checkpoint(**options) returns a decorator.
CURRIED = inspect.signature(torch.utils.checkpoint.checkpoint).parameters["function"].default is None


class _Recording(nn.Module):
    """A block that records, at each run, whether remat is replaying it."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.runs = UnseenLog()  # (the replay's entries stay)

    def forward(self, x):
        self.runs.append(remat.is_recomputing())
        return self.block(x)


@pytest.mark.skipif(not CURRIED, reason="torch before 2.15 has no curried checkpoint(...)(fn)")
def test_the_curried_torch_checkpoint_applies_remat_inside_the_switch_only():
    model = _Recording()
    x = torch.randn(4, 16, dtype=torch.float64)
    ref = grads(list(model.parameters()), [], lambda: model(x).pow(2).sum(), seed=3)
    with torch_checkpointing_as_remat():
        # dropout in the block: torch's default preserve_rng_state=True becomes the
        # RNG hooks, so the replay draws the same mask
        fn = torch.utils.checkpoint.checkpoint(use_reentrant=False)(model)
        imported = imported_checkpoint(use_reentrant=False, respect_saved_tensors_hooks=True)(model)
    model.runs.clear()
    for checkpointed in (fn, imported):
        actual = grads(list(model.parameters()), [], lambda c=checkpointed: c(x).pow(2).sum(), seed=3)
        assert_bitwise_equal(ref, actual)
    assert model.runs == [False, True, False, True]  # each replayed by remat
    assert torch.utils.checkpoint.checkpoint is imported_checkpoint  # put back on exit
    model.runs.clear()
    torch.utils.checkpoint.checkpoint(use_reentrant=False)(model)(x).sum().backward()
    assert model.runs == [False, False]  # torch's own again: it recomputes outside remat


@pytest.mark.skipif(not CURRIED, reason="torch before 2.15 has no curried checkpoint(...)(fn)")
def test_a_direct_torch_checkpoint_call_inside_the_switch_is_torchs_own():
    model = _Recording()
    x = torch.randn(4, 16, dtype=torch.float64)
    with torch_checkpointing_as_remat():
        torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).sum().backward()
    assert model.runs == [False, False]


@pytest.mark.skipif(not CURRIED, reason="torch before 2.15 has no curried checkpoint(...)(fn)")
def test_the_curried_form_refuses_options_remat_cannot_honour():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    with torch_checkpointing_as_remat():
        with pytest.raises(ValueError, match="context_fn"):
            torch.utils.checkpoint.checkpoint(
                use_reentrant=False,
                context_fn=functools.partial(create_selective_checkpoint_contexts, []),
            )
        with pytest.raises(ValueError, match="use_reentrant=True"):
            torch.utils.checkpoint.checkpoint(use_reentrant=True)


def test_checkpoint_wrapper_given_torchs_checkpoint_read_inside_the_switch_applies_remat():
    block = Block()
    with torch_checkpointing_as_remat():
        # read while the switch is open: on torch with the curried form, the switch's
        wrapped = torch_cw.checkpoint_wrapper(block, checkpoint_fn=torch.utils.checkpoint.checkpoint)
    assert wrapped is block and remat_module_names(nn.Sequential(block)) == ["0"]
    assert _replays(block) == ["Block"]


def test_a_module_first_imported_inside_the_switch_gets_torchs_functions_back(tmp_path, monkeypatch):
    (tmp_path / "imported_inside_switch.py").write_text(
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
        "    apply_activation_checkpointing, checkpoint_wrapper as ptd_wrapper)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import sys

    monkeypatch.delitem(sys.modules, "imported_inside_switch", raising=False)
    with torch_checkpointing_as_remat():
        import imported_inside_switch as late
    assert late.ptd_wrapper is torch_cw.checkpoint_wrapper
    assert late.apply_activation_checkpointing is torch_cw.apply_activation_checkpointing


def test_a_replacement_kept_elsewhere_behaves_as_torchs_after_the_switch_closes():
    with torch_checkpointing_as_remat():
        kept = {"wrap": torch_cw.checkpoint_wrapper}
    block = Block()
    wrapped = kept["wrap"](block)
    assert isinstance(wrapped, torch_cw.CheckpointWrapper)
    assert remat_module_names(nn.Sequential(block)) == []


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _wrap_like_olmo(model: Outer) -> None:
    # what OLMo-core, torchtune's ac_mode and accelerate's FSDP2 plugin do
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch_cw.checkpoint_wrapper(block, preserve_rng_state=False)


def test_preserve_rng_state_false_through_the_switch_names_the_path_and_the_switch_fix():
    model = Outer()
    x = torch.randn(4, 16, dtype=torch.float64)
    with torch_checkpointing_as_remat():
        _wrap_like_olmo(model)
    with pytest.raises(RuntimeError) as info:
        model(x).sum().backward()
    message = str(info.value)
    assert "checkpoint 'blocks.1' drew random numbers" in message  # the last block's backward runs first
    assert "preserve_rng_state=False" in message
    assert "torch_checkpointing_as_remat(RematConfig(rng_state_hooks=True))" in message


def test_a_config_given_to_the_switch_overrides_the_frameworks_preserve_rng_state():
    from torch_remat.integrations import RematConfig

    model = Outer()
    x = torch.randn(4, 16, dtype=torch.float64)
    ref = _grads(model, x)
    with torch_checkpointing_as_remat(RematConfig(rng_state_hooks=True)):
        _wrap_like_olmo(model)
    assert remat_module_names(model) == ["blocks.0", "blocks.1"]
    assert_bitwise_equal(ref, _grads(model, x))
    state = torch.get_rng_state()
    model(x).sum().backward()
    after_remat = torch.get_rng_state()
    torch.set_rng_state(state)
    remove_remat(model)
    model(x).sum().backward()
    assert torch.equal(after_remat, torch.get_rng_state())


def test_checkpoint_wrapper_through_the_switch_is_named_by_its_path_once_it_runs():
    from torch_remat.integrations import RematConfig

    model = Outer()
    with torch_checkpointing_as_remat(RematConfig(rng_state_hooks=True)):
        _wrap_like_olmo(model)
    assert _replays(model) == ["blocks.1", "blocks.0"]  # backward replays the last block first
    names = [model.blocks[i].forward.region_name for i in range(2)]
    assert names == ["blocks.0", "blocks.1"]
