"""Edge cases: closure tensors modified in place, partial backwards, regions that
raise, inputs read through arguments of later regions, nested checkpoints, and
offloading hooks around a checkpoint."""

import copy
import gc
import weakref

import pytest
import torch
from helpers import assert_bitwise_equal, grads, recorded_replays

import torch_remat as remat

R = remat.region


def test_closure_tensor_modified_after_forward_is_an_error_not_a_wrong_gradient():
    b = torch.ones(3, dtype=torch.float64)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = remat.checkpoint(region_name="ck")(lambda x: x * b)(x)  # mul saves b
    b.add_(1)
    # Checked before the replay runs: the closure is known to the checkpoint.
    with pytest.raises(remat.SavedTensorModifiedError, match="closure variable 'b'.*version 0 -> 1"):
        y.sum().backward()


def _retained_elements(frame_holders):
    frames = {id(h.frame): h.frame for h in frame_holders}
    return sum(
        t.numel() for f in frames.values() for store in f.recreated.values()
        for t, _ in store.tensors.values()
    )


def test_partial_backwards_with_retain_graph_do_not_accumulate_recomputed_tensors():
    x = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    holders = []
    real_pack = remat.engine.frame.CheckpointFrame.__call__  # the frame is its pack hook

    def spy(self, t):
        packed = real_pack(self, t)
        holders.append(packed)
        return packed

    remat.engine.frame.CheckpointFrame.__call__ = spy
    try:
        with recorded_replays() as replayed:
            y = remat.checkpoint(region_name="ck")(lambda x, w: ((x * 1.5).sin() * w).cos())(x, w)
    finally:
        remat.engine.frame.CheckpointFrame.__call__ = real_pack
    for i in range(3):
        torch.autograd.grad(y.sum(), inputs=[w], retain_graph=True)
        assert replayed == ["ck"] * (i + 1)
        assert _retained_elements(holders) == 0


def test_a_save_region_that_raises_and_is_caught_replays_the_fallback():
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def fast_kernel(t):
        raise NotImplementedError("no fast kernel for this shape")

    def f(x):
        try:
            y = R(fast_kernel, "attn", recompute=False)(x)
        except NotImplementedError:
            y = (x @ w).exp()
        return y.sin()

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    expected = grads([w], [x], lambda x: f(x).sum())
    actual = grads([w], [x], lambda x: remat.checkpoint(region_name="ck")(f)(x).sum())
    assert_bitwise_equal(actual, expected)


def test_input_read_by_bare_code_feeding_a_later_save_region_is_kept():
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def f(x):
        a = R(lambda t: t @ w, "A", recompute=False)(x)
        h = (x * 2).sin()  # bare read of x, result only reaches the output through B
        return R(lambda u, v: u * v, "B", recompute=False)(a, h)

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    expected = grads([w], [x], lambda x: f(x).sum())
    actual = grads([w], [x], lambda x: remat.checkpoint(region_name="ck")(f)(x).sum())
    assert_bitwise_equal(actual, expected)


def test_outer_save_output_read_only_by_an_inner_checkpoints_save_region():
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def inner(y):
        return R(lambda t: (t + w).exp(), "B", recompute=False)(y).sin()

    def outer(x):
        y = R(lambda t: (t @ w).tanh(), "A", recompute=False)(x)
        return remat.checkpoint(region_name="inner")(inner)(y).cos()

    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    expected = grads([w], [x], lambda x: outer(x).sum())
    actual = grads([w], [x], lambda x: remat.checkpoint(region_name="outer")(outer)(x).sum())
    assert_bitwise_equal(actual, expected)


def test_nested_checkpoints_free_everything_after_each_step():
    w = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)

    def inner(t):
        return R(lambda u: (u @ w).exp(), "A", recompute=False)(t).sin()

    def outer(x):
        return remat.checkpoint(region_name="inner")(inner)(x.cos())

    def frames():
        return sum(type(o).__name__ == "CheckpointFrame" for o in gc.get_objects())

    gc.collect()
    before = frames()
    for _ in range(3):
        x = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
        out = remat.checkpoint(region_name="outer")(outer)(x).sum()
        assert frames() > before  # the count sees the frames a step holds
        out.backward()
        del out
    gc.collect()
    assert frames() == before


