"""apply_remat_for_accelerator in one process: what it selects without a plugin and
the errors it raises. The accelerator's state is a stand-in with the two fields the
adapter reads, so no accelerate state is shared with other tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dist_models import MLPBlock, TinyNet
from helpers import recorded_replays
from torch import nn

pytest.importorskip("accelerate", reason="needs the 'accelerate' extra")

from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402

from torch_remat.integrations import (  # noqa: E402
    RematConfig,
    apply_remat,
    apply_remat_for_accelerator,
    remat_module_names,
)


def accelerator(distributed_type=DistributedType.MULTI_CPU, plugin=None):
    return SimpleNamespace(
        state=SimpleNamespace(distributed_type=distributed_type, fsdp_plugin=plugin)
    )


def fsdp(**plugin_kwargs):
    plugin = FullyShardedDataParallelPlugin(**plugin_kwargs)
    return accelerator(DistributedType.FSDP, plugin), plugin


def fsdp_sharding_blocks():
    return fsdp(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["MLPBlock"],
    )


class Net(TinyNet):
    _no_split_modules = ["MLPBlock"]


def replayed(model):
    """The checkpoints one training step of ``model`` replays in backward, sorted."""
    with recorded_replays() as names:
        model(torch.randn(4, 16)).pow(2).sum().backward()
    return sorted(names)


def test_without_a_plugin_blocks_come_from_no_split_modules_or_the_argument():
    net = Net()
    assert apply_remat_for_accelerator(accelerator(), net) == ["layers.0", "layers.1"]
    assert replayed(net) == ["layers.0", "layers.1"]
    tiny = TinyNet()
    assert apply_remat_for_accelerator(accelerator(), tiny, nn.Linear) == [
        "embed",
        "layers.0.up",
        "layers.0.down",
        "layers.1.up",
        "layers.1.down",
        "head",
    ]
    # the input needs no gradient: the embedding keeps nothing to replay for
    assert replayed(tiny) == ["head", "layers.0.down", "layers.0.up", "layers.1.down", "layers.1.up"]


def test_an_fsdp2_plugin_without_auto_wrap_policy_falls_back_to_no_split_modules():
    acc, plugin = fsdp(fsdp_version=2, activation_checkpointing=True)
    model = Net()
    assert apply_remat_for_accelerator(acc, model) == ["layers.0", "layers.1"]
    assert plugin.activation_checkpointing is False
    assert replayed(model) == ["layers.0", "layers.1"]


def test_remat_applied_by_the_caller_is_kept():
    model = Net()
    apply_remat(model, check_fn=lambda m: m is model.layers[1])
    assert apply_remat_for_accelerator(accelerator(), model) == ["layers.1"]
    assert remat_module_names(model) == ["layers.1"]
    assert replayed(model) == ["layers.1"]


def test_disabled_config_applies_nothing_and_leaves_the_plugin_alone():
    acc, plugin = fsdp(fsdp_version=2, activation_checkpointing=True)
    assert apply_remat_for_accelerator(acc, Net(), remat=RematConfig(enabled=False)) == []
    assert plugin.activation_checkpointing is True


def test_fsdp1_is_refused():
    acc, _ = fsdp(fsdp_version=1)
    with pytest.raises(ValueError, match=r"FSDP1 \(fsdp_version=1\) is not supported"):
        apply_remat_for_accelerator(acc, Net())


def test_no_blocks_is_refused_with_what_to_pass():
    with pytest.raises(ValueError, match="no blocks to checkpoint: pass blocks="):
        apply_remat_for_accelerator(accelerator(), TinyNet())


def test_a_selection_that_matches_nothing_is_refused():
    acc, _ = fsdp_sharding_blocks()
    with pytest.raises(ValueError, match="no module of Net matches"):
        apply_remat_for_accelerator(acc, Net(), blocks=lambda m: False)


def test_no_split_modules_naming_a_missing_class_is_refused():
    class Renamed(TinyNet):
        _no_split_modules = ["DecoderLayer"]

    with pytest.raises(ValueError, match=r"names \['DecoderLayer'\], which no module"):
        apply_remat_for_accelerator(accelerator(), Renamed())


def test_an_fsdp2_plugin_selects_the_modules_its_auto_wrap_policy_shards():
    acc, _ = fsdp_sharding_blocks()
    model = TinyNet()
    assert apply_remat_for_accelerator(acc, model) == ["layers.0", "layers.1"]
    assert all(isinstance(model.get_submodule(n), MLPBlock) for n in remat_module_names(model))
    assert replayed(model) == ["layers.0", "layers.1"]
