"""forecast_remat(layout=...): one rank of FSDP2, tensor parallel, both, or DDP,
forecast in this process on a fake process group (no real group, no second
process). The per-rank measurements on 2 gloo ranks are compared in
tests/distributed/test_forecast_layouts_2rank.py; these check what needs no ranks: the
shards each rank holds (against FSDP2's and DTensor's sharding rules, worked out
here independently), the layouts' validation, and the model left untouched."""

from __future__ import annotations

import io
import math
import pathlib
import sys
from contextlib import redirect_stdout

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torch_remat._integration import format_bytes
from torch_remat.integrations.planner import Layout, forecast_remat

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))

from dist_models import MLPBlock, sequence_parallel_plan, tiny_net  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def _fsdp2_shard_bytes(model: nn.Module, world: int) -> tuple[int, int]:
    """(storage bytes, unpadded bytes) of one rank's FSDP2 shards: each parameter
    split on dim 0 into ``world`` chunks of ceil(dim0 / world) rows, every rank's
    storage padded to that size; a rank's own chunk may be shorter (the rest)."""
    storage = unpadded_rank0 = 0
    for p in model.parameters():
        rows = math.ceil(p.shape[0] / world)
        per_row = p[0].numel() * p.element_size() if p.dim() > 1 else p.element_size()
        storage += rows * per_row
        unpadded_rank0 += min(rows, p.shape[0]) * per_row
    return storage, unpadded_rank0


def test_fsdp2_rank_holds_padded_shards_and_their_gradients_and_adam_state():
    model = tiny_net(dim=16, hidden=48, depth=2)
    x = torch.randn(64, 16, dtype=torch.float64)
    before = {n: p for n, p in model.named_parameters()}
    for world in (2, 3):
        forecast = forecast_remat(
            model, x, loss_fn, 1.0, blocks=MLPBlock, layout=Layout(world), optimizer_states=2
        )
        storage, unpadded = _fsdp2_shard_bytes(model, world)
        assert forecast.parameter_bytes == storage
        assert forecast.gradient_bytes == storage  # reduce-scattered into padded shards
        assert forecast.optimizer_bytes == 2 * unpadded  # Adam's states: the unpadded shard
        assert forecast.bucket_bytes == 0
        assert f"on rank 0 of FSDP2 {world} ({world} ranks)" in forecast.format()
    # the model is not sharded by the forecast: same parameter objects, plain tensors
    assert {n: p for n, p in model.named_parameters()} == before
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert not dist.is_initialized()


def test_fsdp2_kept_bytes_are_the_unsharded_models_not_the_roots_unsharded_parameters():
    # The root keeps its parameters unsharded from its forward to its backward (in
    # storages its all-gather allocated in the forward): parameters, which the
    # planner's accounting never counts as kept. Each rank's forward keeps what the
    # unsharded model's keeps at that rank's micro-batch, for every option and policy.
    model = tiny_net(dim=16, hidden=48, depth=2)
    x = torch.randn(64, 16, dtype=torch.float64)
    alone = forecast_remat(model, x, loss_fn, 0.8, blocks=MLPBlock)
    sharded = forecast_remat(model, x, loss_fn, 0.8, blocks=MLPBlock, layout=Layout(2))
    assert (sharded.plan.base_bytes, sharded.plan.checkpoint_base_bytes) == (
        alone.plan.base_bytes, alone.plan.checkpoint_base_bytes)
    assert sharded.plan.table == alone.plan.table
    assert {n: p.kept_bytes for n, p in sharded.policies.items()} == {
        n: p.kept_bytes for n, p in alone.policies.items()}
    assert any(not n.startswith("layers.") for n, _ in model.named_parameters())  # the root's own


