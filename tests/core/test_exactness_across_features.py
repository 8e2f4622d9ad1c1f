"""Exactness of the newer features (saved-tensor hooks, rebuilt saves, module state
the replay reads, threads, the planner): bitwise gradients equal to the run without
remat, or a RematError naming what went wrong."""

import pytest
import torch
from helpers import UnseenLog, kept_bytes, recorded_replays

import torch_remat as remat
from torch_remat.offload import ActivationOffloader

D = torch.float64
KIND = remat.SavedTensorKind


def _x(n=6, seed=0):
    return torch.randn(n, dtype=D, generator=torch.Generator().manual_seed(seed))


def identity_hooks():
    return remat.saved_tensors_hooks(lambda t: t, lambda t: t)


def clone_hooks():
    return remat.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


def offloader_hooks(**kw):
    kw.setdefault("min_bytes", 0)
    off = ActivationOffloader(1 << 20, **kw)
    return remat.saved_tensors_hooks(off.pack_hook, off.unpack_hook)


# Hooks that hand back the tensor they were given (backward would read an in-place
# update: it must raise), and hooks that copy it when it is packed (backward reads
# the copy: exact).
HOOKS = {
    "identity": identity_hooks,
    "clone": clone_hooks,
    "offload-inputs": lambda: offloader_hooks(kinds=[KIND.CHECKPOINT_INPUT]),
    "offload-all": lambda: offloader_hooks(kinds=list(KIND)),
    "offload-all-prefetch0": lambda: offloader_hooks(kinds=list(KIND), prefetch=0),
    "torch-save_on_cpu": torch.autograd.graph.save_on_cpu,
}


# ---------------------------------------------------------------- item 1: version checks under hooks


COPYING = {"clone", "offload-all-prefetch0"}


@pytest.mark.parametrize("hooks", sorted(HOOKS))
def test_a_checkpoint_input_modified_before_backward_raises_or_is_exact_under_any_hooks(hooks):
    # (x * 2) saves nothing of x: only the replay reads it, so only the kept input's
    # version check can notice the in-place update.
    leaf = _x().requires_grad_()
    x = leaf * 1
    with HOOKS[hooks](), recorded_replays() as replayed:
        y = remat.checkpoint(region_name="blk")(lambda t: (t * 2).exp())(x)
    with torch.no_grad():
        x.add_(1)
    if hooks in COPYING:
        y.sum().backward()
        assert replayed == ["blk"]  # from the copy of x the hooks took
        assert torch.equal(leaf.grad, (_x() * 2).exp() * 2)
        return
    with pytest.raises(remat.SavedTensorModifiedError, match="checkpoint input 0 of checkpoint 'blk'"):
        y.sum().backward()


@pytest.mark.parametrize("hooks", sorted(HOOKS))
def test_a_save_region_save_modified_after_the_region_raises_or_is_exact_under_any_hooks(hooks):
    x = _x().requires_grad_()

    def body(t):
        return remat.region(lambda u: u.exp(), "attn", recompute=False)(t)  # saves its output

    with HOOKS[hooks]():
        y = remat.checkpoint(region_name="blk")(body)(x)
    assert "attn" in kept_bytes(y)["blk"]  # the region's save is the checkpoint's
    with torch.no_grad():
        y.mul_(2)
    if hooks in COPYING:
        y.sum().backward()
        assert torch.equal(x.grad, _x().exp())
        return
    with pytest.raises(remat.SavedTensorModifiedError, match="region 'attn' of checkpoint 'blk'"):
        y.sum().backward()


