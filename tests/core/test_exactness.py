"""Exactness beyond the arguments: repeated arguments, tensors the function reads
but does not save (parameters, buffers, closure tensors), parameter swaps, state
updated during the forward and random ops. Each case ends in bitwise gradients and
module state equal to the run without remat, or in a RematError that names what
changed."""

import functools

import pytest
import torch
from helpers import UnseenLog, recorded_replays
from torch import nn
from torch.nn.utils import parametrize

import torch_remat as remat
from torch_remat.integrations import apply_remat

D = torch.float64


def _grads(params, fn, x):
    for p in params:
        p.grad = None
    x.grad = None
    fn(x).pow(2).sum().backward()
    return [p.grad.clone() for p in params] + [x.grad.clone()]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def _replayed(run, *args):
    """``run(*args)`` and the names of the checkpoints its backward replayed."""
    with recorded_replays() as replayed:
        out = run(*args)
    return out, replayed


def _assert_same_as_without_remat(run):
    """``run(True)`` (with remat) replays a checkpoint and gives what ``run(False)``
    gives."""
    actual, replayed = _replayed(run, True)
    assert replayed, "no checkpoint was replayed: remat did nothing"
    assert _same(actual, run(False))


def _mlp():
    return nn.Sequential(nn.Linear(4, 4, dtype=D), nn.Tanh(), nn.Linear(4, 4, dtype=D), nn.Tanh())


def _x(*shape):
    return torch.randn(*shape or (3, 4), dtype=D, requires_grad=True)


# ------------------------------------------------------------- argument identity


def test_a_tensor_passed_twice_is_one_object_in_the_replay_too():
    seen = UnseenLog()

    def fn(a, b):
        seen.append(a is b)
        return a.sin() * b.cos()

    x = _x()
    remat.checkpoint(region_name="c")(fn)(x, x).sum().backward()
    assert seen == [True, True]
    assert torch.equal(x.grad, (x.detach().cos() ** 2 - x.detach().sin() ** 2))


def test_multihead_self_attention_gives_bitwise_gradients():
    mha = nn.MultiheadAttention(8, 2, dtype=D, batch_first=True)
    params = list(mha.parameters())
    h = _x(2, 5, 8)
    expected = _grads(params, lambda h: mha(h, h, h)[0], h)
    ckpt = remat.checkpoint(region_name="attn")(mha)
    actual, replayed = _replayed(_grads, params, lambda h: ckpt(h, h, h)[0], h)
    assert replayed == ["attn"]
    assert _same(actual, expected)


class _AttnBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, dtype=D, batch_first=True)
        self.out = nn.Linear(8, 8, dtype=D)

    def forward(self, h):
        return self.out(self.attn(h, h, h)[0]).tanh()


def test_apply_remat_on_a_model_with_multihead_attention_gives_bitwise_gradients():
    model = nn.Sequential(_AttnBlock(), _AttnBlock())
    params = list(model.parameters())
    h = _x(2, 5, 8)
    expected = _grads(params, model, h)
    apply_remat(model, check_fn=lambda m: isinstance(m, _AttnBlock))
    actual, replayed = _replayed(_grads, params, model, h)
    assert len(replayed) == 2  # one per block
    assert _same(actual, expected)


# ----------------------------------------------------- tensors read but not saved


def _modified_bias_error(ckpt_fn, bias, x):
    out = ckpt_fn(x).pow(2).sum()
    with torch.no_grad():
        bias.add_(1.0)
    with pytest.raises(remat.SavedTensorModifiedError) as e:
        out.backward()
    return str(e.value)


def test_a_bias_changed_in_place_before_backward_raises_naming_it_for_a_module():
    model = _mlp()
    msg = _modified_bias_error(remat.checkpoint(region_name="mlp")(model), model[0].bias, _x())
    assert "'0.bias'" in msg and "'mlp'" in msg and "clone" in msg.lower()


def test_a_bias_changed_in_place_before_backward_raises_for_a_bound_method():
    model = _mlp()
    msg = _modified_bias_error(remat.checkpoint(region_name="m")(model.forward), model[2].bias, _x())
    assert "'2.bias'" in msg


def test_a_bias_changed_in_place_before_backward_raises_for_a_partial():
    model = _mlp()

    def run(m, x):
        return m(x)

    ckpt = remat.checkpoint(region_name="p")(functools.partial(run, model))
    assert "'0.bias'" in _modified_bias_error(ckpt, model[0].bias, _x())


