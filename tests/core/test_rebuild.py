"""SAVE regions keep only what the replay cannot rebuild.

A SAVE region's save of a tensor that replayed code produces (a region argument, or
a view of one) is refilled by the replay at the region call instead of being kept.
Sizes are float64 (8, 32) = 2048 B unless said otherwise.
"""

import functools

import pytest
import torch
from helpers import UnseenLog, recorded_replays
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import torch_remat as remat

ROW = 2048  # one (8, 32) float64 tensor


def linear(n_in=32, n_out=32):
    return torch.nn.Linear(n_in, n_out, bias=False, dtype=torch.float64)


def save(fn, name):
    return remat.region(fn, name, recompute=False)


def base_input():
    return torch.randn(8, 32, dtype=torch.float64, requires_grad=True)


def logged(fn, runs):
    """``fn``, appending to ``runs`` (an UnseenLog: the replay's entries stay) at each
    call whether backward is replaying it: a SAVE region's body runs in the forward
    only, a recomputed one in the replay too."""

    def body(*args):
        runs.append(remat.is_recomputing())
        return fn(*args)

    return body


def resident_bytes(memory_probe, fn, base, **opts):
    """Bytes the checkpoint holds after its forward, with a non-leaf input only the
    checkpoint can keep alive; returns (bytes, output, the list that will name the
    checkpoint once backward replays it)."""
    with memory_probe() as probe, recorded_replays() as replayed:
        x = base.clone()
        out = remat.checkpoint(region_name="c", **opts)(fn)(x)
        del x
    return probe.bytes, out, replayed


def assert_same_gradients(fn, base, out, replayed, replays=1):
    """Backward through ``out`` replays the checkpoint ``replays`` times and gives
    the gradients of ``fn`` without remat."""
    out.sum().backward()
    assert replayed == ["c"] * replays
    expected = base.detach().clone().requires_grad_()
    fn(expected.clone()).sum().backward()
    assert torch.equal(base.grad, expected.grad)


def test_save_of_an_argument_computed_by_replayed_code_is_rebuilt_not_kept(memory_probe):
    lin = linear()

    def fn(x):
        h = x.tanh()  # bare code: the replay recomputes h
        return save(lin, "proj")(h)  # the matmul saves h: rebuilt

    base = base_input()
    held, out, replayed = resident_bytes(memory_probe, fn, base)
    # x, kept for the replay; the output. h is neither kept by the region nor by tanh.
    assert held == 2 * ROW
    report = remat.saved_tensors_report(out).checkpoints[0].to_dict()
    assert (report["bytes"], report["rebuilt_bytes"]) == (ROW, ROW)  # holds x, rebuilds h
    assert_same_gradients(fn, base, out, replayed)


def test_view_of_an_argument_saved_by_the_region_is_rebuilt(memory_probe):
    lin = linear()
    runs = UnseenLog()

    def fn(x):
        h = x.exp()  # (8, 32) -> the region reshapes it to (64, 4)... and back
        return save(logged(lambda t: lin(t.view(4, 2, 32)).view(8, 32), runs), "proj")(h)

    base = base_input()
    # The same checkpoint keeping its SAVE region's saves: the view keeps all of h.
    kept = resident_bytes(memory_probe, fn, base, rebuild="never")[0]
    held, out, replayed = resident_bytes(memory_probe, fn, base)
    assert held == 2 * ROW  # x and the output; the saved (4*2, 32) view of h is rebuilt
    assert kept == held + ROW  # ... where keeping the save holds h's storage too
    assert_same_gradients(fn, base, out, replayed)
    assert True not in runs  # the replay refilled the view without running the body


def test_matmul_before_the_checkpoint_does_not_stop_a_rebuild(memory_probe):
    lin, before = linear(), linear()

    def fn(x):
        # Nothing saved outside the region: the replay runs only to rebuild x.neg().
        return save(lin, "proj")(x.neg())

    base = base_input()
    with memory_probe() as probe, recorded_replays() as replayed:
        x = before(base)  # a matmul outside the checkpoint, which the replay never runs
        out = remat.checkpoint(region_name="c")(fn)(x)
        del x
    assert probe.bytes == 2 * ROW  # x, kept for the replay; the output
    report = remat.saved_tensors_report(out).checkpoints[0].to_dict()
    assert (report["bytes"], report["rebuilt_bytes"]) == (ROW, ROW)  # holds x, rebuilds -x
    out.sum().backward()
    assert replayed == ["c"]


