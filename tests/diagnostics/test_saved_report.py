"""remat.print_saved_tensors_report: exact text, exact bytes, never a recompute."""

import gc
import io
import weakref

import pytest
import torch
from helpers import BLOCK_REGIONS, Block, UnseenLog
from torch import nn

import torch_remat as remat
from torch_remat.diagnostics import registry as _registry
from torch_remat.diagnostics.saved_report import compress_names
from torch_remat.engine.records import RegionRecord, RegionSaved


class Sq(torch.autograd.Function):
    """y = x * x, saving y and gf = 2x under their names."""

    @staticmethod
    def forward(ctx, x):
        y = x * x
        gf = 2 * x
        remat.save_for_backward(ctx, y=y, gf=gf)
        return y

    @staticmethod
    def backward(ctx, g):
        _, gf = ctx.saved_tensors
        return g * gf


@pytest.fixture(autouse=True)
def _no_graphs_left_from_other_tests():
    # The report covers every live checkpoint in the process, by design.
    gc.collect()


def sq_layer(x):
    return remat.region(Sq.apply, "sq", recompute=False)(x)


SEED_REPORT = """\
saved for backward: 240 B resident -- 2 region(s) 192 B, outside regions 48 B

regions:
  96 B  x2  layer.0-1  (2 storages each)

outside regions: 48 B in 1 storage
       48 B  TanhBackward0 (x1)

region detail:
[x2: layer.0-1]
layer.0: 96 B resident in 2 storage(s)
layer.0::sq: 96 B
  48 B  y (output at idx 0)  (3, 4)  float32
  48 B  gf                   (3, 4)  float32
"""

EMPTY_REPORT = """\
saved for backward: 0 B resident -- 0 region(s) 0 B, outside regions 0 B

regions: none

outside regions: 0 B in 0 storages
"""


def two_sq_layers(x):
    h = x
    for i in range(2):
        h = remat.checkpoint(region_name=f"layer.{i}")(sq_layer)(h)
    return torch.tanh(h).sum()


def test_report_matches_the_readme_and_is_empty_after_backward():
    x = torch.randn(3, 4, requires_grad=True)
    loss = two_sq_layers(x)
    out = io.StringIO()
    remat.print_saved_tensors_report(loss, file=out)
    assert out.getvalue() == SEED_REPORT
    loss.backward()
    out = io.StringIO()
    remat.print_saved_tensors_report(loss, file=out)
    assert out.getvalue() == EMPTY_REPORT
    ref = x.detach().clone().requires_grad_()
    torch.tanh(Sq.apply(Sq.apply(ref))).sum().backward()
    assert torch.equal(x.grad, ref.grad)


def test_building_the_report_never_recomputes():
    calls = UnseenLog()

    def block(x):
        calls.append(remat.is_recomputing())
        h = remat.region(torch.exp, "exp", recompute=True)(x)  # dropped, recomputed later
        return remat.region(torch.sin, "sin", recompute=False)(h).cos()

    x = torch.randn(4, requires_grad=True)
    loss = remat.checkpoint(region_name="layer")(block)(x).sum()
    for _ in range(2):
        remat.saved_tensors_report(loss)
        remat.saved_tensors_report(None)
    assert calls == [False]
    loss.backward()
    assert calls == [False, True]
    assert torch.equal(
        x.grad, -(x.detach().exp().sin().sin() * x.detach().exp().cos() * x.detach().exp())
    )


def _four_blocks():
    torch.manual_seed(0)
    return nn.ModuleList(Block(dropout=0.0) for _ in range(4))


@pytest.mark.parametrize(
    "saves",
    [(), ("qkv", "attention", "mlp"), BLOCK_REGIONS],
    ids=["all-recompute", "some-save", "all-save"],
)
def test_total_equals_the_bytes_the_profiler_sees_live(memory_probe, saves):
    model = _four_blocks()
    for block in model:
        block.save = {name: name in saves for name in BLOCK_REGIONS}
    elsewhere = remat.saved_tensors_report().total_bytes  # graphs other tests leaked
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    with memory_probe() as probe:
        h = x.clone()  # not a leaf (autograd holds those anyway): billed
        for i, block in enumerate(model):
            h = remat.checkpoint(region_name=f"layers.{i}")(block)(h)
        loss = h.sum()
        del h
    report = remat.saved_tensors_report(loss)
    # live after the forward: what is held for backward, plus the loss itself
    assert report.total_bytes == probe.bytes - 8
    assert len(report.checkpoints) == 4
    assert [len(g.blocks) for g in report.groups()] == [4]  # the layers read the same
    assert remat.saved_tensors_report().total_bytes - elsewhere == report.total_bytes
    assert remat.format_saved_tensors_report(loss) == report.format()
    loss.backward()
    assert remat.saved_tensors_report(loss).total_bytes == 0


