"""Checks run on 2 gloo ranks (see dist_worker.py); each raises on failure and
returns the numbers it measured. Listed in CHECKS in launch order."""

from __future__ import annotations

import gc
import json
import os

import torch
import torch.distributed as dist
from dist_memory import resident_bytes_outside_fsdp
from dist_models import (
    MLPBlock,
    assert_grads_equal,
    param_grads,
    sequence_parallel_plan,
    tiny_net,
)
from helpers import recorded_replays
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

import torch_remat as remat
from torch_remat.integrations import (
    MemoryReportTimeout,
    RematConfig,
    apply_remat,
    ddp_with_remat,
    fully_shard_with_remat,
    gather_memory_report,
    parallelize_with_remat,
    plan_remat,
    prepare_dtensor_rng,
    remat_module_names,
    remove_remat,
)

NO_REMAT = RematConfig(enabled=False)


class CollectiveLog(TorchDispatchMode):
    """Test-only: records every c10d collective and whether a recompute issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            self.calls.append((func.name().split("::")[1], remat.is_recomputing()))
        return func(*args, **(kwargs or {}))

    def count(self, name: str, *, during_recompute: bool | None = None) -> int:
        return sum(
            1
            for n, r in self.calls
            if n == name and (during_recompute is None or r == during_recompute)
        )


def _batch(ctx, shape=(8, 16), seed=10):
    torch.manual_seed(seed + ctx.rank)
    return torch.randn(*shape, dtype=torch.float64)


def _fsdp_step(ctx, model, x, *, seed=20):
    """One forward/backward; returns (loss, grads, collectives)."""
    torch.manual_seed(seed + ctx.rank)  # each rank draws its own dropout masks
    with CollectiveLog() as log:
        loss = model(x).pow(2).sum()
        loss.backward()
    return loss.detach(), param_grads(model), log


def _profiled_forward(model, x):
    """The profile of one forward (no dispatch mode active: it would move allocations
    out of FSDP2's profiler scopes)."""
    # Objects of earlier steps (FSDP2 state holds reference cycles) must not be
    # collected inside the measured forward.
    gc.collect()
    gc.disable()
    try:
        with torch.profiler.profile(profile_memory=True) as prof:
            loss = model(x).pow(2).sum()
    finally:
        gc.enable()
    loss.backward()
    return prof


# ----------------------------------------------------------------------- FSDP2


def fsdp2_gradients_equal_without_remat(ctx):
    x = _batch(ctx)
    results = {}
    for name, config in (("plain", NO_REMAT), ("remat", RematConfig())):
        model = tiny_net(dropout=0.2)
        fully_shard_with_remat(model, MLPBlock, remat=config)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _fsdp_step(ctx, model, x)
        opt.step()
        opt.zero_grad()
        results[name] = _fsdp_step(ctx, model, x, seed=30)  # second step: resharded params
        if config.enabled:
            assert remat_module_names(model) == ["layers.0", "layers.1"]
    assert torch.equal(results["plain"][0], results["remat"][0])
    assert_grads_equal(results["plain"][1], results["remat"][1])


def fsdp2_compiled_remat_gives_the_gradients_of_eager_remat(ctx):
    from torch._dynamo.utils import counters

    x = _batch(ctx)
    results = {}
    # The projections are SAVE regions, so the compiled graph has tags to obey.
    config = RematConfig(save_modules=nn.Linear)
    for name, compile_options in (("eager", False), ("compiled", {"backend": "aot_eager"})):
        torch._dynamo.reset()
        counters.clear()
        model = tiny_net()
        fully_shard_with_remat(model, MLPBlock, remat=config, compile=compile_options)
        # No dispatch mode around the step (CollectiveLog): Dynamo skips frames
        # that run under one, and would silently not compile.
        torch.manual_seed(30 + ctx.rank)
        loss = model(x).pow(2).sum()
        loss.backward()
        results[name] = (loss.detach(), param_grads(model))
    graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    torch._dynamo.reset()  # clears the counters too: read them first
    assert graphs == 2, graphs  # one per block
    assert not breaks, breaks
    assert torch.equal(results["eager"][0], results["compiled"][0])
    assert_grads_equal(results["eager"][1], results["compiled"][1])


def fsdp2_remat_applied_after_fully_shard_gives_equal_gradients(ctx):
    x = _batch(ctx)
    reference = tiny_net(dropout=0.2)
    fully_shard_with_remat(reference, MLPBlock, remat=NO_REMAT)
    model = tiny_net(dropout=0.2)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    assert apply_remat(model, check_fn=lambda m: isinstance(m, MLPBlock)) == [
        "layers.0",
        "layers.1",
    ]
    assert type(model.layers[0]).__name__ == "FSDPMLPBlock"
    assert_grads_equal(_fsdp_step(ctx, reference, x)[1], _fsdp_step(ctx, model, x)[1])


def fsdp2_a_checkpoint_around_a_sharded_block_gives_equal_gradients(ctx):
    # remat.checkpoint called on fully_shard-ed blocks (FSDP2's hooks inside the
    # checkpoint, as torch.utils.checkpoint(block, x) has them). Before, the replay
    # put back the sharded parameters it saw at the checkpoint's start over the
    # unsharded ones FSDP2's pre-backward hook had set: "mixed torch.Tensor and
    # DTensor" in the replay's layer norm.
    x = _batch(ctx)
    grads = []
    for ckpt in (False, True):
        model = tiny_net(dropout=0.2)
        for block in model.layers:
            fully_shard(block)
        calls = [
            remat.checkpoint(region_name=f"layers.{i}", recompute_state_hooks=(remat.CPURNGStateHook(),))(b)
            if ckpt else b
            for i, b in enumerate(model.layers)
        ]

        def forward(t, calls=calls, model=model):
            h = model.embed(t)
            for call in calls:
                h = call(h)
            return model.head(h)

        torch.manual_seed(20 + ctx.rank)
        with recorded_replays() as replayed:
            forward(x).pow(2).sum().backward()
        grads.append(param_grads(model))
    assert sorted(replayed) == ["layers.0", "layers.1"], replayed
    assert_grads_equal(grads[0], grads[1])


def fsdp2_recompute_issues_no_all_gather(ctx):
    x = _batch(ctx)
    logs = {}
    for name, config in (("plain", NO_REMAT), ("remat", RematConfig())):
        model = tiny_net(dropout=0.2)
        fully_shard_with_remat(model, MLPBlock, remat=config)
        with recorded_replays() as replayed:
            logs[name] = _fsdp_step(ctx, model, x)[2]
    plain, with_remat = logs["plain"], logs["remat"]
    # the recompute ran: the remat step (the last) replayed both blocks
    assert sorted(replayed) == ["layers.0", "layers.1"], replayed
    # root (embed+head) and 2 blocks gathered in forward, the 2 blocks again in backward
    assert plain.count("_allgather_base_") == with_remat.count("_allgather_base_") == 5
    assert plain.count("_reduce_scatter_base_") == with_remat.count("_reduce_scatter_base_") == 3
    assert with_remat.count("_allgather_base_", during_recompute=True) == 0
    assert with_remat.calls == plain.calls
    return {
        "all_gather": with_remat.count("_allgather_base_"),
        "reduce_scatter": with_remat.count("_reduce_scatter_base_"),
        "all_gather_during_recompute": with_remat.count("_allgather_base_", during_recompute=True),
    }


def fsdp2_activation_bytes_per_rank_are_lower_with_remat(ctx):
    """Bytes the forward leaves allocated on each rank (dist_memory.py), exact."""
    batch, seq, dim, hidden, depth = 4, 32, 16, 32, 2
    x = _batch(ctx, (batch, seq, dim))

    def forward_bytes(config):
        model = tiny_net(depth=depth)  # no dropout: its masks would add 1 byte per element
        fully_shard_with_remat(model, MLPBlock, remat=config)
        return resident_bytes_outside_fsdp(_profiled_forward(model, x))

    resident = {
        "plain": forward_bytes(NO_REMAT),
        "remat": forward_bytes(RematConfig(rng_state_hooks=False)),
        "remat_with_cpu_rng_hooks": forward_bytes(RematConfig()),
    }
    f64, rows = 8, batch * seq
    # Each block without remat keeps LayerNorm's mean and rstd, its output (saved by
    # `up`) and tanh's output (saved by tanh and `down`); remat drops all of it.
    per_block = 2 * rows * f64 + rows * dim * f64 + rows * hidden * f64
    assert resident["plain"] - resident["remat"] == depth * per_block, resident
    # What stays with remat: the embed output, both block outputs (each the next
    # one's checkpoint input), the head output and the loss.
    assert resident["remat"] == 3 * rows * dim * f64 + rows * f64 + f64, resident
    # The CPU generator snapshot taken at each checkpoint's entry: 5056 bytes.
    assert resident["remat_with_cpu_rng_hooks"] - resident["remat"] == depth * 5056, resident
    return {"forward_resident_bytes_per_rank": resident, "dropped_per_block": per_block}


def fsdp2_per_rank_activation_bytes_equal_the_forecast_of_the_unsharded_model(ctx):
    """FSDP2 shards parameters, not activations: what a rank's forward keeps is what
    the forecast of the unsharded model at that rank's micro-batch says, to the byte
    (the planner's forecast, on fake tensors, for each hand policy)."""
    from torch_remat.integrations.planner import forecast_remat

    x = _batch(ctx, (4 * (ctx.rank + 1), 32, 16))  # rank 1's micro-batch is twice rank 0's
    loss_fn = lambda out: out.pow(2).sum()  # noqa: E731 (as _profiled_forward)
    forecast = forecast_remat(tiny_net(depth=2), x, loss_fn, 1.0, blocks=MLPBlock)

    def measured(config):
        model = tiny_net(depth=2)
        fully_shard_with_remat(model, MLPBlock, remat=config)
        return resident_bytes_outside_fsdp(_profiled_forward(model, x))

    pairs = {
        "no remat": (forecast.policies["no remat"].kept_bytes, measured(NO_REMAT)),
        # the blocks draw no random numbers: checkpointed, as the planner installs
        # them, without the RNG hooks' 5,056 B entry snapshot
        "full checkpoint": (
            forecast.policies["full checkpoint"].kept_bytes,
            measured(RematConfig(rng_state_hooks=False)),
        ),
    }
    for name, (predicted, got) in pairs.items():
        assert predicted == got, (name, pairs)
    return {"forecast_and_measured_bytes": pairs}


def fsdp2_mixed_precision_and_reshard_after_forward_pass_through(ctx):
    x = _batch(ctx)
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    out = {}
    for reshard in (True, False):
        runs = {}
        for name, config in (("plain", NO_REMAT), ("remat", RematConfig())):
            model = tiny_net(dropout=0.2)
            fully_shard_with_remat(
                model, MLPBlock, remat=config, mp_policy=mp, reshard_after_forward=reshard
            )
            torch.manual_seed(40 + ctx.rank)
            with CollectiveLog() as log:
                output = model(x)
                output.pow(2).sum().backward()
            assert output.dtype == torch.float32  # blocks ran in the param dtype
            runs[name] = (param_grads(model), log)
        assert_grads_equal(runs["plain"][0], runs["remat"][0])
        gathers = runs["remat"][1].count("_allgather_base_")
        assert gathers == runs["plain"][1].count("_allgather_base_") == (5 if reshard else 3)
        out[f"all_gather_reshard_{reshard}"] = gathers
    return out


# ------------------------------------------------------------------------- DCP


def dcp_keys_unchanged_and_round_trip_between_remat_and_plain(ctx):
    import torch.distributed.checkpoint as dcp

    plain = tiny_net()
    names = (
        list(plain.state_dict()),
        [n for n, _ in plain.named_parameters()],
        [n for n, _ in plain.named_modules()],
    )
    models = {}
    for name, config in (("remat", RematConfig()), ("plain", NO_REMAT)):
        model = tiny_net(dropout=0.2)
        fully_shard_with_remat(model, MLPBlock, remat=config)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        _fsdp_step(ctx, model, _batch(ctx))
        opt.step()  # values differ from the initialisation
        assert (
            list(model.state_dict()),
            [n for n, _ in model.named_parameters()],
            [n for n, _ in model.named_modules()],
        ) == names
        models[name] = model
    for source, target in (("remat", "plain"), ("plain", "remat")):
        path = os.path.join(ctx.scratch, f"dcp_from_{source}")
        dcp.save(models[source].state_dict(), checkpoint_id=path)
        fresh = tiny_net(seed=123)
        fully_shard_with_remat(fresh, MLPBlock, remat=RematConfig(enabled=target == "remat"))
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=path)
        fresh.load_state_dict(state)
        for (n, p), (_, q) in zip(models[source].named_parameters(), fresh.named_parameters()):
            assert torch.equal(p.full_tensor(), q.full_tensor()), n
        assert bool(remat_module_names(fresh)) == (target == "remat")


