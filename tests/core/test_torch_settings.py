"""The replay runs under the torch settings and TorchFunctionModes its forward ran
under: the default dtype, float32 matmul precision, the attention backends, and a
``torch.device`` block or any other TorchFunctionMode, set around the forward only.
Without that a replay recreates other values (silently wrong gradients) or other
saves."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import UnseenLog, assert_bitwise_equal, grads, recorded_replays
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

import torch_remat as remat


@contextlib.contextmanager
def default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def matmul_precision(precision):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class DoubledSine(TorchFunctionMode):
    """A mode that changes what an op returns (as a quantization mode would)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.sin else out


def scaled(x):
    # torch.full makes a tensor of the default dtype: 0.1 rounds differently
    return (x * torch.full(x.shape[-1:], 0.1)).sin().exp()


def sine(x):
    return torch.sin(x * 1.5).exp()


def attention(x):
    return F.scaled_dot_product_attention(x, x * 1.5, x * 0.5).sin()


def matmul(x):
    return (x @ x.t()).sin()


@contextlib.contextmanager
def flushed_denormals():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def through_denormals(x):
    # float32 denormals in between: 0 where they are flushed (tanh saves its output)
    return x.sin() + ((x * 1e-39) * 1e38).tanh()


CASES = {
    # name: (function, input, context around the forward only)
    "default dtype": (scaled, lambda: torch.randn(3, 5, dtype=torch.float64), lambda: default_dtype(torch.float64)),
    "function mode": (sine, lambda: torch.randn(3, 5), DoubledSine),
    "attention backend": (attention, lambda: torch.randn(2, 2, 8, 16), lambda: sdpa_kernel([SDPBackend.MATH])),
    "matmul precision": (matmul, lambda: torch.randn(64, 64), lambda: matmul_precision("medium")),
    # torch.set_flush_denormal has no getter (read through Python's float arithmetic)
    "flush denormals": (through_denormals, lambda: torch.randn(4, 8), flushed_denormals),
}


def forward_only(fn, context):
    def loss(x):
        with context():
            out = fn(x)
        return out.square().sum()  # backward runs outside the context

    return loss


@pytest.mark.parametrize("case", CASES)
def test_the_replay_runs_under_the_settings_of_the_forward(case):
    fn, make, context = CASES[case]
    torch.manual_seed(0)
    x = make().requires_grad_()
    expected = grads([], [x], forward_only(fn, context))
    if case == "matmul precision":
        plain = grads([], [x], lambda x: fn(x).square().sum())
        if all(torch.equal(a, b) for a, b in zip(plain[1], expected[1])):
            pytest.skip("this CPU computes float32 matmuls alike at every precision")
    actual = grads([], [x], forward_only(remat.checkpoint(region_name="c")(fn), context))
    assert_bitwise_equal(actual, expected)


def test_the_callers_settings_and_modes_are_back_after_the_replay():
    seen = UnseenLog()

    def body(t):
        if remat.is_recomputing():
            seen.append((torch.get_default_dtype(), torch.overrides._get_current_function_mode_stack()))
        return scaled(t) + torch.sin(t)

    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    forward_mode = DoubledSine()
    with default_dtype(torch.float64), forward_mode:
        out = remat.checkpoint(region_name="c")(body)(x)
    caller_mode = DoubledSine()
    with caller_mode:
        out.sum().backward()
        stack = torch.overrides._get_current_function_mode_stack()
    assert seen == [(torch.float64, [forward_mode])]
    assert stack == [caller_mode]
    assert torch.get_default_dtype() == torch.float32


def test_a_mode_active_only_in_backward_is_not_seen_by_the_replay():
    torch.manual_seed(0)
    x = torch.randn(3, 5, requires_grad=True)
    expected = grads([], [x], lambda t: sine(t).square().sum())
    x.grad = None
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="c")(sine)(x)
        with DoubledSine():
            out.square().sum().backward()
    assert replayed == ["c"]  # (a replay under the mode would have doubled its sine)
    assert torch.equal(x.grad, expected[1][0])