def test_the_offloader_does_not_offload_a_save_modified_before_its_group_moves():
    # prefetch=1: checkpoint 0's saves stay on the device until checkpoint 1 hands
    # over its own; the in-place update happens before that copy.
    off = ActivationOffloader(1 << 20, min_bytes=0)
    x = _x().requires_grad_()

    def body(t):
        return remat.region(lambda u: u.exp(), "attn", recompute=False)(t)

    with remat.saved_tensors_hooks(off.pack_hook, off.unpack_hook):
        a = remat.checkpoint(region_name="c0")(body)(x)
        with torch.no_grad():
            a.mul_(2)
        b = remat.checkpoint(region_name="c1")(body)(a.detach().requires_grad_())
    assert off.stats.offloaded_bytes == {}  # the updated save stayed on the device
    with pytest.raises(remat.SavedTensorModifiedError, match="region 'attn' of checkpoint 'c0'"):
        (a.sum() + b.sum()).backward()


@pytest.mark.parametrize("hooks", sorted(HOOKS))
def test_hooks_without_modification_give_the_gradients_without_remat(hooks):
    def body(t):
        a = remat.region(lambda u: u.exp(), "attn", recompute=False)(t)
        return (a * t * 2).sin()

    def run(ckpt):
        x = _x().requires_grad_()
        fn = remat.checkpoint(region_name="blk")(body) if ckpt else body
        with HOOKS[hooks](), recorded_replays() as replayed:
            y = fn(x)
            y = fn(y)
        y.sum().backward()
        assert replayed == (["blk", "blk"] if ckpt else [])  # sin's result is recomputed
        return x.grad

    assert torch.equal(run(True), run(False))


# ---------------------------------------------------------------- item 3: conjugate and negative views

C = torch.complex128


def _c(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=C, generator=g)


def _complex_grads(body, ckpt, *shapes, replays=1, **options):
    xs = [_c(*s, seed=i).requires_grad_() for i, s in enumerate(shapes)]
    fn = remat.checkpoint(region_name="blk", **options)(body) if ckpt else body
    with recorded_replays() as replayed:
        out = fn(*xs)
    assert list(kept_bytes(out)) == (["blk"] if ckpt else [])
    out = out if out.is_complex() else out.to(C)
    (out.real.sum() + out.imag.square().sum()).backward()
    assert replayed == (["blk"] * replays if ckpt else [])
    return [x.grad for x in xs]


SAVES_OF_CONJUGATES = {
    # each SAVE region saves a conjugate (or negative) view of an argument the replay recomputes
    "conj-mul": lambda a, b: a.conj() * b,
    "mH-matmul": lambda a, b: a.mH @ b,
    "einsum-conj": lambda a, b: torch.einsum("ij,jk->ik", a.conj(), b),
    "neg-imag": lambda a, b: a.conj().imag * b.real,
}


@pytest.mark.parametrize("name", sorted(SAVES_OF_CONJUGATES))
@pytest.mark.parametrize("rebuild", ["free", "always"])
def test_a_save_region_save_that_is_a_conjugate_view_of_a_replayed_argument(name, rebuild):
    op = SAVES_OF_CONJUGATES[name]

    def body(x, y):
        a, b = x * 2, y.sin()  # replayed: the region's saves of them are rebuild candidates
        return remat.region(op, "r", recompute=False)(a, b).sin()

    expected = _complex_grads(body, False, (4, 4), (4, 4))
    # neg-imag saves real views into the complex arguments, which are kept rather
    # than rebuilt: nothing is left to replay.
    replays = 0 if name == "neg-imag" else 1
    got = _complex_grads(body, True, (4, 4), (4, 4), replays=replays, rebuild=rebuild)
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def test_a_kept_save_output_held_through_its_storage_root_keeps_its_conjugate_bit():
    def body(x):
        # the region's output is a conjugate view; the object dies at once, and bare
        # code saves a slice of it, so the checkpoint holds the storage root; the
        # replay recomputes (v * 2) from it
        v = remat.region(lambda u: (u * 2).conj(), "r", recompute=False)(x)[1:]
        return (v * 2).sin() * v

    expected = _complex_grads(body, False, (5,))
    got = _complex_grads(body, True, (5,))
    assert torch.equal(expected[0], got[0])