def test_the_last_fsdp2_rank_holds_the_remainder_of_uneven_shards():
    model = tiny_net(dim=16, hidden=48, depth=2)  # head.weight: 1 row, head.bias: 1
    x = torch.randn(64, 16, dtype=torch.float64)
    first = forecast_remat(model, x, loss_fn, 1.0, blocks=MLPBlock, layout=Layout(2, rank=0))
    last = forecast_remat(model, x, loss_fn, 1.0, blocks=MLPBlock, layout=Layout(2, rank=1))
    assert first.parameter_bytes == last.parameter_bytes  # padded storage alike
    # rank 1 holds no row of the head's weight (16 doubles) and bias (1 double)
    assert first.optimizer_bytes - last.optimizer_bytes == 2 * (16 + 1) * 8
    # activations do not depend on the rank
    assert {n: p.kept_bytes for n, p in first.policies.items()} == {
        n: p.kept_bytes for n, p in last.policies.items()
    }


def test_tensor_parallel_rank_holds_column_and_row_shards_and_keeps_dtensor_saves():
    # Colwise up: a (hidden / tp, dim) weight and (hidden / tp) bias; rowwise down:
    # (dim, hidden / tp) and the whole bias; the norm's parameters replicated.
    model = tiny_net(dim=16, hidden=64, depth=2, dropout=0.2)
    x = torch.randn(8, 8, 16, dtype=torch.float64)  # this rank's half of 16 positions
    layout = Layout(2, tp=2, tp_plan=sequence_parallel_plan())
    forecast = forecast_remat(model, x, loss_fn, 1.0, blocks=MLPBlock, layout=layout)
    block = (2 * 16) + (32 * 16 + 32) + (16 * 32 + 16)
    outside = (16 * 16 + 16) + (16 + 1)
    assert forecast.parameter_bytes == 8 * (2 * block + outside)
    # every candidate SAVE region's saves are DTensors: kept, never rebuilt
    saves = {m.option.save: m.bytes for m in forecast.plan.table[0] if m.option.checkpoint}
    assert saves[("up",)] > saves[()] and saves[("norm", "up", "down")] > saves[("up",)]
    assert "on rank 0 of TP 2 (2 ranks)" in forecast.format()


def test_ddp_rank_holds_the_whole_model_and_its_buckets():
    model = tiny_net(dim=16, hidden=48, depth=2)
    x = torch.randn(64, 16, dtype=torch.float64)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    single = forecast_remat(model, x, loss_fn, 1.0, blocks=MLPBlock)
    ddp = forecast_remat(model, x, loss_fn, 1.0, blocks=MLPBlock, layout=Layout(8, ddp=True),
                         device_memory="1MiB")
    assert ddp.parameter_bytes == ddp.gradient_bytes == ddp.bucket_bytes == params
    assert ddp.fixed_bytes == params + ddp.optimizer_bytes + params
    assert {n: p.kept_bytes for n, p in ddp.policies.items()} == {
        n: p.kept_bytes for n, p in single.policies.items()
    }
    view = forecast_remat(model, x, loss_fn, 1.0, blocks=MLPBlock,
                          layout=Layout(8, ddp=True, gradient_as_bucket_view=True))
    assert view.bucket_bytes == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=0), "world_size must be an integer >= 1"),
    (dict(world_size=8, tp=3, tp_plan={}), "tp=3 does not divide world_size=8"),
    (dict(world_size=8, fsdp=2, tp=2, tp_plan={}), "replicated shards \\(HSDP\\)"),
    (dict(world_size=8, tp=2), "pass tp_plan"),
    (dict(world_size=8, tp_plan={}), "pass tp_plan"),
    (dict(world_size=8, ddp=True, tp=2, tp_plan={}), "ddp=True replicates"),
    (dict(world_size=8, rank=8), "rank must be in \\[0, 8\\)"),
])
def test_bad_layouts_are_refused_naming_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


