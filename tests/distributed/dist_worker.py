"""Runs a module's named checks on every rank of a real gloo process group.

    python dist_worker.py CHECKS_MODULE WORLD_SIZE OUT_DIR

Spawns WORLD_SIZE processes (torch.multiprocessing, start method "spawn"); each
joins one gloo group and runs every function listed in ``CHECKS_MODULE.CHECKS`` in
order, writing ``OUT_DIR/rank{N}.json``: ``{check: {"ok": bool, "error": str,
"data": {...}}}``. A failing check is recorded and the next one runs; a barrier
between checks (with the group's timeout) keeps ranks in step.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GROUP_TIMEOUT = datetime.timedelta(seconds=45)


class Context:
    """What a check receives: rank, world size and a scratch folder shared by ranks."""

    def __init__(self, rank: int, world_size: int, scratch: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.scratch = scratch


def _run_rank(rank: int, module_name: str, world_size: int, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world_size,
        timeout=GROUP_TIMEOUT,
    )
    module = importlib.import_module(module_name)
    ctx = Context(rank, world_size, os.path.join(out_dir, "scratch"))
    results = {}
    for check in module.CHECKS:
        torch.manual_seed(0)
        try:
            data = check(ctx) or {}
            results[check.__name__] = {"ok": True, "error": "", "data": data}
        except BaseException as e:  # noqa: BLE001 - report every failure to pytest
            results[check.__name__] = {"ok": False, "error": traceback.format_exc(), "data": {}}
            if isinstance(e, KeyboardInterrupt):
                raise
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f, indent=1)
        if getattr(check, "leaves_group_unusable", False):
            break
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    module_name, world_size, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.makedirs(os.path.join(out_dir, "scratch"), exist_ok=True)
    mp.spawn(_run_rank, args=(module_name, world_size, out_dir), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
