"""Every misuse gets a clear error: its type and the words that tell the user what
happened and what to do."""

import pytest
import torch
from helpers import UnseenCounter, kept_bytes, recorded_replays

import torch_remat as remat


def _lin(dim=4):
    return torch.nn.Linear(dim, dim, dtype=torch.float64)


def test_checkpoint_called_with_function_shows_right_spelling():
    with pytest.raises(TypeError, match=r"remat\.checkpoint\(region_name=\.\.\.\)\(fn\)\(\*args"):
        remat.checkpoint(torch.sin)


def test_preserve_rng_state_true_is_refused_with_reason():
    with pytest.raises(ValueError) as e:
        remat.checkpoint(preserve_rng_state=True)
    msg = str(e.value)
    assert "preserve_rng_state" in msg and "recompute_state_hooks" in msg and "5 KB" in msg


def test_preserve_rng_state_false_and_use_reentrant_false_are_accepted():
    def fn(t):
        return t.sin().exp()  # exp saves its result, which the checkpoint drops

    x = torch.randn(3, requires_grad=True)
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="c", preserve_rng_state=False, use_reentrant=False)(fn)(x)
        out.sum().backward()
    assert replayed == ["c"]  # accepted as a working checkpoint: backward replays it
    plain = x.detach().requires_grad_()
    fn(plain).sum().backward()
    assert torch.equal(x.grad, plain.grad)


def test_use_reentrant_true_is_refused():
    with pytest.raises(ValueError, match="non-reentrant"):
        remat.checkpoint(use_reentrant=True)


def test_empty_checkpoint_name_is_refused():
    with pytest.raises(ValueError, match="non-empty"):
        remat.checkpoint(region_name="")


def test_empty_region_name_is_refused():
    with pytest.raises(ValueError, match="non-empty"):
        remat.region(torch.sin, "", recompute=False)


def test_non_bool_recompute_is_refused():
    with pytest.raises(TypeError, match="recompute must be True or False"):
        remat.region(torch.sin, "sin", recompute=1)
    with pytest.raises(TypeError, match="recompute must be True or False"):
        remat.region(torch.sin, "sin", recompute=None)


def test_region_first_argument_must_be_callable():
    with pytest.raises(TypeError, match="callable"):
        remat.region("sin", "sin", recompute=False)


def test_bad_state_hook_is_refused():
    with pytest.raises(TypeError, match=r"recompute_state_hooks\[0\].*snapshot\(\) and restore"):
        remat.checkpoint(recompute_state_hooks=(object(),))


def test_same_region_name_twice_in_one_forward():
    def fn(x):
        x = remat.region(torch.sin, "act", recompute=False)(x)
        return remat.region(torch.sin, "act", recompute=False)(x)

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="region name 'act' is used twice.*'blk'"):
        remat.checkpoint(region_name="blk")(fn)(x)


def test_forward_and_recompute_taking_different_paths_names_both_sequences():
    # state remat does not see: a ctypes integer (a list in the closure, or an
    # attribute of a plain object, would be replayed as at entry, and take the
    # same path)
    calls = UnseenCounter()

    def fn(x):
        calls.value += 1
        name = "left" if calls.value == 1 else "right"
        h = remat.region(torch.sin, name, recompute=True)(x)
        return h.exp()

    x = torch.randn(3, requires_grad=True)
    out = remat.checkpoint(region_name="blk")(fn)(x)
    with pytest.raises(remat.RecomputeMismatchError) as e:
        out.sum().backward()
    msg = str(e.value)
    assert "different path" in msg
    assert "Regions in forward: [left (recompute)]" in msg
    assert "regions in the recompute so far: [right (recompute)]" in msg