def test_internal_activations_of_a_save_region_stay_resident(memory_probe):
    lin1, lin2 = linear(), linear()

    def body(h):
        return lin2(lin1(h).relu())  # saves h (rebuilt), relu's output and lin2's input

    def fn(x):
        return save(body, "mlp")(x.tanh())

    base = base_input()
    held, out, replayed = resident_bytes(memory_probe, fn, base)
    # x; relu's output (lin2 saves it, relu saves it: one storage); the output.
    assert held == 3 * ROW
    assert_same_gradients(fn, base, out, replayed)


def test_nested_save_region_saving_the_outer_argument_is_rebuilt_at_the_outer_call(memory_probe):
    lin1, lin2 = linear(), linear()

    def outer(h):
        a = save(lin1, "inner")(h)  # the inner region saves h, the outer's argument
        return lin2(a)  # saves a: created by the outer body, kept

    def fn(x):
        return save(outer, "outer")(x.tanh())

    base = base_input()
    held, out, replayed = resident_bytes(memory_probe, fn, base)
    assert held == 3 * ROW  # x, a, the output
    assert_same_gradients(fn, base, out, replayed)


def test_save_output_consumed_by_a_later_save_region_is_held_once(memory_probe):
    lin1, lin2 = linear(), linear()

    def fn(x):
        y = save(lin1, "a")(x)  # saves x, a checkpoint input: kept as before
        return save(lin2, "b")(y)  # saves y: y is kept as a's output (rule a); one copy

    base = base_input()
    held, out, replayed = resident_bytes(memory_probe, fn, base)
    assert held == 3 * ROW  # x, y, the output
    assert remat.saved_tensors_report(out).checkpoint_bytes == 2 * ROW  # x and y
    assert_same_gradients(fn, base, out, replayed, replays=0)  # every save kept


def test_replay_stops_exactly_at_the_last_region_whose_saves_it_rebuilds():
    lin = linear()
    log = UnseenLog()

    def mark(name, t):
        if remat.is_recomputing():
            log.append(name)
        return t

    def fn(x):
        a = x.exp()  # saves its result: the last tensor the replay must recreate
        b = mark("b", a * 3)  # saves nothing; the region saves b
        y = save(lambda t: lin(mark("proj", t)), "proj")(b)  # its body: never replayed
        return mark("after", y + 1)  # saves nothing: never replayed

    x = base_input()
    with recorded_replays() as replayed:
        remat.checkpoint(region_name="c")(fn)(x).sum().backward()
    assert replayed == ["c"]
    # b rebuilt for the region's save; the region's body and what follows not run
    assert log == ["b"]


def test_replayed_argument_with_another_layout_raises_mismatch_naming_region_and_argument():
    lin = linear()

    def fn(x):
        # Same values, transposed memory layout in the replay.
        h = (x.t().contiguous() * 1.5).t() if remat.is_recomputing() else x * 1.5
        return save(lin, "proj")(h)

    out = remat.checkpoint(region_name="c")(fn)(base_input())
    with pytest.raises(
        remat.RecomputeMismatchError,
        match=r"argument 0 of SAVE region 'proj' in checkpoint 'c' is .*stride \(1, 8\)",
    ):
        out.sum().backward()


def test_replayed_argument_with_other_bits_raises_under_the_bitwise_check():
    lin = linear()

    def fn(x):
        return save(lin, "proj")(x * (1.25 if remat.is_recomputing() else 1.5))

    out = remat.checkpoint(region_name="c", determinism_check="bitwise")(fn)(base_input())
    with pytest.raises(
        remat.RecomputeMismatchError,
        match="determinism check failed: argument 0 of SAVE region 'proj' in checkpoint 'c'",
    ):
        out.sum().backward()


def test_argument_modified_in_place_after_the_region_is_kept_and_reported():
    lin = linear()

    def fn(x):
        h = x * 2
        y = save(lin, "proj")(h)
        h.add_(1)  # without the checkpoint, backward reports this too
        return y

    out = remat.checkpoint(region_name="c")(fn)(base_input())
    with pytest.raises(remat.SavedTensorModifiedError, match="SAVE region 'proj'"):
        out.sum().backward()


def test_argument_the_replay_cannot_recompute_is_kept(memory_probe):
    lin1, lin2 = linear(), linear()

    def fn(x):
        a = save(lin1, "a")(x)  # a is not kept: no region consumes it, nothing saves it
        h = a + x  # so the replay could not recompute h ...
        return save(lin2, "b")(h)  # ... and b keeps its save of h

    base = base_input()
    held, out, replayed = resident_bytes(memory_probe, fn, base)
    assert held == 3 * ROW  # x (saved by a), h, the output
    assert remat.saved_tensors_report(out).checkpoint_bytes == 2 * ROW  # x and h
    assert_same_gradients(fn, base, out, replayed, replays=0)  # every save kept