# ------------------------------------------------------------------------- DDP


def _ddp_accumulated_grads(ctx, config, static_graph, find_unused):
    model = tiny_net(dropout=0.2)
    if find_unused:
        model.unused = nn.Linear(4, 4).double()  # never called: DDP must find it
    ddp = ddp_with_remat(
        model,
        MLPBlock,
        remat=config,
        static_graph=static_graph,
        find_unused_parameters=find_unused,
    )
    # One synced iteration first: DDP's static_graph cannot start with no_sync (it
    # raises "expect_autograd_hooks_ INTERNAL ASSERT FAILED", with or without remat).
    torch.manual_seed(1000 + ctx.rank)
    ddp(torch.randn(4, 16, dtype=torch.float64)).pow(2).sum().backward()
    ddp.zero_grad()
    for step in range(2):
        for micro in range(2):
            torch.manual_seed(100 * step + 10 * micro + ctx.rank)
            x = torch.randn(4, 16, dtype=torch.float64)
            if micro == 0:
                with ddp.no_sync():
                    ddp(x).pow(2).sum().backward()
            else:
                ddp(x).pow(2).sum().backward()
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def ddp_gradients_equal_for_static_graph_find_unused_and_no_sync(ctx):
    for static_graph in (False, True):
        for find_unused in (False, True):
            plain = _ddp_accumulated_grads(ctx, NO_REMAT, static_graph, find_unused)
            with_remat = _ddp_accumulated_grads(ctx, RematConfig(), static_graph, find_unused)
            assert_grads_equal(plain, with_remat)
    # gradients are averaged: both ranks hold the same values
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, with_remat["layers.0.up.weight"])
    assert torch.equal(gathered[0], gathered[1])