def test_all_recompute_model_keeps_only_each_layer_input():
    model = _four_blocks()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    h = x
    for i, block in enumerate(model):
        h = remat.checkpoint(region_name=f"layers.{i}")(block)(h)
    loss = h.sum()
    text = remat.format_saved_tensors_report(loss)
    # plus 8 B per layer outside regions: autograd saves the Python scalar of
    # "scores / sqrt(d)" as a tensor without calling saved-tensor hooks
    assert text.startswith(
        "saved for backward: 5.03 KiB resident -- 4 region(s) 5.00 KiB, outside regions 32 B\n"
        "\n"
        "regions:\n"
        "  1.25 KiB  x4  layers.0-3  (1 storage each)\n"
        "\n"
        "outside regions: 32 B in 4 storages\n"
        "       32 B  DivBackward0 (x4)\n"
    )
    assert "layers.0::(inputs): 1.25 KiB\n  1.25 KiB  (input 0)  (2, 5, 16)  float64" in text


def test_storages_are_counted_once_across_the_report(memory_probe):
    def block(x):
        return remat.region(torch.exp, "exp", recompute=False)(x)  # saves its output

    x = torch.randn(8, requires_grad=True)
    with memory_probe() as probe:
        y = remat.checkpoint(region_name="a")(block)(x)
        z = y * y  # saves y twice outside regions: already counted in "a"
        loss = (z.sin() + y.sin()).sum()  # SinBackward0 x2: saves z (new) and y (counted)
        del z
    report = remat.saved_tensors_report(loss)
    text = report.format()
    assert report.total_bytes == probe.bytes - 4  # all but the loss: y in "a", z outside
    assert "outside regions: 32 B in 1 storage\n       32 B  SinBackward0 (x1)\n" in text
    assert "a: 32 B resident in 1 storage(s)" in text


def test_parameters_are_not_counted():
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    y = remat.checkpoint(region_name="lin")(lambda t: remat.region(lin, "mm", recompute=False)(t))(
        x
    )
    loss = (y * lin.weight[0]).sum()  # MulBackward0 saves a view of the weight
    report = remat.saved_tensors_report(loss)
    assert report.to_dict()["checkpoints"][0]["regions"][0]["tensors"][0]["shape"] == [4, 16]
    assert report.checkpoint_bytes == 256  # x only (saved by addmm and kept as input)
    assert report.outside_bytes == 256  # y, saved by MulBackward0
    assert [g.node_type for g in report.outside] == ["MulBackward0"]


def test_calls_with_different_contents_are_separate_groups():
    x = torch.randn(3, 4, requires_grad=True)
    h = remat.checkpoint(region_name="layer.0")(sq_layer)(x)
    h = remat.checkpoint(region_name="layer.1")(sq_layer)(h)
    h = remat.checkpoint(region_name="head")(lambda t: t.exp())(h + 1)  # keeps its input
    text = remat.format_saved_tensors_report(h.sum())
    assert (
        "regions:\n  96 B  x2  layer.0-1  (2 storages each)\n  48 B  x1  head       (1 storage)\n"
    ) in text
    assert "\n[x1: head]\nhead: 48 B resident in 1 storage(s)\nhead::(inputs): 48 B\n" in text