def test_a_kept_save_output_held_through_its_storage_root_keeps_its_negative_bit():
    def body(x):
        v = remat.region(lambda u: torch._neg_view(u * 2), "r", recompute=False)(x)[1:]
        return (v * 2).sin() * v

    expected = _complex_grads(body, False, (5,))
    got = _complex_grads(body, True, (5,))
    assert torch.equal(expected[0], got[0])


# ---------------------------------------------------------------- item 5: module state besides params and buffers


class Masked(torch.nn.Module):
    """Reads a plain tensor attribute (a per-micro-batch mask), a submodule and
    ``self.training``."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.inner = torch.nn.Linear(6, 6, dtype=D)
        with torch.no_grad():
            self.inner.weight.copy_(torch.randn(6, 6, dtype=D, generator=g))
        self.mask = torch.ones(6, dtype=D)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        h = self.inner(x) * self.mask
        h = h * 2 if self.training else h * 3
        return self.drop(h).sin()


def _mb(i):
    return torch.randn(3, 6, dtype=D, generator=torch.Generator().manual_seed(10 + i)).requires_grad_()


def _mask(i):
    return (torch.arange(6) % (i + 2) != 0).to(D)


def _run_micro_batches(ckpt, between):
    """Two micro-batches, each with its own mask, forward both, then ``between``,
    then backward both; returns the gradients (inner weight, inputs)."""
    torch.manual_seed(0)
    m = Masked()
    fn = remat.checkpoint(region_name="blk", recompute_state_hooks=(remat.CPURNGStateHook(),))(m) if ckpt else m
    outs, xs = [], []
    with recorded_replays() as replayed:
        for i in range(2):
            m.mask = _mask(i)
            xs.append(_mb(i))
            outs.append(fn(xs[-1]))
    weight = m.inner.weight
    between(m)
    for out in reversed(outs):
        out.sum().backward()
    assert replayed == (["blk", "blk"] if ckpt else [])
    return m, [weight.grad] + [x.grad for x in xs]


def _same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"gradient {i} differs"


def test_a_tensor_attribute_rebound_between_forward_and_backward_is_replayed_as_the_forward_saw_it():
    _, expected = _run_micro_batches(False, lambda m: None)
    m, got = _run_micro_batches(True, lambda m: None)  # the mask of micro-batch 1 is set during backward 0
    _same(expected, got)
    assert torch.equal(m.mask, _mask(1))  # the caller's attribute is back after the replay


def test_a_submodule_replaced_between_forward_and_backward_is_replayed_as_the_forward_saw_it():
    new = torch.nn.Linear(6, 6, dtype=D)

    def replace(m):
        m.inner = new

    _, expected = _run_micro_batches(False, replace)
    m, got = _run_micro_batches(True, replace)
    _same(expected, got)
    assert m.inner is new and new.weight.grad is None


def test_eval_between_forward_and_backward_replays_in_training_mode():
    _, expected = _run_micro_batches(False, lambda m: m.eval())
    m, got = _run_micro_batches(True, lambda m: m.eval())
    _same(expected, got)
    assert not m.training and not m.drop.training and not m.inner.training


def test_a_tensor_attribute_updated_in_place_before_backward_raises_naming_it():
    m = Masked()
    y = remat.checkpoint(region_name="blk")(m)(_mb(0))
    with torch.no_grad():
        m.mask.mul_(0)
    with pytest.raises(remat.SavedTensorModifiedError, match="'mask' read by checkpoint 'blk'"):
        y.sum().backward()


# ---------------------------------------------------------------- item 6: threads and the CPU generator

import threading  # noqa: E402

RNG = (remat.CPURNGStateHook(),)


def _dropout_block(between=None, save_region=False):
    """sum(dropout(x) * 3): with x all ones, x.grad is 3 * the forward's mask * 2,
    which the forward's output shows."""

    def body(x):
        if between is not None and not remat.is_recomputing():
            between()  # another thread draws from the CPU generator, in forward only
        if save_region:
            x = remat.recompute_needs_tensor(remat.region(lambda t: t * 1, "pre", recompute=False)(x))
        return torch.nn.functional.dropout(x, 0.5) * 3

    return body


