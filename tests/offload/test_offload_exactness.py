"""The offloader's own copies: what comes back is the tensor that went, at the
version it had, and a broadcast view moves its storage, not its expanded size."""

import pytest
import torch

import torch_remat as remat
from torch_remat.offload import ActivationOffloader

B, H, S = 2, 16, 32
KIND = remat.SavedTensorKind


def _scores():
    return torch.randn(B, H, S, S, generator=torch.Generator().manual_seed(0)).requires_grad_()


def _mask():
    return torch.randn(1, 1, S, S, generator=torch.Generator().manual_seed(1))  # 4 KiB


def attention(s, m):
    # mul saves the mask broadcast to (B, H, S, S): a stride-0 view of 4 KiB
    return remat.region(lambda a, b: a * b.expand(B, H, S, S), "attn", recompute=False)(s, m).sum(-1)


def test_a_broadcast_view_moves_its_storage_and_comes_back_with_its_strides():
    off = ActivationOffloader(1 << 20, min_bytes=0, prefetch=0)
    seen = []

    def unpack(packed):
        t = off.unpack_hook(packed)
        seen.append((t.shape, t.stride()))
        return t

    s = _scores()
    with remat.saved_tensors_hooks(off.pack_hook, unpack):
        y = remat.checkpoint(region_name="c")(attention)(s, _mask())
    y.sum().backward()
    assert off.stats.offloaded_bytes == {"attn": S * S * 4}
    assert off.stats.fetched_bytes == {"attn": S * S * 4}
    assert off.pool.high_water_bytes == S * S * 4
    # the SAVE region's save, and the checkpoint's two inputs (packed at its start,
    # left resident by the offloader's default kinds)
    assert sorted(seen, key=str) == sorted(
        [(torch.Size([B, H, S, S]), (0, 0, S, 1)), (torch.Size([B, H, S, S]), (H * S * S, S * S, S, 1)),
         (torch.Size([1, 1, S, S]), (S * S, S * S, S, 1))], key=str)
    plain = _scores()
    attention(plain, _mask()).sum().backward()
    assert torch.equal(s.grad, plain.grad)


def test_a_tensor_brought_back_is_at_the_version_the_forward_saw():
    # kinds=[SAVE_OUTPUT]: the kept output comes back from the pool into replayed
    # code that saves it; a copy at version 1 looked modified in place.
    off = ActivationOffloader(1 << 20, min_bytes=0, prefetch=0, kinds=[KIND.SAVE_OUTPUT])
    x = torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()

    def body(t):
        a = remat.region(lambda u: u * 3, "proj", recompute=False)(t)
        return a.sin()  # replayed, saves a

    with remat.saved_tensors_hooks(off.pack_hook, off.unpack_hook):
        y = remat.checkpoint(region_name="c")(body)(x)
    y.sum().backward()
    assert off.stats.fetched_bytes == {"proj": 64 * 8}
    assert torch.equal(x.grad, (x.detach() * 3).cos() * 3)


def test_a_permuted_view_still_comes_back_with_its_strides():
    off = ActivationOffloader(1 << 20, min_bytes=0, prefetch=0)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.stride())
        return off.pack_hook(t)

    def unpack(p):
        t = off.unpack_hook(p)
        unpacked.append(t.stride())
        return t

    x = torch.randn(4, 8, dtype=torch.float64).requires_grad_()

    def body(t):
        return remat.region(lambda u: u.t().exp(), "r", recompute=False)(t)  # saves a (8, 4) of strides (1, 8)

    with remat.saved_tensors_hooks(pack, unpack):
        y = remat.checkpoint(region_name="c")(body)(x)
    y.sum().backward()
    assert packed == [(8, 1), (1, 8)]  # the checkpoint's input, then the region's save
    assert sorted(unpacked) == sorted(packed)
    assert off.stats.offloaded_bytes == {"r": 32 * 8}
    assert torch.equal(x.grad, x.detach().exp())


def _gapped_save_grads(off):
    # mul saves v, a column-major view with gaps; the incoming gradient of sum() is
    # an expanded tensor, so torch lays out grad * v as v is laid out, and b's
    # gradient sums that product: in another layout it adds in another order.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 128, generator=g).requires_grad_()
    b = torch.randn(1, 48, generator=g).requires_grad_()

    def body(t):
        return remat.region(lambda u: u.exp().t()[::2] * b, "r", recompute=False)(t)

    if off is None:
        y = body(x)
    else:
        with remat.saved_tensors_hooks(off.pack_hook, off.unpack_hook):
            y = remat.checkpoint(region_name="c")(body)(x)
    return torch.autograd.grad(y.sum(), [x, b])


