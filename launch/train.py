"""Train a small GPT with torch_remat, on one process or under torchrun.

    python launch/train.py                                  # one process, CPU
    torchrun --standalone --nproc-per-node 2 launch/train.py --parallel fsdp2

Each block is one checkpoint (its forward is recomputed in backward); the
sub-layers the remat policy keeps run as SAVE regions (``Block.sublayer``), so
their outputs stay in memory and the recompute skips them. Data: a
character-level snapshot of this repository's documentation
(launch/data/corpus.txt), so the loss visibly falls. Every rank reads the same
text; data-parallel ranks take different batches. CPU runs use gloo, GPU runs nccl.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torch_remat as remat
from torch_remat.integrations import (
    RematConfig,
    apply_remat,
    ddp_with_remat,
    fully_shard_with_remat,
    gather_memory_report,
    oom,
    parallelize_with_remat,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- model


@dataclasses.dataclass
class GPTConfig:
    vocab: int
    seq_len: int = 64
    layers: int = 4
    dim: int = 64
    heads: int = 4
    dropout: float = 0.1
    keep: frozenset[str] = frozenset()  # sub-layers of each block kept by remat


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.dropout, self.keep = c.dropout, c.keep
        self.head_dim = c.dim // c.heads
        self.norm1, self.norm2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.q, self.k, self.v = (nn.Linear(c.dim, c.dim) for _ in range(3))
        self.proj = nn.Linear(c.dim, c.dim)
        self.up, self.down = nn.Linear(c.dim, 4 * c.dim), nn.Linear(4 * c.dim, c.dim)

    def sublayer(self, name: str, x):
        """Run the sub-layer ``name``. A kept one is a SAVE region: the recompute skips
        it and reads its output, which therefore stays in memory after the forward."""
        if name not in self.keep:
            return getattr(self, name)(x)
        out = remat.region(getattr(self, name), name, recompute=False)(x)
        return remat.recompute_needs_tensor(out)  # the replayed ops after it read it

    def attention(self, x):
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them
        q, k, v = (self.sublayer(n, x).view(b, s, -1, self.head_dim).transpose(1, 2) for n in "qkv")
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        att = F.dropout(att.softmax(-1), self.dropout, self.training)
        return self.sublayer("proj", (att @ v).transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        x = x + self.attention(self.sublayer("norm1", x))
        return x + self.sublayer("down", F.gelu(self.sublayer("up", self.sublayer("norm2", x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.tok, self.pos = nn.Embedding(c.vocab, c.dim), nn.Embedding(c.seq_len, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm, self.head = nn.LayerNorm(c.dim), nn.Linear(c.dim, c.vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        # (batch * seq, vocab) logits: a fresh tensor, not a view, as FSDP2 prefers
        return self.head(self.norm(x).flatten(0, 1))


SUBLAYERS = ("norm1", "q", "k", "v", "proj", "norm2", "up", "down")


def remat_policy(spec: str) -> tuple[bool, frozenset[str]]:
    """``--remat`` -> (checkpoint every block?, the sub-layers each block keeps)."""
    if spec == "none" or spec.startswith("budget="):
        # budget=...: no remat until plan_on_first_step installs the plan.
        return False, frozenset()
    if spec == "full":  # keep nothing: the whole block is recomputed
        return True, frozenset()
    if spec == "selective":
        # Megatron-style: keep every matmul's output, replay the attention core,
        # the norms and the pointwise ops.
        return True, frozenset({"q", "k", "v", "proj", "up", "down"})
    if spec.startswith("keep="):
        keep = frozenset(spec.removeprefix("keep=").split(","))
        if keep <= set(SUBLAYERS):
            return True, keep
    raise ValueError(
        f"--remat {spec}: expected none, full, selective, keep=NAMES with NAMES "
        f"a comma-separated subset of {','.join(SUBLAYERS)}, or budget=F (a fraction "
        "of the no-remat activation bytes, e.g. budget=0.3), budget=BYTES or budget=auto"
    )


def plan_on_first_step(spec: str, model, x, y, rank: int) -> None:
    """--remat budget=...: measure the options on the first batch, install the
    cheapest plan that fits, and print its table (measured bytes included)."""
    from torch_remat.integrations import plan_remat

    value = spec.split("=", 1)[1]
    budget = value if value == "auto" else int(value) if value.isdigit() else float(value)
    # The linear layers as candidates: 2**6 + 1 measured options per block.
    loss_fn = lambda logits: F.cross_entropy(logits, y.flatten())  # noqa: E731
    plan = plan_remat(model, (x,), loss_fn, budget, blocks=Block, candidates=[nn.Linear])
    plan.apply(model)
    if rank == 0:
        print(plan, flush=True)


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # Megatron's split: column-parallel in, row-parallel out, one all-reduce per pair.
    return {
        **{f"blocks.*.{n}": ColwiseParallel() for n in ("q", "k", "v", "up")},
        **{f"blocks.*.{n}": RowwiseParallel() for n in ("proj", "down")},
    }


# ------------------------------------------------------------------------------ data


def load_text() -> str:
    # A snapshot of this project's docs, shipped with the repository, so that runs
    # stay comparable when the docs change.
    return (ROOT / "launch" / "data" / "corpus.txt").read_text()


class Batches:
    def __init__(self, text: str, seq_len: int, batch_size: int, seed: int, dp_rank: int):
        self.chars = sorted(set(text))
        self.data = torch.tensor([self.chars.index(ch) for ch in text])
        self.seq_len, self.batch_size, self.seed, self.dp_rank = seq_len, batch_size, seed, dp_rank

    def __call__(self, step: int):
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 131 + self.dp_rank)
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch_size,), generator=g)
        x = torch.stack([self.data[s : s + self.seq_len] for s in starts])
        y = torch.stack([self.data[s + 1 : s + self.seq_len + 1] for s in starts])
        return x, y


# --------------------------------------------------------------------- parallelism


def build(args, vocab: int, device: torch.device, world: int):
    """The model, wrapped for ``--parallel``, and this rank's (data-parallel rank, size)."""
    checkpointed, keep = remat_policy(args.remat)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = GPT(GPTConfig(vocab, args.seq_len, args.layers, args.dim, args.heads, keep=keep)).to(device)
    config = RematConfig(enabled=checkpointed)
    mode = args.parallel
    if mode == "none":
        apply_remat(model, check_fn=lambda m: isinstance(m, Block), remat=config)
        return model, 0, 1
    from torch.distributed.device_mesh import init_device_mesh

    if mode == "ddp":
        return ddp_with_remat(model, Block, remat=config), dist.get_rank(), world
    if mode == "fsdp2":
        mesh = init_device_mesh(device.type, (world,))
        return fully_shard_with_remat(model, Block, mesh=mesh, remat=config), dist.get_rank(), world
    if mode == "tp":
        mesh = init_device_mesh(device.type, (world,))
        return parallelize_with_remat(model, mesh, tp_plan(), Block, remat=config), 0, 1
    if mode == "fsdp2+tp":
        tp = 2 if world % 2 == 0 else 1
        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        model = fully_shard_with_remat(
            model, Block, mesh=mesh["dp"], remat=config, tp_mesh=mesh["tp"], tp_plan=tp_plan()
        )
        return model, mesh["dp"].get_local_rank(), world // tp
    raise ValueError(mode)


