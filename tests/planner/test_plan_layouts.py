"""plan_remat with no configuration on the layouts real models use: blocks in an
nn.ModuleList, nn.ModuleDict or nn.Sequential; default candidates that skip
parameter-free modules and group sibling projections; blocks with many candidates
planned from a bounded number of measured runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import assert_bitwise_equal, grads
from torch_remat.integrations import plan_remat, remove_remat
from torch_remat.integrations.planner import _space
from torch_remat.integrations.planner import plan as plan_module

D = 16


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class NineLinear(nn.Module):
    """Nine chained linear sub-layers, held in a container of ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        layers = [nn.Linear(D, D, dtype=torch.float64) for _ in range(9)]
        if kind == "dict":
            self.sub = nn.ModuleDict({f"fc{i}": m for i, m in enumerate(layers)})
        else:
            self.sub = nn.Sequential(*layers)
        self.act = nn.Tanh()  # parameter-free: never a candidate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.sub.values() if isinstance(self.sub, nn.ModuleDict) else self.sub:
            h = self.act(layer(h))
        return x + h


class DictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D, dtype=torch.float64)
        self.blocks = nn.ModuleDict({str(i): NineLinear("dict") for i in range(3)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks.values():
            x = block(x)
        return x


def _sequential_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(D, D, dtype=torch.float64), *(NineLinear("seq") for _ in range(3))
    )


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def _x() -> torch.Tensor:
    return torch.randn(64, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _count_runs(monkeypatch) -> list[int]:
    runs = [0]
    real = plan_module.measure

    def counting(*args, **kwargs):
        runs[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_module, "measure", counting)
    return runs


@pytest.mark.parametrize("build", [DictNet, _sequential_net], ids=["ModuleDict", "Sequential"])
def test_nine_linear_blocks_plan_with_no_configuration(build, monkeypatch):
    torch.manual_seed(0)
    model = build()
    runs = _count_runs(monkeypatch)
    plan = plan_remat(model, _x(), loss_fn, budget=0.4)
    if isinstance(model, nn.Sequential):
        assert plan.blocks == ["1", "2", "3"]  # the leading Linear is no block
    else:
        assert plan.blocks == ["blocks.0", "blocks.1", "blocks.2"]
    assert plan.measured_bytes == plan.predicted_bytes <= plan.budget_bytes
    (cands,) = plan.candidates.values()
    assert len(cands) == 9 and set(cands.values()) == {"Linear"}  # no Tanh
    # 2**9 subsets exceed the exhaustive limit: full checkpoint, each alone, and
    # at most MAX_PREDICTED combinations (plus the two no-checkpoint runs).
    assert runs[0] <= 2 + 1 + 9 + _space.MAX_PREDICTED
    x = _x().requires_grad_()
    params = list(model.parameters())
    ref = grads(params, [x], lambda x: loss_fn(model(x)))
    plan.apply()
    try:
        assert_bitwise_equal(ref, grads(params, [x], lambda x: loss_fn(model(x))))
    finally:
        remove_remat(model)


def test_the_outermost_container_of_blocks_wins_over_containers_inside_them():
    # Each NineLinear holds an nn.Sequential of nine Linears itself; those are leaves,
    # so the blocks are the children of the outer Sequential, not the Linears.
    names = _space.select_blocks(_sequential_net(), None)
    assert names == ["1", "2", "3"]


def test_a_model_without_a_container_of_blocks_is_refused_listing_the_candidates():
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = NineLinear("seq")
            self.b = NineLinear("seq")

        def forward(self, x):
            return self.b(self.a(x))

    with pytest.raises(ValueError) as e:
        plan_remat(Flat(), _x(), loss_fn, budget=0.4)
    msg = str(e.value)
    assert "nn.ModuleList, nn.ModuleDict or nn.Sequential" in msg
    assert "NineLinear: a, b" in msg and "blocks=" in msg


# ---------------------------------------------------------------- Llama-like


class SDPA(nn.Module):
    """A parameter-free attention backend (its name says attention)."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D, dtype=torch.float64))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(D, D, bias=False, dtype=torch.float64)
        self.k_proj = nn.Linear(D, D, bias=False, dtype=torch.float64)
        self.v_proj = nn.Linear(D, D, bias=False, dtype=torch.float64)
        self.o_proj = nn.Linear(D, D, bias=False, dtype=torch.float64)
        self.backend = SDPA()

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 2, D // 2).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(self.backend(q, k, v).transpose(1, 2).reshape(b, t, D))


class GatedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(D, 2 * D, bias=False, dtype=torch.float64)
        self.up_proj = nn.Linear(D, 2 * D, bias=False, dtype=torch.float64)
        self.down_proj = nn.Linear(2 * D, D, bias=False, dtype=torch.float64)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm()
        self.self_attn = SelfAttention()
        self.post_attention_layernorm = RMSNorm()
        self.mlp = GatedMLP()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, D, dtype=torch.float64)
        self.layers = nn.ModuleList(LlamaBlock() for _ in range(n))

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return x


def _tokens() -> torch.Tensor:
    return torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(2))


def test_default_candidates_skip_parameter_free_modules_and_group_sibling_projections():
    torch.manual_seed(0)
    model = Llama()
    plan = plan_remat(model, _tokens(), loss_fn, budget=0.4)
    (cands,) = plan.candidates.values()
    assert "self_attn.backend" not in cands  # an "attention" class, but no parameters
    assert {"self_attn", "self_attn.q_proj", "mlp", "mlp.gate_proj", "input_layernorm"} <= set(cands)
    siblings = [{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"},
                {"mlp.gate_proj", "mlp.up_proj"}]
    options = [m.option for opts in plan.table for m in opts]
    for option in options:
        for group in siblings:
            kept = group & set(option.save)
            assert not kept or kept == group, option  # saved all together or not at all
    assert any(siblings[0] <= set(o.save) for o in options)
    assert plan.measured_bytes == plan.predicted_bytes <= plan.budget_bytes


def test_grouping_reads_the_inputs_not_the_names():
    # Nine Linears of the same shape under one parent, chained: none share an input.
    groups = _space.group_blocks(DictNet(), ["blocks.0"], None, (_x(),))
    assert all(len(unit) == 1 for unit in groups[0].units)


# ---------------------------------------------------------------- many candidates


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, 2 * D, bias=False, dtype=torch.float64)
        self.w3 = nn.Linear(D, 2 * D, bias=False, dtype=torch.float64)
        self.w2 = nn.Linear(2 * D, D, bias=False, dtype=torch.float64)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Mixtral-style: a router and top-1 routing over four experts."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(D, n, bias=False, dtype=torch.float64)
        self.experts = nn.ModuleList(Expert() for _ in range(n))

    def forward(self, x):
        flat = x.reshape(-1, D)
        weight, choice = self.router(flat).softmax(-1).max(-1)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            idx = (choice == i).nonzero().squeeze(-1)
            out = out.index_add(0, idx, expert(flat[idx]) * weight[idx, None])
        return out.view_as(x)


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm()
        self.self_attn = SelfAttention()
        self.post_attention_layernorm = RMSNorm()
        self.block_sparse_moe = MoE()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


def test_a_block_with_sixteen_or_more_candidates_plans_from_a_bounded_number_of_runs(monkeypatch):
    torch.manual_seed(0)
    model = Llama()
    model.layers = nn.ModuleList(MoEBlock() for _ in range(2))
    runs = _count_runs(monkeypatch)
    plan = plan_remat(model, _tokens(), loss_fn, budget=0.4)
    (cands,) = plan.candidates.values()
    units = _space.group_blocks(model, plan.blocks, None, (_tokens(),))[0].units
    assert len(units) >= 16
    # warm-up and no checkpoint, the full checkpoint, each unit, the predicted
    # combinations, and the verifying run
    assert runs[0] <= 2 + 1 + len(units) + _space.MAX_PREDICTED + 1
    assert plan.measured_bytes == plan.predicted_bytes <= plan.budget_bytes
    x = _tokens()
    params = list(model.parameters())
    ref = grads(params, [], lambda: loss_fn(model(x)))
    plan.apply()
    try:
        assert_bitwise_equal(ref, grads(params, [], lambda: loss_fn(model(x))))
    finally:
        remove_remat(model)


def test_below_the_exhaustive_limit_every_combination_is_measured(monkeypatch):
    # Llama block: 8 units, nested in two containers -> 1 + 5*5*2*2 = 101 options.
    # Measured whole, and pruned under a lower limit: the pruned table holds real
    # options only, within the bound, and its plan costs no less than the optimum.
    torch.manual_seed(0)
    model = Llama(n=1)
    monkeypatch.setattr(_space, "MAX_EXHAUSTIVE_OPTIONS", 10_000)
    full = plan_remat(model, _tokens(), loss_fn, budget=0.4)
    assert len(full.table[0]) == 1 + 5 * 5 * 2 * 2
    monkeypatch.setattr(_space, "MAX_EXHAUSTIVE_OPTIONS", 64)
    pruned = plan_remat(model, _tokens(), loss_fn, budget=0.4)
    assert len(pruned.table[0]) <= 2 + 8 + _space.MAX_PREDICTED
    assert {m.option for m in pruned.table[0]} <= {m.option for m in full.table[0]}
    assert pruned.recompute_flops >= full.recompute_flops


# ---------------------------------------------------------------- small blocks


class NineReLU(nn.Module):
    def __init__(self, d: int, p: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({f"l{i}": nn.Linear(d, d) for i in range(9)})
        self.p = p

    def forward(self, x):
        for layer in self.layers.values():
            x = F.dropout(torch.relu(layer(x)), self.p, self.training)
        return x


def test_small_blocks_that_draw_no_random_numbers_keep_no_rng_state():
    # A CPU RNG snapshot (5,056 B) per checkpoint is more than these blocks hold;
    # blocks that drew no random numbers in the example forward keep none.
    torch.manual_seed(0)
    model = nn.Sequential(*(NineReLU(32) for _ in range(4)))
    x = torch.randn(8, 32)
    plan = plan_remat(model, x, budget=0.4)
    assert plan.measured_bytes == plan.predicted_bytes <= plan.budget_bytes
    assert plan.rng_free == ["0", "1", "2", "3"]
    params = list(model.parameters())
    ref = grads(params, [], lambda: model(x).sum())
    plan.apply()
    try:
        assert_bitwise_equal(ref, grads(params, [], lambda: model(x).sum()))
    finally:
        remove_remat(model)


def test_blocks_with_dropout_keep_their_rng_state_and_stay_exact():
    torch.manual_seed(0)
    model = nn.Sequential(*(NineReLU(64, p=0.1) for _ in range(3))).double()
    x = torch.randn(16, 64, dtype=torch.float64)
    plan = plan_remat(model, x, budget=0.4)
    assert plan.rng_free == []
    params = list(model.parameters())
    ref = grads(params, [], lambda: model(x).sum())
    plan.apply()
    try:
        assert_bitwise_equal(ref, grads(params, [], lambda: model(x).sum()))
    finally:
        remove_remat(model)


def test_a_model_planned_in_eval_mode_keeps_the_rng_state():
    # Dropout is off in eval mode; training later would draw: keep the snapshot.
    model = nn.Sequential(*(NineReLU(64, p=0.1) for _ in range(3))).eval()
    plan = plan_remat(model, torch.randn(16, 64), budget=0.6)
    assert plan.rng_free == []


class TakesPositions(nn.Module):
    """A block handed a tensor made outside the blocks that it does not use (as
    transformers' decoder layers get position_ids): only a checkpoint keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 4 * D, dtype=torch.float64)
        self.fc2 = nn.Linear(4 * D, D, dtype=torch.float64)

    def forward(self, x, positions):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class PositionsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TakesPositions() for _ in range(3))

    def forward(self, x):
        positions = torch.arange(x.shape[0])
        for layer in self.layers:
            x = layer(x, positions)
        return x


def test_bytes_a_checkpoint_keeps_outside_the_blocks_are_predicted():
    torch.manual_seed(0)
    model = PositionsNet()
    x = _x()
    for budget in (0.5, 0.7, 0.9):
        plan = plan_remat(model, x, loss_fn, budget=budget)  # verify: measured == predicted
        assert plan.measured_bytes == plan.predicted_bytes <= plan.budget_bytes
