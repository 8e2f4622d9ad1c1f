"""accelerate checks, run on every rank under torchrun:

    torchrun --standalone --nproc-per-node 2 accelerate_checks.py OUT_DIR

Each rank creates the Accelerator the way a user would (``cpu=True``: MULTI_CPU on
gloo), runs every check in CHECKS in order and writes ``OUT_DIR/rank{N}.json``
(``{check: {"ok", "error", "data"}}``, read by dist_harness.assert_check_passed).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import sys
import traceback

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
    TorchDynamoPlugin,
)
from dist_models import TinyNet, assert_grads_equal, param_grads
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

import torch_remat as remat
import torch_remat.integrations as remat_integrations
from torch_remat.integrations import (
    RematForward,
    apply_remat_for_accelerator,
    prepare_with_remat,
    remat_module_names,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCKS = ["layers.0", "layers.1"]
STEPS = 2


class Net(TinyNet):
    """TinyNet with dropout, naming its block class the transformers way."""

    _no_split_modules = ["MLPBlock"]


def net() -> Net:
    torch.manual_seed(0)
    return Net(dropout=0.1).double()


def train(accelerator: Accelerator, model, optimizer) -> list:
    """STEPS optimizer steps on rank-specific data and dropout; (loss, grads) per step."""
    rank = accelerator.process_index
    out = []
    for step in range(STEPS):
        x = torch.randn(
            4, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(rank * 10 + step)
        )
        torch.manual_seed(1000 + 10 * step + rank)
        with remat.collect_trace(checkpoints=True) as trace:
            loss = model(x).square().mean()
        accelerator.backward(loss)
        out.append((loss.detach().clone(), param_grads(model), [n.name for n in trace.roots]))
        optimizer.step()
        optimizer.zero_grad()
    return out


def assert_same_training(actual: list, expected: list) -> None:
    for (loss_a, grads_a, _), (loss_b, grads_b, _) in zip(actual, expected, strict=True):
        assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
        assert_grads_equal(grads_a, grads_b)


def prepared(accelerator: Accelerator, model, *, with_remat: bool, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if with_remat:
        return prepare_with_remat(accelerator, model, optimizer, **kwargs)
    return accelerator.prepare(model, optimizer)


def fsdp2_accelerator(**plugin_kwargs) -> tuple[Accelerator, FullyShardedDataParallelPlugin]:
    """An Accelerator whose prepare() takes its FSDP2 path (``_prepare_fsdp2``) on CPU.

    accelerate 1.x selects FSDP only for accelerator devices: on CPU the plugin is
    dropped (see check_accelerate_drops_the_fsdp_plugin_on_cpu). Setting the shared
    state's distributed type is what accelerate itself would have done on GPUs.
    """
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["MLPBlock"],
        **plugin_kwargs,
    )
    accelerator = Accelerator(cpu=True)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator, plugin


# ------------------------------------------------------------------------- checks

FIRST: dict = {}  # set by main(): how the first Accelerator(cpu=True, fsdp_plugin=...) came up


def check_accelerate_drops_the_fsdp_plugin_on_cpu():
    assert FIRST["distributed_type"] == "MULTI_CPU", FIRST
    assert FIRST["num_processes"] == 2
    accelerator = Accelerator(cpu=True)
    model, _ = prepared(accelerator, net(), with_remat=False)
    assert isinstance(model, DistributedDataParallel)
    return {**FIRST, "prepared_as": type(model).__name__}


def _load_example():
    path = os.path.join(ROOT, "launch", "train_accelerate.py")
    spec = importlib.util.spec_from_file_location("train_accelerate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_example_losses_equal_with_and_without_remat():
    example = _load_example()
    argv = ["--steps", "6", "--seq-len", "32", "--dim", "32", "--batch-size", "4"]
    with_remat = example.train(argv)
    without = example.train(argv + ["--remat", "none"])
    assert with_remat["remat_modules"] == ["blocks.0", "blocks.1"]
    assert without["remat_modules"] == []
    assert with_remat["losses"] == without["losses"]
    assert all(math.isfinite(v) for v in with_remat["losses"])
    return {"losses": with_remat["losses"]}


def check_ddp_gradients_equal_with_and_without_remat():
    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU
    plain, opt_plain = prepared(accelerator, net(), with_remat=False)
    expected = train(accelerator, plain, opt_plain)

    model, opt = prepared(accelerator, net(), with_remat=True)  # blocks from _no_split_modules
    assert isinstance(model, DistributedDataParallel)
    assert remat_module_names(accelerator.unwrap_model(model)) == BLOCKS
    actual = train(accelerator, model, opt)
    assert_same_training(actual, expected)
    assert actual[0][2] == BLOCKS and expected[0][2] == []
    assert list(accelerator.get_state_dict(model)) == list(accelerator.get_state_dict(plain))
    return {"loss_step0": actual[0][0].item()}


def check_fsdp2_plugin_checkpointing_is_replaced_by_remat():
    accelerator, reference_plugin = fsdp2_accelerator(activation_checkpointing=False)
    plain, opt_plain = prepared(accelerator, net(), with_remat=False)
    expected = train(accelerator, plain, opt_plain)

    accelerator, plugin = fsdp2_accelerator(activation_checkpointing=True)
    assert accelerator.is_fsdp2
    model, opt = prepared(accelerator, net(), with_remat=True)
    assert plugin.activation_checkpointing is False  # accelerate did not wrap as well
    assert remat_module_names(model) == BLOCKS
    assert all(isinstance(model.layers[i], FSDPModule) for i in range(2))
    names = [n for n, _ in model.named_modules()]
    assert not any("_checkpoint_wrapped_module" in n for n in names)
    assert list(model.state_dict()) == list(plain.state_dict())
    actual = train(accelerator, model, opt)
    assert_same_training(actual, expected)
    assert actual[0][2] == BLOCKS

    # accelerate's own step, for comparison: checkpoint_wrapper(preserve_rng_state=False).
    accelerator, _ = fsdp2_accelerator(activation_checkpointing=True)
    wrapped, opt_wrapped = prepared(accelerator, net(), with_remat=False)
    torch_wrapped = train(accelerator, wrapped, opt_wrapped)
    first = {
        n.replace("._checkpoint_wrapped_module", ""): g for n, g in torch_wrapped[0][1].items()
    }
    max_diff = max((first[n] - g).abs().max().item() for n, g in expected[0][1].items())
    return {
        "accelerate_checkpoint_wrapper_module_names": [
            n for n, _ in wrapped.named_modules() if "_checkpoint_wrapped_module" in n
        ],
        "accelerate_checkpoint_wrapper_max_grad_diff_with_dropout": max_diff,
    }


def check_fsdp2_plugin_offload_runs_remat_under_save_on_cpu():
    accelerator, _ = fsdp2_accelerator()
    plain, opt_plain = prepared(accelerator, net(), with_remat=False)
    expected = train(accelerator, plain, opt_plain)

    accelerator, plugin = fsdp2_accelerator(
        activation_checkpointing=True, activation_checkpointing_offload=True
    )
    model = net()
    assert apply_remat_for_accelerator(accelerator, model) == BLOCKS
    assert plugin.activation_checkpointing is False
    assert plugin.activation_checkpointing_offload is False
    assert all(model.layers[i].__dict__["forward"].offload for i in range(2))
    assert isinstance(model.layers[0].__dict__["forward"], RematForward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert_same_training(train(accelerator, model, optimizer), expected)


# The graph breaks DDP's forward makes under Dynamo, by the function each names: its
# C++ logger's per-iteration call and its forward context (marked not to be traced).
# Matched on those names, never on a bare word: the second message also quotes the
# path of torch's files, which can contain any word ("remat" in a checkout named so).
DDP_GRAPH_BREAKS = (
    "trace method `set_runtime_stats_and_log` of class `Logger`",
    "qualname: DistributedDataParallel._inside_ddp_forward,",
)
REMAT_SOURCES = tuple(
    os.path.dirname(module.__file__) + os.sep for module in (remat, remat_integrations)
)


def names_remat_code(graph_break: str) -> bool:
    """Whether a graph break message names a torch_remat module or source file."""
    return "module: torch_remat" in graph_break or any(d in graph_break for d in REMAT_SOURCES)


def check_dynamo_backend_traces_the_checkpoints_with_the_gradients_of_eager_remat():
    from torch._dynamo.utils import counters

    def no_dropout_net() -> Net:
        torch.manual_seed(0)
        return Net().double()

    accelerator = Accelerator(cpu=True)
    eager, opt_eager = prepared(accelerator, no_dropout_net(), with_remat=True)
    expected = train(accelerator, eager, opt_eager)

    torch._dynamo.reset()
    counters.clear()
    accelerator = Accelerator(cpu=True)
    # accelerate keeps the first Accelerator's dynamo plugin in its shared state
    # (see fsdp2_accelerator); set what Accelerator(dynamo_backend=...) would.
    accelerator.state.dynamo_plugin = TorchDynamoPlugin(backend="aot_eager")
    try:
        model, opt = prepared(accelerator, no_dropout_net(), with_remat=True)
    finally:
        accelerator.state.dynamo_plugin = TorchDynamoPlugin()
    assert type(model).__name__ == "OptimizedModule"  # torch.compile'd by prepare
    assert remat_module_names(accelerator.unwrap_model(model, keep_torch_compile=False)) == BLOCKS
    actual = train(accelerator, model, opt)
    graphs = counters["stats"]["unique_graphs"]
    breaks = list(counters["graph_break"])
    torch._dynamo.reset()
    # DDP's own forward is not traced by design (DistributedDataParallel's forward
    # helpers and logger break); the model inside it, checkpoints and all, is.
    assert graphs >= 1, graphs
    assert not [b for b in breaks if names_remat_code(b)], breaks
    assert all(any(known in b for known in DDP_GRAPH_BREAKS) for b in breaks), breaks
    unprefixed = [  # parameter names of the compiled wrapper start with "_orig_mod."
        (loss, {n.removeprefix("_orig_mod."): g for n, g in grads.items()}, trace)
        for loss, grads, trace in actual
    ]
    assert_same_training(unprefixed, expected)
    return {"graphs": graphs, "graph_breaks_in_ddp": len(breaks)}


CHECKS = [
    check_accelerate_drops_the_fsdp_plugin_on_cpu,
    check_example_losses_equal_with_and_without_remat,
    check_ddp_gradients_equal_with_and_without_remat,
    check_fsdp2_plugin_checkpointing_is_replaced_by_remat,
    check_fsdp2_plugin_offload_runs_remat_under_save_on_cpu,
    check_dynamo_backend_traces_the_checkpoints_with_the_gradients_of_eager_remat,
]


def main() -> None:
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    # The first Accelerator of the process sets accelerate's shared state: a user's
    # FSDP2 plugin on CPU, to record what accelerate makes of it.
    first = Accelerator(
        cpu=True,
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))],
    )
    FIRST.update(distributed_type=first.distributed_type.value, num_processes=first.num_processes)
    os.environ.pop("ACCELERATE_USE_FSDP", None)  # set by Accelerator(fsdp_plugin=...)
    results = {}
    for check in CHECKS:
        torch.manual_seed(0)
        try:
            results[check.__name__] = {"ok": True, "error": "", "data": check() or {}}
        except Exception:  # noqa: BLE001 - report every failure to pytest
            results[check.__name__] = {"ok": False, "error": traceback.format_exc(), "data": {}}
        with open(os.path.join(out_dir, f"rank{first.process_index}.json"), "w") as f:
            json.dump(results, f, indent=1)
        first.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
