"""torch's checkpoint, plain or selective (SAC, ``context_fn``), nested inside remat:
inside a ``remat.checkpoint``, inside a SAVE region, under ``remat.saved_tensors_hooks``
and inside a ``gradient_checkpoint_scope``.

From torch 2.15 SAC asks which saved-tensor hooks are the user's, to route the
tensors it caches through them (``respect_saved_tensors_hooks``; a
``FutureWarning`` while the option is left unset). remat's own hooks are not the
user's: a nested checkpoint gives exact gradients, the same saved bytes and no
warning under every value of the option; the user's torch hooks around the remat
checkpoint are still the user's."""

import functools
import inspect
import warnings

import pytest
import torch
from helpers import GradResult, assert_bitwise_equal, grads, recorded_replays
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import torch_remat as remat

D = torch.float64
N = 16
TENSOR_BYTES = N * N * 8

# The option exists from torch 2.15; before, a nested checkpoint takes no such argument.
HAS_RESPECT = "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
RESPECT = [None, True, False] if HAS_RESPECT else ["absent"]


def _keep_mm(ctx, op, *args, **kwargs):
    if op is torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _inner(x, w):
    return (x @ w).sin() @ w


def _torch_checkpoint(x, w, kind, respect):
    options = {} if respect == "absent" else {"respect_saved_tensors_hooks": respect}
    if kind == "sac":
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_mm)
    return checkpoint(_inner, x, w, use_reentrant=False, **options)


def _identity_pair():
    return (lambda t: t), (lambda t: t)


def _model(nesting, kind, respect):
    """The step ``loss(x, w)`` for one nesting, and the bytes of what remat keeps: in
    a SAVE region its output (read by the replay). The checkpoint's inputs x and w are
    leaves that require grad, which autograd holds anyway: not billed, as parameters
    are not. torch's holders and SAC's cache are not remat's to count."""
    nested = functools.partial(_torch_checkpoint, kind=kind, respect=respect)

    def body(x, w):
        if nesting == "save_region":
            y = remat.region(lambda a: nested(a, w), "sac", recompute=False)(x)
            remat.recompute_needs_tensor(y)
        elif nesting == "hooks_inside":
            with remat.saved_tensors_hooks(*_identity_pair()):
                y = nested(x, w)
        else:
            y = nested(x, w)
        return y.tanh().sum()

    ck = remat.checkpoint(region_name="outer")(body)
    if nesting == "hooks_around":
        def step(x, w):
            with remat.saved_tensors_hooks(*_identity_pair()):
                return ck(x, w)
        return step, 0
    if nesting == "scope":
        def step(x, w):
            with remat.gradient_checkpoint_scope():
                y = nested(x, w)
            return y.tanh().sum()
        # the scope's output y is stored by tanh (no checkpoint keeps anything)
        return step, TENSOR_BYTES
    return ck, (1 if nesting == "save_region" else 0) * TENSOR_BYTES


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, N, dtype=D, generator=g, requires_grad=True)
    w = torch.randn(N, N, dtype=D, generator=g, requires_grad=True)
    return x, w


def _reference():
    x, w = _inputs()
    return grads([], [x, w], lambda x, w: _inner(x, w).tanh().sum())


class _Step:
    """One step: forward, the saved bytes report, backward; FutureWarnings recorded."""

    def __init__(self, step):
        self.x, self.w = _inputs()
        with warnings.catch_warnings(record=True) as caught, recorded_replays() as replayed:
            warnings.simplefilter("always")
            loss = step(self.x, self.w)
            self.saved_bytes = remat.saved_tensors_report(loss).total_bytes
            loss.backward()
        self.result = GradResult((loss.detach(), [self.x.grad, self.w.grad]))
        self.result.replays = list(replayed)
        self.future_warnings = [str(w.message) for w in caught if w.category is FutureWarning]


