"""Per-rank forecasts against per-rank measurements, run on every rank under torchrun:

    torchrun --standalone --nproc-per-node 2 forecast_checks.py OUT_DIR

Each rank first forecasts its own rank of every layout (``forecast_remat(...,
layout=Layout(2, ..., rank=RANK))``: a fake process group, no real one yet), then
joins the gloo group, shards the same model for real and measures it as the planner
measures (``plan_remat``'s ``measure``: the option table and every policy's kept
bytes) and as the allocator holds it (parameter shards, gradients, Adam's
state). Every check compares forecast and measurement exactly and writes
``OUT_DIR/rank{N}.json`` (``{check: {"ok", "error", "data"}}``).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from dist_models import MLPBlock, sequence_parallel_plan, tiny_net
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from torch_remat.integrations.planner import Layout, forecast_remat
from torch_remat.integrations.planner._fake import storage_bytes
from torch_remat.integrations.planner._measure import (
    blocks_drawing_no_random_numbers,
    measure,
)
from torch_remat.integrations.planner._space import group_blocks, select_blocks
from torch_remat.integrations.planner.plan import measure_table

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
BLOCKS = ["layers.0", "layers.1"]
BUDGET = 0.8


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def _fsdp_model():
    return tiny_net(dim=16, hidden=48, dropout=0.1)


def _fsdp_input():
    torch.manual_seed(10 + RANK)  # each rank its own batch, of one shape
    return torch.randn(64, 16, dtype=torch.float64)


def _tp_model():
    return tiny_net(dim=16, hidden=64, dropout=0.2)


def _tp_input():
    torch.manual_seed(10)  # the sequence split over the ranks: this rank's slice
    return torch.randn(8, 16, 16, dtype=torch.float64).chunk(WORLD, dim=1)[RANK]


def _shard_fsdp(model):
    mesh = init_device_mesh("cpu", (WORLD,))
    for name in reversed(BLOCKS):
        fully_shard(model.get_submodule(name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _shard_tp(model):
    parallelize_module(model, init_device_mesh("cpu", (WORLD,)), sequence_parallel_plan())
    return model


LAYOUTS = {
    "fsdp2": (_fsdp_model, _fsdp_input, _shard_fsdp, dict(world_size=WORLD)),
    "tp": (_tp_model, _tp_input, _shard_tp, dict(world_size=WORLD, tp=WORLD,
                                                 tp_plan=sequence_parallel_plan())),
    "ddp": (_fsdp_model, _fsdp_input, None, dict(world_size=WORLD, ddp=True)),
}


def _forecast(kind: str):
    build, inputs, _, layout = LAYOUTS[kind]
    return forecast_remat(
        build(), inputs(), loss_fn, BUDGET, blocks=MLPBlock, layout=Layout(**layout, rank=RANK)
    )


def _adam_state_bytes(model, x) -> int:
    """Bytes of Adam's two moment tensors per parameter after one step (its ``step``
    counters, one 4-byte scalar per parameter, are not counted by the forecast)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn(model(x)).backward()
    opt.step()
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    opt.zero_grad(set_to_none=True)
    return storage_bytes(moments)


def _compare(kind: str, forecast, model, x) -> dict:
    """The forecast of this rank against this rank's measurements of ``model``: the
    planner's option table and the bytes of every policy, measured on the real
    group as ``plan_remat`` measures them, and the allocator's parameter, gradient and optimizer
    bytes. Every measurement runs before any comparison, so that a failing rank
    stays in step with the other."""
    names = select_blocks(model, MLPBlock)
    groups = group_blocks(model, names, None, (x,))
    rng_free = blocks_drawing_no_random_numbers(model, (x,), names)
    base, checkpoint_base, table, _refused = measure_table(
        model, (x,), loss_fn, names, groups, frozenset(rng_free), measure=measure
    )
    kept = {
        name: measure(model, (x,), loss_fn, policy.config, names).total_bytes
        for name, policy in forecast.policies.items()
    }
    params = storage_bytes(list(model.parameters()))
    loss_fn(model(x)).backward()
    grads = storage_bytes([p.grad for p in model.parameters()])
    for p in model.parameters():
        p.grad = None
    moments = _adam_state_bytes(model, x)

    fp = forecast.plan
    assert fp.blocks == names == BLOCKS
    assert fp.rng_free == rng_free, (fp.rng_free, rng_free)
    assert (fp.base_bytes, fp.checkpoint_base_bytes) == (base, checkpoint_base), (
        fp.base_bytes, fp.checkpoint_base_bytes, base, checkpoint_base)
    for name, real, fake in zip(names, table, fp.table):
        assert fake == real, (name, fake, real)  # bytes, FLOPs and ops of every option
    for name, policy in forecast.policies.items():
        assert kept[name] == policy.kept_bytes, (name, kept[name], policy.kept_bytes)
    assert params == forecast.parameter_bytes, (params, forecast.parameter_bytes)
    assert grads == forecast.gradient_bytes, (grads, forecast.gradient_bytes)
    assert moments == forecast.optimizer_bytes, (moments, forecast.optimizer_bytes)
    return {
        "kind": kind,
        "kept_bytes": kept,
        "parameter_bytes": params,
        "gradient_bytes": grads,
        "optimizer_bytes": moments,
        "table": [[m.bytes for m in opts] for opts in table],
        "format": forecast.format(),
    }


FORECASTS: dict[str, object] = {}


def check_fsdp2_forecast_of_each_rank_equals_its_measurement(ctx=None):
    build, inputs, shard, _ = LAYOUTS["fsdp2"]
    return _compare("fsdp2", FORECASTS["fsdp2"], shard(build()), inputs())


def check_tensor_parallel_forecast_of_each_rank_equals_its_measurement(ctx=None):
    build, inputs, shard, _ = LAYOUTS["tp"]
    return _compare("tp", FORECASTS["tp"], shard(build()), inputs())


def check_ddp_forecast_equals_the_replica(ctx=None):
    build, inputs, _, _ = LAYOUTS["ddp"]
    forecast = FORECASTS["ddp"]
    model = build()
    x = inputs()
    # activations, parameters, gradients and Adam's state: those of the replica
    data = _compare("ddp", forecast, model, x)
    # its gradient buckets are the trainable parameters' bytes, counted, not run
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert forecast.bucket_bytes == trainable, (forecast.bucket_bytes, trainable)
    data["bucket_bytes"] = forecast.bucket_bytes
    return data


CHECKS = [
    check_fsdp2_forecast_of_each_rank_equals_its_measurement,
    check_tensor_parallel_forecast_of_each_rank_equals_its_measurement,
    check_ddp_forecast_equals_the_replica,
]


def main() -> None:
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    results: dict[str, dict] = {}
    forecast_error = ""
    try:
        for kind in LAYOUTS:
            FORECASTS[kind] = _forecast(kind)
    except Exception:  # noqa: BLE001 - reported by every check
        forecast_error = traceback.format_exc()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    for check in CHECKS:
        try:
            if forecast_error:
                raise RuntimeError(f"forecasting failed:\n{forecast_error}")
            torch.manual_seed(0)
            results[check.__name__] = {"ok": True, "error": "", "data": check() or {}}
        except Exception:  # noqa: BLE001 - every failure goes to pytest
            results[check.__name__] = {"ok": False, "error": traceback.format_exc(), "data": {}}
        with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
            json.dump(results, f, indent=1)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