# -------------------------------------------------------------- tensor parallel


def _tp_run(ctx, config):
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    model = tiny_net(dropout=0.2)
    parallelize_with_remat(model, mesh, sequence_parallel_plan(), MLPBlock, remat=config)
    torch.manual_seed(10)
    x = torch.randn(2, 8, 16, dtype=torch.float64).chunk(ctx.world_size, dim=1)[ctx.rank]
    torch.manual_seed(20)  # the same seed on every rank, as DTensor expects
    with CollectiveLog() as log:
        loss = model(x).pow(2).sum()
        loss.backward()
    return loss.detach(), param_grads(model), log


def tp_dropout_on_dtensors_replays_exactly(ctx):
    plain = _tp_run(ctx, NO_REMAT)
    with_remat = _tp_run(ctx, RematConfig())
    # on a CPU mesh DTensor has no RNG tracker: dropout draws from the CPU generator
    assert not prepare_dtensor_rng(init_device_mesh("cpu", (ctx.world_size,)))
    assert torch.equal(plain[0], with_remat[0])
    assert_grads_equal(plain[1], with_remat[1])
    # the TP collectives of the blocks are replayed by the recompute
    replayed = [n for n, r in with_remat[2].calls if r]
    assert replayed, "the recompute replayed no TP collective"
    # control: without the RNG hooks the recompute would draw other dropout masks,
    # so backward refuses it, naming the generator
    try:
        _tp_run(ctx, RematConfig(rng_state_hooks=False))
    except remat.RecomputeMismatchError as e:
        assert "CPU generator" in str(e) and "recompute_state_hooks" in str(e)
    else:
        raise AssertionError("dropout replayed without RNG hooks was not refused")
    # the bitwise replay check works on DTensor activations: passes with the RNG
    # hooks, names the mismatch without them
    checked = _tp_run(ctx, RematConfig(determinism_check="bitwise"))
    assert_grads_equal(plain[1], checked[1])
    try:
        _tp_run(ctx, RematConfig(rng_state_hooks=False, determinism_check="bitwise"))
    except remat.RecomputeMismatchError as e:
        assert "determinism check failed" in str(e)
    else:
        raise AssertionError("bitwise check did not catch dropout replayed without RNG hooks")
    return {"collectives_replayed_by_recompute": replayed}


