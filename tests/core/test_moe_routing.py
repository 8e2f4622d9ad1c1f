"""A mixture-of-experts block whose routing depends on the data: a top-k router
(softmax + topk, optional jitter noise, an auxiliary load-balancing loss), token
dispatch with data-dependent shapes (``torch.where``, ``index_add``), optional
capacity (token dropping). The router runs in a SAVE region, so the replay reuses
the forward's routing; the experts are recomputed by the checkpoint or offloaded.
Routing and gradients equal a run without remat bit for bit; a router that is
recomputed from state the replay does not restore raises instead of routing
differently."""

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import UnseenLog, recorded_replays
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import torch_remat as remat
from torch_remat.integrations import RematConfig, apply_remat, remove_remat
from torch_remat.integrations.planner import forecast_remat, plan_remat
from torch_remat.integrations.planner._fake import DataDependentOpError
from torch_remat.offload import ActivationOffloader

D = 8
E = 4
F64 = torch.float64

# What every call of each MoE dispatched, replays too, by id of the MoE, in an
# UnseenLog: remat sets a module's attributes, and the lists and dicts its code
# reads, around the replay.
ROUTING: dict[int, UnseenLog] = {}
DROPPED: dict[int, int] = {}


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, 2 * D, bias=False, dtype=F64)
        self.w2 = nn.Linear(2 * D, D, bias=False, dtype=F64)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)))


class Router(nn.Module):
    """Top-k gate with multiplicative jitter while training, and the switch
    load-balancing loss (experts' token fractions times their mean probabilities)."""

    def __init__(self, k: int, jitter: float = 0.0, generator=None) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False, dtype=F64)
        self.k, self.jitter, self.generator = k, jitter, generator

    def forward(self, x):
        if self.training and self.jitter:
            noise = torch.rand(x.shape, dtype=x.dtype, generator=self.generator)
            x = x * (1 - self.jitter + 2 * self.jitter * noise)
        probs = self.gate(x).softmax(-1)
        weight, expert = probs.topk(self.k, -1)
        weight = weight / weight.sum(-1, keepdim=True)
        counts = torch.bincount(expert[:, 0], minlength=E).to(probs.dtype)
        aux = E * (counts / x.shape[0] * probs.mean(0)).sum()
        return weight, expert, aux


class MoE(nn.Module):
    """``keep_router``: the router is a SAVE region. ``offload_experts``: each expert
    is a SAVE region named ``experts.<i>`` (for an offloader's ``regions=``).
    ``capacity_factor``: each expert takes at most ``ceil(cf * tokens * k / E)``
    assignments, the rest are dropped (they add nothing to the output)."""

    def __init__(self, k=1, jitter=0.0, generator=None, capacity_factor=None,
                 keep_router=True, offload_experts=False) -> None:
        super().__init__()
        self.router = Router(k, jitter, generator)
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.capacity_factor = capacity_factor
        self.keep_router, self.offload_experts = keep_router, offload_experts
        # keyed by id: a collected module's id can be handed to this one
        ROUTING.pop(id(self), None)
        DROPPED.pop(id(self), None)

    @property
    def routing(self) -> UnseenLog:
        log = ROUTING.get(id(self))
        if log is None:
            log = ROUTING[id(self)] = UnseenLog()
        return log

    @property
    def dropped(self) -> int:
        return DROPPED.get(id(self), 0)

    def forward(self, x):
        flat = x.reshape(-1, D)
        if self.keep_router:
            weight, expert, aux = remat.region(self.router, "router", recompute=False)(flat)
        else:
            weight, expert, aux = self.router(flat)
        remat.recompute_needs_tensor(weight, expert)  # the replay's dispatch reads them
        capacity = None
        if self.capacity_factor is not None:
            capacity = -(-int(self.capacity_factor * flat.shape[0] * self.router.k) // E)
        out = torch.zeros_like(flat)
        seen: list[torch.Tensor] = []
        self.routing.append(seen)  # before the dispatch: the replay stops early after it
        for i, ffn in enumerate(self.experts):
            token, slot = torch.where(expert == i)
            if capacity is not None:
                if not remat.is_recomputing():
                    DROPPED[id(self)] = self.dropped + max(0, token.numel() - capacity)
                token, slot = token[:capacity], slot[:capacity]
            seen.append(token.detach().clone())
            if self.offload_experts:
                y = remat.region(ffn, f"experts.{i}", recompute=False)(flat[token])
            else:
                y = ffn(flat[token])
            out = out.index_add(0, token, y * weight[token, slot, None])
        return out.view_as(x), aux


def _x(seed=0, tokens=24):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens // 6, 6, D, dtype=F64, generator=g)


def _run(moe, x, ck=None, seed=7, reseed=None):
    """Loss (output and aux loss), gradients of parameters and input; ``ck``: the
    checkpoint options, None for no remat."""
    moe.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    if reseed is not None:
        reseed.manual_seed(seed)
    fn = moe if ck is None else remat.checkpoint(region_name="moe", **ck)(moe)
    y, aux = fn(x)
    loss = y.square().sum() + 0.01 * aux
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in moe.parameters()] + [x.grad.clone()]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))