def test_bare_op_reading_a_placeholder_names_region_and_fix():
    lin = _lin()

    def fn(x):
        h = remat.region(lin, "proj", recompute=False)(x)
        return (h + 1).sin()  # the add reads h during the recompute

    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    out = remat.checkpoint(region_name="layers.3")(fn)(x)
    with pytest.raises(remat.PlaceholderReadError) as e:
        out.sum().backward()
    msg = str(e.value)
    assert "checkpoint 'layers.3'" in msg
    assert "output 0 of SAVE region 'proj'" in msg
    assert "aten.add" in msg
    assert "remat.recompute_needs_tensor(t)" in msg and "before the bare op" in msg


def test_a_dropout_on_an_output_not_kept_names_the_op_that_reads_its_values():
    # dropout makes its mask with empty_like, which reads only the shape; the
    # multiplication after it reads the values (the message named empty_like)
    lin = _lin()

    def fn(x):
        h = remat.region(lin, "proj", recompute=False)(x)
        return torch.nn.functional.dropout(h, 0.3, training=True).sin()

    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    out = remat.checkpoint(region_name="blk", recompute_state_hooks=(remat.CPURNGStateHook(),))(fn)(x)
    with pytest.raises(remat.PlaceholderReadError, match=r"the op aten\.mul\.Tensor read output 0 of SAVE region 'proj'"):
        out.sum().backward()


def test_tensors_made_like_an_output_not_kept_are_replayed_exactly():
    # zeros_like, randn_like, full_like and new_ones take only an output's shape, dtype
    # and device: the replay makes them from the placeholder (it raised before)
    lin = _lin()

    def fn(x):
        h = remat.region(lin, "proj", recompute=False)(x)
        other = (torch.zeros_like(h) + x).pow(2).sum() + (torch.randn_like(h) * x).sin().sum()
        other = other + h.new_ones(3).sum() + torch.full_like(h, 2.0).mul(x).tanh().sum()
        return h, other

    def loss(out):
        return out[0].pow(2).sum() + out[1]

    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(0)
    loss(fn(x)).backward()
    expected = [x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()]
    generator_after = torch.get_rng_state()
    x.grad = lin.weight.grad = lin.bias.grad = None
    torch.manual_seed(0)
    with recorded_replays() as replayed:
        loss(remat.checkpoint(region_name="blk", recompute_state_hooks=(remat.CPURNGStateHook(),))(fn)(x)).backward()
    assert replayed == ["blk"]
    for got, want in zip([x.grad, lin.weight.grad, lin.bias.grad], expected):
        assert torch.equal(got, want)
    assert torch.equal(torch.get_rng_state(), generator_after)


def test_a_factory_reading_the_value_of_an_output_not_kept_names_that_output():
    # randint_like(h, high) reads h's shape only, but high's value: refused, naming
    # the region that made high
    lin = _lin()

    def fn(x):
        h = remat.region(lin, "proj", recompute=False)(x)
        high = remat.region(lambda t: (t.abs().sum() * 10 + 2).long(), "bound", recompute=False)(x)
        drawn = torch.ops.aten.randint_like.Tensor(h, high)
        return h, (drawn.to(x.dtype) * x).sum()

    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    out = remat.checkpoint(region_name="blk", recompute_state_hooks=(remat.CPURNGStateHook(),))(fn)(x)
    with pytest.raises(remat.PlaceholderReadError, match=r"aten\.randint_like\.Tensor read output 0 of SAVE region 'bound'"):
        (out[0].sum() + out[1]).backward()


def test_saved_tensor_modified_in_place_after_save_in_save_region():
    def fn(x):
        y = remat.region(torch.exp, "exp", recompute=False)(x)  # exp saves its result y
        y.add_(1)
        return y + x  # add saves nothing: nothing to recompute

    x = torch.randn(3, requires_grad=True)
    out = remat.checkpoint(region_name="blk")(fn)(x)
    with pytest.raises(remat.SavedTensorModifiedError) as e:
        out.sum().backward()
    assert "saved for backward by SAVE region 'exp' of checkpoint 'blk'" in str(e.value)
    assert "modified in place after it was saved" in str(e.value)


