"""apply_remat: the swap-in for torch's apply_activation_checkpointing (one process)."""

from __future__ import annotations

import copy
import functools
import gc
import io
import pickle

import pytest
import torch
from dist_models import MLPBlock, assert_grads_equal, param_grads, tiny_net
from helpers import kept_bytes, recorded_replays
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy, size_based_auto_wrap_policy

import torch_remat as remat
from torch_remat.integrations import (
    DeviceRNGStateHook,
    RematConfig,
    RematForward,
    SaveRegionForward,
    apply_remat,
    remat_module_names,
    remove_remat,
    save_region_names,
)


def IS_BLOCK(module):
    return isinstance(module, MLPBlock)


def _run(model, x, seed=1, *, replays=True):
    """Loss and gradients of one step. A model with remat applied must replay its
    checkpoints in backward (``replays=False``: compiled ones, whose backward
    re-runs no Python), one without it replays nothing."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    with recorded_replays() as replayed:
        loss = model(x).pow(2).sum()
        loss.backward()
    assert bool(replayed) == (replays and bool(remat_module_names(model))), replayed
    return loss.detach(), param_grads(model)


def _input(batch=4, dim=16):
    torch.manual_seed(7)
    return torch.randn(batch, dim, dtype=torch.float64)


def _torch_wrapped_names(model, **kwargs):
    """FQNs torch's apply_activation_checkpointing wraps, without its infix."""
    model = copy.deepcopy(model)
    apply_activation_checkpointing(model, **kwargs)
    infix = "_checkpoint_wrapped_module."
    return [
        name.replace(infix, "")
        for name, m in model.named_modules()
        if type(m).__name__ == "CheckpointWrapper"
    ]


def test_forward_is_an_instance_attribute_and_module_tree_is_unchanged():
    model = tiny_net(dropout=0.1)
    before = (
        [n for n, _ in model.named_modules()],
        [n for n, _ in model.named_parameters()],
        list(model.state_dict()),
        [type(m) for m in model.modules()],
    )
    names = apply_remat(model, check_fn=IS_BLOCK)
    after = (
        [n for n, _ in model.named_modules()],
        [n for n, _ in model.named_parameters()],
        list(model.state_dict()),
        [type(m) for m in model.modules()],
    )
    assert names == ["layers.0", "layers.1"]
    assert before == after
    assert isinstance(model.layers[0].__dict__["forward"], RematForward)
    assert model.layers[0].forward.region_name == "layers.0"
    assert "forward" not in model.embed.__dict__
    assert remat_module_names(model) == ["layers.0", "layers.1"]


