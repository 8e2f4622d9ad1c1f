"""``torch_remat.offload.ActivationOffloader`` on CPU: the CUDA code path with
synchronous copies into the host pool."""

import pytest
import torch
from helpers import assert_bitwise_equal, grads

import torch_remat as remat
from torch_remat.offload import ActivationOffloader

D = torch.float64
B, DIM, K = 16, 32, 5
ACT = B * DIM * 8  # 4096 B: what "attn" and "mlp" each save per checkpoint


def block(x):
    a = remat.region(lambda t: t.mul(2).exp(), "attn", recompute=False)(x)  # saves exp's result
    m = remat.region(lambda t: t.mul(0.5).sin(), "mlp", recompute=False)(a)  # saves t * 0.5
    s = remat.region(lambda t: t[:1].exp(), "tiny", recompute=False)(m)  # 256 B: stays resident
    m, s = remat.recompute_needs_tensor(m, s)
    return m.tanh() + s


def model(x, checkpointed=True, **options):
    for k in range(K):
        fn = remat.checkpoint(region_name=f"layers.{k}", **options)(block) if checkpointed else block
        x = fn(x)
    return x.sum()


def make_input():
    return torch.randn(B, DIM, dtype=D, generator=torch.Generator().manual_seed(0)).requires_grad_()


def offloader(**kw):
    kw.setdefault("pool_bytes", 1 << 20)
    kw.setdefault("min_bytes", 1024)
    kw.setdefault("regions", ["*"])
    return ActivationOffloader(record_events=True, **kw)


def run(off, **options):
    with remat.saved_tensors_hooks(off.pack_hook, off.unpack_hook):
        return grads([], [make_input()], lambda x: model(x, **options))


def test_gradients_are_bitwise_those_without_offloading():
    off = offloader(prefetch=2)
    assert_bitwise_equal(run(off), grads([], [make_input()], lambda x: model(x, checkpointed=False)))


def test_all_but_the_last_k_checkpoints_are_moved_and_come_back_byte_for_byte():
    off = offloader(prefetch=2)
    run(off)
    moved = (K - 2) * ACT
    assert off.stats.offloaded_bytes == {"attn": moved, "mlp": moved}
    assert off.stats.fetched_bytes == {"attn": moved, "mlp": moved}
    assert off.stats.resident_small == K
    assert (off.stats.prefetches, off.stats.sync_fetches) == (2 * (K - 2), 0)


def test_every_prefetch_is_issued_k_checkpoints_before_its_unpack():
    k = 2
    off = offloader(prefetch=k)
    run(off)
    events = off.events
    prefetches = [(i, e) for i, e in enumerate(events) if e.what == "prefetch"]
    assert sorted({e.group for _, e in prefetches}) == list(range(K - k))
    for i, e in prefetches:
        assert e.at - e.group >= k
        first_unpack = next(j for j, u in enumerate(events) if u.what == "unpack" and u.group == e.group)
        assert i < first_unpack
        # backward went through k checkpoint calls between issuing and using it
        reached = {u.group for u in events[i:first_unpack] if u.what == "unpack"}
        assert reached == set(range(e.group + 1, e.at + 1)) and len(reached) >= k


def test_backward_takes_the_checkpoints_in_reverse_order():
    off = offloader(prefetch=1)
    run(off)
    order = []
    for e in off.events:
        if e.what == "unpack" and (not order or order[-1] != e.group):
            order.append(e.group)
    assert order == list(reversed(range(K)))


def test_nothing_is_held_after_backward():
    off = offloader(prefetch=2)
    run(off)
    assert sum(off.stats.offloaded_bytes.values()) > 0  # it held saves during the step
    assert off.held_tensors() == 0
    assert off.pool.in_use_bytes == 0


def test_the_pool_is_reused_across_steps_without_new_buffers():
    off = offloader(prefetch=1)
    run(off)
    created, high = off.pool.buffers_created, off.pool.high_water_bytes
    run(off)
    assert off.pool.buffers_created == created
    assert off.pool.high_water_bytes == high
    assert off.stats.offloaded_bytes["attn"] == 2 * (K - 1) * ACT


def test_a_full_pool_leaves_tensors_resident_and_never_exceeds_its_size():
    off = offloader(prefetch=0, pool_bytes=3 * ACT)
    actual = run(off)
    assert_bitwise_equal(actual, grads([], [make_input()], lambda x: model(x, checkpointed=False)))
    assert off.pool.high_water_bytes <= 3 * ACT
    assert off.pool.high_water_bytes == 3 * ACT
    assert off.stats.resident_pool_full == 2 * K - 3
    assert off.stats.sync_fetches == 3  # prefetch=0: every copy back on unpack


def test_region_patterns_choose_what_moves():
    off = offloader(prefetch=1, regions=["att*"])
    run(off)
    assert off.stats.offloaded_bytes == {"attn": (K - 1) * ACT}


def test_the_offloader_as_a_checkpoint_option():
    off = offloader(prefetch=1)
    actual = grads([], [make_input()], lambda x: model(x, saved_tensors_hooks=off))
    assert_bitwise_equal(actual, grads([], [make_input()], lambda x: model(x, checkpointed=False)))
    assert off.stats.offloaded_bytes["mlp"] == (K - 1) * ACT
    assert off.held_tensors() == 0