def tp_save_regions_on_dtensors_keep_their_saves(ctx):
    # A SAVE region's saves that are DTensors are kept, never rebuilt: a DTensor has
    # no storage of its own to refill (rebuilding one raised "as_strided not
    # supported with DTensor" in backward). Every rebuild setting, dropout on.
    plain = _tp_run(ctx, NO_REMAT)
    for save in ((nn.Linear,), (nn.LayerNorm, nn.Linear, nn.Dropout)):
        for rebuild in ("free", "always", "never"):
            got = _tp_run(ctx, RematConfig(save_modules=save, rebuild=rebuild))
            assert torch.equal(plain[0], got[0]), (save, rebuild)
            assert_grads_equal(plain[1], got[1])
    return {}


# --------------------------------------------------------------------- hot path


class StoreCallLog:
    """Test-only: records every call of a ``torch.distributed.Store`` method made from
    Python (the process group's own C++ calls are not seen)."""

    METHODS = ("set", "get", "add", "append", "wait", "check", "multi_get", "multi_set",
               "compare_set", "delete_key", "num_keys", "queue_push", "queue_pop", "list_keys")

    def __enter__(self) -> StoreCallLog:
        self.calls: list[str] = []
        self._saved = {name: dist.Store.__dict__[name] for name in self.METHODS if name in dist.Store.__dict__}
        for name, method in self._saved.items():
            setattr(dist.Store, name, self._recording(name, method))
        return self

    def _recording(self, name, method):
        def record(store, *args, **kwargs):
            self.calls.append(name)
            return method(store, *args, **kwargs)

        return record

    def __exit__(self, *exc) -> None:
        for name, method in self._saved.items():
            setattr(dist.Store, name, method)