def test_a_state_dict_saved_without_remat_loads_strictly():
    plain = tiny_net(seed=3)
    buffer = io.BytesIO()
    torch.save(plain.state_dict(), buffer)
    buffer.seek(0)
    model = tiny_net()
    apply_remat(model, check_fn=IS_BLOCK)
    model.load_state_dict(torch.load(buffer), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
    # the checkpointed blocks replay with the loaded weights: the plain model's gradients
    x = _input()
    assert_grads_equal(_run(model, x)[1], _run(plain, x)[1])


def test_gradients_with_dropout_equal_the_model_without_remat():
    x = _input()
    reference = _run(tiny_net(dropout=0.25), x)
    model = tiny_net(dropout=0.25)
    apply_remat(model, check_fn=IS_BLOCK)
    loss, grads = _run(model, x)
    assert torch.equal(loss, reference[0])
    assert_grads_equal(grads, reference[1])


def test_without_rng_hooks_dropout_replay_is_caught_by_the_bitwise_check():
    model = tiny_net(dropout=0.25)
    apply_remat(
        model, check_fn=IS_BLOCK, remat=RematConfig(rng_state_hooks=False, determinism_check="bitwise")
    )
    with pytest.raises(remat.RecomputeMismatchError, match="layers.1"):
        _run(model, _input())


def test_rebuild_choice_reaches_every_checkpoint_and_a_wrong_one_is_refused_before_patching():
    model = tiny_net()
    with pytest.raises(ValueError, match="apply_remat: rebuild must be one of"):
        apply_remat(model, check_fn=IS_BLOCK, remat=RematConfig(rebuild="all"))
    assert not remat_module_names(model)
    x = _input()
    reference = _run(tiny_net(), x)
    apply_remat(model, check_fn=IS_BLOCK, remat=RematConfig(rebuild="never"))
    loss, grads = _run(model, x)
    assert torch.equal(loss, reference[0])
    assert_grads_equal(grads, reference[1])
    assert RematConfig(rebuild="never").checkpoint_options() == {"rebuild": "never"}


SCRIPT = """
import functools
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, checkpoint_wrapper)
{import_line}

model = make_model()
apply_activation_checkpointing(
    model,
    checkpoint_wrapper_fn=functools.partial(
        checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
    check_fn=lambda m: isinstance(m, MLPBlock),
)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for step in range(3):
    torch.manual_seed(100 + step)
    x = torch.randn(4, 16, dtype=torch.float64)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.detach())
grads = {{n: p.grad.clone() for n, p in model.named_parameters()}}
state = model.state_dict()
"""

TORCH_IMPORT = (
    "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import "
    "apply_activation_checkpointing"
)
REMAT_IMPORT = "from torch_remat.integrations import apply_remat as apply_activation_checkpointing"


def _run_script(import_line):
    namespace = {"make_model": lambda: tiny_net(dropout=0.2), "MLPBlock": MLPBlock}
    with recorded_replays() as replayed:
        exec(SCRIPT.format(import_line=import_line), namespace)
    namespace["replayed"] = replayed
    return namespace


def test_switching_the_import_line_alone_gives_identical_losses_gradients_and_state():
    torch_run = _run_script(TORCH_IMPORT)
    remat_run = _run_script(REMAT_IMPORT)
    assert all(torch.equal(a, b) for a, b in zip(torch_run["losses"], remat_run["losses"]))
    # torch's wrapper leaks its infix into named_parameters() of the root; remat does not
    infix = "_checkpoint_wrapped_module."
    assert any(infix in name for name in torch_run["grads"])
    torch_grads = {n.replace(infix, ""): g for n, g in torch_run["grads"].items()}
    assert list(remat_run["grads"]) == [n for n, _ in tiny_net().named_parameters()]
    assert_grads_equal(torch_grads, remat_run["grads"])
    assert list(torch_run["state"]) == list(remat_run["state"])
    assert all(
        torch.equal(torch_run["state"][k], remat_run["state"][k]) for k in torch_run["state"]
    )
    assert remat_module_names(remat_run["model"]) == ["layers.0", "layers.1"]
    # the equalities compare torch's checkpointing with remat's replays, step by step
    assert torch_run["replayed"] == []
    assert remat_run["replayed"] == ["layers.1", "layers.0"] * 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"check_fn": lambda m: isinstance(m, nn.Linear)},
        {"auto_wrap_policy": ModuleWrapPolicy({MLPBlock})},
        {"auto_wrap_policy": CustomPolicy(lambda m: isinstance(m, (MLPBlock, nn.LayerNorm)))},
        {"auto_wrap_policy": functools.partial(size_based_auto_wrap_policy, min_num_params=600)},
    ],
    ids=["default", "check_fn", "ModuleWrapPolicy", "CustomPolicy", "size_based"],
)
def test_selection_matches_torch(kwargs):
    model = tiny_net()
    expected = _torch_wrapped_names(model, **kwargs)
    assert expected, "the case must select something"
    names = apply_remat(model, **kwargs)
    assert sorted(names) == sorted(expected)
    # the selected modules are checkpoints: backward replays them and nothing else
    with recorded_replays() as replayed:
        model(_input()).pow(2).sum().backward()
    assert replayed and set(replayed) <= set(names), replayed
    assert {"layers.0", "layers.1"} & set(names) <= set(replayed)


def test_nested_selection_gives_equal_gradients():
    x = _input()
    reference = _run(tiny_net(dropout=0.1), x)
    model = tiny_net(dropout=0.1)
    names = apply_remat(model)  # torch's default: every submodule, nested
    assert "layers.0" in names and "layers.0.up" in names
    assert_grads_equal(_run(model, x)[1], reference[1])


def test_applying_twice_is_refused_and_remove_remat_undoes_it():
    model = tiny_net()
    apply_remat(model, check_fn=IS_BLOCK)
    with pytest.raises(ValueError, match=r"already applied to \['layers.0', 'layers.1'\]"):
        apply_remat(model, check_fn=IS_BLOCK)
    assert remove_remat(model) == ["layers.0", "layers.1"]
    assert all("forward" not in m.__dict__ for m in model.modules())
    with recorded_replays() as replayed:
        model(_input()).pow(2).sum().backward()
    assert replayed == []
    assert apply_remat(model, check_fn=lambda m: m is model.layers[1]) == ["layers.1"]
    with recorded_replays() as replayed:
        model(_input()).pow(2).sum().backward()
    assert replayed == ["layers.1"]


