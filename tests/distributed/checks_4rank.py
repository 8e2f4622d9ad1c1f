"""Checks run on 4 gloo ranks: a 2-D (dp=2, tp=2) mesh with FSDP2 over TP."""

from __future__ import annotations

import torch
from checks_2rank import CollectiveLog, training_steps_touch_no_store_and_remat_adds_no_collective
from dist_models import MLPBlock, assert_grads_equal, param_grads, sequence_parallel_plan, tiny_net
from torch.distributed.device_mesh import init_device_mesh

from torch_remat.integrations import RematConfig, fully_shard_with_remat, remat_module_names


def _run_2d(config):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tiny_net(dropout=0.2)
    fully_shard_with_remat(
        model,
        MLPBlock,
        mesh=mesh["dp"],
        tp_mesh=mesh["tp"],
        tp_plan=sequence_parallel_plan(),
        remat=config,
    )
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    torch.manual_seed(10 + dp_rank)  # a batch per data-parallel rank
    x = torch.randn(2, 8, 16, dtype=torch.float64).chunk(2, dim=1)[tp_rank]
    torch.manual_seed(20 + dp_rank)  # equal seeds inside a TP group, as DTensor expects
    with CollectiveLog() as log:
        loss = model(x).pow(2).sum()
        loss.backward()
    return model, loss.detach(), param_grads(model), log


def fsdp2_over_tp_2d_mesh_gradients_equal_without_remat(ctx):
    _, plain_loss, plain_grads, plain_log = _run_2d(RematConfig(enabled=False))
    model, loss, grads, log = _run_2d(RematConfig())
    assert remat_module_names(model) == ["layers.0", "layers.1"]
    # parameters of the blocks are 2-D: sharded over dp by FSDP2 and over tp by TP
    weight = model.layers[0].up.weight
    assert weight.device_mesh.mesh_dim_names == ("dp", "tp")
    assert len(weight.placements) == 2  # (dp shard, tp shard)
    assert torch.equal(plain_loss, loss)
    assert_grads_equal(plain_grads, grads)
    assert log.count("_allgather_base_", during_recompute=True) == 0
    # the blocks were recomputed: their TP collectives ran again in backward
    assert any(r for _, r in log.calls), "the recompute replayed no TP collective"
    assert log.count("_allgather_base_") == plain_log.count("_allgather_base_") == 5
    assert log.count("_reduce_scatter_base_") == plain_log.count("_reduce_scatter_base_") == 3
    return {
        "fsdp_all_gather": log.count("_allgather_base_"),
        "fsdp_reduce_scatter": log.count("_reduce_scatter_base_"),
        "tp_collectives_replayed_by_recompute": sum(1 for _, r in log.calls if r),
    }


CHECKS = [
    fsdp2_over_tp_2d_mesh_gradients_equal_without_remat,
    training_steps_touch_no_store_and_remat_adds_no_collective,
]