def _routing_equal(moe, calls):
    """The first call (no remat) and every later one (the remat forward and its
    replay) dispatched the same tokens to each expert."""
    ref = moe.routing[0]
    assert len(moe.routing) == calls
    return all(_same(ref, r) for r in moe.routing[1:])


def _check_exact(moe, x, ck=None, reseed=None, replayed=True):
    ck = {} if ck is None else ck
    moe.routing.clear()
    ref = _run(moe, x, None, reseed=reseed)
    got = _run(moe, x, ck, reseed=reseed)
    assert _same(ref, got)
    # no remat, remat forward, and the replay (which runs the dispatch again)
    assert _routing_equal(moe, 3 if replayed else 2)


def test_experts_recomputed_router_kept_routing_and_gradients_are_exact():
    torch.manual_seed(0)
    moe = MoE()
    _check_exact(moe, _x())


def test_top2_routing_is_exact():
    torch.manual_seed(1)
    moe = MoE(k=2)
    _check_exact(moe, _x(1))
    assert all(r.numel() for r in moe.routing[0])  # every expert got tokens


def test_capacity_factor_token_dropping_is_exact_and_drops_tokens():
    torch.manual_seed(2)
    moe = MoE(k=2, capacity_factor=0.75)
    _check_exact(moe, _x(2))
    assert moe.dropped > 0


def test_experts_offloaded_move_their_saves_and_stay_exact():
    torch.manual_seed(3)
    moe = MoE(offload_experts=True)
    off = ActivationOffloader(1 << 20, min_bytes=0, prefetch=0, regions=["*experts*"])
    _check_exact(moe, _x(3), dict(saved_tensors_hooks=off))
    moved = off.stats.offloaded_bytes
    assert moved and all(name.startswith("experts.") for name in moved)
    assert sum(moved.values()) > 0
    assert off.stats.fetched_bytes == moved  # all of it came back for backward


def test_router_jitter_from_the_default_generator_is_replayed_exactly_when_the_router_is_kept():
    torch.manual_seed(4)
    moe = MoE(jitter=0.3)
    _check_exact(moe, _x(4))


def test_a_recomputed_router_with_jitter_is_exact_with_an_rng_hook_and_refused_without():
    torch.manual_seed(5)
    moe = MoE(jitter=0.3, keep_router=False)
    _check_exact(moe, _x(5), dict(recompute_state_hooks=[remat.CPURNGStateHook()]))
    with pytest.raises(remat.RecomputeMismatchError):
        _run(moe, _x(5), {})


def test_a_recomputed_router_drawing_from_its_own_generator_is_exact():
    # The router's jitter comes from a torch.Generator the module holds (no state
    # hook restores it): the replay forks it from its state at the checkpoint's entry,
    # so the recomputed router routes as the forward did, and the module's generator
    # ends where it would without remat.
    for capacity_factor in (None, 0.5):  # dynamic and static dispatch shapes
        torch.manual_seed(6)
        g = torch.Generator()
        moe = MoE(jitter=0.5, generator=g, keep_router=False, capacity_factor=capacity_factor)
        _check_exact(moe, _x(6), reseed=g)
        after_remat = g.get_state()
        torch.manual_seed(6)
        g2 = torch.Generator()
        plain = MoE(jitter=0.5, generator=g2, keep_router=False, capacity_factor=capacity_factor)
        _run(plain, _x(6), None, reseed=g2)
        _run(plain, _x(6), None, reseed=g2)
        assert torch.equal(after_remat, g2.get_state())
    # kept in a SAVE region, the same router is exact too
    torch.manual_seed(6)
    g = torch.Generator()
    moe = MoE(jitter=0.5, generator=g)
    _check_exact(moe, _x(6), reseed=g)


def test_a_generator_in_a_closure_is_forked_around_the_replay():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, dtype=F64, requires_grad=True)

    def noisy(t):
        return (t * torch.rand(t.shape, generator=g, dtype=F64)).sin().sum()

    start = g.get_state()
    with recorded_replays() as replayed:
        loss = remat.checkpoint(region_name="noisy")(noisy)(x)
        loss.backward()
    assert replayed == ["noisy"]
    after = g.get_state()
    g.set_state(start)
    ref = x.detach().requires_grad_()
    noisy(ref).backward()
    assert torch.equal(x.grad, ref.grad) and torch.equal(after, g.get_state())


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    tokens=st.sampled_from([6, 12, 24, 36]),
    k=st.sampled_from([1, 2]),
    capacity_factor=st.sampled_from([None, 0.5, 1.0, 1.25]),
    policy=st.sampled_from(["recompute", "offload", "jitter_kept", "jitter_hook", "jitter_own_generator"]),
)
def test_property_routing_and_gradients_are_exact(seed, tokens, k, capacity_factor, policy):
    torch.manual_seed(seed)
    jitter = 0.2 if policy.startswith("jitter") else 0.0
    g = torch.Generator() if policy == "jitter_own_generator" else None
    moe = MoE(k=k, jitter=jitter, capacity_factor=capacity_factor, generator=g,
              keep_router=policy not in ("jitter_hook", "jitter_own_generator"),
              offload_experts=policy == "offload")
    ck = {}
    if policy == "offload":
        ck["saved_tensors_hooks"] = ActivationOffloader(1 << 20, min_bytes=0, prefetch=0,
                                                        regions=["*experts*"])
    if policy == "jitter_hook":
        ck["recompute_state_hooks"] = [remat.CPURNGStateHook()]
    _check_exact(moe, _x(seed, tokens), ck, reseed=g)