def test_checkpoint_input_modified_after_forward():
    def fn(x):
        return x.sin()

    base = torch.randn(3, requires_grad=True)
    x = base * 1.0
    out = remat.checkpoint(region_name="blk")(fn)(x)
    x.add_(1)
    with pytest.raises(remat.RematError, match="modified by an inplace operation|modified in place"):
        out.sum().backward()


def test_kept_save_output_modified_after_forward_is_refused_by_the_replay():
    # Without saved-tensor hooks a kept tensor is held as it is, with its version.
    outputs = []

    def fn(x):
        y = remat.region(torch.exp, "exp", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        outputs.append(y)
        return (y + 1).sin()  # the replay reads y; nothing saves it

    x = torch.randn(3, requires_grad=True)
    out = remat.checkpoint(region_name="blk")(fn)(x)
    with torch.no_grad():
        outputs.pop().add_(1)  # the kept exp output
    with pytest.raises(
        remat.SavedTensorModifiedError,
        match="output 0 of SAVE region 'exp' of checkpoint 'blk'.*after the forward, before backward",
    ):
        out.sum().backward()


def test_checkpoint_input_modified_in_place_by_the_function():
    def fn(x):
        x.mul_(2)
        return x.sin()

    x = torch.randn(3, requires_grad=True) * 1.0
    with pytest.raises(remat.SavedTensorModifiedError, match="input 0.*modified in place by the checkpointed function"):
        remat.checkpoint(region_name="blk")(fn)(x)


def test_a_save_output_its_own_op_saved_then_updated_in_place_is_refused_in_backward_as_without_remat():
    # exp saves its result: updating it in place makes exp's gradient wrong, which
    # autograd refuses without remat; the SAVE region's kept save says so by name
    def fn(x):
        y = remat.region(torch.exp, "exp", recompute=False)(x)
        remat.recompute_needs_tensor(y)
        y.mul_(2)
        return y.sin()

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fn(x).sum().backward()
    out = remat.checkpoint(region_name="blk")(fn)(x)
    with pytest.raises(remat.SavedTensorModifiedError, match="'saved.0'.*SAVE region 'exp'.*modified in place"):
        out.sum().backward()


def test_recompute_region_nested_in_save_region_is_refused():
    def outer(x):
        return remat.region(torch.sin, "inner", recompute=True)(x)

    def fn(x):
        return remat.region(outer, "outer", recompute=False)(x)

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="'outer.inner'.*nested inside SAVE region 'outer'"):
        remat.checkpoint(region_name="blk")(fn)(x)


def test_save_region_returning_an_opaque_object_is_refused():
    class Box:
        def __init__(self, t):
            self.t = t

    def fn(x):
        return remat.region(lambda t: Box(t.sin()), "boxed", recompute=False)(x).t

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match="SAVE region 'boxed'.*Box.*register_pytree_node"):
        remat.checkpoint(region_name="blk")(fn)(x)


def test_disabled_saved_tensor_hooks_error_carries_user_message():
    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in functorch land"):
        with pytest.raises(remat.RematError, match="disabled.*no hooks in functorch land"):
            remat.checkpoint(region_name="blk")(torch.sin)(x)


def test_recompute_needs_tensor_rejects_non_tensors():
    with pytest.raises(TypeError, match="expects a tensor"):
        remat.recompute_needs_tensor([1, 2])


def test_checkpoint_decorating_a_non_callable():
    with pytest.raises(TypeError, match="callable"):
        remat.checkpoint(region_name="c")(3)


def test_bad_determinism_check_value():
    with pytest.raises(ValueError, match="determinism_check"):
        remat.checkpoint(determinism_check="strict")


