"""enable_remat: remat through a transformers model's own per-layer checkpoint hook.

A tiny Llama built from a LlamaConfig (no downloads): gradients bitwise equal to
transformers' own gradient checkpointing and to no checkpointing (with attention
dropout, replayed by the RNG hooks), exact forward bytes from the profiler, and the
errors for models without the hook.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="needs the 'transformers' extra")

from helpers import recorded_replays  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaAttention  # noqa: E402

import torch_remat as remat  # noqa: E402
from torch_remat.integrations import RematConfig, apply_remat, remove_remat  # noqa: E402
from torch_remat.integrations.transformers import (  # noqa: E402
    RematLayerCheckpoint,
    disable_remat,
    enable_remat,
    remat_layer_names,
)

CPU_RNG_STATE_BYTES = 5056  # one snapshot of the Mersenne Twister state
LAYERS = ["model.layers.0", "model.layers.1"]


def tiny_llama(attention_dropout: float = 0.0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=attention_dropout,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.train()  # transformers checkpoints only in training mode
    return model


def transformers_checkpointing(model: PreTrainedModel) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the name changed in transformers 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def input_ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ids = input_ids()
    torch.manual_seed(2)  # dropout draws
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def forward_bytes(model: nn.Module) -> int:
    """Bytes the training forward leaves allocated (the loss graph), exact."""
    ids = input_ids()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        loss = model(input_ids=ids, labels=ids).loss
    live = sum(e.self_cpu_memory_usage for e in prof.events())
    loss.backward()
    return live


def checkpoint_names(model: nn.Module) -> list[str]:
    ids = input_ids()
    with remat.collect_trace(checkpoints=True) as trace:
        model(input_ids=ids, labels=ids).loss.backward()
    return [n.name for n in trace.roots if n.kind == "checkpoint"]


def test_each_layer_is_a_checkpoint_named_after_it_and_the_module_tree_is_unchanged():
    plain = tiny_llama()
    model = tiny_llama()
    assert enable_remat(model) == LAYERS
    assert remat_layer_names(model) == LAYERS
    assert checkpoint_names(model) == LAYERS
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    assert list(model.state_dict()) == list(plain.state_dict())
    assert isinstance(model.model.layers[0]._gradient_checkpointing_func, RematLayerCheckpoint)


def test_gradients_equal_no_checkpointing_and_transformers_checkpointing_with_dropout():
    expected = loss_and_grads(tiny_llama(attention_dropout=0.1))

    hf = tiny_llama(attention_dropout=0.1)
    transformers_checkpointing(hf)
    assert_same(loss_and_grads(hf), expected)

    model = tiny_llama(attention_dropout=0.1)
    enable_remat(model)
    with recorded_replays() as replayed:
        assert_same(loss_and_grads(model), expected)
    assert sorted(replayed) == sorted(LAYERS)


def _switched_kernel_step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A step whose attention kernel is switched between the forward and backward."""
    model.zero_grad(set_to_none=True)
    ids = input_ids()
    model.config._attn_implementation = "eager"
    torch.manual_seed(2)
    loss = model(input_ids=ids, labels=ids).loss
    model.config._attn_implementation = "sdpa"  # e.g. set for the next step's forward
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_config_setting_changed_before_backward_is_replayed_as_the_forward_read_it():
    # The layers read config._attn_implementation at every call: the replay must run
    # the eager kernel the forward ran (with its dropout), not SDPA's.
    expected = _switched_kernel_step(tiny_llama(attention_dropout=0.1))
    model = tiny_llama(attention_dropout=0.1)
    enable_remat(model)
    with recorded_replays() as replayed:
        assert_same(_switched_kernel_step(model), expected)
    assert sorted(replayed) == sorted(LAYERS)
    assert model.config._attn_implementation == "sdpa"  # the caller's setting after backward
    # and the step after it, on the caller's setting
    assert_same(loss_and_grads(model), loss_and_grads(tiny_llama(attention_dropout=0.1)))


def test_attention_as_save_region_keeps_gradients_exact():
    expected = loss_and_grads(tiny_llama(attention_dropout=0.1))
    model = tiny_llama(attention_dropout=0.1)
    enable_remat(model, remat=RematConfig(save_modules=LlamaAttention))
    with remat.collect_trace() as trace, recorded_replays() as replayed:
        assert_same(loss_and_grads(model), expected)
    assert [(n.name, n.kind) for n in trace.roots] == [("self_attn", "save")] * 2
    assert sorted(replayed) == sorted(LAYERS)


