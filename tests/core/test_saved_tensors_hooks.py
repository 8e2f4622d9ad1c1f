"""``remat.saved_tensors_hooks`` and the checkpoint's ``saved_tensors_hooks`` /
``input_saved_tensors_hooks`` options: hooks that see only what remat keeps."""

import gc
import itertools
import weakref

import pytest
import torch
from helpers import assert_bitwise_equal, grads

import torch_remat as remat
from torch_remat import SavedTensorInfo, SavedTensorKind

D = torch.float64
BACKWARD = SavedTensorKind.BACKWARD
INPUT = SavedTensorKind.CHECKPOINT_INPUT
OUTPUT = SavedTensorKind.SAVE_OUTPUT


def chain(x):
    # SAVE region "proj": exp saves its own result p (an internal activation).
    p = remat.region(lambda t: t.mul(2).exp(), "proj", recompute=False)(x)
    remat.recompute_needs_tensor(p)  # sin below reads p in the replay
    return p.sin().tanh() + x.cos()  # sin saves p, cos saves x (kept); tanh is dropped


class Recorder:
    """Hooks that tag what they pack and record what they see."""

    def __init__(self, tag="hooks", copy=False):
        self.tag = tag
        self.copy = copy
        self.packed = []  # (tag, info, is_recomputing, detached)
        self.unpacked = 0

    def pack_hook(self, t):
        info = remat.current_saved_tensor_info()
        self.packed.append((self.tag, info, remat.is_recomputing(), t.grad_fn is None and not t.requires_grad))
        return (self.tag, t.clone() if self.copy else t)

    def unpack_hook(self, packed):
        self.unpacked += 1
        return packed[1]

    def pair(self):
        return (self.pack_hook, self.unpack_hook)

    def kinds(self):
        return sorted((info.kind.value, info.region) for _, info, _, _ in self.packed)


def run_chain(**options):
    x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(0)).requires_grad_()
    return grads([], [x], lambda x: remat.checkpoint(region_name="c", **options)(chain)(x).sum())


def reference():
    x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(0)).requires_grad_()
    return grads([], [x], lambda x: chain(x).sum())


def test_hooks_see_exactly_the_save_region_save_the_kept_output_and_the_kept_input():
    rec = Recorder()
    with remat.saved_tensors_hooks(rec.pack_hook, rec.unpack_hook):
        actual = run_chain()
    assert_bitwise_equal(actual, reference())
    infos = sorted((info for _, info, _, _ in rec.packed), key=lambda i: i.kind.value)
    call = infos[0].call
    assert infos == [
        SavedTensorInfo("c", "proj", BACKWARD, call=call),
        SavedTensorInfo("c", None, INPUT, input_index=0, call=call),
        SavedTensorInfo("c", "proj", OUTPUT, output_index=0, call=call),
    ]
    assert rec.unpacked == 3


def test_pack_receives_detached_tensors_and_never_runs_during_the_replay():
    rec = Recorder(copy=True)
    with remat.saved_tensors_hooks(rec.pack_hook, rec.unpack_hook):
        x = torch.randn(3, 4, dtype=D, requires_grad=True)
        loss = remat.checkpoint(region_name="c")(chain)(x).sum()
        packed_in_forward = len(rec.packed)
        loss.backward()
    assert packed_in_forward == len(rec.packed) == 3
    assert [(recomputing, detached) for _, _, recomputing, detached in rec.packed] == [(False, True)] * 3


def test_current_saved_tensor_info_is_none_outside_a_pack_hook():
    assert remat.current_saved_tensor_info() is None


def test_the_pair_is_bound_at_pack_time_so_leaving_the_block_keeps_its_unpack():
    rec = Recorder(copy=True)
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(rec.pack_hook, rec.unpack_hook):
        loss = remat.checkpoint(region_name="c")(chain)(x).sum()
    loss.backward()
    assert rec.unpacked == 3


def test_capture_context_is_taken_when_the_pair_is_bound_and_handed_to_pack():
    step = {"now": "start"}
    seen = []

    def pack(t, context):
        seen.append((remat.current_saved_tensor_info().kind, context))
        return t

    def proj(t):
        p = t.mul(2).exp()  # saved here
        step["now"] = "proj returns"
        return p

    def fn(x):
        step["now"] = "in proj"
        p = remat.region(proj, "proj", recompute=False)(x)
        step["now"] = "after proj"
        return p.sin() + x.cos()

    x = torch.randn(3, dtype=D, requires_grad=True)
    with remat.saved_tensors_hooks(pack, lambda t: t, capture_context=lambda: step["now"]):
        remat.checkpoint(region_name="c")(fn)(x).sum().backward()
    # The save happens in the region; the output is bound as the region returns and
    # the input as the checkpoint starts, both packed only when the forward ends.
    assert sorted(seen, key=lambda s: s[0].value) == [
        (BACKWARD, "in proj"),
        (INPUT, "start"),
        (OUTPUT, "proj returns"),
    ]


def test_an_identity_hook_leaves_no_cycle_a_save_op_saving_its_own_output_is_freed_without_gc():
    outputs = []

    def region_body(t):
        p = t.exp()  # exp saves its own output
        outputs.append(weakref.ref(p))
        return p

    def fn(x):
        return remat.region(region_body, "proj", recompute=False)(x).sum()

    gc.collect()
    gc.disable()
    try:
        x = torch.randn(4, dtype=D, requires_grad=True)
        with remat.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = remat.checkpoint(region_name="c")(fn)(x)
        # Dropped without a backward (which would free the saves and so break a cycle).
        del loss
        assert outputs[0]() is None
    finally:
        gc.enable()


