"""Exactness cases that end in an error, and errors a user can act on: in-place
writes inside SAVE regions, placeholders refusing raw data access, leaks of failed
SAVE regions, argument validation."""

import gc
import weakref

import pytest
import torch
from helpers import UnseenLog, kept_bytes, recorded_replays
from torch import nn

import torch_remat as remat
from torch_remat.diagnostics import ActiveCheckpoint
from torch_remat.integrations import RematConfig, apply_remat, remat_module_names

D = torch.float64


def _x(*shape):
    return torch.randn(*shape or (3, 4), dtype=D, requires_grad=True)


# ------------------------------------------------ in-place writes in SAVE regions


def test_a_save_region_writing_in_place_to_its_argument_gives_the_gradients_without_remat():
    b = torch.randn(4, dtype=D)

    def fn(x):
        h = x.sin()
        remat.region(lambda t: t.add_(b), "fused_add", recompute=False)(h)
        return h.cos()

    def grad(ckpt):
        torch.manual_seed(0)
        x = _x()
        out = (remat.checkpoint(region_name="c")(fn) if ckpt else fn)(x)
        # cos saves the region's written output: the checkpoint keeps it, as the
        # region's, and the replay has nothing left to do
        assert kept_bytes(out) == ({"c": {"fused_add": 3 * 4 * 8}} if ckpt else {})
        out.sum().backward()
        return x.grad

    assert torch.equal(grad(True), grad(False))


def test_a_later_save_region_updating_a_saved_earlier_save_output_raises_in_backward_as_autograd_does():
    # exp saves its output h, which region 'b' then updates: without remat autograd
    # refuses this backward too
    def fn(x):
        h = remat.region(torch.exp, "a", recompute=False)(x)
        remat.region(lambda t: t.mul_(2), "b", recompute=False)(h)
        return h.sin()

    y = remat.checkpoint(region_name="c")(fn)(_x())
    with pytest.raises(remat.SavedTensorModifiedError) as e:
        y.sum().backward()
    msg = str(e.value)
    assert "SAVE region 'a'" in msg and "'c'" in msg


# ---------------------------------------------------------------- placeholders


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.data_ptr(),
        lambda t: t.untyped_storage().data_ptr(),
        lambda t: t.numpy(),
        lambda t: t.__array__(),
        lambda t: t.tolist(),
        lambda t: t.item(),
    ],
    ids=["data_ptr", "storage_data_ptr", "numpy", "array", "tolist", "item"],
)
def test_a_placeholder_refuses_raw_data_access(read):
    def fn(x):
        h = remat.region(lambda t: t.exp().sum(), "e", recompute=False)(x)
        if remat.is_recomputing():
            read(h.detach())
        return x.sin().sin()

    out = remat.checkpoint(region_name="c")(fn)(_x()).sum()
    with pytest.raises(remat.PlaceholderReadError) as e:
        out.backward()
    assert "SAVE region 'e'" in str(e.value) and "output 0" in str(e.value)


# ------------------------------------------------------------------------ leaks


class _Uncopyable(Exception):
    def __init__(self, code):
        super().__init__(f"code {code}")
        self.code = code

    def __reduce__(self):
        raise TypeError("not copyable")


@pytest.mark.parametrize("exc", [KeyError, _Uncopyable], ids=["copyable", "uncopyable"])
def test_a_caught_save_region_error_frees_the_forward_after_the_step(exc):
    refs = UnseenLog()

    def failing(t):
        raise exc(3)

    def fn(x):
        h = x.sin() * 2
        refs.append(weakref.ref(h))
        try:
            h = remat.region(failing, "fast", recompute=False)(h)
        except exc:
            h = h.cos()
        return h.tanh()

    gc.collect()
    gc.disable()
    try:
        x = _x()
        with recorded_replays() as replayed:
            for _ in range(3):
                remat.checkpoint(region_name="c")(fn)(x).sum().backward()
        assert replayed == ["c"] * 3  # each step's h was dropped and rebuilt, then freed
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


# -------------------------------------------------------------- argument errors


def test_apply_remat_validates_early_stop_before_patching():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(TypeError, match="early_stop"):
        apply_remat(model, remat=RematConfig(early_stop="false"))
    assert remat_module_names(model) == []


def test_apply_remat_validates_determinism_check_before_patching():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="determinism_check"):
        apply_remat(model, remat=RematConfig(determinism_check="exact"))
    assert remat_module_names(model) == []