def training_steps_touch_no_store_and_remat_adds_no_collective(ctx):
    x, steps = _batch(ctx), 3
    logs = {}
    for name, config in (("plain", NO_REMAT), ("remat", RematConfig(save_modules=nn.Linear))):
        model = tiny_net(dropout=0.2)
        fully_shard_with_remat(model, MLPBlock, remat=config)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with StoreCallLog() as stores, CollectiveLog() as collectives:
            for step in range(steps):
                torch.manual_seed(100 * step + ctx.rank)
                model(x).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
        logs[name] = (stores.calls, collectives.calls)
    assert logs["plain"][0] == logs["remat"][0] == []
    assert logs["remat"][1] == logs["plain"][1]
    # the log does see the store when a report is asked for
    with StoreCallLog() as stores:
        loss = model(x).pow(2).sum()
        gather_memory_report(loss, tag=f"hot-path-{ctx.world_size}", timeout=30)
        loss.backward()
    assert stores.calls[:2] == ["append", "add"]
    return {"store_calls_per_step": 0, "collectives_per_step": len(logs["remat"][1]) // steps,
            "store_calls_per_report_on_this_rank": len(stores.calls)}


# --------------------------------------------------------------------- reports


def _report_run(ctx, batch, dst, tag):
    """A DDP step with remat and Linear SAVE regions; the gathered report on dst."""
    ddp = ddp_with_remat(tiny_net(dropout=0.1), MLPBlock, remat=RematConfig(save_modules=nn.Linear))
    torch.manual_seed(ctx.rank)
    loss = ddp(torch.randn(batch, 16, dtype=torch.float64)).pow(2).sum()
    local = remat.saved_tensors_report(loss).to_dict()
    report = gather_memory_report(loss, dst=dst, tag=tag, timeout=30)
    loss.backward()
    every_local = [None] * ctx.world_size
    dist.all_gather_object(every_local, local)
    return report, every_local