def test_remove_remat_restores_a_forward_set_on_the_instance_before():
    model = tiny_net()
    calls = []
    block = model.layers[0]

    def traced_forward(x):
        calls.append(1)
        return MLPBlock.forward(block, x)

    block.forward = traced_forward
    apply_remat(model, check_fn=IS_BLOCK)
    _run(model, _input())
    assert len(calls) == 2  # forward and recompute
    remove_remat(model)
    assert block.forward is traced_forward


def test_a_module_wrapped_by_torchs_checkpoint_wrapper_is_refused():
    model = tiny_net()
    model.layers[1] = checkpoint_wrapper(model.layers[1])
    with pytest.raises(
        ValueError, match="'layers.1' is already wrapped by torch's CheckpointWrapper"
    ):
        apply_remat(model, check_fn=IS_BLOCK)


@pytest.mark.parametrize(
    "wrapper_fn, message",
    [
        (
            functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT),
            "non-reentrant",
        ),
        (functools.partial(checkpoint_wrapper, context_fn=lambda: None), "save_modules"),
        (functools.partial(checkpoint_wrapper, checkpoint_fn=print), "custom checkpoint_fn"),
        (functools.partial(checkpoint_wrapper, use_reentrant=True), "use_reentrant=True"),
        (lambda m: m, "understands torch's checkpoint_wrapper"),
    ],
    ids=["reentrant", "context_fn", "checkpoint_fn", "use_reentrant", "unknown_wrapper"],
)
def test_unsupported_wrapper_options_are_refused(wrapper_fn, message):
    with pytest.raises((ValueError, TypeError), match=message):
        apply_remat(tiny_net(), checkpoint_wrapper_fn=wrapper_fn, check_fn=IS_BLOCK)


def test_wrapper_options_are_translated():
    model = tiny_net()
    apply_remat(
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, preserve_rng_state=False, determinism_check="none"
        ),
        check_fn=IS_BLOCK,
    )
    fwd = model.layers[0].forward
    assert fwd.state_hooks == ()
    assert fwd.checkpoint_options == {"determinism_check": "none"}
    remove_remat(model)
    apply_remat(model, check_fn=IS_BLOCK)
    (hook,) = model.layers[0].forward.state_hooks
    assert isinstance(hook, DeviceRNGStateHook) and hook.device == torch.device("cpu")


def test_offload_wrapper_keeps_activations_on_cpu_with_equal_gradients():
    x = _input()
    reference = _run(tiny_net(), x)
    model = tiny_net()
    apply_remat(model, checkpoint_wrapper_fn=offload_wrapper, check_fn=IS_BLOCK)
    assert model.layers[0].forward.offload
    # offloaded, not recomputed: nothing replays
    assert_grads_equal(_run(model, x, replays=False)[1], reference[1])


@pytest.mark.parametrize("config", [
    RematConfig(save_modules=nn.Linear),
    RematConfig(early_stop=False, determinism_check="none"),
])
def test_offload_wrapper_refuses_options_only_a_checkpoint_reads(config):
    # save_modules was dropped without a word: no SAVE region, nothing checkpointed
    model = tiny_net()
    with pytest.raises(ValueError, match="offload_wrapper .* checkpoints nothing") as e:
        apply_remat(model, checkpoint_wrapper_fn=offload_wrapper, check_fn=IS_BLOCK, remat=config)
    assert ("save_modules=" in str(e.value)) is (config.save_modules is not None)
    assert remat_module_names(model) == []