def test_apply_remat_names_a_bad_state_hook_by_the_users_index():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"recompute_state_hooks\[1\]"):
        apply_remat(model, remat=RematConfig(recompute_state_hooks=(remat.CPURNGStateHook(), object())))
    assert remat_module_names(model) == []


def test_apply_remat_rejects_a_truthy_string_for_rng_state_hooks():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(TypeError, match="rng_state_hooks"):
        apply_remat(model, remat=RematConfig(rng_state_hooks="no"))
    assert remat_module_names(model) == []


class _TwiceLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=D)

    def forward(self, x):
        return self.lin(self.lin(x).tanh()).tanh()


def test_save_modules_called_twice_in_one_block_get_distinct_names():
    model = nn.Sequential(_TwiceLinear(), _TwiceLinear())
    params = list(model.parameters())
    x = _x()
    model(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in params] + [x.grad.clone()]
    for t in [*params, x]:
        t.grad = None
    apply_remat(model, check_fn=lambda m: isinstance(m, _TwiceLinear), remat=RematConfig(save_modules=nn.Linear))
    with recorded_replays() as replayed:
        loss = model(x).pow(2).sum()
        kept = kept_bytes(loss)
        loss.backward()
    assert replayed == ["1", "0"]
    # the second call of the shared Linear is a region of its own, not a second 'lin'
    assert sorted(kept) == ["0", "1"]
    assert all({"lin", "call1/lin"} <= set(regions) for regions in kept.values())
    actual = [p.grad for p in params] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(actual, expected))


def test_saved_tensors_report_refuses_an_int():
    with pytest.raises(TypeError, match="saved_tensors_report"):
        remat.saved_tensors_report(3)


def test_checkpointing_a_generator_function_is_refused():
    def gen(x):
        yield x.sin()

    with pytest.raises(TypeError, match="generator"):
        remat.checkpoint(region_name="g")(gen)


def test_torch_func_grad_inside_a_checkpoint_says_the_hooks_are_active():
    def fn(x):
        return torch.func.grad(lambda t: t.sin().sum())(x) * x

    with pytest.raises(remat.RematError, match="saved-tensor hooks"):
        remat.checkpoint(region_name="c")(fn)(_x())


# ------------------------------------------------- where an exception was raised


def test_active_checkpoint_of_an_exception_does_not_need_its_traceback():
    def body(t):
        raise torch.OutOfMemoryError("in forward")

    def fn(x):
        return remat.region(body, "mlp", recompute=True)(x)

    with pytest.raises(torch.OutOfMemoryError) as info:
        remat.checkpoint(region_name="layers.1")(fn)(_x())
    bare = info.value.with_traceback(None)  # e.g. handed over from another thread
    assert remat.active_checkpoint(bare) == ActiveCheckpoint("layers.1", "forward", "mlp")


def test_partial_backwards_of_a_scope_with_retain_graph_do_not_grow(memory_probe):
    a = torch.randn(256, dtype=D, requires_grad=True)
    w = torch.randn(256, dtype=D, requires_grad=True)
    with remat.gradient_checkpoint_scope():
        h = (a * 2).sin()
        k = (h * w).exp()
    loss = (k * h).sum()
    torch.autograd.grad(loss, inputs=[a], retain_graph=True)  # warm-up
    with memory_probe() as probe:
        for _ in range(5):
            torch.autograd.grad(loss, inputs=[w], retain_graph=True)
    assert probe.bytes == 0


def test_rng_fingerprints_stay_out_of_a_pre_dispatch_trace(monkeypatch):
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_remat.engine import rng

    taken = []
    fingerprint = rng.DefaultGenerator.fingerprint
    monkeypatch.setattr(rng.DefaultGenerator, "fingerprint", lambda g: taken.append(g.device) or fingerprint(g))

    def body(x):
        h = torch.nn.functional.dropout(x, 0.5)
        return remat.region(torch.sin, "s", recompute=False)(h)

    def traced(x):
        return remat.checkpoint(region_name="blk", recompute_state_hooks=[remat.CPURNGStateHook()])(body)(x)

    gm = make_fx(traced, pre_dispatch=True)(torch.randn(4, 4, requires_grad=True))
    assert taken  # the checkpoint fingerprinted the CPU generator while being traced
    # The generator state read for the fingerprints (5 KB each) is not a graph constant.
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and "_tensor_constant" in str(n.target)]
