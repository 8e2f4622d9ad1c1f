"""gradient_checkpoint_scope: what it records, what it replays, and the failure modes
of the original (RETURNN) design, one test each.

Gradients are compared bitwise (float64, CPU) with the same code run without the
scope. Memory is measured in tests/scope/test_scope_memory.py.
"""

import contextlib
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_bitwise_equal, grads

import torch_remat as remat
from torch_remat.scope.hooks import _pack_after_scope, hook_stack

D = torch.float64


def scope_or_not(use):
    return remat.gradient_checkpoint_scope() if use else contextlib.nullcontext()


def replays(fn):
    """Run ``fn`` and count the scope replays it triggers (profiler ranges)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "remat.scope.replay")


def leaves(*shapes):
    return [torch.randn(*s, dtype=D, requires_grad=True) for s in shapes]


# ------------------------------------------------------------------ basic contract


def test_seed_example_saved_after_exit_is_replayed_with_exact_gradients():
    a, b, c = leaves((5,), (5,), (5,))

    def loss(use):
        with scope_or_not(use):
            x = a + b
        y = x * c  # saves x after the scope exited: x is not stored but replayed
        return y.sum()

    expected = grads([a, b, c], [], lambda: loss(False))
    actual = grads([a, b, c], [], lambda: loss(True), scope=True)
    assert_bitwise_equal(actual, expected)
    assert replays(lambda: loss(True).backward()) == 1
    assert hook_stack() == []


def test_saves_inside_the_scope_are_replayed_too():
    a, w = leaves((4, 6), (6, 6))

    def loss(use):
        with scope_or_not(use):
            h = (a @ w).exp().sin()  # exp's result and sin's input are scope tensors
        return h.tanh().sum()

    assert_bitwise_equal(
        grads([a, w], [], lambda: loss(True), scope=True), grads([a, w], [], lambda: loss(False))
    )


@pytest.mark.parametrize("view", ["conj", "conj resolved", "imag of conj (negative bit)"])
def test_conjugate_and_negative_views_are_replayed_with_their_bits(view):
    # a.exp().conj() is a lazy view of exp's storage: the replay rebuilds the view
    # from the storage, and without the bit it read the unconjugated values
    (a,) = [torch.randn(4, 4, dtype=torch.complex128, generator=torch.Generator().manual_seed(5)).requires_grad_()]

    def loss(use):
        with scope_or_not(use):
            e = a.exp()
            c = {"conj": e.conj(), "conj resolved": e.conj().resolve_conj(),
                 "imag of conj (negative bit)": e.conj().imag}[view]
        return ((c * a).abs() if c.is_complex() else c * a.real).sum()

    assert_bitwise_equal(grads([a], [], lambda: loss(True), scope=True), grads([a], [], lambda: loss(False)))
    assert replays(lambda: loss(True).backward()) == 1


def test_dropout_is_replayed_with_the_rng_state_it_saw():
    a, c = leaves((64,), (64,))

    def loss(use):
        with scope_or_not(use):
            x = F.dropout(a.exp(), 0.5) + torch.rand(64, dtype=D)
        return (x * c).sum()

    expected = grads([a, c], [], lambda: loss(False), seed=7)
    after_expected = torch.rand(3)
    actual = grads([a, c], [], lambda: loss(True), seed=7, scope=True)
    # The replay restores the caller's generator afterwards: later draws are unchanged.
    assert torch.equal(torch.rand(3), after_expected)
    assert_bitwise_equal(actual, expected)


def test_autocast_ops_are_replayed_as_recorded():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    params = list(lin.parameters())

    def loss(use):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with scope_or_not(use):
                h = lin(x).relu()
                g = lin(h).softmax(-1)
            out = lin(g)
        return out.float().square().sum()  # backward runs outside autocast

    assert_bitwise_equal(
        grads(params + [x], [], lambda: loss(True), scope=True), grads(params + [x], [], lambda: loss(False))
    )


def test_batchnorm_running_stats_are_updated_once_and_replay_reads_their_old_value():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4, dtype=D)
    x = torch.randn(8, 4, dtype=D, requires_grad=True)
    results = {}
    for use in (False, True):
        bn = torch.nn.BatchNorm1d(4, dtype=D)
        params = list(bn.parameters()) + list(lin.parameters())

        def loss(bn=bn, use=use):
            with scope_or_not(use):
                h = bn(lin(x)).relu()
            return (h * h.sin()).sum()

        results[use] = (
            grads(params + [x], [], loss, scope=use),
            bn.running_mean.clone(),
            bn.running_var.clone(),
        )
    assert_bitwise_equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
    assert torch.equal(results[True][2], results[False][2])


@pytest.mark.parametrize("inplace", [False, True])
def test_an_op_that_fills_an_argument_it_saves_gives_backward_the_filled_value(inplace):
    # rrelu's autograd saves its noise buffer (made by empty_like in the scope) before
    # the op draws into it: backward reads the drawn slopes, and so must the replay
    a, c = leaves((64,), (64,))

    def loss(use):
        with scope_or_not(use):
            x = F.rrelu(a * 1.0, training=True, inplace=inplace)
        return (x * c).sum()

    expected = grads([a, c], [], lambda: loss(False), seed=3)
    actual = grads([a, c], [], lambda: loss(True), seed=3, scope=True)
    assert_bitwise_equal(actual, expected)


def test_a_save_then_a_write_under_no_grad_keeps_the_value_at_the_save():
    # tanh's output is saved after tanh ran, and the very next op writes it in place
    # under no_grad (no autograd node in between): the replay hands back the value
    # tanh gave, as a clone before the write would (the losses differ: the write
    # doubles what sum reads in one run only)
    (a,) = leaves((16,))

    def run(clone_first):
        with remat.gradient_checkpoint_scope():
            y = (a * 1.0).tanh()
            with torch.no_grad():
                (y.clone() if clone_first else y).mul_(2)
        return y.sum()

    written, cloned = (grads([a], [], lambda c=c: run(c), scope=True) for c in (False, True))
    assert written.replays and cloned.replays
    assert torch.equal(written[1][0], cloned[1][0])


def test_an_in_place_op_saving_an_alias_of_what_it_writes_replays_the_value_before_the_write():
    # addcmul_ saves tensor1 (here y itself) before writing y: unlike rrelu's noise,
    # y is the op's returned self, and the scope gives what a clone before the write
    # gives (autograd alone refuses the program)
    a, c = leaves((16,), (16,))

    def run(clone_first):
        with remat.gradient_checkpoint_scope():
            y = a * 2.0
            y.addcmul_(y.clone() if clone_first else y, c)
        return y.sum()

    assert_bitwise_equal(
        grads([a, c], [], lambda: run(False), scope=True), grads([a, c], [], lambda: run(True), scope=True)
    )


def test_eval_batchnorm_replays_with_the_running_stats_of_its_forward():
    # batch norm in training mode updates running stats without a version bump: an
    # eval-mode forward in the scope, then a training-mode one before backward
    torch.manual_seed(0)
    x, c = leaves((6, 6), (6, 6))
    results = {}
    for use in (False, True):
        torch.manual_seed(0)
        bn = torch.nn.BatchNorm1d(6, dtype=D)
        bn(torch.randn(4, 6, dtype=D))  # running stats that are not the initial ones

        def loss(bn=bn, use=use):
            bn.eval()
            with scope_or_not(use):
                y = bn(x)
            bn.train()
            bn(torch.randn(4, 6, dtype=D))  # changes running_mean and running_var in place
            return (y * c).sum()

        results[use] = (grads([x, c], [], loss, seed=1, scope=use), bn.running_mean.clone())
    assert_bitwise_equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


def _weight_noise_then(change):
    # the weight-noise example: the scope reads w, autograd saves only wn (a recipe);
    # ``change(w)`` runs between the forward and backward
    torch.manual_seed(0)
    w, x = leaves((5, 5), (3, 5))
    with remat.gradient_checkpoint_scope():
        wn = w + 0.01 * torch.randn_like(w)
    loss = (x @ wn).sin().sum()
    change(w)
    loss.backward()


def _fused_adam_step(w):
    w.grad = torch.ones_like(w)
    torch.optim.Adam([w], lr=0.1, fused=True).step()  # writes w, its version stays
    w.grad = None


def _data_clamp(w):
    w.data.clamp_(-0.1, 0.1)  # (weight clipping through .data: no version bump)


@pytest.mark.parametrize("change", [_fused_adam_step, _data_clamp], ids=["fused-adam", "data-clamp"])
def test_a_read_tensor_changed_without_a_version_bump_is_refused_not_replayed_stale(change):
    # without the scope wn itself is saved and the gradient is right; the replay would
    # compute wn from the changed w: refused, naming what changes a tensor so
    with pytest.raises(remat.SavedTensorModifiedError, match="without a version bump"):
        _weight_noise_then(change)
    _weight_noise_then(lambda w: None)  # (unchanged: replayed)


def test_a_parameter_read_through_a_view_and_changed_without_a_version_bump_is_refused():
    # nn.Linear without bias: the replayed addmm reads weight.t(), a view (with a
    # grad_fn) of the parameter; its storage is what is checked
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8, bias=False, dtype=D)
    (x,) = leaves((4, 8))
    with remat.gradient_checkpoint_scope():
        h = lin(x)
    loss = h.sin().sum()
    _fused_adam_step(lin.weight)
    with pytest.raises(remat.SavedTensorModifiedError, match="without a version bump"):
        loss.backward()


def test_a_scope_reading_meta_tensors_exits_without_reading_their_data():
    x = torch.randn(4, 8, device="meta", requires_grad=True)
    w = torch.randn(8, 8, device="meta")
    with remat.gradient_checkpoint_scope():
        y = (x @ w).sin()
    assert y.shape == (4, 8) and y.device.type == "meta"


def test_an_inference_tensor_read_then_updated_under_inference_mode_is_refused():
    with torch.inference_mode():
        mean = torch.randn(6, dtype=D)  # a running normaliser
    (a,) = leaves((6,))
    with remat.gradient_checkpoint_scope():
        h = (a - mean).exp()  # sub saves nothing of mean
    y = (h * h.detach()).sum()  # saves h: a recipe
    with torch.inference_mode():
        mean.mul_(0.9)  # inference tensors have no version counter
    with pytest.raises(remat.SavedTensorModifiedError, match="without a version bump"):
        y.backward()


def test_a_batch_norm_forward_after_the_scope_read_its_running_stats_is_refused():
    # conv + batch norm folding: the scope reads running_var in plain ops; the
    # training-mode batch norm after it updates running_var without a version bump
    torch.manual_seed(0)
    w, x = leaves((4, 3, 3, 3), (2, 3, 8, 8))
    bn = torch.nn.BatchNorm2d(4, dtype=D)
    with remat.gradient_checkpoint_scope():
        w_fold = w * (bn.weight / torch.sqrt(bn.running_var + bn.eps)).reshape(-1, 1, 1, 1)
    loss = bn(F.conv2d(x, w_fold)).sin().sum()
    with pytest.raises(remat.SavedTensorModifiedError, match="without a version bump"):
        loss.backward()


def test_an_outside_tensor_written_in_the_scope_and_freed_there_does_not_alias_a_new_one():
    # the written tensor's storage is remembered by address; a new tensor made in the
    # scope after it died could get that address (held now while the scope is open)
    a, c = leaves((6,), (6,))

    def loss(use):
        tmp = torch.zeros(6, dtype=D)
        with scope_or_not(use):
            tmp.add_(1.0)
            del tmp
            x = a.detach().exp() * 2 + a
        return (x * c).sin().sum()

    assert_bitwise_equal(grads([a, c], [], lambda: loss(True), scope=True), grads([a, c], [], lambda: loss(False)))


def test_second_backward_with_retain_graph_replays_again():
    a, c = leaves((5,), (5,))
    with remat.gradient_checkpoint_scope():
        x = a.exp()
    loss = (x * c).sum()
    del x
    loss.backward(retain_graph=True)
    first = a.grad.clone()
    a.grad = None
    loss.backward()
    assert torch.equal(a.grad, first)


def test_under_no_grad_the_scope_just_runs():
    a = torch.randn(3, dtype=D)
    with torch.no_grad(), remat.gradient_checkpoint_scope():
        x = a.exp()
    assert torch.equal(x, a.exp())
    assert hook_stack() == []


def test_inference_tensors_inside_and_around_the_scope():
    with torch.inference_mode():
        buf = torch.randn(5, dtype=D)  # no version counter
    (a,) = leaves((5,))

    def loss(use):
        with scope_or_not(use):
            with torch.inference_mode():
                k = buf * 2  # an inference tensor created in the scope
            x = a.exp() + buf + k.clone()
        return (x * a).sum()

    assert_bitwise_equal(grads([a], [], lambda: loss(True), scope=True), grads([a], [], lambda: loss(False)))
    assert hook_stack() == []


def test_exception_inside_the_scope_leaves_only_what_live_tensors_need():
    (a,) = leaves((5,))
    with pytest.raises(ValueError, match="boom"):
        with remat.gradient_checkpoint_scope():
            x = a.exp()
            raise ValueError("boom")
    assert [p for p, _ in hook_stack()] == [_pack_after_scope]  # x is alive
    del x
    assert hook_stack() == []


def test_sparse_tensor_inside_the_scope_is_refused():
    with pytest.raises(remat.RematError, match="plain dense tensors only.*sparse_coo"):
        with remat.gradient_checkpoint_scope():
            torch.eye(3).to_sparse() * 2
    assert hook_stack() == []


def test_scope_hook_popped_by_someone_else_is_reported_at_exit():
    a = torch.randn(3, dtype=D, requires_grad=True)
    with pytest.raises(remat.RematError, match="removed from the hook stack by someone else"):
        with remat.gradient_checkpoint_scope():
            torch._C._autograd._pop_saved_tensors_default_hooks()  # unbalanced
            x = a.exp()
    del x
    assert hook_stack() == []


def test_set_inside_the_scope_is_refused():
    a = torch.randn(3, dtype=D, requires_grad=True)
    storage = torch.zeros(3, dtype=D).untyped_storage()
    with pytest.raises(remat.RematError, match="set_ is not supported"):
        with remat.gradient_checkpoint_scope():
            torch.empty(0, dtype=D).set_(storage) + a
    assert hook_stack() == []


# ------------------------------------------- failure modes of the original design


def test_inplace_on_scope_output_after_exit_then_saved_gives_correct_gradient():
    # The original design replays x = a + 1 for the save below and so feeds the
    # backward the value before mul_: a silently wrong gradient. Here the in-place
    # change is seen (version counter) and x is stored as it is.
    a, c = leaves((5,), (5,))

    def loss(use):
        with scope_or_not(use):
            x = a + 1
        x.mul_(2)
        return (x * c).sum()

    # x is stored, not replayed
    assert_bitwise_equal(
        grads([a, c], [], lambda: loss(True), scope=True), grads([a, c], [], lambda: loss(False)),
        replays=0,
    )


def test_scope_output_saved_then_modified_in_place_gets_the_value_it_was_saved_with():
    # Without the scope autograd refuses this (x changed after it was saved). The
    # replay recreates the saved value, so the gradient is the correct one: that of
    # the same program with x cloned before the in-place op.
    a, c = leaves((5,), (5,))
    with remat.gradient_checkpoint_scope():
        x = a.exp()
    y = x * c
    x.add_(1)
    y.sum().backward()
    actual = [a.grad.clone(), c.grad.clone()]
    a.grad = c.grad = None
    x = a.exp()
    (x.clone() * c).sum().backward()
    assert torch.equal(actual[0], a.grad) and torch.equal(actual[1], c.grad)


def test_scope_input_modified_in_place_after_the_scope_is_a_clear_error():
    a, c = leaves((5,), (5,))
    base = a * 1
    with remat.gradient_checkpoint_scope():
        x = base.exp()
    loss = (x * c).sum()
    with torch.no_grad():
        base.add_(1)
    with pytest.raises(
        remat.SavedTensorModifiedError, match="read inside gradient_checkpoint_scope"
    ):
        loss.backward()


def test_sibling_scopes_whose_outputs_are_alive_together_are_both_replayed():
    a, b = leaves((5,), (5,))

    def loss(use):
        with scope_or_not(use):
            x1 = a.exp()
        with scope_or_not(use):
            x2 = b.sin()
        return (x1 * x2).sum()  # saves both after both scopes exited

    assert_bitwise_equal(
        grads([a, b], [], lambda: loss(True), scope=True), grads([a, b], [], lambda: loss(False))
    )
    assert replays(lambda: loss(True).backward()) == 2


def test_nested_scopes_keep_hook_bookkeeping_and_later_plain_hooks_work():
    a, c = leaves((5,), (5,))
    packed = []

    def loss(use):
        with scope_or_not(use):
            with scope_or_not(use):
                x = a.exp()
            h = x.sin() * c
        y = (h * x).sum()
        # A plain saved_tensors_hooks block afterwards enters and exits cleanly.
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: packed.append(1) or t.detach(), lambda t: t
        ):
            z = (y * c.sum()).tanh()
        return z

    assert_bitwise_equal(
        grads([a, c], [], lambda: loss(True), scope=True), grads([a, c], [], lambda: loss(False))
    )
    assert hook_stack() == []
    assert packed  # the plain block's hook was the active one inside it


def test_user_hooks_entered_before_the_scope_are_never_popped_by_it():
    a, c = leaves((5,), (5,))
    seen = []

    def pack(t):
        seen.append(tuple(t.shape))
        return t.detach()

    def unpack(t):
        return t

    user = torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def loss(use):
        with user:
            with scope_or_not(use):
                x = a.exp()  # exp saves x: a scope tensor, claimed by the scope
            assert hook_stack()[-1] == (pack, unpack)  # the user's pair is on top again
            y = x * c  # innermost hooks win: the user's hook packs x and c
        if use:
            assert hook_stack() == [(_pack_after_scope, hook_stack()[0][1])]
        return y.sum()

    expected = grads([a, c], [], lambda: loss(False))
    seen.clear()
    # Not counted: whether the scope replays x here depends on when its tensor is
    # freed, which varies with what ran before; this test is about the hook stack.
    actual = grads([a, c], [], lambda: loss(True))
    assert_bitwise_equal(actual, expected, replays=0)
    assert seen == [(5,), (5,)]  # x and c; exp's save of x went to the scope
    assert hook_stack() == []


def test_user_hooks_entered_after_the_scope_apply_inside_their_block_and_pop_their_own_entry():
    a, c = leaves((5,), (5,))
    seen = []

    def pack(t):
        seen.append(tuple(t.shape))
        return t.detach()

    def unpack(t):
        return t

    def loss(use):
        with scope_or_not(use):
            x = a.exp()
        if use:
            assert [p for p, _ in hook_stack()] == [_pack_after_scope]
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            if use:
                assert [p for p, _ in hook_stack()] == [_pack_after_scope, pack]
            y = x * c  # the user's hook is innermost: it packs x (and c)
        z = x.sin()  # back to the scope's hook: x is replayed, not stored
        out = (y + z).sum()
        del x, y, z
        assert hook_stack() == []  # the last scope tensor died: the hook is gone
        return out

    expected = grads([a, c], [], lambda: loss(False))
    seen.clear()
    actual = grads([a, c], [], lambda: loss(True), scope=True)
    assert_bitwise_equal(actual, expected)
    assert seen == [(5,), (5,)]


def test_user_hooks_entered_inside_the_scope_win_inside_their_block():
    a, c = leaves((5,), (5,))
    seen = []
    with remat.gradient_checkpoint_scope():
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: seen.append(1) or t.detach(), lambda t: t
        ):
            x = a.exp()
        y = x * c
    loss = y.sum()
    del x, y
    loss.backward()
    assert seen == [1]
    assert torch.equal(a.grad, a.detach().exp() * c.detach())
    assert hook_stack() == []


def test_two_threads_record_and_replay_independently():
    inputs = [leaves((32,), (32,)) for _ in range(2)]

    def loss(i, use, barrier=None):
        a, c = inputs[i]
        gen = torch.Generator().manual_seed(i)
        with scope_or_not(use):
            if barrier is not None:
                barrier.wait()  # both threads are inside a scope at the same time
            mask = torch.rand(32, dtype=D, generator=gen) > 0.3  # a generator per thread
            x = a.exp() * mask * torch.rand(32, dtype=D, generator=gen)
        out = (x * c).sum()
        if barrier is not None:
            barrier.wait()  # both forwards done before either backward starts
        return out

    expected = [grads(inputs[i], [], lambda i=i: loss(i, False), seed=i) for i in range(2)]
    barrier = threading.Barrier(2, timeout=60)
    results, errors, stacks = [None, None], [], [None, None]

    def worker(i):
        try:
            results[i] = grads(inputs[i], [], lambda: loss(i, True, barrier), seed=i)
            stacks[i] = hook_stack()
        except BaseException as e:  # reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert stacks == [[], []]
    for i in range(2):
        # Not counted: the profiler that counts scope replays cannot run in two
        # threads at once (the tests above count them).
        assert_bitwise_equal(results[i], expected[i], replays=0)
