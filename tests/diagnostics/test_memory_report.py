"""remat.print_current_memory_report and remat.save_for_backward."""

import io
import re

import torch
from helpers import UnseenLog

import torch_remat as remat


class Softmax(torch.autograd.Function):
    """Saves two named tensors: lse (3,) and probs (4,)."""

    @staticmethod
    def forward(ctx, s):
        lse = s.logsumexp(-1)
        probs = s.sum(0).softmax(0)
        remat.save_for_backward(ctx, lse=lse, probs=probs)
        return probs

    @staticmethod
    def backward(ctx, g):
        lse, probs = ctx.saved_tensors
        gs = probs * (g - (g * probs).sum())
        return gs.expand(3, 4).clone()


def attn(s):
    return remat.region(Softmax.apply, "softmax", recompute=False)(s)


def run_and_report(fn, *args, region_name="layers.0"):
    """Run ``fn`` in a checkpoint; return (output, report text taken at its end)."""
    reports = []

    def body(*a):
        out = fn(*a)
        if not remat.is_recomputing():
            reports.append(remat.format_current_memory_report())
        return out

    out = remat.checkpoint(region_name=region_name)(body)(*args)
    return out, reports[0]


def test_report_inside_forward_matches_the_readme():
    s = torch.randn(3, 4, requires_grad=True)
    printed = io.StringIO()

    def layer(s):
        p = remat.region(attn, "attn", recompute=False)(s)
        if not remat.is_recomputing():
            remat.print_current_memory_report(file=printed)
        return p * 2

    out = remat.checkpoint(region_name="layers.0")(layer)(s)
    assert printed.getvalue() == (
        "layers.0: 28 B resident in 2 storage(s)\n"
        "layers.0::attn.softmax: 28 B\n"
        "  12 B  lse    (3,)  float32\n"
        "  16 B  probs  (4,)  float32\n"
    )
    out.sum().backward()
    ref = s.detach().clone().requires_grad_()
    (Softmax.apply(ref) * 2).sum().backward()
    assert torch.equal(s.grad, ref.grad)


def _row_bytes(line):
    m = re.match(r"^\s+(\d+) B  ", line)
    return int(m.group(1)) if m else 0


def test_header_equals_the_sum_of_the_rows():
    def block(x, w):
        h = remat.region(lambda t: (t @ w).relu(), "mm", recompute=False)(x)
        g = remat.region(lambda t: t * t, "sq", recompute=False)(h)
        remat.recompute_needs_tensor(g)
        return (g + x[:, :2]).sigmoid()

    # computed, not leaves: a leaf that requires grad is autograd's, not billed
    x0, w0 = torch.randn(4, 3, requires_grad=True), torch.randn(3, 2, requires_grad=True)
    x, w = x0 * 1, w0 * 1
    out, text = run_and_report(block, x, w)
    lines = text.splitlines()
    total = int(re.match(r"layers\.0: (\d+) B resident in 4 storage\(s\)$", lines[0]).group(1))
    regions = []
    for line in lines[1:]:
        m = re.match(r"^layers\.0::\S+: (\d+) B$", line)
        if m:
            regions.append([int(m.group(1)), 0])
        else:
            regions[-1][1] += _row_bytes(line)
    assert [header for header, _ in regions] == [rows for _, rows in regions] == [104, 32]
    assert total == 136
    # h is saved by "mm" (its output) and twice by "sq": one storage, counted once
    assert text == (
        "layers.0: 136 B resident in 4 storage(s)\n"
        "layers.0::mm: 104 B\n"
        "  24 B  saved.0                    (3, 2)  float32\n"
        "  48 B  saved.1                    (4, 3)  float32\n"
        "  32 B  saved.2 (output at idx 0)  (4, 2)  float32\n"
        "layers.0::sq: 32 B\n"
        "  shared  saved.0, saved.1 (counted in mm)  (4, 2)  float32\n"
        "    32 B  (output at idx 0)                 (4, 2)  float32"
    )
    out.sum().backward()
    assert x0.grad is not None and w0.grad is not None


def test_same_tensor_twice_joins_names_and_a_view_is_marked():
    def gram(t):
        y = t.exp()  # saves its result y
        return y @ y.t()  # saves the view y.t() (saved.1) and y again (saved.2)

    x = torch.randn(3, 2, requires_grad=True)
    _, text = run_and_report(lambda x: remat.region(gram, "gram", recompute=False)(x), x)
    assert text == (
        "layers.0: 24 B resident in 1 storage(s)\n"
        "layers.0::gram: 24 B\n"
        "  24 B  saved.0, saved.2  (3, 2)  float32\n"
        "  view  saved.1           (2, 3)  float32"
    )


def test_the_same_view_saved_twice_joins_one_row_also_when_it_is_not_the_storages_first():
    def gram_of_view(t):
        y = t.exp()  # saves its result y (the storage's first row)
        v = y.t()
        return v * v  # saves the view v twice: one row after y's

    x = torch.randn(3, 2, requires_grad=True)
    _, text = run_and_report(lambda x: remat.region(gram_of_view, "g", recompute=False)(x), x)
    assert text == (
        "layers.0: 24 B resident in 1 storage(s)\n"
        "layers.0::g: 24 B\n"
        "  24 B  saved.0           (3, 2)  float32\n"
        "  view  saved.1, saved.2  (2, 3)  float32"
    )


