"""Checks run on 3 gloo ranks (see dist_worker.py): cluster OOM dumps.

Every rank installs integrations.oom on one shared folder and trains three steps
under the guard. Rank 1 runs out of memory at step 2 in the forward of region
``attn`` of checkpoint ``layers.1``: a real allocator failure, a 1 PiB request that
no process can address. torch 2.13's CPU allocator reports it as a ``RuntimeError``
("DefaultCPUAllocator: can't allocate memory"), never as ``torch.OutOfMemoryError``,
so to cover that type too rank 2 raises an injected ``torch.OutOfMemoryError`` at
step 3, in the backward's recompute of region ``mlp`` of ``layers.0``. Rank 0 never
fails. A barrier after each step orders the two failures in time. The merge itself
is run by the pytest side (test_integrations_oom_multi_rank.py) on the folder.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn

import torch_remat as remat
from torch_remat.integrations import oom

JOB = "oom-check-job"
OTHER_JOB = "oom-check-job-b"
IMPOSSIBLE_HEADS = 2**45  # (heads, 4, 8) float32 = 2**52 bytes
DIM, SEQ = 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, DIM)
        self.down = nn.Linear(DIM, DIM)
        self.heads = 1
        self.inject_oom_in_recompute = False
        self.report_at_failure: dict | None = None

    def attn(self, h: torch.Tensor) -> torch.Tensor:
        if self.heads == IMPOSSIBLE_HEADS:
            self.report_at_failure = remat.saved_tensors_report().to_dict()
        q = h.unsqueeze(0).expand(self.heads, *h.shape)  # a view: no memory yet
        return (q @ h.transpose(-1, -2)).mean(0).softmax(-1) @ h

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.inject_oom_in_recompute and remat.is_recomputing():
            raise torch.OutOfMemoryError("injected at step 3: Tried to allocate 2.00 GiB")
        return torch.tanh(self.down(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = remat.region(self.up, "up", recompute=False)(x)
        h = remat.region(self.attn, "attn", recompute=False)(h)
        return x + remat.region(self.mlp, "mlp", recompute=True)(h)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = remat.checkpoint(region_name=f"layers.{i}")(layer)(x)
        return x


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(SEQ, DIM, generator=torch.Generator().manual_seed(100 * rank + step))


def _train_step(model, opt, x) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    opt.step()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def one_rank_runs_out_its_dump_is_written_the_others_keep_their_state(ctx):
    os.environ["TORCHELASTIC_RUN_ID"] = JOB
    folder = os.path.join(ctx.scratch, "oom")
    dumps = oom.install(folder)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outcomes = []
    for step in (1, 2, 3):
        if ctx.rank == 1 and step == 2:
            model.layers[1].heads = IMPOSSIBLE_HEADS
        if ctx.rank == 2 and step == 3:
            model.layers[0].inject_oom_in_recompute = True
        before = _params(model)
        try:
            with dumps.guard(step=step):
                _train_step(model, opt, _batch(ctx.rank, step))
            outcomes.append("ok")
        except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
            outcomes.append(type(e).__name__)
            assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))  # no update
        finally:
            model.layers[1].heads = 1
            model.layers[0].inject_oom_in_recompute = False
        dist.barrier()

    # the group is still usable, and every rank sees what happened where
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, outcomes)
    assert everyone == [
        ["ok", "ok", "ok"],
        ["ok", "RuntimeError", "ok"],
        ["ok", "ok", "OutOfMemoryError"],
    ]
    if ctx.rank == 0:
        # no dump, and training the same steps without the guard gives the same weights
        assert dumps.written == []
        reference = Net()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in (1, 2, 3):
            _train_step(reference, ref_opt, _batch(0, step))
        assert all(torch.equal(a, b) for a, b in zip(_params(reference), _params(model)))
        return {"dumps": 0}
    [path] = dumps.written
    assert os.path.dirname(path) == folder
    with open(path) as f:
        dump = json.load(f)
    assert (dump["job_id"], dump["rank"], dump["world_size"]) == (JOB, ctx.rank, 3)
    if ctx.rank == 1:
        assert dump["step"] == 2 and dump["device"] == "cpu"
        assert dump["requested_bytes"] == IMPOSSIBLE_HEADS * SEQ * DIM * 4
        assert dump["location"] == {"checkpoint": "layers.1", "phase": "forward", "region": "attn"}
        # What the dump says was held is what the rank held when the allocation
        # failed, less the outputs the failed forward kept for its replay: those
        # are released as the forward unwinds, before the guard runs.
        held = model.layers[1].report_at_failure
        released = sum(
            t["bytes"]
            for c in held["checkpoints"]
            if c["name"] == "layers.1"
            for r in c["regions"]
            for t in r["tensors"]
            if t["name"].startswith("(output at idx")
        )
        assert released > 0
        assert dump["saved_tensors"]["checkpoint_bytes"] == held["checkpoint_bytes"] - released
        done = [c for c in held["checkpoints"] if c["name"] != "layers.1"]
        assert [c for c in dump["saved_tensors"]["checkpoints"] if c["name"] != "layers.1"] == done
    else:
        assert dump["step"] == 3 and dump["error"]["type"] == "OutOfMemoryError"
        assert (dump["requested_bytes"], dump["requested_bytes_exact"]) == (2 * 2**30, False)
        assert dump["location"] == {"checkpoint": "layers.0", "phase": "recompute", "region": "mlp"}
    return {"dumps": 1, "checkpoint_bytes": dump["saved_tensors"]["checkpoint_bytes"]}


def a_second_job_writing_into_the_same_folder(ctx):
    os.environ["TORCHELASTIC_RUN_ID"] = OTHER_JOB
    dumps = oom.install(os.path.join(ctx.scratch, "oom"))
    if ctx.rank == 0:
        with dumps.guard(step=1, suppress=True):
            raise torch.OutOfMemoryError("injected: Tried to allocate 512.00 MiB")
        assert len(dumps.written) == 1
    oom.uninstall()
    return {}


CHECKS = [
    one_rank_runs_out_its_dump_is_written_the_others_keep_their_state,
    a_second_job_writing_into_the_same_folder,
]
