"""Two messages users meet in frameworks: enable_remat given a PEFT model, and the
context_fn warning torch logs under torch.compile."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import torch_remat as remat

transformers = pytest.importorskip("transformers", reason="needs the 'transformers' extra")

from tests.integrations.test_transformers import tiny_llama  # noqa: E402
from torch_remat.integrations import enable_remat  # noqa: E402


class Wrapper(nn.Module):
    """What PEFT's PeftModel is to enable_remat: a module around a transformers model
    that hands it out through get_base_model()."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_model = base

    def get_base_model(self) -> nn.Module:
        return self.base_model


def test_a_wrapper_with_get_base_model_is_refused_naming_get_base_model():
    with pytest.raises(TypeError, match=r"enable_remat\(model\.get_base_model\(\)\)") as e:
        enable_remat(Wrapper(tiny_llama()))
    assert "Wrapper" in str(e.value)


def test_a_real_peft_model_is_refused_naming_get_base_model(monkeypatch):
    peft = pytest.importorskip("peft")
    # peft 0.21 refuses torchao < 0.16 when it builds LoRA layers; hide torchao
    # (as if absent) for this test only.
    monkeypatch.setitem(sys.modules, "torchao", None)
    peft.import_utils.is_torchao_available.cache_clear()
    try:
        model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
        with pytest.raises(TypeError, match=r"PeftModel.*get_base_model\(\)"):
            enable_remat(model)
        assert enable_remat(model.get_base_model()) == ["model.layers.0", "model.layers.1"]
    finally:
        peft.import_utils.is_torchao_available.cache_clear()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_compiling_a_checkpoint_logs_no_context_fn_warning_the_user_did_not_cause():
    import torch._logging._internal as torch_logging

    torch_logging.warning_once.cache_clear()  # torch logs it once per process
    records = _Records()
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    logger.addHandler(records)
    try:
        torch._dynamo.reset()
        block = Block()
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        eager = torch.autograd.grad(block(x).sum(), [x, *block.parameters()])
        counter = CompileCounterWithBackend("aot_eager")
        fn = torch.compile(remat.checkpoint(region_name="block")(block), backend=counter)
        compiled = torch.autograd.grad(fn(x).sum(), [x, *block.parameters()])
        # a checkpoint was traced: the silence is about it
        targets = {n.target for gm in counter.graphs for n in gm.graph.nodes}
        assert torch.ops.higher_order.tag_activation_checkpoint in targets
    finally:
        logger.removeHandler(records)
        torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    assert not [m for m in records.messages if "context_fn" in m], records.messages


def test_a_user_context_fn_under_compile_still_logs_torch_warning():
    import functools

    import torch._logging._internal as torch_logging
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    torch_logging.warning_once.cache_clear()
    records = _Records()
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    logger.addHandler(records)
    try:
        torch._dynamo.reset()
        block = Block()
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

        def run(x):
            return torch.utils.checkpoint.checkpoint(
                block, x, use_reentrant=False,
                context_fn=functools.partial(create_selective_checkpoint_contexts, policy),
            )

        torch.compile(run, backend="aot_eager")(x).sum().backward()
    finally:
        logger.removeHandler(records)
        torch._dynamo.reset()
    assert [m for m in records.messages if "context_fn" in m]