def test_offloaded_saves_are_counted_where_they_live(memory_probe):
    # The region saves -u, which its body creates, through save_on_cpu, which packs
    # (device, tensor). (A save of its argument t + 1 would be rebuilt by the replay,
    # not kept.) Not an op that saves its output: with hooks that return the output
    # itself, autograd's graph holds itself alive (also without torch_remat).
    x = torch.randn(6, requires_grad=True)  # autograd's (the leaf), so not billed
    with memory_probe() as probe:
        with torch.autograd.graph.save_on_cpu():
            y = remat.checkpoint(region_name="off")(
                lambda t: remat.region(lambda u: torch.sin(-u), "sin", recompute=False)(t + 1).cos()
            )(x)
        loss = y.sum()
        del y
    report = remat.saved_tensors_report(loss)
    assert report.total_bytes == probe.bytes - 4
    assert [r.region for r in report.checkpoints[0].regions] == ["sin"]
    assert report.checkpoints[0].format() == (
        "off: 48 B resident in 2 storage(s)\n"
        "off::sin: 48 B\n"
        "  24 B  saved.0            (6,)  float32\n"
        "  24 B  (output at idx 0)  (6,)  float32"
    )


@pytest.mark.parametrize("hooks", ["none", "identity", "moving"])
def test_an_unread_leaf_input_is_billed_only_when_hooks_copied_it(hooks):
    # x is a leaf that requires grad: autograd holds it for x.grad anyway. The
    # replay does not read it (a SAVE region only), so hooks pack it at the start
    # and hold the payload until backward: x itself (identity hooks) is not billed,
    # a copy the hooks made is.
    x = torch.randn(64, 64, requires_grad=True)
    pair = {
        "none": None,
        "identity": (lambda t: t, lambda t: t),
        "moving": (lambda t: t.detach().clone(), lambda t: t),
    }[hooks]
    kw = {} if pair is None else {"saved_tensors_hooks": pair}
    y = remat.checkpoint(region_name="layers.0", **kw)(
        lambda t: remat.region(torch.exp, "exp", recompute=False)(t)
    )(x)
    report = remat.saved_tensors_report(y.sum())
    extra = 64 * 64 * 4 if hooks == "moving" else 0
    assert report.total_bytes == 64 * 64 * 4 + extra  # exp's output, saved for its backward
    assert ("(inputs)" in report.checkpoints[0].format()) == (hooks == "moving")


def test_a_checkpoint_nested_in_replayed_code_holds_nothing_and_is_not_listed():
    # The inner checkpoint runs in the outer one's replayed code: the outer packs the
    # inner's save and drops it (its replay runs the inner one again), so only the
    # outer's SAVE output is held.
    def inner(t):
        return remat.region(torch.exp, "iexp", recompute=False)(t)

    def outer(t):
        h = remat.region(torch.sin, "osin", recompute=False)(t)
        return remat.checkpoint(region_name="inner")(inner)(h).tanh()

    x = torch.randn(4, 4, requires_grad=True)
    y = remat.checkpoint(region_name="outer")(outer)(x)
    report = remat.saved_tensors_report(y.sum())
    assert [c.name for c in report.checkpoints] == ["outer"]
    assert report.format().startswith(
        "saved for backward: 64 B resident -- 1 region(s) 64 B, outside regions 0 B\n\n"
        "regions:\n  64 B  x1  outer  (1 storage)\n"
    )
    y.sum().backward()
    plain = x.detach().clone().requires_grad_()
    plain.sin().exp().tanh().sum().backward()
    assert torch.equal(x.grad, plain.grad)


def test_to_dict_is_machine_readable():
    x = torch.randn(3, 4, requires_grad=True)
    d = remat.saved_tensors_report(two_sq_layers(x)).to_dict()
    assert (d["total_bytes"], d["checkpoint_bytes"], d["outside_bytes"]) == (240, 192, 48)
    assert d["outside"] == [
        {"node": "TanhBackward0", "count": 1, "bytes": 48, "storages": 1, "site": None}
    ]
    assert [c["name"] for c in d["checkpoints"]] == ["layer.0", "layer.1"]
    assert d["checkpoints"][0]["regions"][0]["tensors"][1] == {
        "name": "gf",
        "kind": "storage",
        "bytes": 48,
        "storage_bytes": 48,
        "shape": [3, 4],
        "dtype": "float32",
        "device": "cpu",
        "site": None,
        "counted_in": None,
    }