# ------------------------------------------------------------------ precedence

LEVELS = ("option", "context", "torch")


@pytest.mark.parametrize(
    "present", [c for n in range(4) for c in itertools.combinations(LEVELS, n)], ids=str
)
def test_precedence_checkpoint_option_then_innermost_of_context_and_torch_hooks_then_resident(present):
    # torch's hooks are entered inside the remat.saved_tensors_hooks block here:
    # the innermost wins (issue 27: as upstream torch-remat and torch itself nest).
    recs = {level: Recorder(level, copy=True) for level in LEVELS}
    options = {"saved_tensors_hooks": recs["option"].pair()} if "option" in present else {}
    ctx = remat.saved_tensors_hooks(*recs["context"].pair())
    torch_ctx = torch.autograd.graph.saved_tensors_hooks(*recs["torch"].pair())
    x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(0)).requires_grad_()

    def run(x):
        fn = remat.checkpoint(region_name="c", **options)(chain)
        if "context" in present:
            ctx.__enter__()
        if "torch" in present:
            torch_ctx.__enter__()
        try:
            return fn(x)
        finally:
            if "torch" in present:
                torch_ctx.__exit__(None, None, None)
            if "context" in present:
                ctx.__exit__(None, None, None)

    actual = grads([], [x], lambda x: run(x).sum())
    assert_bitwise_equal(actual, reference())
    winner = next((level for level in ("option", "torch", "context") if level in present), None)
    for level, rec in recs.items():
        # torch's hooks see the kept tensors too (without remat's info) when they win.
        assert len(rec.packed) == (3 if level == winner else 0), level


def test_input_hooks_take_the_inputs_ahead_of_the_checkpoint_hooks():
    saves, inputs = Recorder("saves", copy=True), Recorder("inputs", copy=True)
    actual = run_chain(saved_tensors_hooks=saves.pair(), input_saved_tensors_hooks=inputs.pair())
    assert_bitwise_equal(actual, reference())
    assert inputs.kinds() == [("checkpoint_input", None)]
    assert saves.kinds() == [("backward", "proj"), ("save_output", "proj")]


def test_input_hooks_alone_leave_the_other_kept_tensors_to_the_context():
    ctx, inputs = Recorder("ctx", copy=True), Recorder("inputs", copy=True)
    with remat.saved_tensors_hooks(*ctx.pair()):
        actual = run_chain(input_saved_tensors_hooks=inputs.pair())
    assert_bitwise_equal(actual, reference())
    assert inputs.kinds() == [("checkpoint_input", None)]
    assert ctx.kinds() == [("backward", "proj"), ("save_output", "proj")]


def test_saved_tensors_hooks_none_means_no_hooks_of_the_checkpoint():
    assert_bitwise_equal(run_chain(saved_tensors_hooks=None), reference())


def test_a_malformed_hook_option_is_refused_when_the_checkpoint_is_built():
    with pytest.raises(TypeError, match="saved_tensors_hooks must be None, a \\(pack, unpack\\)"):
        remat.checkpoint(region_name="c", saved_tensors_hooks=lambda t: t)
    with pytest.raises(TypeError, match="input_saved_tensors_hooks: the unpack hook must be callable"):
        remat.checkpoint(region_name="c", input_saved_tensors_hooks=(lambda t: t, 3))


def test_a_nested_checkpoint_hands_its_kept_tensors_to_the_outer_one():
    rec = Recorder(copy=True)

    def outer(x):
        h = remat.checkpoint(region_name="inner")(chain)(x)  # replayed by the outer
        return remat.region(lambda t: t.mul(3).exp(), "top", recompute=False)(h).sum()

    x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(0)).requires_grad_()
    with remat.saved_tensors_hooks(*rec.pair()):
        actual = grads([], [x], lambda x: remat.checkpoint(region_name="outer")(outer)(x))
    x2 = x.detach().clone().requires_grad_()
    expected = grads([], [x2], lambda x: chain(x).mul(3).exp().sum())
    assert_bitwise_equal(actual, expected)
    # Only the outer checkpoint's own kept tensors: its SAVE region's save and its
    # input x (read by the replayed inner checkpoint).
    assert rec.kinds() == [("backward", "top"), ("checkpoint_input", None)]


def test_with_input_hooks_the_checkpoint_keeps_only_what_pack_returned():
    # The caller modifies its input after the forward: without input hooks the
    # checkpoint holds that very tensor and refuses; with a copying input hook it
    # holds the copy, and backward is exact.
    def run(**options):
        leaf = torch.randn(5, dtype=D, generator=torch.Generator().manual_seed(0)).requires_grad_()
        x = leaf * 1
        y = remat.checkpoint(region_name="c", **options)(lambda t: t.sin())(x)
        with torch.no_grad():
            x.add_(1)
        y.sum().backward()
        return leaf.grad

    with pytest.raises(remat.SavedTensorModifiedError, match="checkpoint 'c'.*modified in place"):
        run()
    copied = run(input_saved_tensors_hooks=(lambda t: t.clone(), lambda t: t))
    expected = torch.randn(5, dtype=D, generator=torch.Generator().manual_seed(0)).cos()
    assert torch.equal(copied, expected)
