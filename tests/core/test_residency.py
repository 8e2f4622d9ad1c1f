"""The residency table of design §3, measured in bytes.

Chain x -> A -> y -> B -> z -> C, where A's backward needs p and B's needs q, and C
saves z. Sizes (float64) are distinct so the live total names the resident set:
x 256 B, p 512 B, y 32 B, q 96 B, z 48 B (and w 32 B, a leaf weight of the argument rows).
"""

import pytest
import torch
from helpers import UnseenLog, kept_bytes, recorded_replays

import torch_remat as remat

SIZES = {"x": 256, "p": 512, "y": 32, "q": 96, "z": 48, "w": 32}
# Who keeps a resident tensor: the region whose save or output it is, or the
# checkpoint itself for its replay.
KEPT_BY = {"x": "(inputs)", "p": "A", "y": "A", "q": "B", "z": "B"}
LOSS_BYTES = 8

ROWS = [
    # (A saves, B saves, resident after forward, recreated in backward)
    (True, True, {"y", "z", "p", "q"}, set()),
    (True, False, {"y", "p"}, {"z", "q"}),
    (False, True, {"x", "z", "q"}, {"y", "p"}),
    (False, False, {"x"}, {"y", "z", "p", "q"}),
]


def make_chain(a_saves, b_saves, log):
    # A running during the recompute recreates p and y; B recreates q and z. The
    # log is written before the ops because early stop may end the replay inside one.
    def A(x):
        if remat.is_recomputing():
            log.extend(["p", "y"])
        p = x.repeat(1, 2).exp()  # ExpBackward saves its result p (4, 16)
        return p.sum(-1)  # y (4,), SumBackward saves nothing

    def B(y):
        if remat.is_recomputing():
            log.extend(["q", "z"])
        q = y.repeat(3).exp()  # q (12,)
        return q.reshape(2, 6).sum(0)  # z (6,)

    def fn(x):
        y = remat.region(A, "A", recompute=not a_saves)(x)
        z = remat.region(B, "B", recompute=not b_saves)(y)
        return z.sin().sum()  # C: SinBackward saves z

    fn.A = A
    return fn


def check_chain(memory_probe, fn, log, resident, recreated):
    """Bytes held after the forward (in all, and by whom), what the backward
    recreated, exact gradients. Saved leaves that require grad are held by autograd
    anyway and billed to no checkpoint."""
    base = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with memory_probe() as probe, recorded_replays() as replayed:
        x = base.clone()  # non-leaf: nothing but torch_remat can keep it alive
        loss = remat.checkpoint(region_name="chain")(fn)(x)
        del x
    assert probe.bytes == sum(SIZES[n] for n in resident) + LOSS_BYTES
    kept: dict[str, int] = {}
    for n in resident:
        kept[KEPT_BY[n]] = kept.get(KEPT_BY[n], 0) + SIZES[n]
    assert kept_bytes(loss) == {"chain": kept}
    loss.backward()
    assert set(log) == recreated
    assert replayed == (["chain"] if recreated else [])
    expected = base.detach().clone().requires_grad_()
    fn(expected.clone()).backward()
    assert torch.equal(base.grad, expected.grad)


@pytest.mark.parametrize("a_saves,b_saves,resident,recreated", ROWS)
def test_residency_table(memory_probe, a_saves, b_saves, resident, recreated):
    log = UnseenLog()
    fn = make_chain(a_saves, b_saves, log)
    check_chain(memory_probe, fn, log, resident, recreated)


ARGUMENT_ROWS = [
    # B saves its argument y itself (as a linear layer saves its input).
    (False, {"x", "z", "q"}, {"y", "p"}),  # y rebuilt by the replay at B's call
    (True, {"y", "z", "p", "q"}, set()),  # y kept once, as A's output
]


@pytest.mark.parametrize("a_saves,resident,recreated", ARGUMENT_ROWS)
def test_save_region_saving_its_argument(memory_probe, a_saves, resident, recreated):
    log = UnseenLog()
    w = torch.ones(4, dtype=torch.float64, requires_grad=True)  # a leaf: not counted
    chain = make_chain(a_saves, True, log)

    def B(y):
        q = (y * w).repeat(3).exp()  # mul saves y (for w's gradient); exp saves q
        return q.reshape(2, 6).sum(0)

    def fn(x):
        y = remat.region(chain.A, "A", recompute=not a_saves)(x)
        z = remat.region(B, "B", recompute=False)(y)
        return z.sin().sum()

    check_chain(memory_probe, fn, log, resident, recreated)


def test_input_consumed_only_by_save_regions_is_not_kept(memory_probe):
    lin = torch.nn.Linear(32, 32, bias=False, dtype=torch.float64)

    def fn(x):
        h = remat.region(lin, "proj", recompute=False)(x)  # saves x inside the region
        remat.recompute_needs_tensor(h)  # tanh is replayed and reads h
        return h.tanh()  # saves tanh's output (dropped, recomputed)

    base = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    with memory_probe() as probe, recorded_replays() as replayed:
        x = base.clone()
        out = remat.checkpoint(region_name="c")(fn)(x)
        del x
    # Resident: x once (2048 B), saved by the region's matmul and not kept again by
    # the checkpoint; h (2048 B), kept for the replay; the output (2048 B), held by
    # the caller. tanh's saved result is dropped.
    assert probe.bytes == 3 * 2048
    assert kept_bytes(out) == {"c": {"proj": 2 * 2048}}  # x and h, both the region's
    out.sum().backward()
    assert replayed == ["c"]


def test_input_read_by_bare_code_is_kept(memory_probe):
    lin = torch.nn.Linear(32, 32, bias=False, dtype=torch.float64)

    def fn(x):
        h = remat.region(lin, "proj", recompute=False)(x + 1)  # x read by bare add
        remat.recompute_needs_tensor(h)
        return h.tanh()

    base = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    with memory_probe() as probe, recorded_replays() as replayed:
        x = base.clone()
        out = remat.checkpoint(region_name="c")(fn)(x)
        del x
    # x kept for the replay of `x + 1`; h; the output. The region's save of x + 1,
    # an argument replayed code produces, is rebuilt by the replay, not kept.
    assert probe.bytes == 3 * 2048
    assert kept_bytes(out) == {"c": {"(inputs)": 2048, "proj": 2048}}
    out.sum().backward()
    assert replayed == ["c"]


def test_a_save_region_whose_output_dies_inside_the_forward_frees_its_saves_at_once():
    import weakref

    class Box:
        def __init__(self, t):
            self.t = t

    boxes = []

    def pack(t):
        boxes.append(Box(t))
        return boxes[-1]

    checked = []

    def body(x):
        h = remat.region(torch.exp, "unused", recompute=False)(x)  # exp saves its output
        if not remat.is_recomputing():  # (the replay skips the region: packs nothing)
            ref = weakref.ref(boxes[-1])
            boxes.clear()
            del h  # nothing reads it: its graph, and exp's save, die here
            checked.append(ref() is None)
        return x.sin()

    x = torch.randn(1024, dtype=torch.float64, requires_grad=True)
    with remat.saved_tensors_hooks(pack, lambda b: b.t):
        y = remat.checkpoint(region_name="c")(body)(x)
    assert checked == [True]
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().cos())