def report_uneven_batches_show_min_median_max_and_flag_imbalance(ctx):
    batches = [4, 8]
    report, local = _report_run(ctx, batches[ctx.rank], dst=1, tag="uneven")
    if ctx.rank != 1:
        assert report is None
        return {}
    assert report.ranks == [0, 1]
    assert report.totals == [r["total_bytes"] for r in local]
    # A block holds its input and each Linear SAVE region's kept output
    # (batch x (16 + 32 + 16) float64; the Linears' saved inputs come from replayed
    # code, LayerNorm and tanh, and are rebuilt), and one CPU RNG snapshot (dropout
    # runs after the last SAVE region, so the later snapshots are shared).
    block = [b * (16 + 32 + 16) * 8 + 5056 for b in batches]
    by_name = {r.name: r for r in report.regions}
    assert list(by_name) == ["layers.0", "layers.1", "(outside regions)"]
    layer = by_name["layers.0"]
    assert layer.bytes_per_rank == block == [7104, 9152]
    assert (layer.min_bytes, layer.median_bytes, layer.max_bytes) == (7104, 8128, 9152)
    assert report.ranks[layer.max_rank_index] == 1
    # outside checkpoints: embed and head keep their inputs, pow its input
    assert by_name["(outside regions)"].bytes_per_rank == [b * (16 + 16 + 1) * 8 for b in batches]
    assert report.is_imbalanced and [r.name for r in report.imbalanced()] == [
        "layers.0",
        "layers.1",
        "(outside regions)",
    ]
    as_json = json.loads(report.to_json())
    assert as_json["regions"][0] == {
        "name": "layers.0",
        "bytes_per_rank": [7104, 9152],
        "calls_per_rank": [1, 1],
        "min": 7104,
        "median": 8128,
        "max": 9152,
        "max_rank": 1,
        "top_ranks": [1, 0],
        "spread": (9152 - 7104) / 9152,
    }
    assert "! 22% spread" in report.format()
    return {"report": report.format()}


def report_even_batches_are_balanced(ctx):
    report, _ = _report_run(ctx, 8, dst=0, tag="even")
    if ctx.rank != 0:
        return {}
    assert not report.is_imbalanced
    assert all(r.spread == 0 for r in report.regions)
    return {"report": report.format()}


def report_names_a_rank_that_skips_the_call(ctx):
    model = tiny_net()
    apply_remat(model, check_fn=lambda m: isinstance(m, MLPBlock))
    loss = model(_batch(ctx)).sum()
    message = ""
    if ctx.rank == 0:  # rank 1 skips the call
        try:
            gather_memory_report(loss, timeout=2, tag="skipped")
        except MemoryReportTimeout as e:
            assert e.missing_ranks == [1]
            message = str(e)
            assert message.startswith("gather_memory_report: rank 1 did not send")
        else:
            raise AssertionError("gather_memory_report returned without rank 1")
    dist.barrier()  # no collective was left half-done: the group still works
    report = gather_memory_report(loss, tag="after-skip", timeout=30)
    assert (report is not None) == (ctx.rank == 0)
    return {"error": message}