def test_argument_whose_replay_needs_a_matmul_is_kept(memory_probe):
    w = torch.randn(32, 32, dtype=torch.float64, requires_grad=True)
    lin = linear()

    def fn(x):
        h = x.exp() @ w  # mm saves its inputs: early stop ends the replay before it
        return save(lin, "proj")(h)  # rebuilding h would replay the mm: h is kept

    base = base_input()
    held, out, replayed = resident_bytes(memory_probe, fn, base)
    assert held == 3 * ROW  # x, h, the output
    assert_same_gradients(fn, base, out, replayed)


def test_without_early_stop_an_argument_whose_replay_needs_a_matmul_is_rebuilt(memory_probe):
    w = torch.randn(32, 32, dtype=torch.float64, requires_grad=True)
    lin = linear()
    runs = UnseenLog()

    def fn(x):
        h = x.exp() @ w  # the full replay runs the mm anyway: rebuilding h is free
        return save(logged(lin, runs), "proj")(h)

    base = base_input()
    with_early_stop = resident_bytes(memory_probe, fn, base)[0]
    held, out, replayed = resident_bytes(memory_probe, fn, base, early_stop=False)
    assert held == 2 * ROW  # x and the output
    assert with_early_stop == held + ROW  # h, kept when early stop would skip the mm
    assert_same_gradients(fn, base, out, replayed)
    assert True not in runs  # the replay refilled h without running the body


def test_rebuild_always_rebuilds_an_argument_whose_replay_needs_a_matmul(memory_probe):
    w = torch.randn(32, 32, dtype=torch.float64, requires_grad=True)
    lin = linear()
    runs = UnseenLog()

    def fn(x):
        h = x.exp() @ w  # the replay now runs the mm, which early stop would skip
        return save(logged(lin, runs), "proj")(h)

    base = base_input()
    free = resident_bytes(memory_probe, fn, base)[0]  # the default, rebuild="free"
    held, out, replayed = resident_bytes(memory_probe, fn, base, rebuild="always")
    assert held == 2 * ROW  # x and the output
    assert free == held + ROW  # h, which the default keeps rather than replay the mm
    assert_same_gradients(fn, base, out, replayed)
    assert True not in runs  # the replay refilled h without running the body


def test_rebuild_never_keeps_the_saves_of_replayed_arguments(memory_probe):
    lin = linear()

    def fn(x):
        return save(lin, "proj")(x.tanh())

    base = base_input()
    held, out, replayed = resident_bytes(memory_probe, fn, base, rebuild="never")
    assert held == 3 * ROW  # x, tanh's output (kept by the region), the output
    assert_same_gradients(fn, base, out, replayed)


def test_unknown_rebuild_choice_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"rebuild must be one of \('free', 'always', 'never'\)"):
        remat.checkpoint(rebuild="all")


def test_each_forward_of_a_branching_function_gets_its_own_rebuild_decision(memory_probe):
    w = torch.randn(32, 32, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    lin = linear()

    def fn(x, use_mm):
        # Both branches create two autograd nodes and save three tensors.
        h = x.exp() @ w if use_mm else x.exp() * scale
        return save(lin, "proj")(h)

    checkpointed = remat.checkpoint(region_name="c")(fn)
    base = base_input()
    for use_mm in (False, True, False, True):
        with memory_probe() as probe:
            x = base.clone()
            out = checkpointed(x, use_mm)
            del x
        # h rebuilt by replaying x.exp() * scale, kept rather than replaying the mm
        assert probe.bytes == (3 if use_mm else 2) * ROW, use_mm
        base.grad = None
        out.sum().backward()
        expected = base.detach().clone().requires_grad_()
        fn(expected.clone(), use_mm).sum().backward()
        assert torch.equal(base.grad, expected.grad)
        del out  # freed before the next probe starts


def test_input_read_only_by_code_backward_never_replays_is_not_kept(memory_probe):
    def fn(x):
        # -x is replayed code, but the region saves only its own result.
        return save(torch.exp, "exp")(-x).sum()

    base = base_input()
    held, out, replayed = resident_bytes(memory_probe, fn, base)
    assert held == ROW + 8  # exp's result and the loss; x is not kept
    assert remat.saved_tensors_report(out).checkpoint_bytes == ROW  # exp's result
    assert_same_gradients(fn, base, out, replayed, replays=0)


def test_rebuilt_saves_are_refilled_again_for_a_second_backward(memory_probe):
    lin = linear()
    runs = UnseenLog()

    def fn(x):
        return save(logged(lin, runs), "proj")(x.tanh())

    base = base_input()
    kept = resident_bytes(memory_probe, fn, base, rebuild="never")[0]
    held, out, replayed = resident_bytes(memory_probe, fn, base)
    assert held == kept - ROW  # tanh(x) is rebuilt, not kept
    loss = out.sum()
    loss.backward(retain_graph=True)
    first = base.grad.clone()
    base.grad = None
    loss.backward()
    assert replayed == ["c", "c"]  # each backward rebuilds tanh(x) for itself
    assert torch.equal(base.grad, first)
    expected = base.detach().clone().requires_grad_()
    fn(expected.clone()).sum().backward()
    assert torch.equal(base.grad, expected.grad)
    # the two forwards and the plain call: neither replay ran the SAVE body, each
    # refilled its save from the recomputed tanh(x)
    assert runs == [False, False, False]


def _mlp_block(ln, fc1, fc2, x):
    return x + fc2(torch.nn.functional.gelu(fc1(ln(x))))


def test_save_regions_around_linears_hold_no_more_bytes_than_sac_saving_mm(memory_probe):
    ln = torch.nn.LayerNorm(32, dtype=torch.float64)
    fc1, fc2 = linear(32, 128), linear(128, 32)

    def remat_block(x):
        h = save(fc1, "fc1")(ln(x))
        return x + save(fc2, "fc2")(torch.nn.functional.gelu(h))

    block = functools.partial(_mlp_block, ln, fc1, fc2)
    context_fn = functools.partial(
        create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]
    )
    base = base_input()
    with memory_probe() as probe:
        x = base.clone()
        sac_out = torch_checkpoint(
            block, x, use_reentrant=False, context_fn=context_fn, preserve_rng_state=False
        )
        del x
    sac_bytes = probe.bytes
    held, out, replayed = resident_bytes(memory_probe, remat_block, base)
    # x (the replay reads it), fc1's output (gelu saves it), the output. SAC also
    # keeps fc2's matmul output.
    assert held == ROW + 4 * ROW + ROW
    assert sac_bytes == held + ROW
    sac_out.sum().backward()
    sac_grad, base.grad = base.grad, None
    out.sum().backward()
    assert torch.equal(base.grad, sac_grad)