def _storage_alive(ptr):
    for o in gc.get_objects():
        if type(o) is torch.Tensor and not o.is_meta:
            try:
                if o.untyped_storage().data_ptr() == ptr:
                    return True
            except RuntimeError:  # tensors without storage left by other tests
                continue
    return False


def test_copying_hooks_around_a_checkpoint_hold_the_only_copy_of_kept_inputs():
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def f(x):
        h = R(lambda t: (t @ w).exp(), "A", recompute=True)(x)
        return (x * h).sin()  # mul saves x, a kept input

    x0 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    x = x0 * 1.0
    x.add_(1)  # an input at version 1
    ptr = x.untyped_storage().data_ptr()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t), recorded_replays() as replayed:
        out = remat.checkpoint(region_name="c")(f)(x)
    del x
    gc.collect()
    assert not _storage_alive(ptr)  # only the hook's clone is kept, as without remat
    out.sum().backward()
    assert replayed == ["c"]  # the replay read the clone
    got = x0.grad.clone()
    x0.grad = None
    x = x0 * 1.0
    x.add_(1)
    f(x).sum().backward()
    assert torch.equal(got, x0.grad)



def test_a_key_value_cache_passed_by_position_is_dropped_like_one_passed_by_keyword(caplog, monkeypatch):
    # GPT-2's model passes its DynamicCache as each block's second positional
    # argument. Only keyword caches were dropped, so the forward and the replay
    # both appended to it: after backward every layer held its 8 keys twice.
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from torch_remat.integrations import apply_remat

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, use_cache=True)
    model = transformers.GPT2LMHeadModel(config)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 8))
    assert reference(ids).past_key_values.get_seq_length() == 8  # the cache without remat
    # the blocks run without a cache (with one, GPT-2's own gradients differ in the
    # last bits: its attention reads the keys back from the cache)
    reference.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    reference(ids, use_cache=False).logits.sum().backward()
    apply_remat(model, auto_wrap_policy={GPT2Block})
    from torch_remat.integrations import _forwards

    monkeypatch.setattr(_forwards, "_dropped_cache_said", [False])
    torch.manual_seed(1)
    with recorded_replays() as replays, caplog.at_level("WARNING", logger="torch_remat"):
        out = model(ids)
        out.logits.sum().backward()
    assert replays == ["transformer.h.1", "transformer.h.0"]
    # said once (two blocks dropped it), with how to compare bitwise
    said = [r.getMessage() for r in caplog.records if "drops its key/value cache" in r.getMessage()]
    assert len(said) == 1 and "model.config.use_cache = False" in said[0]
    # no block filled it, as under transformers' own gradient checkpointing
    assert all(layer.keys is None or layer.keys.numel() == 0 for layer in out.past_key_values.layers)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_key_value_cache_a_replay_extends_is_freed_after_the_step():
    # A GPT-2 block checkpointed directly (not through apply_remat, which drops the
    # cache) and given a DynamicCache: the forward and the replay both extend it
    # with tensors the loss never reaches. The replay's saved tensors kept its pack
    # hook, so the pass, the frame and its arguments (the cache among them) alive:
    # a cycle through autograd that Python's collector cannot see.
    transformers = pytest.importorskip("transformers")
    from transformers.cache_utils import DynamicCache
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, attn_pdrop=0.0, resid_pdrop=0.0)
    config._attn_implementation = "sdpa"
    block = GPT2Block(config, layer_idx=0)
    h = torch.randn(2, 8, 32, requires_grad=True)
    cache = DynamicCache(config=config)
    with recorded_replays() as replays:
        out = remat.checkpoint(region_name="h.0")(block)(h, cache, None, use_cache=True)
        out.sum().backward()
    assert replays == ["h.0"]
    alive = weakref.ref(cache)
    del cache, out
    gc.collect()
    assert alive() is None
