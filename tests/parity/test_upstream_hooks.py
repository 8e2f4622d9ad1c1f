"""``remat.saved_tensors_hooks`` with upstream torch-remat 0.2.2's contract: it
applies outside checkpoints as torch's own hooks do, nests innermost-wins with
torch's ``saved_tensors_hooks``, exposes the captured context on
``SavedTensorInfo.context`` (one-argument pack hooks), and hands saved
``nn.Parameter`` objects to the pack hook as themselves."""

from __future__ import annotations

import torch
from helpers import UnseenLog, kept_bytes

import torch_remat as remat
from torch_remat import SavedTensorKind

D = torch.float64


class Log:
    """A pack/unpack pair of one argument each (torch's shape) that records (the
    packs of a replay too)."""

    def __init__(self) -> None:
        self.packed = UnseenLog()
        self.unpacked = 0

    def pack(self, t):
        info = remat.current_saved_tensor_info()  # None under torch's own hooks
        kind, context = (None, None) if info is None else (info.kind, info.context)
        self.packed.append((tuple(t.shape), kind, context, isinstance(t, torch.nn.Parameter)))
        return t

    def unpack(self, t):
        self.unpacked += 1
        return t


class Square(torch.autograd.Function):
    """Saves an internal tensor (2x), not its input."""

    @staticmethod
    def forward(ctx, x):
        doubled = x * 2
        ctx.save_for_backward(doubled)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (doubled,) = ctx.saved_tensors
        return g * doubled


def square_region(x):
    return remat.region(Square.apply, "square", recompute=False)(x)


def test_outside_checkpoints_the_hooks_see_what_torch_hooks_see():
    def run(hooks, log):
        x = torch.tensor([2.0, 3.0], dtype=D, requires_grad=True)
        with hooks(log.pack, log.unpack):
            y = (x * x).sin()
        y.sum().backward()
        return x.grad

    native, ours = Log(), Log()
    expected = run(torch.autograd.graph.saved_tensors_hooks, native)
    actual = run(remat.saved_tensors_hooks, ours)
    assert torch.equal(actual, expected)
    assert [p[0] for p in ours.packed] == [p[0] for p in native.packed] == [(2,), (2,), (2,)]
    assert ours.unpacked == native.unpacked == 3
    assert [p[1:] for p in ours.packed] == [(SavedTensorKind.BACKWARD, None, False)] * 3