# ----------------------------------------------------------------------- planner


def _planned_on_rank(ctx, per_rank: bool):
    """Each rank plans its own copy with a batch of its own size (rank 1's is twice
    rank 0's, so its bytes differ) and a budget of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(*(MLPBlock(16) for _ in range(3))).double()
    x = _batch(ctx, shape=(64 * (ctx.rank + 1), 16))
    budget = (0.5, 0.9)[ctx.rank]
    plan = plan_remat(
        model, x, lambda out: out.pow(2).sum(), budget, blocks=MLPBlock, per_rank=per_rank
    )
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, (plan.choices, plan.for_budget(budget).choices))
    return model, plan, everyone


def planner_rank0_choice_is_applied_on_every_rank(ctx):
    model, plan, everyone = _planned_on_rank(ctx, per_rank=False)
    chosen = [c for c, _ in everyone]
    own = [c for _, c in everyone]
    assert chosen[0] == chosen[1] == own[0], everyone
    assert own[1] != own[0], "rank 1's own budget must choose differently for the check to bite"
    # Each rank's prediction is of its own bytes, and its run measured them.
    assert plan.measured_bytes == plan.predicted_bytes
    names = plan.apply(model)
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, names)
    remove_remat(model)
    assert gathered[0] == gathered[1]
    return {"choices": chosen[0]}


def planner_per_rank_plans_each_rank_for_its_own_budget(ctx):
    _, plan, everyone = _planned_on_rank(ctx, per_rank=True)
    assert [c for c, _ in everyone] == [c for _, c in everyone], everyone
    assert everyone[0][0] != everyone[1][0]
    assert plan.measured_bytes == plan.predicted_bytes <= plan.budget_bytes
    return {"choices": everyone[ctx.rank][0]}


def planner_per_rank_infeasible_on_one_rank_raises_on_every_rank(ctx):
    # A budget of bytes that fits rank 0's batch and not rank 1's (twice as large):
    # before, only rank 1 raised, and rank 0 went on into the verifying run alone.
    from torch_remat.integrations.planner import InfeasibleBudgetError

    torch.manual_seed(0)
    model = nn.Sequential(*(MLPBlock(16) for _ in range(3))).double()
    x = _batch(ctx, shape=(64 * (ctx.rank + 1), 16))
    minimum = [None] * ctx.world_size
    plan = plan_remat(model, x, lambda out: out.pow(2).sum(), 1.0, blocks=MLPBlock, per_rank=True)
    dist.all_gather_object(minimum, min(p.bytes for p in plan.frontier()))  # each rank's least
    budget = (minimum[0] + minimum[1]) // 2  # above rank 0's minimum, below rank 1's
    try:
        plan_remat(model, x, lambda out: out.pow(2).sum(), budget, blocks=MLPBlock, per_rank=True)
    except InfeasibleBudgetError as e:
        message = str(e)
    else:
        raise AssertionError("plan_remat did not raise on this rank")
    assert message.startswith("rank 1 (of the failing ranks 1): "), message
    # every rank is still in step: a collective right after completes
    dist.barrier()
    return {"minimum": minimum}


def planner_leaves_an_fsdp2_models_gradients_as_found(ctx):
    """plan_remat's forwards without gradients leave FSDP2's root unsharded; the
    measurements must still give every gradient back, so the first training step
    after planning sees the gradients it would have seen without planning (the root's
    embedding and head gradients used to keep what the measuring steps added)."""
    x = _batch(ctx, shape=(64, 16))
    reference = tiny_net()
    fully_shard_with_remat(reference, MLPBlock, remat=NO_REMAT)
    expected = _fsdp_step(ctx, reference, x, seed=30)
    model = tiny_net()
    fully_shard_with_remat(model, MLPBlock, remat=NO_REMAT)
    plan_remat(model, x, lambda out: out.pow(2).sum(), 0.6, blocks=MLPBlock)
    assert all(p.grad is None for p in model.parameters()), [
        n for n, p in model.named_parameters() if p.grad is not None
    ]
    got = _fsdp_step(ctx, model, x, seed=30)
    assert_grads_equal(expected[1], got[1])


def planner_offload_plan_under_fsdp2_is_exact_on_every_rank(ctx):
    """plan_remat with offload among the options on an FSDP2 model: every rank
    installs rank 0's choice, its offloader moves what the plan says, and the
    gradients equal FSDP2's without remat, bitwise."""
    from torch_remat.integrations.planner import OffloadOptions
    from torch_remat.integrations.planner._time import DeviceProfile

    # matmuls so slow that moving a tensor is cheaper than recomputing one
    slow = DeviceProfile("slow compute", {"float64": 1e8}, 1e10, 1e10, overlap_copies=False)
    x = _batch(ctx, shape=(64, 16))
    reference = tiny_net()
    fully_shard_with_remat(reference, MLPBlock, remat=NO_REMAT)
    expected = _fsdp_step(ctx, reference, x, seed=30)
    model = tiny_net()
    fully_shard_with_remat(model, MLPBlock, remat=NO_REMAT)
    plan = plan_remat(model, x, lambda out: out.pow(2).sum(), 0.4, blocks=MLPBlock,
                      candidates=["up"], offload=OffloadOptions(prefetch=0, min_bytes=0), profile=slow)
    assert plan.measured_bytes == plan.predicted_bytes <= plan.budget_bytes
    offloaded = sorted(n for n, o in plan.options.items() if o.offload)
    assert offloaded, plan
    plan.apply(model)
    try:
        got = _fsdp_step(ctx, model, x, seed=30)
        moved = sum(plan.offloader.stats.offloaded_bytes.values())
    finally:
        remove_remat(model)
    assert moved == plan.host_bytes > 0
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, offloaded)
    assert everyone[0] == everyone[1]
    assert torch.equal(expected[0], got[0])
    assert_grads_equal(expected[1], got[1])
    return {"offloaded": offloaded, "moved": moved}