def _exact_or_refused(body):
    x = torch.ones(64, dtype=D, requires_grad=True)
    with recorded_replays() as replayed:
        y = remat.checkpoint(region_name="blk", recompute_state_hooks=RNG)(body)(x)
    try:
        y.sum().backward()
    except remat.RecomputeMismatchError as e:
        return str(e)
    assert replayed == ["blk"]  # the dropout mask is recomputed
    assert torch.equal(x.grad, y.detach()), "the replay drew another dropout mask"
    return None


@pytest.mark.parametrize("save_region", [False, True])
def test_draws_of_another_thread_inside_a_checkpoint_forward_are_refused_not_replayed_wrong(save_region):
    message = _exact_or_refused(_dropout_block(lambda: torch.rand(3), save_region))
    assert message is not None
    assert "checkpoint 'blk'" in message and "CPU generator" in message and "thread" in message


def test_a_checkpoint_without_interleaved_draws_is_exact():
    assert _exact_or_refused(_dropout_block()) is None
    assert _exact_or_refused(_dropout_block(save_region=True)) is None


def test_two_threads_training_with_dropout_get_exact_gradients_or_an_error():
    # thread B draws while thread A is between its checkpoint's entry and its dropout
    a_entered, b_drew = threading.Event(), threading.Event()
    results = {}

    def wait_for_b():
        a_entered.set()
        assert b_drew.wait(10)

    def thread_a():
        try:
            results["a"] = _exact_or_refused(_dropout_block(wait_for_b))
        except AssertionError as e:
            results["wrong"] = str(e)

    def thread_b():
        assert a_entered.wait(10)
        torch.rand(5)
        b_drew.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "wrong" not in results
    assert "a" in results  # thread A finished: exact, or refused with a message
    assert results["a"] is None or "CPU generator" in results["a"]


def test_a_forward_that_draws_after_its_last_save_replays_to_the_end_exactly():
    # rand draws after dropout's mask, the last tensor backward refills: the replay
    # does not stop there (the generator is not where the forward ended) but runs
    # to the end, whose position matches
    ends = UnseenLog()

    def body(x):
        y = torch.nn.functional.dropout(x, 0.5) * 3
        ends.append(remat.is_recomputing())
        return y + torch.rand(64, dtype=D)

    x = torch.ones(64, dtype=D, requires_grad=True)
    y = remat.checkpoint(region_name="blk", recompute_state_hooks=RNG)(body)(x)
    noise_free = y.detach() - y.detach().frac()  # 0 or 6 per element: dropped or kept
    y.sum().backward()
    assert ends == [False, True]  # the replay went past the last save
    assert torch.equal(x.grad, noise_free)  # d(mask * 2 * 3)/dx


def test_the_forward_reads_no_generator_per_save(monkeypatch):
    from torch_remat.engine import rng

    reads = []
    real = rng.hook_fingerprint
    monkeypatch.setattr(rng, "hook_fingerprint", lambda h: reads.append(1) or real(h))

    def body(x):
        for _ in range(20):
            x = x.sin()  # 20 saves
        return torch.nn.functional.dropout(x, 0.5)

    x = torch.ones(64, dtype=D, requires_grad=True)
    remat.checkpoint(region_name="blk", recompute_state_hooks=RNG)(body)(x)
    assert len(reads) == 2  # at the checkpoint's entry and at its end


# ---------------------------------------------------------------- item 4: tensors rebuilding cannot handle


def _sparse_body(x):
    s = (x * 2).to_sparse()  # a sparse COO argument with a grad_fn, produced by replayed code
    return remat.region(lambda a: torch.sparse.mm(a, torch.ones(4, 3, dtype=D)), "r", recompute=False)(s).sum(0)