def test_region_takes_its_callable_as_function_too_and_refuses_both_spellings():
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def body(t):
        a = remat.region(function=torch.sin, name="sin", recompute=False)(t)
        return remat.region(torch.cos, "cos", recompute=True)(a).sum()

    loss = remat.checkpoint(region_name="layer")(body)(x)
    # the region spelled with function= is a SAVE region of the checkpoint: it keeps sin
    assert "sin" in kept_bytes(loss)["layer"]
    loss.backward()
    assert torch.equal(x.grad, -torch.sin(torch.sin(x.detach())) * torch.cos(x.detach()))
    with remat.collect_trace() as trace:
        remat.region(function=torch.sin, name="sin", recompute=False)(x)
    assert trace.format() == "torch_remat trace\nsin: save"
    with pytest.raises(TypeError, match="got both fn and function"):
        remat.region(torch.sin, "sin", recompute=False, function=torch.cos)
    with pytest.raises(TypeError, match="missing the callable"):
        remat.region(name="sin", recompute=False)


def test_a_lazy_module_first_called_inside_a_checkpoint_is_told_to_run_a_forward_first():
    lazy = torch.nn.LazyLinear(4)
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(remat.SavedTensorModifiedError) as e:
        remat.checkpoint(region_name="lazy")(lazy)(x).sum().backward()
    assert "the parameter 'weight' read by checkpoint 'lazy'" in str(e.value)
    assert "A lazy module (nn.LazyLinear, nn.LazyConv2d) materializes its parameters" in str(e.value)
    # one forward outside first, then checkpointed: exact
    lazy(x)
    expected = torch.autograd.grad(lazy(x).sum(), (x, lazy.weight))
    got = torch.autograd.grad(remat.checkpoint(region_name="lazy")(lazy)(x).sum(), (x, lazy.weight))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


class LookUp(torch.nn.Module):
    """An embedding with max_norm (renormalizes the rows it looks up, in place, in
    every forward) and a Linear after it."""

    def __init__(self, bag: bool):
        super().__init__()
        torch.manual_seed(0)
        cls = torch.nn.EmbeddingBag if bag else torch.nn.Embedding
        self.emb = cls(20, 6, max_norm=1.0)
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, ids):
        return self.lin(self.emb(ids)).tanh()


@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
def test_an_embedding_with_max_norm_is_told_to_renormalize_before_the_checkpoint(bag):
    ids = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(1))
    model = LookUp(bag)
    with pytest.raises(remat.SavedTensorModifiedError) as e:
        remat.checkpoint(region_name="lookup")(model)(ids).sum().backward()
    text = str(e.value)
    assert "the parameter 'emb.weight' read by checkpoint 'lookup'" in text
    assert "nn.Embedding or nn.EmbeddingBag with max_norm" in text
    assert "torch.embedding_renorm_(emb.weight, ids, emb.max_norm, emb.norm_type)" in text
    assert "register it as a buffer" not in text  # (the advice for other parameters)
    # the advice, taken: bitwise what the embedding with max_norm gives without remat
    plain, fixed = LookUp(bag), LookUp(bag)
    expected = torch.autograd.grad(plain(ids).sum(), list(plain.parameters()))
    with torch.no_grad():
        torch.embedding_renorm_(fixed.emb.weight, ids, fixed.emb.max_norm, fixed.emb.norm_type)
    fixed.emb.max_norm = None
    with recorded_replays() as replays:
        got = torch.autograd.grad(
            remat.checkpoint(region_name="lookup")(fixed)(ids).sum(), list(fixed.parameters())
        )
    assert replays == ["lookup"]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert torch.equal(plain.emb.weight, fixed.emb.weight)  # renormalized alike


def test_a_forward_on_dual_tensors_is_named_when_its_replay_differs():
    import torch.autograd.forward_ad as fwAD

    x = torch.randn(3, requires_grad=True)
    f = remat.checkpoint(region_name="dual")(lambda t: t.sin().exp())
    with fwAD.dual_level():
        y = f(fwAD.make_dual(x, torch.ones(3)))
        primal = fwAD.unpack_dual(y).primal
        with pytest.raises(remat.RecomputeMismatchError) as e:
            primal.sum().backward()
    text = str(e.value)
    assert "'dual'" in text and "forward-mode AD dual level" in text
    assert "in separate calls" in text  # what to do instead