def test_a_saved_view_with_gaps_comes_back_in_its_layout_so_gradients_are_bitwise():
    off = ActivationOffloader(1 << 24, min_bytes=0, prefetch=0)
    got = _gapped_save_grads(off)
    assert off.stats.offloaded_bytes == {"r": (48 * 128 + 64 * 48 + 48) * 4}  # exp's output, v, b
    assert all(torch.equal(a, e) for a, e in zip(got, _gapped_save_grads(None)))


def _input_grads(base, view, fn, off):
    """The gradient of ``base`` through ``fn(view(base * 1))``: a checkpoint under
    ``off``'s hooks, or plainly where ``off`` is None."""
    base_ = base.clone().requires_grad_()
    h = view(base_ * 1.0)
    if off is None:
        y = fn(h)
    else:
        with remat.saved_tensors_hooks(off.pack_hook, off.unpack_hook):
            y = remat.checkpoint(region_name="c")(fn)(h)
    return torch.autograd.grad(y.sum(), base_)[0]


def test_a_checkpoint_input_with_gaps_comes_back_in_its_layout():
    off = ActivationOffloader(1 << 24, min_bytes=0, prefetch=0, kinds=tuple(KIND))
    base = torch.randn(128, 48, generator=torch.Generator().manual_seed(4))

    def fn(h):
        s = h.sum(0, keepdim=True)  # reduces over a column-major input
        return (s * h).sin()

    def column_slice(b):
        return b.t()[:, ::2]

    got = _input_grads(base, column_slice, fn, off)
    assert off.stats.offloaded_bytes  # the input moved
    assert torch.equal(got, _input_grads(base, column_slice, fn, None))


@pytest.mark.parametrize("b_shape", [(4, 1, 1), (1, 16, 1), (1, 1, 20), (4, 16, 1)])
def test_a_broadcast_view_with_gaps_comes_back_in_the_layout_torch_gives_its_copies(b_shape):
    # stride 0 (the expanded dimension) is not ordered by its stride: it keeps its
    # place, as in torch's own copies of such a tensor (clone, empty_like)
    g = torch.Generator().manual_seed(6)
    u = torch.randn(16, 60, 3, generator=g).requires_grad_()
    b = torch.randn(*b_shape, generator=g).requires_grad_()

    def body(t):
        v = t.exp()[:, ::3, 0].unsqueeze(0).expand(4, 16, 20)  # gaps and a broadcast dim
        return v * b

    def grads(off):
        for p in (u, b):
            p.grad = None
        if off is None:
            y = body(u)
        else:
            with remat.saved_tensors_hooks(off.pack_hook, off.unpack_hook):
                y = remat.checkpoint(region_name="c")(
                    lambda t: remat.region(body, "r", recompute=False)(t)
                )(u)
        y.sum().backward()
        return [u.grad.clone(), b.grad.clone()]

    off = ActivationOffloader(1 << 24, min_bytes=0, prefetch=0)
    got = grads(off)
    assert off.stats.offloaded_bytes["r"] > 0
    assert all(torch.equal(a, e) for a, e in zip(got, grads(None)))


def test_a_full_reduction_of_a_checkpoint_input_with_gaps_is_bitwise():
    # h.sum() over a row-major slice with gaps loops in two dimensions; over the
    # same values laid out dense it loops over one and adds in another order
    base = torch.randn(2000, 64, generator=torch.Generator().manual_seed(4))

    def fn(h):
        return (h.sum() * h).sin()

    def row_slice(b):
        return b[:, :33]

    off = ActivationOffloader(1 << 24, min_bytes=0, prefetch=0, kinds=tuple(KIND))
    got = _input_grads(base, row_slice, fn, off)
    assert off.stats.fetched_bytes[""] == 2000 * 33 * 4  # the input moved, its elements only
    assert torch.equal(got, _input_grads(base, row_slice, fn, None))


@pytest.mark.parametrize("op", ["var", "std", "var_mean"])
def test_a_full_reduction_of_a_saved_slice_with_gaps_in_backward_is_bitwise(op):
    # var's backward takes the mean of the saved slice: a full reduction of it
    reduce = {"var": torch.var, "std": torch.std, "var_mean": lambda v: torch.var_mean(v)[0]}[op]

    def body(t):
        return remat.region(lambda u: reduce(u.exp()[:, :33]), "r", recompute=False)(t)

    x = torch.randn(2000, 64, generator=torch.Generator().manual_seed(0))
    off = ActivationOffloader(1 << 24, min_bytes=0, prefetch=0)
    got = _input_grads(x, lambda b: b, body, off)
    assert off.stats.fetched_bytes["r"] >= 2000 * 33 * 4
    assert torch.equal(got, _input_grads(x, lambda b: b, body, None))