def _jagged_body(x):
    a = x * 2
    nt = torch.nested.as_nested_tensor([a[:2], a[2:]], layout=torch.jagged)
    return remat.region(lambda n: n.sin().values(), "r", recompute=False)(nt)


@pytest.mark.parametrize("body,shape", [(_sparse_body, (4, 4)), (_jagged_body, (5, 3))], ids=["sparse-coo", "jagged"])
@pytest.mark.parametrize("rebuild", ["free", "always"])
def test_arguments_rebuilding_cannot_handle_are_kept(body, shape, rebuild):
    def run(ckpt):
        x = torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(5)).requires_grad_()
        fn = remat.checkpoint(region_name="blk", rebuild=rebuild)(body) if ckpt else body
        out = fn(x)
        # kept by the region, not rebuilt: nothing is left to replay
        assert list(kept_bytes(out)) == (["blk"] if ckpt else [])
        assert "r" in kept_bytes(out).get("blk", {"r": 0})
        with recorded_replays() as replayed:
            out.sum().backward()
        assert replayed == []
        return x.grad

    assert torch.equal(run(True), run(False))


# ---------------------------------------------------------------- item 8: smaller defects


def test_recompute_needs_tensor_in_a_nested_save_region_keeps_the_output():
    def body(t):
        def outer(u):
            def inner(v):
                w = v.exp()
                remat.recompute_needs_tensor(w)  # the call the error message asks for
                return w

            return remat.region(inner, "inner", recompute=False)(u)

        o = remat.region(outer, "outer", recompute=False)(t)
        return (o + 1).exp()  # bare code that reads o and saves only its own result

    x = _x().requires_grad_()
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="blk")(body)(x)
        assert kept_bytes(out) == {"blk": {"outer": 6 * 8, "outer.inner": 0}}  # o, kept once
        out.sum().backward()
    assert replayed == ["blk"]
    e = (x.detach().exp() + 1).exp()
    assert torch.equal(x.grad, e * x.detach().exp())


def test_checkpointing_a_function_that_returns_a_generator_is_refused():
    x = _x().requires_grad_()
    with pytest.raises(TypeError, match="checkpoint 'gen'.*generator"):
        remat.checkpoint(region_name="gen")(lambda t: (u.exp() for u in [t]))(x)


def test_a_rebuild_candidate_kept_after_all_is_packed_with_the_context_of_its_save():
    step = {"n": 0}
    seen = []

    def pack(t, context):
        info = remat.current_saved_tensor_info()
        seen.append((info.kind, info.region, context))
        return t

    def body(x, y):
        a = x @ y  # replayed code; rebuilding a would replay the matmul: kept after all
        out = remat.region(lambda t: t.sin(), "r", recompute=False)(a)  # sin saves a
        step["n"] = 1  # after the save, before the forward ends
        return out

    x, y = _x().reshape(2, 3).requires_grad_(), _x(seed=1).reshape(3, 2)
    with remat.saved_tensors_hooks(pack, lambda t: t, capture_context=lambda: step["n"]):
        remat.checkpoint(region_name="blk")(body)(x, y).sum().backward()
    assert (KIND.BACKWARD, "r", 0) in seen
    assert not any(kind is KIND.BACKWARD and context == 1 for kind, _, context in seen)


def _context_pack(step, seen):
    def pack(t, context):
        info = remat.current_saved_tensor_info()
        seen.append((info.kind, info.region, context))
        return t

    return remat.saved_tensors_hooks(pack, lambda t: t, capture_context=lambda: step["n"])


def test_a_rebuild_candidate_kept_because_it_reads_an_unkept_output_is_packed_with_the_context_of_its_save():
    step = {"n": 0}
    seen = []

    def body(x):
        p = remat.region(lambda t: t.exp(), "p", recompute=False)(x)  # not kept: nothing reads it again
        a = p * 2  # replayed code on a placeholder: rebuilding a is impossible, kept after all
        out = remat.region(lambda t: t.sin(), "r", recompute=False)(a)  # sin saves a
        step["n"] = 1  # after the save, before the forward ends
        return out

    x = _x().requires_grad_()
    with _context_pack(step, seen):
        remat.checkpoint(region_name="blk", rebuild="always")(body)(x).sum().backward()
    assert (KIND.BACKWARD, "r", 0) in seen
    assert not any(kind is KIND.BACKWARD and context == 1 for kind, _, context in seen)
    e = x.detach().exp()
    assert torch.equal(x.grad, (e * 2).cos() * 2 * e)