class _SaveOutputAliasingArgument(torch.autograd.Function):
    """Saves its own output, a view of its argument (the node then reaches the save)."""

    @staticmethod
    def forward(ctx, a):
        out = a.view_as(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * torch.ones_like(out)


def test_forward_raising_after_a_save_region_frees_its_rebuilt_saves_without_gc():
    import gc
    import weakref

    seen, runs = [], UnseenLog()

    def body(x):
        h = x * 2
        return save(logged(lambda a: _SaveOutputAliasingArgument.apply(a) * 1, runs), "f")(h)

    # The same forward without the raise: the region's save (its output, a view of h)
    # is rebuilt. Backward replays the checkpoint only to refill it (keeping the save,
    # rebuild="never", needs no replay), and the replay does not run the region's body.
    for rebuild, replays in (("never", []), ("free", ["c"])):
        with recorded_replays() as replayed:
            remat.checkpoint(region_name="c", rebuild=rebuild)(body)(base_input()).sum().backward()
        assert replayed == replays, rebuild
    assert runs == [False, False]

    def fn(x):
        out = body(x)
        seen.append(weakref.ref(out.grad_fn.next_functions[0][0]))
        seen.append(remat.active_checkpoint().checkpoint)
        raise ValueError("after the region")

    gc.disable()
    try:
        with pytest.raises(ValueError, match="after the region"):
            remat.checkpoint(region_name="c")(fn)(base_input())
        assert seen[1] == "c"  # the save region ran inside the checkpoint
        # no reference cycle through autograd nodes: plain refcounting frees it
        assert seen[0]() is None
    finally:
        gc.enable()


def test_pack_hooks_of_a_save_kept_after_all_see_a_detached_tensor():
    seen = []

    def pack(t):
        seen.append((t.requires_grad, t.grad_fn))
        return t

    def fn(x):
        h = x @ x.T  # rebuilding h would replay the matmul: the save is kept, not rebuilt
        return save(torch.sin, "s")(h)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        remat.checkpoint(region_name="c")(fn)(base_input())
    # x (the checkpoint's input, packed at its start), then sin's input, kept by the
    # matmul rule and packed when the forward ends
    assert seen == [(False, None), (False, None)]


def test_a_save_modified_after_it_was_saved_is_not_packed_by_hooks_and_backward_raises():
    seen = []

    def fn(x):
        h = x * 2
        y = save(torch.sin, "s")(h)
        h.add_(1)  # modified after the save: the save is kept, not rebuilt
        return y

    x = base_input()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        y = remat.checkpoint(region_name="c")(fn)(x)
    # only the checkpoint's input: packing h now would hand the hook the modified value
    assert len(seen) == 1 and torch.equal(seen[0], x)
    with pytest.raises(remat.SavedTensorModifiedError, match="SAVE region 's' of checkpoint 'c'"):
        y.sum().backward()
