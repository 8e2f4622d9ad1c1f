"""``remat.name_scope``: region names ``prefix/name``, in the replay, in reports and
in traces."""

import pytest
import torch
from helpers import UnseenLog, assert_bitwise_equal, grads

import torch_remat as remat

D = torch.float64


def mlp(x, w):
    h = remat.region(lambda t: (t @ w).exp(), "up", recompute=False)(x)
    return remat.recompute_needs_tensor(h).sin()


def twice(x, w):
    with remat.name_scope("first"):
        h = mlp(x, w)
    with remat.name_scope("second"):
        return mlp(h, w)


def test_one_sub_block_called_twice_gets_two_regions_and_exact_gradients():
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    x = torch.randn(2, 4, dtype=D, requires_grad=True)
    expected = grads([w], [x], lambda x: twice(x, w).sum())
    with remat.collect_trace() as trace:
        actual = grads([w], [x], lambda x: remat.checkpoint(region_name="c")(twice)(x, w).sum())
    assert_bitwise_equal(actual, expected)
    assert trace.format() == "torch_remat trace\nfirst/up: save\nsecond/up: save"


def test_without_name_scope_the_second_call_is_refused():
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    x = torch.randn(2, 4, dtype=D, requires_grad=True)
    with pytest.raises(ValueError, match="region name 'up' is used twice"):
        remat.checkpoint(region_name="c")(lambda x: mlp(mlp(x, w), w))(x)


def test_nested_scopes_join_with_a_slash_and_a_region_body_starts_unscoped():
    names = UnseenLog()

    def inner(t):
        names.append(remat.active_checkpoint().region)
        return t.exp()

    def outer(t):
        return remat.region(inner, "inner", recompute=True)(t)

    def fn(x):
        with remat.name_scope("a"), remat.name_scope("b"):
            return remat.region(outer, "outer", recompute=True)(x)

    x = torch.randn(3, dtype=D, requires_grad=True)
    remat.checkpoint(region_name="c")(fn)(x).sum().backward()
    # forward, then the replay (which runs under the forward's scopes)
    assert names == ["a/b/outer.inner", "a/b/outer.inner"]


def test_a_scope_around_the_checkpoint_call_also_names_the_replay():
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    x = torch.randn(2, 4, dtype=D, requires_grad=True)
    expected = grads([w], [x], lambda x: mlp(x, w).tanh().sum())

    def run(x):
        with remat.name_scope("enc"):
            # tanh's dropped result makes backward replay, through region "enc/up"
            return remat.checkpoint(region_name="c")(lambda x: mlp(x, w).tanh())(x).sum()

    # backward runs outside the scope; the replay must still find region "enc/up"
    actual = grads([w], [x], run)
    assert_bitwise_equal(actual, expected)
    assert actual.replays == ["c"]


def test_reports_show_the_full_region_name():
    w = torch.randn(4, 4, dtype=D, requires_grad=True) * 1  # not leaves: billed
    x = torch.randn(2, 4, dtype=D, requires_grad=True) * 1
    loss = remat.checkpoint(region_name="c")(twice)(x, w).sum()
    report = remat.format_saved_tensors_report(loss)
    lines = report.splitlines()
    # second/up's save of its argument (first's output, through the bare sin) is
    # rebuilt by the replay, so it holds 64 B less than first/up.
    assert "c::first/up: 128 B" in lines and "c::second/up: 64 B" in lines
    loss.backward()


def test_a_prefix_must_be_a_non_empty_string():
    with pytest.raises(ValueError, match="prefix must be a non-empty string, got ''"):
        with remat.name_scope(""):
            pass
    with pytest.raises(TypeError, match="prefix must be a string, got int"):
        with remat.name_scope(3):
            pass