def test_a_layout_forecast_refuses_an_initialized_process_group_and_a_sharded_model():
    model = tiny_net()
    x = torch.randn(8, 16, dtype=torch.float64)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="Forecast before init_process_group"):
            forecast_remat(model, x, loss_fn, 1.0, blocks=MLPBlock, layout=Layout(2))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        sharded = tiny_net()
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="the model is sharded already"):
        forecast_remat(sharded, x, loss_fn, 1.0, blocks=MLPBlock, layout=Layout(2))
    with pytest.raises(TypeError, match="layout must be a Layout"):
        forecast_remat(model, x, loss_fn, 1.0, blocks=MLPBlock, layout=2)


@pytest.mark.slow  # the launcher's 65 options per block, and the micro-batch search
def test_train_py_forecasts_rank_0_of_its_fsdp2_layout_before_any_group_starts():
    sys.path.insert(0, str(ROOT / "launch"))
    import train

    # (16 MiB: micro-batches of 60 to 117 fit)
    args = train.parse_args(["--layers", "2", "--dim", "32", "--heads", "4", "--seq-len", "32",
                             "--batch-size", "4", "--parallel", "fsdp2", "--remat",
                             "budget=0.6", "--forecast", "--device-memory", "16MiB"])
    vocab = len(sorted(set(train.load_text())))
    out = io.StringIO()
    with redirect_stdout(out):
        train.forecast_before_launch(args, vocab, rank=0, world=2)
    text = out.getvalue()
    assert "remat forecast for 2 blocks at micro-batch 4 on rank 0 of FSDP2 2 (2 ranks)" in text
    assert text.startswith("torch_remat train: --forecast for rank 0 of --parallel fsdp2 on 2 ranks: running")
    with torch.device("meta"):
        model = train.GPT(train.GPTConfig(vocab, 32, 2, 32, 4))
    storage, _ = _fsdp2_shard_bytes(model, 2)
    assert f"parameters {format_bytes(storage)}, gradients {format_bytes(storage)}," in text
    assert "largest micro-batch" in text and "(equal)" in text
    assert not dist.is_initialized()
    # a rank other than 0 prints nothing
    out = io.StringIO()
    with redirect_stdout(out):
        train.forecast_before_launch(args, vocab, rank=1, world=2)
    assert out.getvalue() == ""


def test_tensor_parallel_forecast_converts_no_dtensor_to_a_fake(monkeypatch):
    # A DTensor of the sharded copy wraps fake tensors already: converting it again
    # at every op (FakeTensorMode.from_tensor) made the 8B-shaped TP forecast take
    # more than twice as long and counted nothing more. Only real plain tensors (a
    # closure's target) are converted.
    from torch_remat.integrations.planner import _fake

    ledgers = []
    init = _fake.StorageLedger.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        ledgers.append(self)

    monkeypatch.setattr(_fake.StorageLedger, "__init__", recording)
    model = tiny_net(dim=16, hidden=64, depth=2)
    x = torch.randn(8, 8, 16, dtype=torch.float64)
    layout = Layout(2, tp=2, tp_plan=sequence_parallel_plan())
    forecast_remat(model, x, loss_fn, 1.0, blocks=MLPBlock, layout=layout)
    assert ledgers
    converted = [type(t).__name__ for ledger in ledgers for t in ledger.converted]
    assert converted == [], converted[:5]


def test_offloading_tensor_parallel_activations_is_refused_naming_the_checkpoint():
    from torch_remat.integrations.planner import OffloadOptions

    model = tiny_net(dim=16, hidden=64, depth=2)
    x = torch.randn(8, 8, 16, dtype=torch.float64)
    layout = Layout(2, tp=2, tp_plan=sequence_parallel_plan())
    with pytest.raises(ValueError, match=r"checkpoint 'layers\.0' keeps .* tensor-parallel \(DTensor\)"):
        forecast_remat(model, x, loss_fn, 1.0, blocks=MLPBlock, layout=layout,
                       offload=OffloadOptions(min_bytes=0), profile="H100 SXM")