def test_a_tensor_comes_back_with_its_strides_and_one_with_gaps_moves_only_its_elements():
    off = offloader(prefetch=0, min_bytes=0)
    permuted = torch.randn(DIM, B, dtype=D).t()
    strided = torch.randn(B, 2 * DIM, dtype=D)[:, ::2]
    column = torch.randn(2 * DIM, B, dtype=D).t()[:, ::2]  # gaps, column-major
    expanded = torch.randn(4 * DIM, B, dtype=D)[::4].unsqueeze(0).expand(2, DIM, B)  # gaps, broadcast
    tensors = (permuted, strided, column, expanded)
    back = [off.unpack_hook(off.pack_hook(t)) for t in tensors]
    for t, b in zip(tensors, back):
        assert b.stride() == t.stride() and torch.equal(b, t)
        assert b.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        assert b._version == 0
    # the host held the elements, not the gaps: the permuted tensor's span and the
    # elements of the others (the broadcast one's twice, as its dense copy has them)
    assert off.stats.offloaded_bytes[""] == (3 * DIM * B + 2 * DIM * B) * D.itemsize


def test_a_tensor_with_gaps_comes_back_spanning_them_and_the_layout_says_how_many_bytes():
    # (what a prefetch puts on the device: the planner counts it, not the host bytes)
    from torch_remat.offload.copies import CopyLayout

    off = offloader(prefetch=0, min_bytes=0)
    dense = torch.randn(B, DIM, dtype=D)
    gates = torch.randn(B, 3 * DIM, dtype=D).chunk(3, 1)  # an RNN cell's gates: gaps
    column = torch.randn(2 * DIM, B, dtype=D).t()[:, ::2]
    expanded = torch.randn(4 * DIM, B, dtype=D)[::4].unsqueeze(0).expand(2, DIM, B)
    for t in (dense, *gates, column, expanded):
        layout = CopyLayout(t)
        back = off.unpack_hook(off.pack_hook(t))
        assert layout.back_nbytes(t.element_size()) == back.untyped_storage().nbytes()
    assert CopyLayout(gates[0]).back_nbytes(8) == ((B - 1) * 3 * DIM + DIM) * 8 > CopyLayout(gates[0]).nbytes(gates[0])


def test_bad_prefetch_is_refused():
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        ActivationOffloader(1024, prefetch=-1)


def test_reports_count_the_host_buffer_of_an_offloaded_save_not_the_offloader():
    off = offloader(prefetch=0)

    def fn(x):
        return remat.region(lambda t: t.mul(2).exp(), "attn", recompute=False)(x).sum()

    with remat.saved_tensors_hooks(off.pack_hook, off.unpack_hook):
        loss = remat.checkpoint(region_name="c")(fn)(make_input())
    report = remat.saved_tensors_report(loss)
    # the 4096 B pool buffer holding exp's result; the checkpoint's input, which the
    # offloader (kinds: BACKWARD only) hands back as is when it is packed at the
    # checkpoint's start, is a leaf that requires grad, held by autograd anyway
    assert report.checkpoint_bytes == ACT
    loss.backward()


def test_the_worked_example_of_the_hooks_page_prints_what_it_quotes(docs_check, capsys):
    text = (docs_check.ROOT / "docs" / "api" / "hooks.md").read_text()
    example = text.split("`ex_hooks.py`", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    torch.manual_seed(0)
    exec(compile(example, "ex_hooks.py", "exec"), {"__name__": "ex_hooks"})
    docs_check.check("hooks-worked-example", capsys.readouterr().out)


@pytest.mark.parametrize("what", ["weight", "activation"])
def test_as_a_block_a_save_it_leaves_resident_is_still_refused_once_modified_in_place(what):
    # Outside checkpoints a hook that hands a tensor back as is loses autograd's
    # version check; the offloader keeps it (optimizer.step() before backward).
    off = ActivationOffloader(1 << 20, prefetch=0)  # min_bytes 1 MiB: all stays resident
    lin = torch.nn.Linear(DIM, DIM, dtype=D)
    x = torch.randn(B, DIM, dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(off.pack_hook, off.unpack_hook):
        e = lin(x).exp()  # exp saves its result; linear its input and weight
        loss = (e * 2).sum()
    with torch.no_grad():
        (lin.weight if what == "weight" else e).add_(1)
    with pytest.raises(remat.SavedTensorModifiedError, match="modified in place"):
        loss.backward()


def test_as_a_block_an_output_saved_for_its_own_backward_and_left_resident_is_freed():
    # exp saves its result: held as is by the pack hook, the result held its own
    # autograd node, which held the save (a cycle the collector cannot see)
    import gc
    import weakref

    off = ActivationOffloader(1 << 20, prefetch=0)  # min_bytes 1 MiB: stays resident
    x = torch.randn(B, DIM, dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(off.pack_hook, off.unpack_hook):
        y = x.exp()
    ref = weakref.ref(y)
    del y  # dropped without a backward (a forward for evaluation only)
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("regions, moved", [(("*",), True), (("*attn*",), False)])
def test_as_a_block_the_offloader_sees_saves_outside_checkpoints_as_region_none(regions, moved):
    off = ActivationOffloader(1 << 20, min_bytes=0, prefetch=0, regions=regions)
    x = torch.randn(B, DIM, dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(off.pack_hook, off.unpack_hook):
        y = x.exp()  # no checkpoint: exp saves its result (kind BACKWARD, region None)
    assert off.stats.offloaded_bytes == ({"": ACT} if moved else {})  # stats key it as ""
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().exp())