def test_a_bias_changed_by_an_optimizer_step_before_backward_raises():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    out = remat.checkpoint(region_name="mlp")(model)(_x()).pow(2).sum()
    opt.step()
    with pytest.raises(remat.SavedTensorModifiedError, match=r"'0\.weight'|'0\.bias'"):
        out.backward()


def test_a_closure_tensor_changed_in_place_raises_naming_the_variable():
    shift = torch.randn(4, dtype=D)

    def fn(x):
        return (x + shift).tanh()

    out = remat.checkpoint(region_name="c")(fn)(_x()).sum()
    shift.mul_(2)
    with pytest.raises(remat.SavedTensorModifiedError, match="'shift'"):
        out.backward()


def test_a_module_wrapped_by_apply_remat_raises_naming_the_full_parameter_name():
    model = nn.Sequential(_mlp(), _mlp())
    apply_remat(model, check_fn=lambda m: m in (model[0], model[1]))
    out = model(_x()).pow(2).sum()
    with torch.no_grad():
        model[1][2].bias.sub_(0.5)
    with pytest.raises(remat.SavedTensorModifiedError, match=r"'1\.2\.bias'"):
        out.backward()


def test_a_parameter_replaced_after_the_forward_is_replayed_with_the_forward_tensor():
    def run(ckpt):
        torch.manual_seed(1)
        model = _mlp()
        fn = remat.checkpoint(region_name="m")(model) if ckpt else model
        old = model[0].bias
        x = _x()
        out = fn(x).pow(2).sum()
        model[0].bias = nn.Parameter(torch.zeros(4, dtype=D))
        out.backward()
        return [old.grad, model[0].weight.grad, x.grad]

    _assert_same_as_without_remat(run)


# ---------------------------------------------------------------- parameter swaps


def test_functional_call_with_fast_weights_gives_bitwise_gradients():
    def run(ckpt):
        torch.manual_seed(2)
        model = nn.Sequential(_mlp(), _mlp())
        if ckpt:
            apply_remat(model, check_fn=lambda m: m in (model[0], model[1]))
        x = _x()
        fast = {n: p * 1.5 for n, p in model.named_parameters()}
        torch.func.functional_call(model, fast, (x,)).pow(2).sum().backward()
        return [p.grad for p in model.parameters()] + [x.grad]

    _assert_same_as_without_remat(run)


def test_functional_call_on_a_module_that_checkpoints_a_child_gives_bitwise_gradients():
    class Outer(nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.inner = _mlp()
            self.ckpt = ckpt

        def forward(self, x):
            if self.ckpt:
                return remat.checkpoint(region_name="inner")(self.inner)(x)
            return self.inner(x)

    def run(ckpt):
        torch.manual_seed(3)
        model = Outer(ckpt)
        x = _x()
        fast = {n: p - 0.1 * p.detach().sign() for n, p in model.named_parameters()}
        torch.func.functional_call(model, fast, (x,)).pow(2).sum().backward()
        return [p.grad for p in model.parameters()] + [x.grad]

    _assert_same_as_without_remat(run)


class _Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(0, 1)


def test_a_parametrized_weight_gives_bitwise_gradients():
    def run(ckpt):
        torch.manual_seed(4)
        model = _mlp()
        parametrize.register_parametrization(model[0], "weight", _Symmetric())
        fn = remat.checkpoint(region_name="m")(model) if ckpt else model
        x = _x()
        with parametrize.cached():
            out = fn(x).pow(2).sum()
        out.backward()
        return [p.grad for p in model.parameters()] + [x.grad]

    _assert_same_as_without_remat(run)


# --------------------------------------------------------- state updated in forward


def _bn_model():
    return nn.Sequential(nn.Linear(4, 4, dtype=D), nn.BatchNorm1d(4, dtype=D), nn.Tanh())


def _step_state(model, fn, x):
    fn(x).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    return grads, {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same_step(run):
    g0, s0 = run(False)
    (g1, s1), replayed = _replayed(run, True)
    assert replayed, "no checkpoint was replayed: remat did nothing"
    assert _same(g1, g0)
    assert s0.keys() == s1.keys()
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k


def test_batchnorm_running_stats_are_updated_once_per_step():
    def run(ckpt):
        torch.manual_seed(5)
        model = _bn_model()
        fn = remat.checkpoint(region_name="bn")(model) if ckpt else model
        return _step_state(model, fn, _x(6, 4))

    _assert_same_step(run)


def test_batchnorm_under_apply_remat_is_updated_once_per_step():
    def run(ckpt):
        torch.manual_seed(5)
        model = nn.Sequential(_bn_model(), _bn_model())
        if ckpt:
            apply_remat(model, check_fn=lambda m: m in (model[0], model[1]))
        return _step_state(model, model, _x(6, 4))

    _assert_same_step(run)


class _RunningMean(nn.Module):
    """Updates a buffer under no_grad in forward and reads it."""

    def __init__(self, saves_mean=True):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=D)
        self.register_buffer("mean", torch.zeros(4, dtype=D))
        self.saves_mean = saves_mean

    def forward(self, x):
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        if self.saves_mean:
            return (self.lin(x) * self.mean).tanh()
        return (self.lin(x) + self.mean).tanh()  # reads mean without saving it


def test_a_buffer_updated_in_forward_is_updated_once_and_replayed_with_the_forward_value():
    def run(ckpt):
        torch.manual_seed(6)
        model = _RunningMean()
        fn = remat.checkpoint(region_name="m")(model) if ckpt else model
        return _step_state(model, fn, _x())

    _assert_same_step(run)


def test_spectral_norm_power_iteration_runs_once_per_step():
    def run(ckpt):
        torch.manual_seed(7)
        model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 4, dtype=D)), nn.Tanh())
        fn = remat.checkpoint(region_name="sn")(model) if ckpt else model
        return _step_state(model, fn, _x())

    _assert_same_step(run)