@pytest.mark.parametrize("respect", RESPECT)
@pytest.mark.parametrize("kind", ["sac", "plain"])
@pytest.mark.parametrize(
    "nesting", ["checkpoint", "save_region", "hooks_around", "hooks_inside", "scope"]
)
def test_torch_checkpoint_nested_inside_remat_is_exact_with_remats_bytes_and_no_warning(
    nesting, kind, respect
):
    step, expected_bytes = _model(nesting, kind, respect)
    result = _Step(step)
    # the scope nesting replays a scope, not a checkpoint: none is listed
    assert_bitwise_equal(result.result, _reference(), replays=0 if nesting == "scope" else None)
    assert result.saved_bytes == expected_bytes
    assert result.future_warnings == []


def test_sac_after_a_scope_exited_while_its_tensors_live_gets_no_warning():
    # The scope's hook stays at the bottom of the stack while a tensor it created
    # lives; it is remat's, not the user's.
    x, w = _inputs()
    with remat.gradient_checkpoint_scope():
        h = x.sin()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = _torch_checkpoint(h, w, "sac", RESPECT[0])
        (y * h).sum().backward()
    assert [w for w in caught if w.category is FutureWarning] == []
    hx, hw = _inputs()
    hh = hx.sin()
    expected = torch.autograd.grad((_inner(hh, hw) * hh).sum(), [hx, hw])
    assert torch.equal(x.grad, expected[0]) and torch.equal(w.grad, expected[1])


class _Recorder:
    """torch hooks that record the storages they pack."""

    def __init__(self):
        self.packed = []

    def pack(self, t):
        self.packed.append(t.untyped_storage().data_ptr())
        return t

    def unpack(self, t):
        return t


def _mm_outputs_recorded(respect, around):
    """Runs SAC inside a remat checkpoint under ``around(recorder)``: how many of
    the two mm outputs SAC caches reached the recorder, the FutureWarnings, the
    result."""
    recorder = _Recorder()
    mm_outputs = []

    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.mm.default:
            if not ctx.is_recompute and not remat.is_recomputing():
                mm_outputs.append(ctx.op_output.untyped_storage().data_ptr())
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def body(x, w):
        y = checkpoint(
            _inner, x, w, use_reentrant=False, respect_saved_tensors_hooks=respect,
            context_fn=functools.partial(create_selective_checkpoint_contexts, policy),
        )
        return y.tanh().sum()

    x, w = _inputs()
    with warnings.catch_warnings(record=True) as caught, recorded_replays() as replayed:
        warnings.simplefilter("always")
        with around(recorder):
            loss = remat.checkpoint(region_name="outer")(body)(x, w)
        loss.backward()
    assert len(mm_outputs) == 2
    reached = sum(p in recorder.packed for p in mm_outputs)
    future = [w for w in caught if w.category is FutureWarning]
    result = GradResult((loss.detach(), [x.grad, w.grad]))
    result.replays = list(replayed)
    return reached, len(future), result


def _torch_hooks(recorder):
    return torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack)


def _remat_hooks(recorder):
    return remat.saved_tensors_hooks(recorder.pack, recorder.unpack)


@pytest.mark.skipif(not HAS_RESPECT, reason="torch before 2.15 has no respect_saved_tensors_hooks")
@pytest.mark.parametrize(
    ("respect", "reached", "warned"), [(None, 0, 2), (True, 2, 0), (False, 0, 0)]
)
def test_sac_inside_remat_takes_the_users_torch_hooks_around_the_checkpoint(
    respect, reached, warned
):
    # torch's hooks around the remat checkpoint are the user's: SAC warns about them
    # (once per tensor it caches in forward; the replay runs outside them), and with
    # the option set routes its cache through them as it would without remat.
    result = _mm_outputs_recorded(respect, _torch_hooks)
    assert result[:2] == (reached, warned)
    assert_bitwise_equal(result[2], _reference())


@pytest.mark.skipif(not HAS_RESPECT, reason="torch before 2.15 has no respect_saved_tensors_hooks")
@pytest.mark.parametrize("respect", [None, True, False])
def test_sac_inside_remat_does_not_route_its_cache_through_remat_saved_tensors_hooks(respect):
    # Inside a checkpoint the pair sees only what remat keeps; SAC's cache is torch's.
    result = _mm_outputs_recorded(respect, _remat_hooks)
    assert result[:2] == (0, 0)
    assert_bitwise_equal(result[2], _reference())
