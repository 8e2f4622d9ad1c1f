"""The replay runs a module's forward hooks as the forward had them: a hook
registered or removed between the forward and backward (one that steers an
activation for one forward, a global module hook) does not change what the replay
computes, and the caller's hooks are back afterwards."""

import pytest
import torch
from helpers import UnseenLog, assert_bitwise_equal, grads, recorded_replays
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


def _hook_count(module):
    """The hooks registered on ``module`` and the global module hooks."""
    import torch.nn.modules.module as module_py

    dicts = [v for k, v in vars(module).items() if "hook" in k and isinstance(v, dict)]
    dicts += [v for k, v in vars(module_py).items() if k.startswith("_global") and isinstance(v, dict)]
    return sum(map(len, dicts))


@pytest.mark.parametrize(
    "kind", ["forward hook", "forward pre-hook", "full backward hook", "global forward hook", "state_dict hook"]
)
def test_a_hook_the_forward_registers_and_removes_itself_is_not_left_by_the_replay(kind):
    # The forward registers a hook for one call and removes it at its end. The
    # replay stops at the last save it needs (early stop), before the removal:
    # the hook stayed, and every later forward ran it once more (gradients
    # silently wrong from the second step on). The replay's hooks are removed as
    # it ends, whether or not its code removed them.
    def register(m):
        if kind == "forward hook":
            return m.b.register_forward_hook(lambda mod, i, o: o * 3.0)
        if kind == "forward pre-hook":
            return m.b.register_forward_pre_hook(lambda mod, i: (i[0] * 3.0,))
        if kind == "full backward hook":
            return m.b.register_full_backward_hook(lambda mod, gi, go: (gi[0] * 3.0,))
        if kind == "state_dict hook":
            return m.b.register_state_dict_post_hook(lambda *a: None)
        return register_module_forward_hook(lambda mod, i, o: o * 1.5 if mod is m.b else o)

    class Registers(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(6, 6, dtype=torch.float64), nn.Linear(6, 6, dtype=torch.float64)

        def forward(self, x):
            h = register(self)
            out = self.b(self.a(x).tanh()).sin()  # the last save: the replay stops here
            h.remove()
            return out

    def run(ckpt):
        m = Registers()
        fn = remat.checkpoint(region_name="registers")(m) if ckpt else m
        out, counts = [], []
        for step in range(3):
            x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(step),
                            requires_grad=True)
            fn(x).pow(2).sum().backward()
            out.extend([x.grad, *(p.grad.clone() for p in m.parameters())])
            counts.append(_hook_count(m.b))
        return out, counts

    expected, expected_counts = run(False)
    with recorded_replays() as replayed:
        actual, counts = run(True)
    assert replayed == ["registers"] * 3
    assert counts == expected_counts == [0, 0, 0]
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


@pytest.mark.parametrize("kind", ["forward hook", "forward pre-hook with kwargs", "global forward hook"])
def test_a_hook_a_save_regions_body_registers_runs_after_it_in_the_replay_too(kind):
    # A SAVE body that installs a hook on a later module once (lazily, on its first
    # call): the replay skips the body, and the later module ran without the hook
    # there (hooks registered since the forward started are cleared): gradients
    # silently wrong. Now the hooks the body added are there after it, as in the forward.
    handles = []

    class InstallsAHook(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(6, 6, dtype=torch.float64), nn.Linear(6, 6, dtype=torch.float64)

        def body(self, h):
            if not handles:
                if kind == "forward hook":
                    handles.append(self.b.register_forward_hook(lambda mod, i, o: o * 3.0))
                elif kind == "forward pre-hook with kwargs":
                    handles.append(self.b.register_forward_pre_hook(
                        lambda mod, args, kwargs: ((args[0] * args[0],), kwargs), with_kwargs=True))
                else:
                    handles.append(register_module_forward_hook(
                        lambda mod, i, o: o * 1.5 if mod is self.b else o))
            return self.a(h).tanh()

        def forward(self, x):
            h = remat.region(self.body, "installs", recompute=False)(x.sin())
            return self.b(h).sin()

    def run(ckpt):
        m = InstallsAHook()
        fn = remat.checkpoint(region_name="installs")(m) if ckpt else m
        x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        try:
            with recorded_replays() as replayed:
                fn(x).pow(2).sum().backward()
            counts = _hook_count(m.b)
        finally:
            for h in handles:
                h.remove()
            handles.clear()
        return [x.grad, *(p.grad for p in m.parameters())], replayed, counts

    expected, _, expected_counts = run(False)
    actual, replayed, counts = run(True)
    assert replayed == ["installs"]
    assert counts == expected_counts
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)