class AttentionOverThreeInputs(torch.nn.Module):
    """nn.MultiheadAttention on distinct query, key and value, batch first: its input
    projections run at::linear on transposed (non-contiguous) inputs, which adds the
    bias in place, and out of place under a TorchDispatchMode."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.attention(self.norm(x), self.norm(x) * 2, self.norm(x) * 3, need_weights=False)[0]


def test_a_flop_counter_around_backward_only_sees_the_replay_and_the_gradients_are_exact():
    # Before: the replay's projections, made out of place under the counter, were at
    # version 0 where the forward's were at 1, and were refused as modified in place
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    block = AttentionOverThreeInputs()
    x = torch.randn(2, 6, 16, requires_grad=True)
    params = list(block.parameters())

    def run(fn):
        for p in [*params, x]:
            p.grad = None
        out = fn(x).square().sum()
        with FlopCounterMode(display=False) as counter:
            out.backward()
        return [p.grad.clone() for p in [*params, x]], counter.get_total_flops()

    expected, backward_flops = run(block)
    with recorded_replays() as replayed:
        got, flops = run(remat.checkpoint(region_name="attention")(block))
    assert replayed == ["attention"]
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert flops > backward_flops  # the counter saw the replay's matmuls


def test_a_closure_tensor_modified_in_place_is_still_refused_with_a_dispatch_mode_around_backward():
    from torch.utils.flop_counter import FlopCounterMode

    # a tensor with history made before the checkpoint, read through a closure and
    # modified in place before backward: refused as without the mode
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    table = w * 2

    def f(t):
        return (t * table).sin()

    out = remat.checkpoint(region_name="scaled")(f)(x).sum()
    with torch.no_grad():
        table.mul_(2)
    with pytest.raises(remat.SavedTensorModifiedError, match="scaled"), FlopCounterMode(display=False):
        out.backward()


def test_a_backward_inside_the_forwards_block_replays_as_it_is():
    torch.manual_seed(0)
    x = torch.randn(3, 5, requires_grad=True)

    def in_block(f):
        def run(x):
            with DoubledSine():
                return f(x).square().sum()

        return run

    expected = grads([], [x], in_block(sine))
    x.grad = None
    with DoubledSine(), recorded_replays() as replayed:
        loss = remat.checkpoint(region_name="c")(sine)(x).square().sum()
        loss.backward()
        assert len(torch.overrides._get_current_function_mode_stack()) == 1
    assert replayed == ["c"]
    assert torch.equal(x.grad, expected[1][0])


def test_settings_the_forward_changes_and_resets_itself_replay_exactly():
    torch.manual_seed(0)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)

    def body(t):
        with default_dtype(torch.float64):
            t = scaled(t)
        return t * torch.full((5,), 0.1, dtype=torch.float64)

    expected = grads([], [x], lambda t: body(t).sum())
    actual = grads([], [x], lambda t: remat.checkpoint(region_name="c")(body)(t).sum())
    assert_bitwise_equal(actual, expected)


@contextlib.contextmanager
def oneDNN_matmul_precision(precision):
    # the per-backend switch (torch 2.9+); the legacy getter raises while it differs
    backend = torch.backends.mkldnn.matmul
    before = backend.fp32_precision
    backend.fp32_precision = precision
    try:
        yield
    finally:
        backend.fp32_precision = before


@pytest.mark.skipif(
    not hasattr(torch._C, "_get_fp32_precision_getter"), reason="torch without per-backend fp32 precision"
)
def test_a_per_backend_precision_is_read_and_replayed_without_the_legacy_getter():
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    expected = grads([], [x], forward_only(matmul, lambda: oneDNN_matmul_precision("bf16")))
    actual = grads([], [x], forward_only(remat.checkpoint(region_name="c")(matmul),
                                         lambda: oneDNN_matmul_precision("bf16")))
    assert_bitwise_equal(actual, expected)


@pytest.mark.skipif(
    not hasattr(torch._C, "_get_fp32_precision_getter"), reason="torch without per-backend fp32 precision"
)
def test_the_settings_are_back_exactly_as_the_caller_had_them():
    names = [("generic", "all"), ("mkldnn", "matmul"), ("mkldnn", "conv")]

    def now():
        return [torch._C._get_fp32_precision_getter(b, o) for b, o in names], torch.get_default_dtype()

    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    with recorded_replays() as replayed:
        with matmul_precision("medium"), default_dtype(torch.float64):
            out = remat.checkpoint(region_name="c")(lambda t: scaled(matmul(t)))(x)
        with oneDNN_matmul_precision("none"):  # inherit the generic setting, as untouched
            caller = now()
            out.sum().backward()
            assert now() == caller
    assert replayed == ["c"]  # (the replay ran under the forward's settings, then gave these back)


def test_flushing_denormals_is_back_as_the_caller_had_it_after_the_replay():
    # Before: torch.set_flush_denormal(True) around the forward only was not replayed
    # (gradients off by up to 0.012); read wrongly, it stayed on after the replay
    from torch_remat._compat import SETTING_GETTERS

    def flushing():
        return SETTING_GETTERS[-1]()[1] == 0

    seen = UnseenLog()

    def body(t):
        if remat.is_recomputing():
            seen.append(flushing())
        return through_denormals(t)

    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    x = torch.randn(4, 8, requires_grad=True)
    for forward_flushes in (True, False):
        torch.set_flush_denormal(forward_flushes)
        try:
            out = remat.checkpoint(region_name="c")(body)(x)
        finally:
            torch.set_flush_denormal(False)
        torch.set_flush_denormal(not forward_flushes)
        try:
            out.sum().backward()
            after = flushing()
        finally:
            torch.set_flush_denormal(False)
        assert seen.pop() is forward_flushes
        assert after is (not forward_flushes)


# ------------------------------------------- what a skipped SAVE region's body left set


def _assert_exact_and_grad_mode_back(block, w, x):
    """``block`` checkpointed gives the gradients of ``w`` and ``x`` it gives plain,
    its replay ran, and grad mode is on after the backward."""
    expected = grads([w], [x], block)
    with recorded_replays() as replayed:
        actual = grads([w], [x], remat.checkpoint(region_name="blk")(block))
    assert replayed == ["blk"]
    assert_bitwise_equal(actual, expected)
    assert torch.is_grad_enabled()


def test_grad_mode_a_save_region_leaves_off_is_off_after_it_in_the_replay_too():
    # The body switches grad off and leaves it off; the code after the region runs
    # without grad until it switches grad on. The replay skips the body: before, it
    # ran that code with grad, which saved more tensors of the same shapes, and the
    # saves matched by position handed backward wrong ones (off by 1.2).
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, dtype=torch.float64, generator=g, requires_grad=True)

    def frozen(z):
        torch.set_grad_enabled(False)
        return (z @ w).sin()

    def block(x):
        y = remat.region(frozen, "scorer", recompute=False)(x.exp())
        a = x.cos() * 2  # without grad, in the forward and the replay
        torch.set_grad_enabled(True)
        return (y * x.tanh()).sum() + (x.sin() ** 2).sum() + a.sum()

    x = torch.randn(3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    _assert_exact_and_grad_mode_back(block, w, x)


def test_a_default_dtype_a_save_region_leaves_set_is_set_after_it_in_the_replay_and_given_back():
    def body(z):
        torch.set_default_dtype(torch.float64)
        return z.exp()

    def block(x):
        y = remat.region(body, "s", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        return (y * torch.full((4,), 1.5)).sin().sum()  # float64 in the forward: so is what sin saves

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    try:
        # the forward leaves float64 as the default, with remat or without; so does
        # the backward (the replay ran under the forward's settings, float32 at its
        # entry, and the caller's default is back after it)
        expected = grads([], [x], block)
        assert torch.get_default_dtype() is torch.float64
        torch.set_default_dtype(torch.float32)
        with recorded_replays() as replayed:
            actual = grads([], [x], remat.checkpoint(region_name="dt")(block))
        assert torch.get_default_dtype() is torch.float64
    finally:
        torch.set_default_dtype(torch.float32)
    assert replayed == ["dt"]
    assert_bitwise_equal(actual, expected)


def test_grad_mode_a_save_region_leaves_off_before_raising_is_off_after_it_in_the_replay_too():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 4, dtype=torch.float64, generator=g, requires_grad=True)

    def body(z):
        torch.set_grad_enabled(False)
        raise ValueError("fall back")

    def block(x):
        try:
            remat.region(body, "try", recompute=False)(x)
        except ValueError:
            pass
        a = (x * 3).exp()  # without grad, in the forward and the replay
        torch.set_grad_enabled(True)
        return (x @ w).sin().sum() + a.sum()

    x = torch.randn(4, 4, dtype=torch.float64, generator=g, requires_grad=True)
    _assert_exact_and_grad_mode_back(block, w, x)


SWITCHED_AND_RESET = {
    "default dtype": (lambda: torch.set_default_dtype(torch.float32),
                      lambda: torch.set_default_dtype(torch.float64), torch.get_default_dtype),
    "deterministic algorithms": (lambda: torch.use_deterministic_algorithms(True),
                                 lambda: torch.use_deterministic_algorithms(False),
                                 torch.are_deterministic_algorithms_enabled),
    "float32 matmul precision": (lambda: torch.set_float32_matmul_precision("medium"),
                                 lambda: torch.set_float32_matmul_precision("highest"),
                                 torch.get_float32_matmul_precision),
    "mkldnn enabled": (lambda: setattr(torch.backends.mkldnn, "enabled", False),
                       lambda: setattr(torch.backends.mkldnn, "enabled", True),
                       lambda: torch.backends.mkldnn.enabled),
}


@pytest.mark.parametrize("setting", SWITCHED_AND_RESET)
def test_a_setting_the_forward_switches_and_resets_at_its_end_is_back_after_a_replay_that_stops_early(setting):
    # The replay stops at the last save it needs (early stop), before the forward's
    # own reset: the switch stayed as the replay left it after backward, where the
    # caller's value was the forward's (nothing to give back, it seemed).
    switch, reset, read = SWITCHED_AND_RESET[setting]
    lin = torch.nn.Linear(6, 6, dtype=torch.float64)

    def block(x):
        switch()
        out = lin(x.tanh()).sin()  # the last save: the replay stops here
        reset()
        return out

    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        reset()
        caller = read()
        x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
        expected = grads([lin.weight, lin.bias], [x], lambda t: block(t).pow(2).sum())
        assert read() == caller
        actual = grads([lin.weight, lin.bias], [x],
                       lambda t: remat.checkpoint(region_name="switches")(block)(t).pow(2).sum())
        assert actual.replays == ["switches"]
        assert read() == caller
        assert_bitwise_equal(actual, expected)
    finally:
        reset()
        torch.set_default_dtype(dtype)