def test_kept_inputs_and_kept_outputs_are_listed():
    def block(x):
        h = remat.region(torch.exp, "exp", recompute=False)(x)  # saves its result h
        return (h * x).sum()  # bare code saves h and x: both kept for the recompute

    leaf = torch.randn(2, 2, requires_grad=True)
    x = leaf * 1  # computed: a leaf that requires grad is autograd's, not billed
    out, text = run_and_report(block, x)
    assert text == (
        "layers.0: 32 B resident in 2 storage(s)\n"
        "layers.0::(inputs): 16 B\n"
        "  16 B  (input 0)  (2, 2)  float32\n"
        "layers.0::exp: 16 B\n"
        "  16 B  saved.0 (output at idx 0)  (2, 2)  float32"
    )
    out.backward()
    assert torch.equal(leaf.grad, (x.detach().exp() * x.detach() + x.detach().exp()))


def test_parameters_are_not_listed():
    lin = torch.nn.Linear(3, 2)

    def block(x):
        return remat.region(lin, "lin", recompute=False)(x).tanh()

    _, text = run_and_report(block, torch.randn(4, 3))
    # addmm saves the input and weight.t(), a view of a parameter
    assert text == (
        "layers.0: 48 B resident in 1 storage(s)\n"
        "layers.0::lin: 48 B\n"
        "  48 B  saved.0  (4, 3)  float32"
    )


def test_outside_a_checkpoint_and_during_recompute_it_says_so():
    assert remat.format_current_memory_report().startswith(
        "torch_remat: no checkpoint forward is running in this thread"
    )
    seen = UnseenLog()

    def block(x):
        seen.append(remat.format_current_memory_report())
        return x.exp().sin()  # the dropped exp() makes backward recompute

    x = torch.randn(2, requires_grad=True)
    remat.checkpoint(region_name="layers.7")(block)(x).sum().backward()
    assert seen[1] == (
        "torch_remat: checkpoint 'layers.7' is being recomputed; the memory report "
        "describes the original forward only. Guard the call with "
        "`if not remat.is_recomputing():`."
    )


def test_save_for_backward_saves_positional_then_named():
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            remat.save_for_backward(ctx, a, second=b, third=None)
            return a * b

        @staticmethod
        def backward(ctx, g):
            a, b, none = ctx.saved_tensors
            assert none is None
            return g * b, g * a

    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    F.apply(a, b).sum().backward()  # outside any checkpoint: plain save_for_backward
    assert torch.equal(a.grad, b.detach()) and torch.equal(b.grad, a.detach())

    a.grad = b.grad = None
    out, text = run_and_report(lambda x, y: remat.region(F.apply, "f", recompute=False)(x, y), a, b)
    assert text == "layers.0: 0 B resident in 0 storage(s)"  # leaves: not billed
    out.sum().backward()
    assert torch.equal(a.grad, b.detach()) and torch.equal(b.grad, a.detach())
    a.grad = b.grad = None
    out, text = run_and_report(lambda x, y: remat.region(F.apply, "f", recompute=False)(x, y), a * 1, b * 1)
    assert "  12 B  saved.0  (3,)  float32" in text
    assert "  12 B  second   (3,)  float32" in text
    out.sum().backward()
    assert torch.equal(a.grad, b.detach()) and torch.equal(b.grad, a.detach())


def test_record_save_sites_labels_rows_with_the_innermost_user_frame():
    def block(x):
        return remat.region(lambda t: t.exp(), "exp", recompute=False)(x)  # SITE

    x = torch.randn(2, requires_grad=True)
    with remat.record_save_sites():
        _, text = run_and_report(block, x)
    _, plain = run_and_report(block, x)
    line = next(
        i for i, src in enumerate(open(__file__).read().splitlines(), 1) if src.endswith("# SITE")
    )
    assert text.splitlines()[-1] == (
        f"  8 B  saved.0 (output at idx 0)  (2,)  float32  "
        f"@ test_memory_report.py:{line} <lambda>"
    )
    assert "@" not in plain


def test_requires_grad_leaf_inputs_are_not_billed_as_parameters_are_not():
    # autograd keeps a leaf that requires grad alive for its AccumulateGrad anyway
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    reports = []

    def body(x, w):
        h = remat.recompute_needs_tensor(remat.region(lambda t: (t @ w).tanh(), "mm", recompute=False)(x))
        if not remat.is_recomputing():
            reports.append(remat.format_current_memory_report())
        return (h * 2).sin().sum()

    loss = remat.checkpoint(region_name="layer")(body)(x, w)
    expected = (
        "layer: 128 B resident in 1 storage(s)\n"
        "layer::mm: 128 B\n"
        "  128 B  saved.2 (output at idx 0)  (4, 8)  float32"
    )
    assert reports[0] == expected
    saved = remat.format_saved_tensors_report(loss)
    assert saved.startswith("saved for backward: 136 B resident -- 1 region(s) 128 B, outside regions 8 B\n")
    assert saved.endswith("[x1: layer]\n" + expected)
    loss.backward()