def test_a_save_module_called_twice_in_a_layer_gets_a_region_name_per_call():
    # Segformer's MixFFN calls its one dropout twice: the second call's regions are
    # named call1/..., as under apply_remat, in the forward and the replay alike
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    def build():
        torch.manual_seed(0)
        return SegformerForSemanticSegmentation(SegformerConfig(
            num_encoder_blocks=1, depths=[1], sr_ratios=[2], hidden_sizes=[8], patch_sizes=[7], strides=[4],
            num_attention_heads=[1], mlp_ratios=[2], decoder_hidden_size=8, hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1, num_labels=3,
        )).train()

    g = torch.Generator().manual_seed(1)
    pixels, labels = torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 3, (2, 16, 16), generator=g)

    def grads_of(model):
        torch.manual_seed(2)
        model(pixel_values=pixels, labels=labels).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    expected = grads_of(build())
    model = build()
    assert enable_remat(model, remat=RematConfig(save_modules=nn.Dropout)) == ["segformer.stages.0.blocks.0"]
    with remat.collect_trace() as trace, recorded_replays() as replayed:
        actual = grads_of(model)
    assert "call1/mlp.dropout: save" in trace.format()
    assert replayed == ["segformer.stages.0.blocks.0"]
    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[n], expected[n]) for n in expected)


def test_forward_keeps_fewer_bytes_than_without_checkpointing_exactly_like_transformers():
    plain = forward_bytes(tiny_llama())
    hf = tiny_llama()
    transformers_checkpointing(hf)
    with_rng = tiny_llama()
    enable_remat(with_rng)
    without_rng = tiny_llama()
    enable_remat(without_rng, remat=RematConfig(rng_state_hooks=False))

    measured = {
        "none": plain,
        "transformers": forward_bytes(hf),
        "remat": forward_bytes(with_rng),
        "remat_no_rng": forward_bytes(without_rng),
    }
    print(measured)
    assert measured["remat"] < measured["none"]
    # torch.utils.checkpoint stashes the CPU generator per layer, as remat's RNG hook does.
    assert measured["remat"] == measured["transformers"]
    assert measured["remat"] - measured["remat_no_rng"] == 2 * CPU_RNG_STATE_BYTES


@pytest.mark.skipif(
    not hasattr(PreTrainedModel, "activation_checkpointing_enable"),
    reason="every_n_layers needs transformers 5",
)
def test_every_n_layers_is_transformers_own_selection():
    model = tiny_llama()
    assert enable_remat(model, every_n_layers=2) == ["model.layers.0"]
    assert checkpoint_names(model) == ["model.layers.0"]


def test_disable_remat_and_enable_again_with_other_options():
    model = tiny_llama()
    enable_remat(model, remat=RematConfig(save_modules=LlamaAttention))
    assert disable_remat(model) == LAYERS
    assert remat_layer_names(model) == []
    assert checkpoint_names(model) == []
    assert "forward" not in model.model.layers[0].self_attn.__dict__
    assert enable_remat(model) == LAYERS
    assert checkpoint_names(model) == LAYERS


def test_a_deep_copy_checkpoints_its_own_layers():
    model = tiny_llama(attention_dropout=0.1)
    enable_remat(model)
    copied = copy.deepcopy(model)
    hook = copied.model.layers[1]._gradient_checkpointing_func
    assert hook._owner() is copied.model.layers[1]
    assert checkpoint_names(copied) == LAYERS
    assert_same(loss_and_grads(copied), loss_and_grads(tiny_llama(attention_dropout=0.1)))


class LoopConfig(PretrainedConfig):
    model_type = "torch_remat_loop_test"