def test_two_forwards_before_one_backward_replay_each_with_its_own_buffer_values():
    def run(ckpt):
        torch.manual_seed(8)
        # Without remat, a second forward may update a buffer that the first one
        # read but did not save.
        model = _RunningMean(saves_mean=False)
        fn = remat.checkpoint(region_name="m")(model) if ckpt else model
        x = _x()
        (fn(x).pow(2).sum() + fn(x * 2).pow(2).sum()).backward()
        return [p.grad for p in model.parameters()] + [x.grad, model.mean.clone()]

    _assert_same_as_without_remat(run)


# ------------------------------------------------------------------------- RNG


def _dropout_fn(x):
    return torch.nn.functional.dropout(x.sin(), 0.5).cos()


def test_dropout_without_a_state_hook_raises_naming_the_generator_and_the_fix():
    out = remat.checkpoint(region_name="drop")(_dropout_fn)(_x()).sum()
    with pytest.raises(remat.RecomputeMismatchError) as e:
        out.backward()
    msg = str(e.value)
    assert "'drop'" in msg and "CPU generator" in msg
    assert "recompute_state_hooks" in msg and "CPURNGStateHook" in msg


def test_the_callers_generator_after_backward_is_as_without_remat_with_a_hook():
    def run(hooks):
        torch.manual_seed(9)
        x = _x()
        fn = _dropout_fn if hooks is None else remat.checkpoint(region_name="d", recompute_state_hooks=hooks)(_dropout_fn)
        fn(x).sum().backward()
        return x.grad, torch.rand(3)

    grad0, next0 = run(None)
    (grad1, next1), replayed = _replayed(run, (remat.CPURNGStateHook(),))
    assert replayed == ["d"]
    assert torch.equal(grad0, grad1) and torch.equal(next0, next1)


def test_the_callers_generator_is_not_moved_by_a_refused_replay():
    torch.manual_seed(10)
    _dropout_fn(_x()).sum().backward()
    expected = torch.rand(3)
    torch.manual_seed(10)
    out = remat.checkpoint(region_name="d")(_dropout_fn)(_x()).sum()
    with pytest.raises(remat.RecomputeMismatchError):
        out.backward()
    assert torch.equal(torch.rand(3), expected)


def test_a_checkpoint_that_draws_no_random_numbers_needs_no_hook():
    x = _x()
    with recorded_replays() as replayed:
        remat.checkpoint(region_name="c")(lambda t: t.sin().cos())(x).sum().backward()
    assert replayed == ["c"]
    assert torch.equal(x.grad, -x.detach().sin().sin() * x.detach().cos())


def test_a_batchnorm_inside_a_save_region_is_updated_once_and_read_back_after_it():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, dtype=D)
            self.bn = nn.BatchNorm1d(4, dtype=D)

        def forward(self, x):
            h = remat.recompute_needs_tensor(remat.region(self.bn, "bn", recompute=False)(self.lin(x)))
            return (h.tanh() * self.bn.running_mean).sin()  # reads a buffer the region updated

    def run(ckpt):
        torch.manual_seed(11)
        model = Net()
        fn = remat.checkpoint(region_name="n")(model) if ckpt else model
        return _step_state(model, fn, _x(6, 4))

    _assert_same_step(run)
