"""Run a ``launch/`` example's ``main`` the way its ``__main__`` block does, with the
faults tests need injected from outside (the examples carry no test-only options):

    python tests/launch/example.py train [--fail-at-step N] [--oom-at-step N] ARGS...
    python tests/launch/example.py train_accelerate ARGS...

``--fail-at-step N``: the last rank exits with status 17 when step N's forward
starts, on the first torchrun attempt only (a crashed rank, for ``--max-restarts``).
``--oom-at-step N``: at step N the last rank's last block asks its allocator for
1 PiB, inside the checkpoint's forward, a request no machine grants.
``--plan-mismatch-on-last-rank``: ``plan_remat``'s verifying run on the last rank
measures 4 bytes more in the first block than it predicted (a mismatch on one rank).
``--planning-error-on-last-rank``: the last rank's third measuring run raises.

Afterwards each rank prints ``process group initialized after main: BOOL``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys

import torch
import torch.distributed as dist

import torch_remat as remat

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def is_last_rank() -> bool:
    return int(os.environ.get("RANK", 0)) == int(os.environ.get("WORLD_SIZE", 1)) - 1


def request_impossible_memory_once(module: torch.nn.Module) -> None:
    """``module``'s next forward asks its allocator for 1 PiB."""

    def allocate(module, args):
        handle.remove()
        torch.empty(2**50, dtype=torch.uint8, device=args[0].device)

    handle = module.register_forward_pre_hook(allocate)


def with_faults(build, fail_at_step: int, oom_at_step: int):
    """``train.build`` whose model counts its forwards (one per training step, so on a
    fresh run the count is the step number) and injects the faults at those steps."""

    def build_with_faults(args, *rest):
        model, dp_rank, dp_size = build(args, *rest)
        inner = getattr(model, "module", model)  # DDP wraps the model
        step = [0]
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

        def count_step(module, inputs):
            if remat.is_recomputing():
                return
            step[0] += 1
            if not is_last_rank():
                return
            if step[0] == fail_at_step and first_attempt:
                os._exit(17)
            if step[0] == oom_at_step:
                request_impossible_memory_once(inner.blocks[-1].norm2)

        inner.register_forward_pre_hook(count_step)
        return model, dp_rank, dp_size

    return build_with_faults


def mismatch_on_last_rank() -> None:
    """The last rank's verifying run of a plan measures 4 more bytes in its first
    block (the verifying run is the one that measures the installed plan,
    ``measuring=False``; the option table's runs are left alone)."""
    if not is_last_rank():
        return
    from torch_remat.integrations.planner import plan

    measure = plan.measure

    def off_by_four(model, args, loss_fn, config, blocks, **options):
        got = measure(model, args, loss_fn, config, blocks, **options)
        if options.get("measuring", True) is False:
            got.bytes_by_block[blocks[0]] += 4
        return got

    plan.measure = off_by_four


def planning_error_on_last_rank() -> None:
    """The last rank's planner raises a ValueError in its third measuring run, in the
    middle of the option table: the other rank is then inside a collective of that
    run's FSDP2 forward, which the failing rank never joins."""
    if not is_last_rank():
        return
    from torch_remat.integrations.planner import _measure

    install, calls = _measure.install, [0]

    def failing(model, config, **options):
        calls[0] += 1
        if calls[0] == 3:
            raise ValueError("injected: the third measuring run fails on this rank only")
        return install(model, config, **options)

    _measure.install = failing


def main() -> None:
    name, argv = sys.argv[1], sys.argv[2:]
    faults = argparse.ArgumentParser()
    faults.add_argument("--fail-at-step", type=int, default=0)
    faults.add_argument("--oom-at-step", type=int, default=0)
    faults.add_argument("--plan-mismatch-on-last-rank", action="store_true")
    faults.add_argument("--planning-error-on-last-rank", action="store_true")
    injected, argv = faults.parse_known_args(argv)
    if injected.planning_error_on_last_rank:
        planning_error_on_last_rank()
    if injected.plan_mismatch_on_last_rank:
        mismatch_on_last_rank()
    example = load(name)
    if name == "train":
        example.build = with_faults(example.build, injected.fail_at_step, injected.oom_at_step)
    example.main(argv)
    print(f"process group initialized after main: {dist.is_initialized()}", flush=True)


if __name__ == "__main__":
    main()
