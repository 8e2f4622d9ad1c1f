"""remat.checkpoint options that cannot work under torch.compile are refused with
RematCompileError naming the checkpoint, never silently ignored."""

from __future__ import annotations

import pytest
import torch
from helpers import CounterHook, kept_bytes
from torch import nn

import torch_remat as remat
from torch_remat.integrations import RematConfig, apply_remat

DTYPE = torch.float64


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def identity_hooks():
    return (lambda t: t, lambda t: t)


def compiled_sin(**options):
    ckpt = remat.checkpoint(region_name="layers.2", **options)(torch.sin)
    return torch.compile(ckpt, backend="aot_eager")


def test_saved_tensors_hooks_under_compile_raise_naming_the_checkpoint():
    x = torch.randn(4, dtype=DTYPE, requires_grad=True)
    with pytest.raises(remat.RematCompileError, match=r"'layers.2'.*saved_tensors_hooks"):
        compiled_sin(saved_tensors_hooks=identity_hooks())(x)


def test_input_saved_tensors_hooks_under_compile_raise_naming_the_checkpoint():
    x = torch.randn(4, dtype=DTYPE, requires_grad=True)
    with pytest.raises(remat.RematCompileError, match=r"'layers.2'.*input_saved_tensors_hooks"):
        compiled_sin(input_saved_tensors_hooks=identity_hooks())(x)


def test_an_offloader_compiles_only_as_saved_tensors_hooks_and_only_for_what_regions_keep():
    from torch_remat.offload import ActivationOffloader

    x = torch.randn(4, dtype=DTYPE, requires_grad=True)
    offloader = ActivationOffloader(1 << 20, min_bytes=0)
    # a compiled graph does not offload its inputs
    with pytest.raises(remat.RematCompileError, match=r"'layers.2'.*input_saved_tensors_hooks"):
        compiled_sin(input_saved_tensors_hooks=offloader)(x)
    torch._dynamo.reset()
    inputs_only = ActivationOffloader(1 << 20, kinds=(remat.SavedTensorKind.CHECKPOINT_INPUT,))
    with pytest.raises(remat.RematCompileError, match=r"'layers.2'.*saved_tensors_hooks"):
        compiled_sin(saved_tensors_hooks=inputs_only)(x)
    torch._dynamo.reset()
    assert torch.equal(compiled_sin(saved_tensors_hooks=offloader)(x), torch.sin(x))


def test_saved_tensors_hooks_none_compiles_as_torchtitan_passes_it():
    x = torch.randn(4, dtype=DTYPE, requires_grad=True)
    out = compiled_sin(saved_tensors_hooks=None, input_saved_tensors_hooks=None)(x)
    assert torch.equal(out, torch.sin(x))
    # compiled as the checkpoint, which keeps its input for backward
    assert kept_bytes(out) == {"layers.2": {"(inputs)": x.nbytes}}


def test_an_ambient_hooks_context_refuses_a_checkpoint_compiled_before_it_was_entered():
    step = compiled_sin()
    x = torch.randn(4, dtype=DTYPE, requires_grad=True)
    step(x)  # compiled without the context
    with remat.saved_tensors_hooks(*identity_hooks()):
        with pytest.raises(remat.RematCompileError, match=r"'layers.2'.*remat.saved_tensors_hooks"):
            step(x)


def test_apply_remat_with_an_offloading_config_then_compile_raises():
    model = nn.Sequential(nn.Linear(4, 4, dtype=DTYPE), nn.Linear(4, 4, dtype=DTYPE))
    apply_remat(
        model,
        check_fn=lambda m: isinstance(m, nn.Linear),
        remat=RematConfig(saved_tensors_hooks=identity_hooks()),
    )
    model.compile(backend="aot_eager")
    with pytest.raises(remat.RematCompileError, match=r"'0'.*saved_tensors_hooks"):
        model(torch.randn(2, 4, dtype=DTYPE, requires_grad=True))


def test_a_user_state_hook_under_fullgraph_names_the_checkpoint_and_the_hook():
    ckpt = remat.checkpoint(region_name="layers.3", recompute_state_hooks=(CounterHook(),))(
        torch.sin
    )
    x = torch.randn(4, dtype=DTYPE, requires_grad=True)
    with pytest.raises(Exception, match=r"checkpoint 'layers.3'.*CounterHook") as raised:
        torch.compile(ckpt, backend="aot_eager", fullgraph=True)(x)
    assert "RematCompileError" in str(raised.value)