def test_outside_checkpoints_capture_context_is_not_called_and_the_context_is_none():
    calls = []
    log = Log()
    x = torch.tensor([2.0, 3.0], dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(log.pack, log.unpack, capture_context=lambda: calls.append(1) or "c"):
        y = x * x
    y.sum().backward()
    assert calls == []
    assert [p[1:3] for p in log.packed] == [(SavedTensorKind.BACKWARD, None)] * 2
    assert torch.equal(x.grad, torch.tensor([4.0, 6.0], dtype=D))


def test_one_pair_covers_the_saves_inside_and_outside_checkpoints():
    log = Log()
    x = torch.tensor([2.0, 3.0], dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(log.pack, log.unpack):
        h = x.exp()  # outside: exp saves its result
        y = remat.checkpoint(region_name="c")(square_region)(h)
        loss = y.tanh().sum()  # outside: tanh saves its result
    loss.backward()
    kinds = sorted(p[1].value for p in log.packed)
    # exp, tanh (outside) and the SAVE region's internal save (inside), and the
    # checkpoint's input, packed by the same pair
    assert kinds == ["backward", "backward", "backward", "checkpoint_input"]
    expected_x = x.detach().clone().requires_grad_()
    Square.apply(expected_x.exp()).tanh().sum().backward()
    assert torch.equal(x.grad, expected_x.grad)


def test_the_unpack_bound_outside_a_checkpoint_runs_after_the_block_exits():
    log = Log()
    x = torch.tensor([2.0, 3.0], dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(log.pack, log.unpack):
        y = x * x
    y.sum().backward()  # no hooks active now
    assert log.unpacked == 2


def test_the_captured_context_is_on_the_info_for_one_argument_pack_hooks():
    log = Log()
    chunk = {"id": 7}

    def body(x):
        with remat.saved_tensors_hooks(log.pack, log.unpack, capture_context=lambda: chunk["id"]):
            y = remat.region(lambda t: t * 2, "mul", recompute=False)(x)
        chunk["id"] = 999  # the context moved on before the deferred save packs
        remat.recompute_needs_tensor(y)
        return torch.relu(y)

    x = torch.tensor([1.0, -1.0], dtype=D, requires_grad=True)
    remat.checkpoint(region_name="c")(body)(x).sum().backward()
    assert [(p[1], p[2]) for p in log.packed] == [(SavedTensorKind.SAVE_OUTPUT, 7)]
    assert torch.equal(x.grad, torch.tensor([2.0, 0.0], dtype=D))


def test_a_two_argument_pack_hook_still_receives_the_context_and_the_info_has_it_too():
    seen = []

    def pack(t, context):
        seen.append((context, remat.current_saved_tensor_info().context))
        return t

    x = torch.tensor([2.0, 3.0], dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(pack, lambda t: t, capture_context=lambda: "ctx"):
        y = remat.checkpoint(region_name="c")(square_region)(x)
    y.sum().backward()
    assert seen and all(s == ("ctx", "ctx") for s in seen)


def test_torch_hooks_entered_inside_the_block_take_precedence():
    outer, inner = Log(), Log()
    x = torch.tensor([2.0, 3.0], dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(outer.pack, outer.unpack):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: inner.packed.append(t.shape) or t, lambda t: t):
            y = remat.checkpoint(region_name="c")(square_region)(x)
            z = x.exp()
    (y.sum() + z.sum()).backward()
    assert outer.packed == []
    # the checkpoint's input (packed at its start), the SAVE region's save, exp's result
    assert len(inner.packed) == 3
    assert torch.equal(x.grad, 2 * x.detach() + x.detach().exp())


def test_a_block_entered_inside_torch_hooks_takes_precedence():
    outer = []
    inner = Log()
    x = torch.tensor([2.0, 3.0], dtype=D, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: outer.append(t.shape) or t, lambda t: t):
        with remat.saved_tensors_hooks(inner.pack, inner.unpack):
            y = remat.checkpoint(region_name="c")(square_region)(x)
            z = x.exp()
    (y.sum() + z.sum()).backward()
    assert outer == []
    # the checkpoint's input, the SAVE region's save, exp's result (kind BACKWARD)
    assert len(inner.packed) == 3


def test_nested_blocks_outside_checkpoints_innermost_wins():
    outer, inner = Log(), Log()
    x = torch.tensor([2.0, 3.0], dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(outer.pack, outer.unpack):
        with remat.saved_tensors_hooks(inner.pack, inner.unpack):
            y = x * x
        z = x.exp()
    (y.sum() + z.sum()).backward()
    assert len(inner.packed) == 2 and len(outer.packed) == 1


def test_a_saved_parameter_reaches_the_pack_hook_as_the_parameter():
    weight = torch.nn.Parameter(torch.randn(3, 3, dtype=D))
    got = []

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            act = x * 2
            ctx.save_for_backward(act, w)
            return act @ w.t()

        @staticmethod
        def backward(ctx, g):
            act, w = ctx.saved_tensors
            return (g @ w) * 2, g.t() @ act

    places = []

    def pack(t):
        got.append(t)
        info = remat.current_saved_tensor_info()
        places.append((info.checkpoint, info.region))
        return t

    def body(x):
        return remat.region(lambda t: Linear.apply(t, weight), "linear", recompute=False)(x)

    x = torch.randn(4, 3, dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(pack, lambda t: t):
        y = remat.checkpoint(region_name="c")(body)(x)
        y.sum().backward()
    params = [t for t in got if isinstance(t, torch.nn.Parameter)]
    assert len(params) == 1 and params[0] is weight
    # packed as a save of the region, inside the checkpoint
    assert places[[t is weight for t in got].index(True)] == ("c", "linear")
    assert any(not isinstance(t, torch.nn.Parameter) and t.shape == (4, 3) for t in got)
    expected = x.detach().clone().requires_grad_()
    w2 = weight.detach().clone().requires_grad_()
    Linear.apply(expected, w2).sum().backward()
    assert torch.equal(x.grad, expected.grad) and torch.equal(weight.grad, w2.grad)


def test_a_block_entered_inside_compiled_code_still_refuses_a_compiled_checkpoint_by_name():
    import pytest

    def f(x):
        with remat.saved_tensors_hooks(lambda t: t, lambda t: t):
            return remat.checkpoint(region_name="c")(lambda t: t.sin())(x).sum()

    x = torch.randn(3, requires_grad=True)
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception, match="remat.saved_tensors_hooks context"):
            torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    finally:
        torch._dynamo.reset()


# ------------------------------------------- checkpoint inputs packed at the start


def _two_input_body(x, mask):
    # x reaches only the SAVE region (the replay does not read it), mask only the
    # replayed code
    h = square_region(x)
    return h.sin() * mask


def test_under_hooks_every_input_is_packed_first_in_argument_order_and_unpacked_once():
    log = Log()
    infos = []

    def pack(t):
        infos.append(remat.current_saved_tensor_info())
        return log.pack(t)

    x = torch.tensor([2.0, 3.0], dtype=D, requires_grad=True)
    mask = torch.tensor([1.0, 0.5], dtype=D)
    with remat.saved_tensors_hooks(pack, log.unpack):
        y = remat.checkpoint(region_name="c")(_two_input_body)(x, mask)
    assert [(i.kind, i.input_index, i.region) for i in infos[:2]] == [
        (SavedTensorKind.CHECKPOINT_INPUT, 0, None),
        (SavedTensorKind.CHECKPOINT_INPUT, 1, None),
    ]
    assert [i.kind for i in infos[2:]] == [SavedTensorKind.BACKWARD, SavedTensorKind.SAVE_OUTPUT]
    y.sum().backward()
    # x, which the replay does not read, is unpacked too: one unpack per pack
    assert log.unpacked == len(log.packed) == 4
    xe = x.detach().clone().requires_grad_()
    (square_region(xe).sin() * mask).sum().backward()
    assert torch.equal(x.grad, xe.grad)


def test_torch_hooks_around_a_checkpoint_pack_its_inputs_first():
    packed = []
    x = torch.tensor([2.0, 3.0], dtype=D, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = remat.checkpoint(region_name="c")(square_region)(x)
    assert len(packed) == 2 and torch.equal(packed[0], x) and torch.equal(packed[1], 2 * x)
    y.sum().backward()
    assert torch.equal(x.grad, 2 * x.detach())


def test_an_input_the_replay_does_not_read_may_change_after_the_forward():
    # torch's hooks check versions on unpack; the unread input's unpack must not
    # turn an update nothing reads again into an error
    x = torch.tensor([2.0, 3.0], dtype=D, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        a = x * 1.0
        y = remat.checkpoint(region_name="c")(square_region)(a)
    # the hooks hold the input (a view of it) for the checkpoint
    assert [t.data_ptr() == a.data_ptr() for t in packed] == [True, False]
    with torch.no_grad():
        a.add_(1.0)
    y.sum().backward()
    assert torch.equal(x.grad, 2 * x.detach())


def test_an_input_the_replay_reads_and_that_changed_after_the_forward_still_raises():
    import pytest

    x = torch.tensor([2.0, 3.0], dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(lambda t: t, lambda t: t):
        a = x * 1.0
        y = remat.checkpoint(region_name="c")(lambda t: t.sin().exp())(a)
    with torch.no_grad():
        a.add_(1.0)
    with pytest.raises(remat.SavedTensorModifiedError, match="checkpoint 'c'"):
        y.sum().backward()


def test_without_hooks_an_input_the_replay_does_not_read_is_not_held():
    import weakref

    x = torch.tensor([2.0, 3.0], dtype=D, requires_grad=True)
    a = x * 1.0
    ref = weakref.ref(a)
    y = remat.checkpoint(region_name="c")(square_region)(a)
    assert kept_bytes(y) == {"c": {"square": 2 * 8}}  # the region's save (2x), no input
    del a
    assert ref() is None
    y.sum().backward()
    assert torch.equal(x.grad, 2 * x.detach())


def test_the_report_counts_an_input_hooks_hold_for_backward():
    x = torch.randn(256, requires_grad=True)
    a = x * 1.0
    with remat.saved_tensors_hooks(lambda t: t, lambda t: t):  # holds what it packs
        y = remat.checkpoint(region_name="c")(lambda t: remat.region(torch.exp, "exp", recompute=False)(t))(a)
    del a
    report = str(remat.saved_tensors_report())
    assert "c::(inputs): 1.00 KiB" in report and "(input 0)  (256,)" in report
    y.sum().backward()


def test_an_unread_input_is_unpacked_when_only_rebuilt_saves_reach_backward():
    packs, unpacks = [], []

    def body(x, z):
        remat.region(lambda t: t + 1, "noop", recompute=False)(x)  # x: read by no replay
        h = z * 2  # replayed code
        return remat.region(torch.sin, "s", recompute=False)(h)  # sin's save of h: rebuilt

    x = torch.randn(8, dtype=D, requires_grad=True)
    z = torch.randn(8, dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(lambda t: packs.append(t) or t, lambda t: unpacks.append(t) or t):
        y = remat.checkpoint(region_name="c")(body)(x, z)
    y.sum().backward()
    assert len(packs) == len(unpacks) == 2  # x and z, each unpacked once
    assert torch.equal(z.grad, (2 * z.detach()).cos() * 2)