class Block(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D, dtype=F64)
        self.moe = MoE(**kw)

    def forward(self, x):
        y, aux = self.moe(self.norm(x))
        return x + y + 0.01 * aux


class Net(nn.Module):
    def __init__(self, n=2, **kw) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(**kw) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _net_grads(net, x):
    net.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    net(x).square().sum().backward()
    return [p.grad.clone() for p in net.parameters()]


def test_apply_remat_with_the_router_as_save_module_is_exact_and_does_not_rerun_the_router():
    torch.manual_seed(8)
    net = Net(jitter=0.3, keep_router=False)  # the router's SAVE region comes from apply_remat
    x = _x(8)
    ref = _net_grads(net, x)
    calls = UnseenLog()
    for layer in net.layers:
        layer.moe.router.gate.register_forward_hook(lambda *a: calls.append(1))
    apply_remat(net, check_fn=lambda m: isinstance(m, Block),
                remat=RematConfig(save_modules=Router))
    try:
        got = _net_grads(net, x)
    finally:
        remove_remat(net)
    assert _same(ref, got)
    assert len(calls) == 2  # once per block, in the forward only
    for layer in net.layers:  # forward without, forward with remat, replay
        assert len(layer.moe.routing) == 3
        assert _same(layer.moe.routing[0], layer.moe.routing[2])


@pytest.mark.slow  # about 8 s: one measured run per candidate option
def test_plan_remat_measures_the_moe_on_real_tensors_and_its_plan_is_exact():
    torch.manual_seed(9)
    net = Net()
    x = _x(9)
    ref = _net_grads(net, x)
    plan = plan_remat(net, (x,), lambda o: o.square().sum(), budget=0.9)
    assert plan.measured_bytes <= plan.budget_bytes
    plan.apply()
    try:
        assert _same(ref, _net_grads(net, x))
    finally:
        remove_remat(net)


class WhereRouter(nn.Module):
    """Routing variants whose first data-dependent op differs."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False, dtype=F64)
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.how = how

    def forward(self, x):
        flat = x.reshape(-1, D)
        weight, expert = self.gate(flat).softmax(-1).max(-1)
        out = torch.zeros_like(flat)
        if self.how == "sort":  # sizes read into Python: .tolist() of a bincount
            order = expert.argsort(stable=True)
            sizes = torch.bincount(expert, minlength=E).tolist()
            for i, token in enumerate(order.split(sizes)):
                out = out.index_add(0, token, self.experts[i](flat[token]) * weight[token, None])
            return out.view_as(x)
        for i, ffn in enumerate(self.experts):
            if self.how == "mask":
                mask = expert == i
                out[mask] = out[mask] + ffn(flat[mask]) * weight[mask, None]
            else:
                token = (expert == i).nonzero().squeeze(-1)
                out = out.index_add(0, token, ffn(flat[token]) * weight[token, None])
        return out.view_as(x)


class WhereBlock(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.moe = WhereRouter(how)

    def forward(self, x):
        return x + self.moe(x)


@pytest.mark.parametrize("how, op", [
    ("nonzero", "aten.(nonzero|index)"), ("mask", "aten.(nonzero|index)"), ("sort", "aten.bincount"),
])
def test_forecast_refuses_data_dependent_routing_naming_the_block_and_the_op(how, op):
    net = nn.Sequential(WhereBlock(how), WhereBlock(how))
    with pytest.raises(DataDependentOpError) as info:
        forecast_remat(net, (_x(),), lambda o: o.square().sum(), budget=0.5,
                       blocks=WhereBlock)
    msg = str(info.value)
    assert re.search(f"forecast_remat: {op}", msg)
    assert "in '0.moe' (WhereRouter), inside '0' (WhereBlock)" in msg
    assert "routing" in msg and "plan_remat" in msg


def test_forecast_refuses_the_moe_with_router_and_capacity():
    with pytest.raises(DataDependentOpError, match=r"aten\.bincount.* in 'layers\.0\.moe\.router' \(Router\), inside "
                       r"'layers\.0\.moe' \(MoE\), 'layers\.0' \(Block\)"):
        forecast_remat(Net(capacity_factor=1.0), (_x(),), lambda o: o.square().sum(), budget=0.5)