CHECKS = [
    fsdp2_gradients_equal_without_remat,
    fsdp2_compiled_remat_gives_the_gradients_of_eager_remat,
    fsdp2_remat_applied_after_fully_shard_gives_equal_gradients,
    fsdp2_a_checkpoint_around_a_sharded_block_gives_equal_gradients,
    fsdp2_recompute_issues_no_all_gather,
    fsdp2_activation_bytes_per_rank_are_lower_with_remat,
    fsdp2_per_rank_activation_bytes_equal_the_forecast_of_the_unsharded_model,
    fsdp2_mixed_precision_and_reshard_after_forward_pass_through,
    dcp_keys_unchanged_and_round_trip_between_remat_and_plain,
    ddp_gradients_equal_for_static_graph_find_unused_and_no_sync,
    tp_dropout_on_dtensors_replays_exactly,
    tp_save_regions_on_dtensors_keep_their_saves,
    training_steps_touch_no_store_and_remat_adds_no_collective,
    report_uneven_batches_show_min_median_max_and_flag_imbalance,
    report_even_batches_are_balanced,
    report_names_a_rank_that_skips_the_call,
    planner_rank0_choice_is_applied_on_every_rank,
    planner_per_rank_plans_each_rank_for_its_own_budget,
    planner_per_rank_infeasible_on_one_rank_raises_on_every_rank,
    planner_leaves_an_fsdp2_models_gradients_as_found,
    planner_offload_plan_under_fsdp2_is_exact_on_every_rank,
]