class LoopModel(PreTrainedModel):
    """Checkpoints its layers from the model-level loop, as transformers < 4.52 did."""

    config_class = LoopConfig
    supports_gradient_checkpointing = True

    def __init__(self, config: LoopConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                x = self._gradient_checkpointing_func(layer.__call__, x)
            else:
                x = layer(x)
        return x.tanh().sum()


def test_a_model_level_loop_names_each_checkpoint_after_its_layer():
    model = LoopModel(LoopConfig())
    enable_remat(model)
    model.train()
    with remat.collect_trace(checkpoints=True) as trace:
        model(torch.randn(3, 4)).backward()
    assert [n.name for n in trace.roots] == ["layers.0", "layers.1"]


class NoCheckpointingModel(PreTrainedModel):
    config_class = LoopConfig
    supports_gradient_checkpointing = False

    def __init__(self, config: LoopConfig) -> None:
        super().__init__(config)
        self.layer = nn.Linear(4, 4)
        self.post_init()


def test_a_model_without_gradient_checkpointing_support_is_refused_with_the_alternative():
    with pytest.raises(ValueError, match="does not support gradient checkpointing.*apply_remat"):
        enable_remat(NoCheckpointingModel(LoopConfig()))


def test_a_plain_module_is_refused():
    with pytest.raises(TypeError, match="expected a transformers.PreTrainedModel.*apply_remat"):
        enable_remat(nn.Linear(2, 2))


def test_layers_already_checkpointed_by_apply_remat_are_refused():
    model = tiny_llama()
    apply_remat(model, check_fn=lambda m: type(m).__name__ == "LlamaDecoderLayer")
    with pytest.raises(ValueError, match="apply_remat already checkpoints"):
        enable_remat(model)


class _NoRestore:
    def snapshot(self):
        return None


@pytest.mark.parametrize(
    "config, error, match",
    [
        (RematConfig(recompute_state_hooks=(_NoRestore(),)), TypeError,
         r"enable_remat: recompute_state_hooks\[0\] \(_NoRestore\) needs both snapshot"),
        (RematConfig(determinism_check="nope"), ValueError, "enable_remat: determinism_check must be one of"),
        (RematConfig(early_stop="yes"), TypeError, "enable_remat: early_stop"),
        (RematConfig(rebuild="sometimes"), ValueError, "enable_remat: rebuild must be one of"),
    ],
)
def test_enable_remat_checks_its_config_before_switching_anything_on(config, error, match):
    # as apply_remat does, hooks numbered as passed (the RNG hook goes first later)
    model = tiny_llama()
    with pytest.raises(error, match=match):
        enable_remat(model, remat=config)
    assert not model.is_gradient_checkpointing
    assert checkpoint_names(model) == []


@pytest.mark.parametrize("every, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)])
def test_every_n_layers_is_an_int_of_at_least_one(every, error):
    model = tiny_llama()
    for config in (None, RematConfig(enabled=False)):
        with pytest.raises(error, match="enable_remat: every_n_layers must be"):
            enable_remat(model, every_n_layers=every, remat=config)
    assert not model.is_gradient_checkpointing
    assert enable_remat(model, every_n_layers=__import__("numpy").int64(2)) == LAYERS[:1]


def test_every_n_layers_without_transformers_5_is_refused_before_anything_changes(monkeypatch):
    model = tiny_llama()
    assert enable_remat(model) == LAYERS
    # transformers before 5: no activation_checkpointing_enable, no every_n_layers
    monkeypatch.setattr(type(model), "activation_checkpointing_enable", None, raising=False)
    with pytest.raises(ValueError, match="every_n_layers=2 needs transformers 5"):
        enable_remat(model, every_n_layers=2)
    assert checkpoint_names(model) == LAYERS  # the earlier remat is still on


@pytest.mark.parametrize("given", [{"rng_state_hooks": False}, True, "full"])
def test_a_remat_argument_that_is_not_a_config_is_a_type_error_naming_the_call(given):
    from torch_remat.integrations import torch_checkpointing_as_remat

    model = tiny_llama()
    with pytest.raises(TypeError, match="enable_remat: remat must be a torch_remat.integrations.RematConfig"):
        enable_remat(model, remat=given)
    with pytest.raises(TypeError, match="apply_remat: remat must be a torch_remat.integrations.RematConfig"):
        apply_remat(model, check_fn=lambda m: isinstance(m, LlamaAttention), remat=given)
    with pytest.raises(TypeError, match="torch_checkpointing_as_remat: remat must be"):
        with torch_checkpointing_as_remat(remat=given):
            pass
    assert checkpoint_names(model) == []


@pytest.mark.slow
def test_importing_the_integrations_imports_neither_transformers_nor_accelerate():
    code = (
        "import sys, torch_remat.integrations\n"
        "print(sorted(m for m in ('transformers', 'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_accelerate_adapter_keeps_the_layers_hook_and_applies_nothing_more():
    accelerate = pytest.importorskip("accelerate", reason="needs the 'accelerate' extra")
    from torch_remat.integrations import apply_remat_for_accelerator, remat_module_names

    model = tiny_llama()
    enable_remat(model)
    assert apply_remat_for_accelerator(accelerate.Accelerator(cpu=True), model) == LAYERS
    assert remat_module_names(model) == []
    assert checkpoint_names(model) == LAYERS


def test_accelerate_adapter_refuses_transformers_own_checkpointing():
    accelerate = pytest.importorskip("accelerate", reason="needs the 'accelerate' extra")
    from torch_remat.integrations import apply_remat_for_accelerator

    model = tiny_llama()
    transformers_checkpointing(model)
    with pytest.raises(ValueError, match=r"gradient checkpointing.*twice.*enable_remat"):
        apply_remat_for_accelerator(accelerate.Accelerator(cpu=True), model)


def test_accelerate_adapter_selects_the_no_split_modules_of_a_transformers_model():
    accelerate = pytest.importorskip("accelerate", reason="needs the 'accelerate' extra")
    from torch_remat.integrations import apply_remat_for_accelerator

    expected = loss_and_grads(tiny_llama(attention_dropout=0.1))
    model = tiny_llama(attention_dropout=0.1)
    assert apply_remat_for_accelerator(accelerate.Accelerator(cpu=True), model) == LAYERS
    assert checkpoint_names(model) == LAYERS
    assert_same(loss_and_grads(model), expected)


class OldFormatModel(NoCheckpointingModel):
    """Written for transformers < 4.35: sets its flags itself, installs no hook."""

    supports_gradient_checkpointing = True

    def _set_gradient_checkpointing(self, module, value=False):
        if isinstance(module, OldFormatModel):
            module.gradient_checkpointing = value


def test_a_model_in_the_pre_4_35_checkpointing_format_is_refused_and_left_off():
    model = OldFormatModel(LoopConfig())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="pre-4.35 checkpointing format.*apply_remat"):
            enable_remat(model)
    assert model.gradient_checkpointing is False


# ------------------------------------------- transformers' checkpointing turned on again


def train_one_step_with_trainer(model: PreTrainedModel, tmp_path, **training_args) -> None:
    from transformers import Trainer, TrainingArguments

    ids = input_ids()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing: the old name
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=1,
            use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
            **training_args,
        )
        Trainer(model=model, args=args, train_dataset=[{"input_ids": ids, "labels": ids}]).train()


@pytest.mark.parametrize("flag", ["gradient_checkpointing", "activation_checkpointing"])
def test_trainer_checkpointing_after_enable_remat_raises_at_the_first_forward(tmp_path, flag):
    model = tiny_llama()
    enable_remat(model)
    with pytest.raises(RuntimeError, match=r"replaced remat in \['model.layers.0', 'model.layers.1'"):
        train_one_step_with_trainer(model, tmp_path, **{flag: True})


def test_checkpointing_enabled_again_after_enable_remat_raises_before_the_layers_run():
    model = tiny_llama()
    enable_remat(model)
    transformers_checkpointing(model)
    ids = input_ids()
    with pytest.raises(RuntimeError, match="TrainingArguments"):
        model(input_ids=ids, labels=ids)


def test_disable_remat_after_the_replacement_reports_the_layers_and_switches_all_off():
    model = tiny_llama()
    enable_remat(model, remat=RematConfig(save_modules=LlamaAttention))
    ids = input_ids()
    with recorded_replays() as replayed:
        model(input_ids=ids, labels=ids).loss.backward()
    assert sorted(replayed) == LAYERS  # the layers are checkpoints until disabled
    transformers_checkpointing(model)
    with pytest.warns(UserWarning, match=r"model.layers.0.self_attn', 'model.layers.1.self_attn'"):
        assert disable_remat(model) == LAYERS
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    with recorded_replays() as replayed:
        model(input_ids=ids, labels=ids).loss.backward()  # trains again, with no checkpointing
    assert replayed == []


def test_apply_remat_layers_under_transformers_checkpointing_raise_and_remove_remat_warns():
    model = tiny_llama()
    apply_remat(model, check_fn=lambda m: type(m).__name__ == "LlamaDecoderLayer")
    transformers_checkpointing(model)
    ids = input_ids()
    with pytest.raises(RuntimeError, match="checkpoint 'model.layers.0' was called inside"):
        model(input_ids=ids, labels=ids)
    with pytest.warns(UserWarning, match="still on for"):
        assert remove_remat(model) == LAYERS


def test_fsdp_plugin_checkpointing_after_enable_remat_names_the_fsdp_setting():
    pytest.importorskip("accelerate")
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac

    model = tiny_llama()
    enable_remat(model)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, activation_checkpointing=True, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )
    # what Accelerator.prepare (and the Trainer with fsdp_config) does with it
    fsdp2_apply_ac(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)), model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError) as info:
        model(input_ids=ids)
    message = str(info.value)
    assert "['model.layers.0', 'model.layers.1']" in message
    assert "fsdp_config" in message and "activation_checkpointing=False" in message
    assert "gradient_checkpointing_enable" not in message