def test_compress_names():
    assert compress_names(["layer.0", "layer.1"]) == "layer.0-1"
    assert compress_names(["l3", "l0", "l1", "l5", "l6", "l7"]) == "l0-1,3,5-7"
    assert compress_names(["block", "block"]) == "block"
    assert compress_names(["a", "b.1"]) == "a, b.1"
    assert compress_names([f"n{i}x" for i in range(6)]) == "n0x, n1x, n2x, n3x, ... (+2)"


def test_saves_packed_by_a_gradient_checkpoint_scope_are_counted(memory_probe):
    a = torch.randn(16, requires_grad=True)
    with memory_probe() as probe:
        b = torch.randn(16, requires_grad=True)
        with remat.gradient_checkpoint_scope():
            x = a * 2 + b
        y = x.sin()  # x is recomputed by the scope: not held
        z = (y * b).tanh()  # packed by the scope's persistent hook
        out = remat.checkpoint(region_name="c")(
            lambda t: remat.region(torch.exp, "e", recompute=False)(t)
        )(z)
        loss = out.sum()
        del x, y, z, out, b
    report = remat.saved_tensors_report(loss)
    assert report.total_bytes == probe.bytes - 4
    assert report.checkpoints[0].format() == (
        "c: 64 B resident in 1 storage(s)\nc::e: 64 B\n  64 B  saved.0 (output at idx 0)  (16,)  float32"
    )


class Boxed:
    """A pack hook's object with the tensor in a slot."""

    __slots__ = ("tensor",)

    def __init__(self, t):
        self.tensor = t


class Declared:
    """A packed object that says what it keeps alive."""

    def __init__(self, t):
        self.hidden = [[[t]]]  # deeper than the generic look

    @property
    def tensor(self):
        return self.hidden[0][0][0]

    def _remat_resident_tensors(self):
        return [self.tensor]


@pytest.mark.parametrize("box", [Boxed, Declared])
def test_objects_packed_by_user_hooks_are_looked_into(memory_probe, box):
    x = torch.randn(10, requires_grad=True)
    with memory_probe() as probe:
        with torch.autograd.graph.saved_tensors_hooks(box, lambda b: b.tensor):
            y = (x * x).sin()  # MulBackward0 saves x twice (held anyway), sin its input
        loss = y.sum()
        del y
    report = remat.saved_tensors_report(loss)
    assert report.total_bytes == probe.bytes - 4 + 40  # + x, allocated before
    assert [(g.node_type, g.nbytes) for g in report.outside] == [
        ("MulBackward0", 40),
        ("SinBackward0", 40),
    ]
    loss.backward()
    assert torch.equal(x.grad, (x * x).detach().cos() * 2 * x.detach())


def test_the_registry_forgets_checkpoints_once_their_tensors_are_gone():
    before = set(_registry._entries)
    x = torch.randn(3, 4, requires_grad=True)
    loss = two_sq_layers(x)
    new = set(_registry._entries) - before
    assert len(new) == 2
    loss.backward()
    del loss
    assert [e.serial for e in _registry.live_entries() if e.serial in new] == []
    assert not new & set(_registry._entries)


class _FrameStandIn:
    """Just what the registry reads from a CheckpointFrame."""

    def __init__(self, name):
        self.name = name
        self.regions = []


def test_saves_outliving_their_frame_are_still_reported_in_forward_order():
    # Autograd keeps each saved tensor's pack hook, so today a frame lives as long
    # as anything it packed; the registry does not rely on that.
    frame = _FrameStandIn("gone")
    _registry._Registrar().checkpoint_created(frame)
    keep = []
    for name, n in (("first", 2), ("second", 3)):
        rec = RegionRecord("gone", name, name, False)
        saved = RegionSaved(rec, "saved.0", torch.ones(n), None)
        rec.saved.append(weakref.ref(saved))
        frame.regions.append(rec)
        keep.append(saved)
    del frame, rec, saved
    text = remat.format_saved_tensors_report()
    assert text.endswith(
        "gone: 20 B resident in 2 storage(s)\n"
        "gone::first: 8 B\n"
        "  8 B  saved.0  (2,)  float32\n"
        "gone::second: 12 B\n"
        "  12 B  saved.0  (3,)  float32"
    )
    del keep
    assert "gone" not in remat.format_saved_tensors_report()