def test_save_modules_become_save_regions_named_inside_their_block():
    x = _input()
    reference = _run(tiny_net(dropout=0.1), x)
    model = tiny_net(dropout=0.1)
    apply_remat(model, check_fn=IS_BLOCK, remat=RematConfig(save_modules=nn.Linear))
    # embed and head are Linear too, but outside every checkpointed block
    assert save_region_names(model) == [
        "layers.0.up",
        "layers.0.down",
        "layers.1.up",
        "layers.1.down",
    ]
    assert isinstance(model.layers[0].up.__dict__["forward"], SaveRegionForward)
    assert model.layers[0].up.forward.region_name == "up"
    assert_grads_equal(_run(model, x)[1], reference[1])
    remove_remat(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_save_modules_by_predicate_and_refused_on_a_checkpointed_module():
    model = tiny_net()
    apply_remat(
        model, check_fn=IS_BLOCK, remat=RematConfig(save_modules=lambda m: isinstance(m, nn.LayerNorm))
    )
    assert save_region_names(model) == ["layers.0.norm", "layers.1.norm"]
    kept = kept_bytes(model(_input()).pow(2).sum())
    assert sorted(kept) == ["layers.0", "layers.1"] and all("norm" in regions for regions in kept.values())
    with pytest.raises(ValueError, match="also matches save_modules"):
        apply_remat(tiny_net(), check_fn=IS_BLOCK, remat=RematConfig(save_modules=MLPBlock))


def _resident_after_forward(memory_probe, x, **config):
    gc.collect()
    model = tiny_net()
    if config:
        apply_remat(model, check_fn=IS_BLOCK, remat=RematConfig(**config))
    with memory_probe() as probe:
        out = model(x)
    del out
    return probe.bytes


def test_resident_bytes_after_forward_are_exact(memory_probe):
    """Bytes allocated by the forward and still alive after it, for a batch of 8,
    dim 16, hidden 32, float64 (8 bytes), two blocks."""
    x = _input(batch=8)
    row16, row32, scalar = 8 * 16 * 8, 8 * 32 * 8, 8 * 1 * 8
    outputs = row16 + 2 * row16 + scalar  # embed, two blocks, head
    # Without remat a block keeps LayerNorm's mean and rstd, the normalised input
    # (saved by `up`) and tanh's output (saved by tanh and `down`).
    assert _resident_after_forward(memory_probe, x) == outputs + 2 * (2 * scalar + row16 + row32)
    # Everything recomputed: only the outputs stay.
    assert _resident_after_forward(memory_probe, x, rng_state_hooks=False) == outputs
    # Linear layers as SAVE regions: each keeps its output (kept for the replay,
    # whose consumers apply_remat cannot see); their inputs (saved by addmm) come
    # from replayed code (LayerNorm, tanh), so the replay rebuilds them.
    assert _resident_after_forward(
        memory_probe, x, rng_state_hooks=False, save_modules=nn.Linear
    ) == outputs + 2 * (row32 + row16)
    # The CPU RNG hook snapshots torch.default_generator (5056 bytes) at each
    # checkpoint's entry and after each SAVE region; a snapshot equal to the one
    # before it (no random numbers drawn in between, as here) is shared.
    assert _resident_after_forward(memory_probe, x, rng_state_hooks=True) == outputs + 2 * 5056
    assert (
        _resident_after_forward(memory_probe, x, rng_state_hooks=True, save_modules=nn.Linear)
        == outputs + 2 * (row32 + row16) + 2 * 5056
    )


def test_deepcopy_and_pickle_carry_the_wrapped_forward_to_the_copy():
    model = tiny_net()
    apply_remat(model, check_fn=IS_BLOCK)
    x = _input()
    for clone in (copy.deepcopy(model), torch.load(_saved(model), weights_only=False)):
        assert clone.layers[0].forward.module is clone.layers[0]
        _run(clone, x)
        assert all(p.grad is not None for p in clone.parameters())
        assert all(p.grad is None for p in model.parameters())


def test_compiled_inside_the_checkpoint_gives_equal_gradients():
    x = _input()
    reference = _run(tiny_net(dropout=0.2), x)
    model = tiny_net(dropout=0.2)
    apply_remat(model, check_fn=IS_BLOCK, remat=RematConfig(save_modules=nn.Linear))
    for block in model.layers:
        block.forward.compile(backend="aot_eager")
    assert_grads_equal(_run(model, x)[1], reference[1])
    # a copy rebuilds its compiled function
    assert copy.deepcopy(model).layers[0].forward._compiled is None


def test_apply_remat_then_compiling_a_block_traces_it_as_one_graph_with_no_break():
    model = tiny_net()
    apply_remat(model, check_fn=IS_BLOCK, remat=RematConfig(save_modules=nn.Linear))
    explanation = torch._dynamo.explain(model.layers[0])(_input())
    torch._dynamo.reset()
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    targets = {n.target for gm in explanation.graphs for n in gm.graph.nodes}
    assert torch.ops.higher_order.tag_activation_checkpoint in targets  # the checkpoint is in it


def test_apply_remat_then_module_compile_gives_the_gradients_of_eager_remat():
    x = _input()
    eager = tiny_net()
    apply_remat(eager, check_fn=IS_BLOCK, remat=RematConfig(save_modules=nn.Linear))
    model = tiny_net()
    apply_remat(model, check_fn=IS_BLOCK, remat=RematConfig(save_modules=nn.Linear))
    model.compile(backend="aot_eager", fullgraph=True)
    try:
        assert_grads_equal(_run(model, x, replays=False)[1], _run(eager, x)[1])
    finally:
        torch._dynamo.reset()


def _saved(model):
    buffer = io.BytesIO()
    torch.save(model, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    buffer.seek(0)
    return buffer
