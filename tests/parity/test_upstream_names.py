"""Default checkpoint names (no ``region_name``) are plain strings, the same in
eager code and in code that ``torch.compile`` traces: upstream torch-remat code
creates unnamed checkpoints inside compiled forwards."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import assert_bitwise_equal, grads

import torch_remat as remat

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.seen: list[str] = []  # checkpoint names seen by eager forwards

    def forward(self, x):
        if not torch.compiler.is_compiling() and not remat.is_recomputing():
            self.seen.append(remat.active_checkpoint().checkpoint)
        return remat.region(lambda t: self.lin(t).relu(), "lin", recompute=False)(x)


def scaled(x, block, scale):
    return block(x) * scale


class Model(torch.nn.Module):
    """Creates an unnamed checkpoint of ``how`` inside its forward."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.block = Block()
        self.how = how

    def target(self):
        if self.how == "module":
            return self.block
        if self.how == "method":
            return self.block.forward
        if self.how == "lambda":
            return lambda t: self.block(t)
        return functools.partial(scaled, block=self.block, scale=2.0)

    def forward(self, x):
        return remat.checkpoint()(self.target())(x)


HOWS = ["module", "method", "lambda", "partial"]
EXPECTED = {
    "module": "Block",
    "method": "Block.forward",
    "lambda": "Model.target.<locals>.<lambda>",
    "partial": "partial",
}


@pytest.mark.parametrize("how", HOWS)
def test_an_unnamed_checkpoint_created_inside_compiled_code_compiles(how):
    torch.manual_seed(0)
    model = Model(how)
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    names: list = []

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            custom = n.meta.get("custom") or {}
            if "remat_checkpoint" in custom:
                names.append(custom["remat_checkpoint"])
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    params = list(model.parameters())
    actual = grads(params, [x], lambda x: compiled(x).sum())
    expected = grads(params, [x], lambda x: model(x).sum())
    assert_bitwise_equal(actual, expected, replays=0)
    assert names and all(type(n) is str for n in names)
    assert set(names) == {EXPECTED[how]}


@pytest.mark.parametrize("how", HOWS)
def test_the_default_name_in_eager_code_is_the_same_plain_string(how):
    model = Model(how)
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    model(x).sum().backward()
    assert model.block.seen == [EXPECTED[how]]
    wrapped = remat.checkpoint()(model.target())
    assert wrapped.__name__ == f"remat_checkpoint_{EXPECTED[how]}"
