"""The replay runs a module's forward hooks as the forward had them: a hook
registered or removed between the forward and backward (one that steers an
activation for one forward, a global module hook) does not change what the replay
computes, and the caller's hooks are back afterwards."""

import pytest
import torch
from helpers import UnseenLog, assert_bitwise_equal, grads
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

import torch_remat as remat


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).sin()


def steer(module, args, out):
    return out + 0.5


def scale_linears(module, args, out):
    return out * 1.5 if isinstance(module, nn.Linear) else out


def doubled_input(module, args, kwargs):
    return (args[0] * 2,), kwargs


def always(module, args, out):
    return out - 0.25


# name: register(block) -> handle, and whether the hook is there in forward (else
# registered after it, before backward)
SCENARIOS = {
    "forward hook removed after the forward": (lambda m: m.a.register_forward_hook(steer), True),
    "forward hook registered after the forward": (lambda m: m.a.register_forward_hook(steer), False),
    "pre-hook with kwargs removed after the forward": (
        lambda m: m.b.register_forward_pre_hook(doubled_input, with_kwargs=True), True,
    ),
    "always-called hook removed after the forward": (
        lambda m: m.a.register_forward_hook(always, always_call=True), True,
    ),
    "global hook removed after the forward": (lambda m: register_module_forward_hook(scale_linears), True),
    "global hook registered after the forward": (lambda m: register_module_forward_hook(scale_linears), False),
    "global pre-hook registered after the forward": (
        lambda m: register_module_forward_pre_hook(lambda mod, args: (args[0] * 3,)), False,
    ),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_hooks_changed_between_forward_and_backward_do_not_reach_the_replay(scenario):
    register, in_forward = SCENARIOS[scenario]
    torch.manual_seed(0)
    block = Block()
    params = list(block.parameters())
    x = torch.randn(2, 4, requires_grad=True)

    def loss_of(f):
        def loss(x):
            handles = []
            if in_forward:
                handles.append(register(block))
            out = f(x)
            for h in handles:
                h.remove()
            if not in_forward:
                loss.handle = register(block)
            return out.square().sum()

        return loss

    expected_fn = loss_of(block)
    expected = grads(params, [x], expected_fn)
    if not in_forward:
        expected_fn.handle.remove()
    actual_fn = loss_of(remat.checkpoint(region_name="b")(block))
    actual = grads(params, [x], actual_fn)
    if not in_forward:
        actual_fn.handle.remove()
    assert_bitwise_equal(actual, expected)


def test_the_callers_hooks_are_back_after_the_replay_and_run_next_forward():
    block = Block()
    calls = UnseenLog()
    removed = block.a.register_forward_hook(lambda m, a, o: calls.append("removed"))
    x = torch.randn(2, 4, requires_grad=True)
    out = remat.checkpoint(region_name="b")(block)(x)
    removed.remove()
    block.b.register_forward_hook(lambda m, a, o: calls.append("added"))
    calls.clear()
    out.sum().backward()
    # the replay ran the forward's hook, not the one added since
    assert calls == ["removed"]
    calls.clear()
    block(x)
    assert calls == ["added"]
    assert len(block.a._forward_hooks) == 0 and len(block.b._forward_hooks) == 1


def test_hooks_present_in_forward_and_backward_run_in_the_replay_too():
    block = Block()
    calls = UnseenLog()
    block.a.register_forward_hook(lambda m, a, o: calls.append(remat.is_recomputing()))
    x = torch.randn(2, 4, requires_grad=True)
    remat.checkpoint(region_name="b")(block)(x).sum().backward()
    assert calls == [False, True]


# ------------------------------------- tensor hooks registered inside the function


@pytest.mark.parametrize("where", ["parameter", "parameter, post-accumulate", "closure tensor with history",
                                   "in a RECOMPUTE region"])
def test_a_tensor_hook_the_function_registers_runs_once_as_without_remat(where):
    # The replay runs the registration again on a tensor it did not create: before,
    # the hook ran twice in backward (the weight's gradient doubled; torch's
    # checkpoint does the same). The hooks the replay registers are removed as it ends.
    torch.manual_seed(0)
    lin = nn.Linear(4, 4, dtype=torch.float64)
    base = torch.randn(4, dtype=torch.float64, requires_grad=True)
    handles = []

    def double(p):
        p.grad.mul_(2)

    def register():
        if where == "parameter, post-accumulate":
            handles.append(lin.weight.register_post_accumulate_grad_hook(double))
        elif where == "closure tensor with history":
            handles.append(scale.register_hook(lambda g: g * 3))
        else:
            handles.append(lin.weight.register_hook(lambda g: g * 2))

    def block(x):
        if where == "in a RECOMPUTE region":
            remat.region(register, "reg", recompute=True)()
        else:
            register()
        return (lin(x) * scale).sin().tanh()

    def run(fn):
        global scale
        for h in handles:
            h.remove()
        handles.clear()
        base.grad = None
        scale = base * 2  # a closure-like module-level tensor with autograd history
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        return grads([lin.weight, lin.bias, base], [x], lambda x: fn(x).pow(2).sum())

    expected = run(block)
    actual = run(remat.checkpoint(region_name="hooked")(block))
    assert actual.replays == ["hooked"]
    assert_bitwise_equal(actual, expected)


scale = None