# ----------------------------------------------------------------- checkpoints


def save_checkpoint(directory: pathlib.Path, model, opt, step: int, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(directory / f"step{step}"))
    if rank == 0:
        tmp = directory / "latest.json.tmp"
        tmp.write_text(json.dumps({"step": step}))
        tmp.replace(directory / "latest.json")


def load_checkpoint(directory: pathlib.Path, model, opt) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    latest = directory / "latest.json"
    if not latest.exists():
        return 0
    step = json.loads(latest.read_text())["step"]
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(directory / f"step{step}"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step


# ---------------------------------------------------------------------------- main


def init_process_group(backend: str) -> None:
    """``dist.init_process_group`` with a key space of its own per torchrun attempt.

    After ``--max-restarts`` restarts the workers, torchrun's agent store may still
    hold the previous attempt's keys, and gloo then tries to connect to the dead
    workers' addresses ("connectFullMesh failed ... Connection refused"). A prefix per
    attempt keeps each group's rendezvous apart.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_store and rank == 0,
        multi_tenant=not agent_store,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed = dist.PrefixStore(f"torch_remat_train/attempt{attempt}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a small GPT with torch_remat.")
    p.add_argument("--parallel", choices=["none", "ddp", "fsdp2", "tp", "fsdp2+tp"], default="none")
    p.add_argument("--remat", default="selective", help="none, full, selective (keep the matmuls' outputs), keep=NAMES (sub-layers of a block to keep, e.g. keep=up,down), or budget=F: plan the cheapest policy within F of the no-remat activation bytes on the first step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="", help="save every --save-every steps; resume from the latest")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--report", action=argparse.BooleanOptionalAction, default=False, help="print the memory report of the last step (across ranks under torchrun)")
    p.add_argument("--log-json", default="", help="rank 0 writes the losses (and what each rank saved for backward at the logged steps) here")
    p.add_argument("--oom-dump-dir", default="", help="when a step runs out of memory, the rank writes a JSON dump here; merge them with: python -m torch_remat.integrations.oom DIR")
    args = p.parse_args(argv)
    try:
        remat_policy(args.remat)
    except ValueError as e:
        p.error(str(e))
    return args


def memory_report(loss, distributed: bool) -> str | None:
    """The saved-for-backward report of ``loss``'s graph: on rank 0 across ranks under
    torchrun (every rank must call it), the local one in a single process."""
    if not distributed:
        return remat.saved_tensors_report(loss).format()
    report = gather_memory_report([loss])
    return None if report is None else report.format()


def main(argv=None) -> None:
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ and args.parallel != "none"
    use_cuda = torch.cuda.is_available()
    if distributed:
        init_process_group("nccl" if use_cuda else "gloo")
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    elif args.parallel != "none":
        sys.exit(f"--parallel {args.parallel} needs torchrun (launch/run.sh)")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    text = load_text()
    model, dp_rank, dp_size = build(args, len(sorted(set(text))), device, world)
    batches = Batches(text, args.seq_len, args.batch_size, args.seed, dp_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ckpt_dir = pathlib.Path(args.checkpoint_dir) if args.checkpoint_dir else None
    oom_dumps = oom.install(args.oom_dump_dir) if args.oom_dump_dir else None
    start = 0
    if ckpt_dir is not None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        start = load_checkpoint(ckpt_dir, model, opt)
    if rank == 0:
        print(
            f"torch_remat train: parallel={args.parallel} remat={args.remat} ranks={world} "
            f"device={device.type} layers={args.layers} dim={args.dim} seq={args.seq_len}"
            + (f" (resumed at step {start})" if start else ""),
            flush=True,
        )
    losses, saved_log, report = {}, {}, None
    tokens = args.batch_size * args.seq_len * dp_size
    t0 = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        x, y = (t.to(device) for t in batches(step))
        if step == start + 1 and args.remat.startswith("budget="):
            plan_on_first_step(args.remat, model, x, y, rank)
        log_step = step == start + 1 or step % 10 == 0 or step == args.steps
        with oom_dumps.guard(step=step) if oom_dumps else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y.flatten())
            # What the forward keeps for backward, by the library's own account.
            saved = remat.saved_tensors_report(loss).total_bytes if log_step else 0
            if args.report and step == args.steps:
                report = memory_report(loss, distributed)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if distributed:
            loss_avg = loss.detach().clone()
            dist.all_reduce(loss_avg)
            loss_avg = loss_avg.item() / world
        else:
            loss_avg = loss.item()
        losses[step] = loss_avg
        if ckpt_dir is not None and step % args.save_every == 0:
            save_checkpoint(ckpt_dir, model, opt, step, rank)
        if log_step:
            all_saved = [saved]
            if distributed:
                all_saved = [None] * world
                dist.all_gather_object(all_saved, saved)
            saved_log[step] = all_saved
            if rank == 0:
                rate = tokens * (step - start) / (time.perf_counter() - t0)
                bar = "#" * (20 * step // args.steps)
                mem = " ".join(f"r{r}={b / 2**20:.2f}MiB" for r, b in enumerate(all_saved))
                print(
                    f"[{bar:<20}] step {step:>4}/{args.steps}  loss {loss_avg:.4f}  "
                    f"{rate:,.0f} tok/s  saved for backward {mem}",
                    flush=True,
                )
    if rank == 0 and args.log_json:
        pathlib.Path(args.log_json).write_text(json.dumps({"losses": losses, "saved_bytes": saved_log, "world": world}))
    if report is not None:
        print(report, flush=True)
    if distributed:
        # Free the wrapped model (DDP's reducer holds work on the group) before the
        # group goes away; destroying it afterwards could hang at exit.
        del model, opt
        dist.barrier()
        dist.destroy_process_group()
        # Everything is written; leave without the interpreter's teardown. Under
        # tensor parallelism a gloo thread can still be joinable when its C++
        # object is destroyed at exit, which aborts the rank ("terminate called
        # without an active exception") after a successful run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