@pytest.mark.parametrize("hooks", sorted(HOOKS))
@pytest.mark.parametrize("rebuild", ["free", "always"])
def test_a_rebuild_candidate_modified_after_its_save_raises_in_backward_under_any_hooks(hooks, rebuild):
    # Kept after all because it was modified; packed when the forward ends, after
    # the modification: backward must refuse it, as autograd does without remat,
    # whatever the hooks make of the modified value.
    def body(t):
        a = t * 2  # replayed code: a rebuild candidate
        out = remat.region(lambda u: u.sin(), "r", recompute=False)(a)  # sin saves a
        with torch.no_grad():
            a.add_(1)
        return out

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _plain_modified()  # the same code without remat
    x = _x().requires_grad_()
    with HOOKS[hooks]():
        y = remat.checkpoint(region_name="blk", rebuild=rebuild)(body)(x)
    with pytest.raises(remat.SavedTensorModifiedError, match="SAVE region 'r' of checkpoint 'blk'"):
        y.sum().backward()


def _plain_modified():
    x = _x().requires_grad_()
    a = x * 2
    out = a.sin()
    with torch.no_grad():
        a.add_(1)
    out.sum().backward()  # autograd refuses the modified save


# A SAVE region whose output dies inside the forward: what the region saved is
# reachable only through that output's graph, so it must be freed with it, not when
# the checkpoint's forward returns. The region saves 64 KiB (exp's result); the code
# after it then needs 128 KiB of temporaries at once (repeat, cos of it).
BIG = 4 * 2048 * 8


def _dies_early(use):
    def body(x):
        h = remat.region(lambda t: t.repeat(1, 256).exp().sum(-1), "big", recompute=False)(x)
        if use == "read-by-replay":
            gate = remat.recompute_needs_tensor(h).detach().sigmoid()  # h kept, read as data
        elif use == "consumed-by-a-region":
            gate = remat.region(lambda t: t.detach().sigmoid(), "gate", recompute=True)(h)  # rule 1
        else:
            gate = torch.ones((), dtype=D)  # h is not used at all
        del h
        t = x.repeat(1, 256).cos().sum(-1)  # 128 KiB live at once
        return (t * gate).sum()

    return body


# (An output the checkpoint keeps for its replay, "read-by-replay" and
# "consumed-by-a-region" in _dies_early, still holds its region's graph until the
# forward ends: holding it detached interferes with gradient_checkpoint_scope's
# recording, to be solved separately.)
@pytest.mark.parametrize("use", ["unused"])
def test_a_save_region_whose_output_dies_in_the_forward_frees_its_saves_with_it(memory_probe, use):
    body = _dies_early(use)
    base = _x(32).reshape(4, 8).requires_grad_()
    with memory_probe() as plain:
        loss = body(base)
    loss.backward()
    expected, base.grad = base.grad, None
    with memory_probe() as ckpt, recorded_replays() as replayed:
        loss = remat.checkpoint(region_name="blk")(body)(base)
    loss.backward()
    assert replayed == ["blk"]  # the peaks compare a real checkpoint with the plain run
    assert torch.equal(base.grad, expected)
    assert plain.peak >= 2 * BIG  # the temporaries
    # the uncheckpointed forward frees the region's saves with h; so must remat (the
    # margin is for the checkpoint's own bookkeeping, e.g. a generator-state snapshot)
    assert ckpt.peak < plain.peak + BIG // 2, f"peak {ckpt.peak} B with remat, {plain.peak} B without"
