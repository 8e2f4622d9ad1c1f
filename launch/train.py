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
import hashlib
import json
import logging
import math
import os
import pathlib
import shutil
import signal
import sys
import time
import warnings
from typing import Any, NoReturn

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
from torch_remat.integrations._stderr import write_line

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


def usage_error(message: str, rank: int | None = None) -> NoReturn:
    """Exit with status 2, the status of a usage error, printing ``message`` on rank 0
    only (``rank``: this process's; default: torchrun's RANK)."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        write_line(f"train.py: error: {message}")
    else:
        # Under torchrun the first rank to exit ends the others: let rank 0 be the
        # one, so that its message is printed. The signal that then ends this rank
        # interrupts no training: it exits with the same status, printing nothing.
        _exit_2_on_signals()
        time.sleep(10)
    if dist.is_initialized():
        sys.stdout.flush()
        os._exit(2)  # no teardown of the process group (see the end of main)
    sys.exit(2)


def _exit_2_on_signals() -> None:
    """From now on SIGINT and SIGTERM end this process with status 2, printing
    nothing: it is exiting after an error already, and waits only so that rank 0's
    message is the one printed."""

    def exit_2(signum: int, frame) -> None:
        sys.stdout.flush()
        os._exit(2)

    if threading_main():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, exit_2)


def peer_left(e: BaseException) -> bool:
    """A collective failed because another rank's process went away."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer")
    )


def rank_error(message: str, rank: int) -> NoReturn:
    """Exit with status 2 after an error this rank may have met alone, where the other
    ranks may be waiting in a collective this one left (no outcome can be exchanged):
    rank 0 prints ``message`` at once; another rank waits a moment first, so that when
    rank 0 failed too its message is the one printed (torchrun ends the other ranks
    when the first exits), and then prints its own."""
    if not dist.is_initialized():
        usage_error(message, rank)
    if rank != 0:
        _exit_2_on_signals()  # (ended by torchrun meanwhile: rank 0's message stands)
        time.sleep(3)
    write_line(f"train.py: error: rank {rank}: {message}")
    sys.stdout.flush()
    os._exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """Prints its help and usage errors on rank 0 only (torchrun starts every rank
    with the same arguments)."""

    def print_help(self, file=None) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            super().print_help(file)

    def error(self, message: str) -> NoReturn:
        if int(os.environ.get("RANK", "0")) == 0:
            self.print_usage(sys.stderr)
        usage_error(message)


def parse_budget(value: str) -> float | int | str:
    """``--remat budget=VALUE`` -> plan_remat's budget: a fraction of the no-remat
    activation bytes (a float in (0, 1]), bytes (an int: a whole number above 1,
    however written) or "auto" (the free CUDA memory)."""
    if value == "auto" or (value.isdigit() and int(value) > 1):
        return value if value == "auto" else int(value)
    with contextlib.suppress(ValueError, OverflowError):
        number = float(value)
        if 0 < number <= 1:
            return number
        # a whole number above 1 is bytes however written (budget=2.0 as budget=2,
        # budget=1e9); a fraction is at most 1 (budget=1.5 is neither)
        if 1 < number < math.inf and number == int(number):
            return int(number)
    raise ValueError(value)


def remat_policy(spec: str) -> tuple[bool, frozenset[str]]:
    """``--remat`` -> (checkpoint every block?, the sub-layers each block keeps)."""
    if spec == "none":
        return False, frozenset()
    if spec.startswith("budget="):
        # No remat until plan_on_first_step installs the plan.
        with contextlib.suppress(ValueError):
            parse_budget(spec.removeprefix("budget="))
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
        "in (0, 1] of the no-remat activation bytes, e.g. budget=0.3), budget=BYTES (a "
        "whole number > 1, e.g. budget=2000000 or budget=2e6) or budget=auto (CUDA)"
    )


def offload_options(offload: str | None):
    """``--offload [MIN_BYTES]`` as the planner's ``offload=`` (None: not an option)."""
    from torch_remat.integrations.planner import OffloadOptions

    if offload is None:
        return None
    return OffloadOptions(min_bytes=int(offload)) if offload else OffloadOptions()


_PROFILE_FIELDS = {"name", "flops", "memory_bandwidth", "host_link_bandwidth", "memory_bytes",
                   "overlap_copies", "sources"}


def device_profile(spec: str | None):
    """``--device-profile NAME|FILE.json`` as the planner's ``profile=``: a published
    profile's name, or a JSON file of ``DeviceProfile`` fields (``flops`` by dtype
    name, bandwidths in bytes/s); None without. ``ValueError`` says what is wrong."""
    if spec is None:
        return None
    from torch_remat.integrations.planner._time import PROFILES, DeviceProfile

    if spec in PROFILES:
        return PROFILES[spec]
    if not spec.endswith(".json"):
        raise ValueError(f"--device-profile {spec}: expected a published profile's name "
                         f"({', '.join(sorted(PROFILES))}) or a .json file of its fields")
    try:
        fields = json.loads(pathlib.Path(spec).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--device-profile {spec}: cannot read it: {e}") from None
    unknown = set(fields) - _PROFILE_FIELDS if isinstance(fields, dict) else set()
    needed = {"name", "flops", "memory_bandwidth", "host_link_bandwidth"}
    if not isinstance(fields, dict) or unknown or not needed <= set(fields):
        raise ValueError(
            f"--device-profile {spec}: expected a JSON object with {', '.join(sorted(needed))} "
            f"(optional: memory_bytes, overlap_copies, sources)"
            + (f"; unknown fields: {', '.join(sorted(unknown))}" if unknown else "")
        )
    flops = fields["flops"]
    numbers = [fields["memory_bandwidth"], fields["host_link_bandwidth"]]
    if not isinstance(flops, dict) or not flops or not all(
        type(v) in (int, float) and v > 0 for v in [*flops.values(), *numbers]
    ):
        raise ValueError(f"--device-profile {spec}: flops (FLOP/s by dtype name, e.g. "
                         '{"float32": 1.5e11}) and the bandwidths (bytes/s) must be numbers > 0')
    if type(fields.get("overlap_copies", True)) is not bool or not (
        type(fields.get("memory_bytes", 0)) is int and fields.get("memory_bytes", 0) >= 0
    ):
        raise ValueError(f"--device-profile {spec}: overlap_copies must be true or false, "
                         "memory_bytes an integer >= 0")
    return DeviceProfile(**fields)


def launch_profile(offload: str | None, spec: str | None = None):
    """The forecast's device profile: ``--device-profile``'s if given; with
    ``--offload``, the launch device's, calibrated (as ``plan_remat`` calibrates it
    when planning on the first step); None otherwise."""
    if spec is not None:
        return device_profile(spec)
    if offload is None:
        return None
    from torch_remat.integrations.planner._time import calibrate

    return calibrate("cuda" if torch.cuda.is_available() else "cpu")


def plan_on_first_step(spec: str, model, x, y, rank: int, verify: bool = True,
                       offload: str | None = None, profile: str | None = None) -> None:
    """--remat budget=...: measure the options on the first batch, install the
    cheapest plan that fits, and print its table (measured bytes included). With
    ``--offload``, offloading a block's SAVE regions is among the options, and the
    options are compared by predicted added step time.

    Every rank plans (a sharded forward needs all of them) and installs rank 0's
    choice. A planning error on any rank ends every rank with status 2 and one
    message. An infeasible budget or a failed verification is decided after a
    collective all ranks reach, and rank 0 prints it. An error while measuring may
    hit one rank alone, partway through a run whose collectives the others are
    waiting in: that rank prints it (``rank N:``) and exits, and torchrun ends the
    others."""
    from torch_remat.integrations import InfeasibleBudgetError, PlanMismatchError, plan_remat

    budget = parse_budget(spec.removeprefix("budget="))
    # The linear layers as candidates: 2**6 + 1 measured options per block.
    loss_fn = lambda logits: F.cross_entropy(logits, y.flatten())  # noqa: E731
    plan, error = None, None
    try:
        plan = plan_remat(
            model, (x,), loss_fn, budget, blocks=Block, candidates=[nn.Linear], verify=verify,
            offload=offload_options(offload), profile=device_profile(profile),
        )
    except InfeasibleBudgetError as e:
        error = f"--remat {spec}: {e}"
    except PlanMismatchError as e:
        error = (
            f"--remat {spec}: {e} From the launcher: --no-verify-plan installs the "
            "plan without this check (its printed bytes are then predicted, not measured)."
        )
    except (remat.RematError, ValueError, TypeError) as e:
        # Raised while measuring, perhaps on this rank alone: the others may be in a
        # collective of that measuring run, which no exchange of outcomes reaches.
        rank_error(f"--remat {spec}: planning failed: {type(e).__name__}: {e}", rank)
    except RuntimeError as e:
        if not (dist.is_initialized() and peer_left(e)):
            raise
        # another rank left a collective of the measuring run: its error is printed
        rank_error(f"--remat {spec}: another rank stopped while planning (its message "
                   "says why)", rank)
    error = first_error(error)
    if error is not None:
        usage_error(error, rank)
    plan.apply(model)
    if rank == 0:
        print(plan, flush=True)


def first_error(error: str | None) -> str | None:
    """The first rank's error among every rank's (a collective under torchrun), so
    that every rank stops, or goes on, together."""
    if not dist.is_initialized():
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def forecast_layout(parallel: str, world: int):
    """The planner's Layout of ``--parallel`` on ``world`` ranks (None: one process)."""
    from torch_remat.integrations.planner import Layout

    if parallel == "none" or world == 1:
        return None
    if parallel == "ddp":
        return Layout(world, ddp=True)
    if parallel == "fsdp2":
        return Layout(world)
    if parallel == "tp":
        return Layout(world, tp=world, tp_plan=tp_plan())
    tp = 2 if world % 2 == 0 else 1  # fsdp2+tp: as build() lays it out
    return Layout(world, fsdp=world // tp, tp=tp, tp_plan=tp_plan() if tp > 1 else None)


def forecast_before_launch(args, vocab: int, rank: int, world: int) -> None:
    """--forecast: before any process group starts, rank 0 forecasts its own rank of
    the ``--parallel`` layout on ``world`` ranks (a fake process group, fake tensors:
    nothing allocated) for every hand policy and the plan of ``--remat budget=...``,
    with the largest micro-batch that fits ``--device-memory``, and prints it."""
    if rank != 0:
        return
    from torch_remat.integrations.planner import forecast_remat

    budget = parse_budget(args.remat.removeprefix("budget="))
    with torch.device("meta"):  # shapes only: the forecast allocates nothing of the model
        model = GPT(GPTConfig(vocab, args.seq_len, args.layers, args.dim, args.heads))
    x, y = Batches(load_text(), args.seq_len, args.batch_size, args.seed, 0)(1)

    # The loss of plan_on_first_step; the micro-batch search runs other batch sizes,
    # with targets of the logits' length (their values change no byte or FLOP).
    def loss_fn(logits):
        n = logits.shape[0]
        return F.cross_entropy(logits, y.flatten() if n == y.numel() else y.new_zeros(n))

    where = f" for rank 0 of --parallel {args.parallel} on {world} ranks" if world > 1 else ""
    print(f"torch_remat train: --forecast{where}: running each option of a block once on fake "
          "tensors (nothing allocated), then the largest micro-batch of each policy; the table "
          "follows", flush=True)
    try:
        forecast = forecast_remat(
            model, (x,), loss_fn, budget, blocks=Block, candidates=[nn.Linear],
            device_memory=args.device_memory, layout=forecast_layout(args.parallel, world),
            offload=offload_options(args.offload), profile=launch_profile(args.offload, args.device_profile),
        )
    except (ValueError, TypeError) as e:
        usage_error(f"--forecast: {e}", rank)
    print(forecast, flush=True)


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
        # (tp=1, an odd number of ranks: FSDP2 alone, as the layout line says; a plan
        # on a one-rank mesh would only make every block's tensors DTensors)
        parallel = dict(tp_mesh=mesh["tp"], tp_plan=tp_plan()) if tp > 1 else {}
        model = fully_shard_with_remat(model, Block, mesh=mesh["dp"], remat=config, **parallel)
        return model, mesh["dp"].get_local_rank(), world // tp
    raise ValueError(mode)


# ----------------------------------------------------------------- checkpoints
#
# --checkpoint-dir DIR holds one folder per saved step, DIR/stepN: the model and
# optimizer (torch.distributed.checkpoint, sharded as trained) and every rank's
# random generators (rng/rankR.pt: dropout draws from them, so a resumed run draws
# the masks the uninterrupted run would have), and from rank 0 the model's shape
# (model_config.json, compared at resume) and the log up to the step (log.json, where
# a resumed --log-json starts). checksums.json records the size and sha256 of every
# other file of the folder, verified before a resume loads it. A save is written to
# stepN.tmp and renamed when complete; DIR/latest.json names the newest step. Under torchrun on
# several nodes DIR is a folder every node sees (rank 0 writes the metadata and
# renames).


def _agree(ok: bool) -> bool:
    """True if ``ok`` on every rank (a collective under torchrun)."""
    if not dist.is_initialized():
        return ok
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # nccl reduces CUDA tensors
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@dataclasses.dataclass
class Skipped:
    """The steps of the checkpoint folders ``load_checkpoint`` could not read (all newer
    than the one it resumed from), which ``save_checkpoint``'s pruning neither counts
    among the K it keeps nor deletes while they are newer than its save; ``told``:
    rank 0 has said so."""

    steps: set[int] = dataclasses.field(default_factory=set)
    told: bool = False


def _step_folders(directory: pathlib.Path) -> list[int]:
    """The steps of the complete checkpoints in ``directory``, newest first."""
    steps = []
    for path in directory.glob("step*"):
        if path.name[4:].isdigit() and (path / ".metadata").is_file():
            steps.append(int(path.name[4:]))
    return sorted(steps, reverse=True)


class DamagedCheckpoint(Exception):
    """A file of a checkpoint folder is missing or cannot be read: the folder is skipped."""


def _cause(error: BaseException) -> str:
    """One line naming what failed (a CheckpointException holds each rank's traceback)."""
    from torch.distributed.checkpoint import CheckpointException

    if isinstance(error, DamagedCheckpoint):
        return str(error)
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    text = str(error).strip().splitlines()
    return type(error).__name__ + (f": {text[0]}" if text else "")


def _first_cause(error: BaseException | None, rank: int) -> str | None:
    """What failed on the first rank where something did (None: on none), on every rank
    (a collective under torchrun), that rank named where it is not rank 0."""
    cause = None if error is None else _cause(error)
    return first_error(f"rank {rank}: {cause}" if cause is not None and rank else cause)


def check_writable(directory: pathlib.Path, rank: int, flag: str = "--checkpoint-dir") -> None:
    """Fail at start, not at the first save (or the first dump), where a rank cannot
    write ``directory`` (given as ``flag``)."""
    probe = directory / f".write-check.rank{rank}"
    error = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        error = e.strerror or str(e)
    errors = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        r, e = failed[0]
        usage_error(f"{flag} {directory}: cannot write there"
                    f"{f' from rank {r}' if r else ''} ({e}); choose another directory or "
                    "make this one writable", rank)


_held_lock: int | None = None  # the folder's descriptor: the lock lasts as long as the process


def lock_checkpoint_dir(directory: pathlib.Path, rank: int) -> None:
    """Refuse a --checkpoint-dir another run is writing: rank 0 holds an exclusive
    lock on the folder itself for the run's life (the system releases it when the
    process ends, however it ends: a restarted attempt takes it again; nothing is
    written there). Two runs saving into one folder would replace each other's
    steps and resume from them."""
    global _held_lock
    error = None
    if rank == 0 and _held_lock is None:
        import fcntl

        fd = os.open(directory, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            error = (f"--checkpoint-dir {directory}: another run is writing there (it holds a "
                     "lock on the folder); wait for it to end or choose another directory")
        else:
            _held_lock = fd
    if dist.is_initialized():
        errors = [error]
        dist.broadcast_object_list(errors, src=0)
        error = errors[0]
    if error is not None:
        usage_error(error, rank)


def release_checkpoint_dir() -> None:
    """End of the run: let the folder go (the system does at exit anyway)."""
    global _held_lock
    if _held_lock is not None:
        os.close(_held_lock)
        _held_lock = None


@contextlib.contextmanager
def _no_load_logs():
    """torch.distributed.checkpoint logs each failed metadata read with its traceback
    (about 50 lines per checkpoint); load_checkpoint says in one line what failed."""
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group (--parallel none) torch.distributed.checkpoint warns
    that it saves or loads in a single process, as it is meant to: not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _rng_states() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_states(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


MODEL_FLAGS = (("layers", "--layers"), ("dim", "--dim"), ("heads", "--heads"), ("seq_len", "--seq-len"))
# what else a resume must share with the run it continues to be that run: its batches
# (the seed orders them), their size and the learning rate
TRAINING_FLAGS = (("seed", "--seed"), ("batch_size", "--batch-size"), ("lr", "--lr"))


def model_config(args, vocab: int, world: int | None = None) -> dict:
    """The model's shape, as a checkpoint folder records it (model_config.json), and
    with ``world`` (the number of ranks) the run's training settings and layout,
    compared at resume too."""
    config = {"layers": args.layers, "dim": args.dim, "heads": args.heads,
              "seq_len": args.seq_len, "vocab": vocab}
    if world is not None:
        config.update(seed=args.seed, batch_size=args.batch_size, lr=args.lr,
                      parallel=args.parallel, ranks=world)
    return config


def write_run_metadata(folder: pathlib.Path, config: dict, log: Log) -> None:
    """Rank 0's files in a checkpoint folder: the model's shape, compared at resume,
    and the log up to this step, which a resumed run starts its --log-json from (a
    run killed after the save but before --log-json was written loses no step)."""
    (folder / "model_config.json").write_text(json.dumps(config))
    (folder / "log.json").write_text(json.dumps(log.data()))


RUN_FILES = ("model_config.json", "log.json")  # written together by write_run_metadata


def _read_json_object(path: pathlib.Path) -> dict:
    """The JSON object in ``path``; DamagedCheckpoint where it cannot be read."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(f"{path.name} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise DamagedCheckpoint(f"{path.name} cannot be read (not a JSON object)")
    return value


def read_run_files(folder: pathlib.Path) -> dict | None:
    """The model config and settings a checkpoint folder records (model_config.json),
    None for a checkpoint from before folders recorded them (neither model_config.json
    nor log.json there). Rank 0 writes both files into every folder it saves, so one
    missing beside the other, or either unreadable, is a DamagedCheckpoint."""
    present = [name for name in RUN_FILES if (folder / name).exists()]
    if not present:
        return None
    for name in RUN_FILES:
        if name not in present:
            raise DamagedCheckpoint(f"{name} is missing, and {present[0]} is there: every "
                                    "checkpoint saved with one holds both")
    config = _read_json_object(folder / "model_config.json")
    log = _read_json_object(folder / "log.json")
    if not all(isinstance(log.get(key), dict) for key in ("losses", "saved_bytes")):
        raise DamagedCheckpoint("log.json cannot be read (it lacks its losses or saved_bytes)")
    for key in ("losses", "saved_bytes"):
        for step in log[key]:
            if not (isinstance(step, str) and step.isdigit()):
                raise DamagedCheckpoint(f"log.json cannot be read (its {key} names a step {step!r})")
    return config


CHECKSUMS = "checksums.json"


def _file_digest(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _share(names: list[str], rank: int, world: int) -> list[str]:
    """The files of ``names`` rank ``rank`` reads for their checksums: each file is
    read by one rank, the ranks' shares in parallel."""
    return [name for i, name in enumerate(names) if i % world == rank]


def _all_ranks(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (a collective under torchrun)."""
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def write_checksums(folder: pathlib.Path, rank: int) -> None:
    """After every file of a save is written (every rank calls it): record the size and
    sha256 of each file in ``folder`` in its checksums.json, which rank 0 writes."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    names = [None]
    if rank == 0:
        names = [sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                        if p.is_file() and p.name != CHECKSUMS)]
    if dist.is_initialized():
        dist.broadcast_object_list(names, src=0)
    mine = {name: {"bytes": (folder / name).stat().st_size, "sha256": _file_digest(folder / name)}
            for name in _share(names[0], rank, world)}
    shares = _all_ranks(mine)
    if rank == 0:
        files = {name: entry for share in shares for name, entry in share.items()}
        (folder / CHECKSUMS).write_text(json.dumps({"files": dict(sorted(files.items()))}))


def read_checksums(folder: pathlib.Path) -> dict[str, dict] | None:
    """The files ``folder``'s checksums.json records, by name ({"bytes", "sha256"});
    None for a checkpoint saved before saves recorded them; DamagedCheckpoint where it
    cannot be read."""
    path = folder / CHECKSUMS
    if not path.exists():
        return None
    files = _read_json_object(path).get("files")
    if not isinstance(files, dict) or not all(
        isinstance(e, dict) and type(e.get("bytes")) is int and isinstance(e.get("sha256"), str)
        for e in files.values()
    ):
        raise DamagedCheckpoint(f"{CHECKSUMS} cannot be read (not a record of files, sizes "
                                "and digests)")
    return files


class ChangedCheckpoint(Exception):
    """A file of a checkpoint folder has the size it was saved with and other bytes."""


def verify_checksums(folder: pathlib.Path, rank: int) -> bool:
    """Compare ``folder``'s files with its checksums.json before a resume loads them
    (every rank calls it; each reads its share of the files). DamagedCheckpoint where
    one is missing or has another size than saved (the load would fail on it, or read
    a file the save did not write), ChangedCheckpoint (on every rank alike) where one
    has its saved size and other bytes: a file the storage changed, which would load
    without an error. False for a checkpoint without checksums.json."""
    recorded = read_checksums(folder)
    if recorded is None:
        return False
    world = dist.get_world_size() if dist.is_initialized() else 1
    found = {}
    for name in _share(sorted(recorded), rank, world):
        path, saved = folder / name, recorded[name]
        try:
            size = path.stat().st_size
            if size != saved["bytes"]:
                found[name] = f"{name} is {size:,} bytes, and {saved['bytes']:,} were saved"
            elif _file_digest(path) != saved["sha256"]:
                found[name] = None  # changed in place
        except FileNotFoundError:
            found[name] = f"{name} is missing"
        except OSError as e:
            found[name] = f"{name} cannot be read ({e.strerror or e})"
    problems = {name: why for share in _all_ranks(found) for name, why in share.items()}
    damaged = [problems[name] for name in sorted(problems) if problems[name] is not None]
    if damaged:
        raise DamagedCheckpoint(damaged[0] + (f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""))
    if problems:
        raise ChangedCheckpoint(*sorted(problems))
    return True


def check_small_files(folder: pathlib.Path, world: int) -> None:
    """DamagedCheckpoint (or OSError) where a resume on ``world`` ranks would find
    ``folder``'s small files unsound: its recorded settings and log, its checksums,
    and every rank's random generators."""
    read_checksums(folder)
    saved = read_run_files(folder)
    for name in expected_rng_files(saved, world):
        if not (folder / name).is_file():
            raise DamagedCheckpoint(
                f"{name} is missing: the run saved there had {saved['ranks']} rank(s), "
                "and each wrote its random generators")


def readable_folder(folder: pathlib.Path, world: int) -> bool:
    """Whether ``folder``'s small files are sound (:func:`check_small_files`): what
    pruning asks of the older checkpoints it keeps, which the resume did not try."""
    try:
        check_small_files(folder, world)
    except (DamagedCheckpoint, OSError):
        return False
    return True


def expected_rng_files(saved: dict | None, world: int) -> list[str]:
    """The random generator files (relative to its folder) a checkpoint whose recorded
    settings are ``saved`` must hold for a resume on ``world`` ranks: every rank of
    the saving run wrote its own, so rank R's, for each R below both numbers of ranks;
    none where the checkpoint did not record its number of ranks (saved before
    folders recorded it)."""
    ranks = saved.get("ranks") if isinstance(saved, dict) else None
    if type(ranks) is not int:
        return []
    return [f"rng/rank{r}.pt" for r in range(min(ranks, world))]


def check_saved_shapes(directory: pathlib.Path, step: int, model_state: dict, rank: int) -> None:
    """For a checkpoint without model_config.json: usage error if the tensors it
    holds are not the model's, by name and shape (from its DCP metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    path = directory / f"step{step}"
    try:
        with _no_load_logs():
            metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # unreadable: the load says so
        return
    saved = {k.removeprefix("model."): getattr(v, "size", None) for k, v in metadata.items()
             if k.startswith("model.")}
    mine = {k: tuple(v.shape) for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    detail = None
    extra, missing = sorted(set(saved) - set(mine)), sorted(set(mine) - set(saved))
    if extra:
        detail = f"it holds {extra[0]}, which this run's model lacks"
    elif missing:
        detail = f"it lacks {missing[0]}, which this run's model has"
    else:
        for k, shape in mine.items():
            if saved[k] is not None and tuple(saved[k]) != shape:
                detail = f"{k} is {tuple(saved[k])} there and {shape} here"
                break
    if detail:
        usage_error(f"--checkpoint-dir {directory}: {path.name} holds a model of another shape "
                    f"than this run's ({detail}); pass the --layers, --dim, --heads and "
                    "--seq-len it was trained with, or choose another --checkpoint-dir (nothing "
                    "there was changed)", rank)


def check_model_config(directory: pathlib.Path, step: int, config: dict, rank: int) -> bool:
    """Usage error if the checkpoint of ``step`` holds a model of another shape than
    this run's (loading it would take some of its tensors, or fail on every one), or
    was trained with another seed, batch size or learning rate (the resumed run would
    not be the one it continues); a line on rank 0 where its layout (--parallel, the
    number of ranks) differs. False when the checkpoint does not record its shape (one
    from before folders recorded it); DamagedCheckpoint where model_config.json cannot
    be read."""
    path = directory / f"step{step}" / "model_config.json"
    if not path.exists():
        return False  # an older checkpoint without it
    saved = _read_json_object(path)
    given = [f"{flag} {config[key]}" for key, flag in MODEL_FLAGS if saved.get(key, config[key]) != config[key]]
    there = [f"{flag} {saved[key]}" for key, flag in MODEL_FLAGS if saved.get(key, config[key]) != config[key]]
    if given:
        usage_error(f"--checkpoint-dir {directory}: this run has {', '.join(given)}, but the "
                    f"checkpoints there were saved with {', '.join(there)}; pass "
                    f"{' '.join(there)} to resume them, or choose another --checkpoint-dir "
                    "for this shape (nothing there was changed)", rank)
    if saved.get("vocab", config["vocab"]) != config["vocab"]:
        usage_error(f"--checkpoint-dir {directory}: its checkpoints were saved with a vocabulary "
                    f"of {saved['vocab']} characters and this corpus has {config['vocab']}; "
                    "choose another --checkpoint-dir (nothing there was changed)", rank)
    # (a checkpoint written before these were recorded holds none of them)
    changed = [(flag, saved[key], config[key]) for key, flag in TRAINING_FLAGS
               if key in config and key in saved and saved[key] != config[key]]
    if changed:
        usage_error(f"--checkpoint-dir {directory}: this run has "
                    f"{', '.join(f'{flag} {now}' for flag, _, now in changed)}, but the checkpoints "
                    f"there were saved with {', '.join(f'{flag} {was}' for flag, was, _ in changed)}; "
                    "a resume continues that run exactly: pass "
                    f"{' '.join(f'{flag} {was}' for flag, was, _ in changed)} to resume it, or choose "
                    "another --checkpoint-dir for a new run (nothing there was changed)", rank)
    layout = [(k, saved[k], config[k]) for k in ("parallel", "ranks")
              if k in config and k in saved and saved[k] != config[k]]
    if layout and rank == 0:
        was = dict((k, v) for k, v, _ in layout)
        parallel, ranks = was.get("parallel", config["parallel"]), was.get("ranks", config["ranks"])
        before, now = data_ranks(parallel, ranks), data_ranks(config["parallel"], config["ranks"])
        if set(before) != set(now):
            draws = ("each rank's batches (and dropout masks) after the resume differ from those "
                     "of the run saved there")
        elif before != now or tp_size(parallel, ranks) != tp_size(config["parallel"], config["ranks"]):
            draws = ("each step after the resume trains on the batches of the run saved there; "
                     "the dropout masks differ")
        else:
            draws = ("each rank trains on the batches, and draws the dropout masks, it would have "
                     "in the run saved there")
        print(f"torch_remat train: {path.parent} was saved with --parallel {parallel} on {ranks} "
              f"rank(s), and this run is --parallel {config['parallel']} on {config['ranks']}: "
              f"the model and optimizer states are resharded on loading; {draws}", flush=True)
    return True


def data_ranks(parallel: str, world: int) -> list[int]:
    """Each rank's data-parallel rank under ``--parallel`` on ``world`` ranks, as
    ``build`` lays them out: the batches it trains on (``Batches``) follow from it
    alone, and a step trains on the batches of the data-parallel ranks there are.
    Each rank's dropout masks follow from its random generators (saved and restored
    per rank) and the shapes it holds, the same where the number of ranks and of
    tensor-parallel ranks are."""
    if parallel in ("none", "tp"):
        return [0] * world  # every rank trains on the one batch of each step
    tp = tp_size(parallel, world)  # fsdp2+tp: a mesh of dp x tp, rank r at (r // tp, r % tp)
    return [r // tp for r in range(world)]


SAVE_FAILED = 3
"""Exit status of a run whose checkpoint the system refused to write (see
launch/torchrun.py)."""


def save_checkpoint(directory: pathlib.Path, model, opt, step: int, rank: int, keep: int,
                    config: dict | None = None, log: Log | None = None,
                    skipped: Skipped | None = None) -> None:
    """Save ``step`` to ``directory``/stepN (through stepN.tmp); with ``keep`` > 0,
    delete older checkpoints past the ``keep`` newest (see ``prune_checkpoints``).
    A save the system refuses (a full disk, a folder removed under the run) ends the
    run with status 3 and one line per rank saying why, not a traceback per rank."""
    try:
        _save_checkpoint(directory, model, opt, step, rank, keep, config, log, skipped)
    except BaseException as e:  # (torch.distributed.checkpoint's CheckpointException is one)
        reason = _write_failure(e)
        if reason is None:
            raise
        try:
            free = f"; {shutil.disk_usage(directory).free:,} B free there"
        except OSError:
            free = ""
        write_line(f"torch_remat train: rank {rank}: saving step {step} to {directory} failed: "
                   f"{reason}{free}. Free space there or choose another --checkpoint-dir; the "
                   "checkpoints saved before are kept and a restart resumes from the newest")
        if dist.is_initialized():
            sys.stdout.flush()
            os._exit(SAVE_FAILED)  # the other ranks wait in a collective: torchrun ends them
        sys.exit(SAVE_FAILED)


# what torch.save's zip writer raises when a write fails (a full disk among others)
_ZIP_WRITE_FAILED = ("PytorchStreamWriter failed", "unexpected pos")


def _write_failure(e: BaseException) -> str | None:
    """Why the system refused a write, from ``e``, its causes and, for
    torch.distributed.checkpoint's CheckpointException, each rank's failure: an
    OSError's message (and file), or a failed write of torch.save's zip writer;
    None for anything else."""
    stack: list[Any] = [e]
    seen: set[int] = set()
    found = None
    while stack:
        x = stack.pop()
        if isinstance(x, tuple) and x:  # (exception, traceback summary)
            x = x[0]
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno:
            return f"{x.strerror}" + (f" ({x.filename})" if x.filename else "")
        if found is None and isinstance(x, RuntimeError) and any(s in str(x) for s in _ZIP_WRITE_FAILED):
            found = "a file could not be written (torch.save: " + str(x).strip().splitlines()[0] + ")"
        stack.extend((x.__cause__, x.__context__))
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            stack.extend(failures.values())
    return found


def _save_checkpoint(directory: pathlib.Path, model, opt, step: int, rank: int, keep: int,
                     config: dict | None, log: Log | None, skipped: Skipped | None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final, tmp = directory / f"step{step}", directory / f"step{step}.tmp"
    if rank == 0:
        for path in (final, tmp):
            if path.exists() and not path.is_dir():
                # a file of the user's named like a checkpoint: not replaced
                moved = path.with_name(f"{path.name}.not-a-checkpoint")
                path.rename(moved)
                print(f"torch_remat train: {path} is a file, not a checkpoint folder; moved it to "
                      f"{moved} to save step {step} there", flush=True)
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)  # an earlier attempt's unfinished save
    if dist.is_initialized():
        dist.barrier()
    (tmp / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(_rng_states(), tmp / "rng" / f"rank{rank}.pt")
    msd, osd = get_state_dict(model, opt)
    # Returns on every rank once every rank's files and the metadata are written.
    with _single_process_quiet():
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    if rank == 0 and config is not None and log is not None:
        write_run_metadata(tmp, config, log)
    write_checksums(tmp, rank)  # of every file above, now all written
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for stale in directory.glob("step*.tmp"):  # unfinished saves of crashed attempts
            shutil.rmtree(stale, ignore_errors=True)
        latest = directory / "latest.json.tmp"
        latest.write_text(json.dumps({"step": step}))
        latest.replace(directory / "latest.json")
    if skipped is not None:
        skipped.steps.discard(step)  # replaced by this save, on every rank
    if rank == 0 and keep:
        prune_checkpoints(directory, step, keep, skipped or Skipped())


def prune_checkpoints(directory: pathlib.Path, step: int, keep: int, skipped: Skipped) -> None:
    """--keep-checkpoints ``keep`` after saving ``step``: keep that save and the
    ``keep`` - 1 newest older checkpoints a resume could read, and delete the other
    older ones. A folder the resume found unreadable, or whose small files (settings,
    log, random generators) are damaged, is not one of them (deleted if older than
    the save, as any other not kept). A folder newer than the save is not
    this run's: it is neither counted nor deleted (one the resume skipped as
    unreadable is replaced when the run saves its step; rank 0 says so once)."""
    older = [s for s in _step_folders(directory) if s < step]
    world = dist.get_world_size() if dist.is_initialized() else 1
    readable = [s for s in older if s not in skipped.steps and readable_folder(directory / f"step{s}", world)]
    for old in sorted(set(older) - set(readable[: keep - 1]), reverse=True):
        shutil.rmtree(directory / f"step{old}")
    newer = sorted(s for s in skipped.steps if s > step and (directory / f"step{s}").exists())
    if newer and not skipped.told:
        skipped.told = True
        for s in newer:
            print(f"torch_remat train: --keep-checkpoints {keep}: {directory / f'step{s}'} was "
                  "unreadable at the resume; it is left there and not counted among the "
                  f"checkpoints kept: a save of step {s} replaces it; otherwise move it away "
                  "(every resume tries it first)", flush=True)


def load_checkpoint(directory: pathlib.Path, model, opt, rank: int, config: dict | None = None,
                    skipped: Skipped | None = None) -> int:
    """Resume from the newest complete checkpoint in ``directory`` (0: none there).
    One that cannot be read is skipped, with a message (its step added to
    ``skipped``); one of another model shape than ``config`` is a usage error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    say = (lambda msg: print(f"torch_remat train: {msg}", flush=True)) if rank == 0 else (lambda msg: None)
    steps = _step_folders(directory)
    latest = directory / "latest.json"
    if latest.exists():
        try:
            named = int(json.loads(latest.read_text())["step"])
        except (ValueError, KeyError, TypeError) as e:
            say(f"{latest} is unreadable ({type(e).__name__}: {e}); "
                "resuming from the newest complete checkpoint instead")
        else:
            if named not in steps:
                say(f"{latest} names step{named}, which is not there; "
                    "resuming from the newest complete checkpoint instead")
    for step in steps:
        path = directory / f"step{step}"
        # First the small files, which every rank reads alike; then, where they are
        # sound, the states (no rank enters the load's collectives alone).
        error = None
        try:
            check_small_files(path, dist.get_world_size() if dist.is_initialized() else 1)
        except (DamagedCheckpoint, OSError) as e:  # (an OSError on one rank: all skip)
            error = e
        if _agree(error is None):
            if config is not None and not check_model_config(directory, step, config, rank):
                check_saved_shapes(directory, step, get_state_dict(model, opt)[0], rank)
            try:
                verified = verify_checksums(path, rank)  # (the same outcome on every rank)
            except DamagedCheckpoint as e:
                error = e
            except ChangedCheckpoint as e:
                changed = e.args
                usage_error(
                    f"--checkpoint-dir {directory}: step {step}'s file {path / changed[0]} does "
                    "not match the checksum recorded when it was saved"
                    + (f" (nor do {len(changed) - 1} more of its files)" if len(changed) > 1 else "")
                    + ": it has its saved size and other bytes, changed on disk since (check "
                    f"the storage). Nothing was loaded; to resume from the checkpoint before "
                    f"it, move {path} out of {directory} (or delete it)", rank)
            else:
                if not verified:
                    say(f"{path} records no checksums (saved before checkpoints recorded them): "
                        "its files are loaded unverified")
        if _agree(error is None):
            try:
                msd, osd = get_state_dict(model, opt)
                state = {"model": msd, "optim": osd}
                with _single_process_quiet(), _no_load_logs():
                    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
                rng_file = path / "rng" / f"rank{rank}.pt"
                try:
                    rng = torch.load(rng_file) if rng_file.exists() else None
                except Exception as e:
                    raise DamagedCheckpoint(f"rng/{rng_file.name} cannot be read ({_cause(e)})") from e
            except (Exception, dcp.CheckpointException) as e:  # any unreadable file: try the next
                error = e
        cause = _first_cause(error, rank)
        if cause is not None:
            say(f"checkpoint {path} is unreadable ({cause}); trying the next older one")
            if skipped is not None:
                skipped.steps.add(step)
            continue
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if not _agree(rng is not None):
            say(f"{path} holds no random generator states for this number of ranks: dropout "
                "masks after the resume differ from those of an uninterrupted run")
        if rng is not None:
            _set_rng_states(rng)
        return step
    if steps:
        usage_error(f"--checkpoint-dir {directory}: none of its checkpoints "
                    f"({', '.join(f'step{s}' for s in steps)}) can be read; move them away to "
                    "start afresh", rank)
    return 0


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


class _Default(str):
    """A string default: tells a flag left out from one given its default value."""


POSITIVE = ("steps", "batch_size", "seq_len", "layers", "dim", "heads", "save_every")


def parse_args(argv=None):
    # no abbreviations: run.sh reads --parallel (one process for none) by its full name
    p = ArgumentParser(description="Train a small GPT with torch_remat.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--parallel", choices=["none", "ddp", "fsdp2", "tp", "fsdp2+tp"], default="none", help="how the ranks share the model (all but none need torchrun, e.g. launch/run.sh; none trains in one process); fsdp2+tp: tensor parallelism over pairs of ranks, FSDP2 across the pairs")
    p.add_argument("--remat", default="selective", help="none, full, selective (keep the matmuls' outputs), keep=NAMES (sub-layers of a block to keep, e.g. keep=up,down), or budget=F|BYTES|auto: plan on the first step the cheapest policy within F of the no-remat activation bytes, within BYTES, or (CUDA) within the free memory")
    p.add_argument("--forecast", action="store_true", help="with --remat budget=F|BYTES: before training, print rank 0's forecast for the --parallel layout on the launch's ranks (every hand policy and the plan, run on fake tensors over a fake process group: nothing allocated), with the largest micro-batch fitting --device-memory")
    p.add_argument("--offload", nargs="?", const="", default=None, metavar="MIN_BYTES", help="with --remat budget=F|BYTES: a block's plan may also move what its SAVE regions keep to host memory (an ActivationOffloader, copying back one block ahead) where that is predicted to cost less step time than recomputing; tensors under MIN_BYTES stay on the device (default: 1 MiB, the offloader's)")
    p.add_argument("--device-profile", default=None, metavar="NAME|FILE.json", help="with --remat budget=F|BYTES: predict step times (and with --offload choose among keep, recompute and offload) for this device profile instead of calibrating the launch device: a published one's name (e.g. 'H100 SXM') or a JSON file of its fields (name, flops by dtype, memory_bandwidth and host_link_bandwidth in bytes/s, optional overlap_copies)")
    p.add_argument("--verify-plan", action=argparse.BooleanOptionalAction, default=True, help="with --remat budget=...: run the chosen plan once and stop (status 2, naming each block whose bytes differ) if it keeps other bytes than predicted; --no-verify-plan installs the plan unchecked")
    p.add_argument("--device-memory", default=_Default("80GiB"), help="the device memory --forecast fits micro-batches into (e.g. 80GiB, 40GB); only with --forecast")
    p.add_argument("--steps", type=int, default=40, help="train up to this step (a resumed run continues to it)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step on each data-parallel rank")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (each one checkpoint)")
    p.add_argument("--dim", type=int, default=64, help="model width (a multiple of --heads)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (a multiple of the tensor-parallel ranks)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="initial weights and batches")
    p.add_argument("--checkpoint-dir", default="", help="save every --save-every steps (with every rank's random generators and the model's shape); resume from the newest complete checkpoint there, exactly")
    p.add_argument("--save-every", type=int, default=10, help="steps between checkpoints (with --checkpoint-dir; the last step is saved too)")
    p.add_argument("--keep-checkpoints", type=int, default=0, metavar="K", help="after each save, keep it and the K-1 newest older checkpoints a resume can read, delete the older ones (0: keep all); a folder newer than the save, which the resume found unreadable, is left")
    p.add_argument("--report", action=argparse.BooleanOptionalAction, default=False, help="print the memory report of the last step (across ranks under torchrun)")
    p.add_argument("--log-json", default="", help="rank 0 writes the losses (and what each rank saved for backward at the logged steps) here, at every checkpoint and at the end; a resumed run starts from its checkpoint's log up to the resume point (not from this file, which may be another run's) and lists it in resumed_at; a new run refuses a file that exists and is not empty (another run's log), unless --overwrite-log-json")
    p.add_argument("--overwrite-log-json", action="store_true", help="let a new run (not a resume) replace the file at --log-json that another run wrote")
    p.add_argument("--oom-dump-dir", default="", help="when a step runs out of memory, the rank writes a JSON dump here; merge them with: python -m torch_remat.integrations.oom DIR")
    args = p.parse_args(argv)
    # relative paths name places under the folder the job was started from (run.sh
    # runs from the repository root and passes that folder on)
    caller = os.environ.get("TORCH_REMAT_CALLER_DIR")
    if caller:
        for name in ("checkpoint_dir", "log_json", "oom_dump_dir"):
            value = getattr(args, name)
            if value and not os.path.isabs(value):
                setattr(args, name, os.path.join(caller, value))
    for name in POSITIVE:
        value = getattr(args, name)
        if value < 1:
            p.error(f"--{name.replace('_', '-')} {value}: expected an integer >= 1")
    if not math.isfinite(args.lr) or args.lr < 0:
        p.error(f"--lr {args.lr}: expected a finite learning rate >= 0, e.g. --lr 3e-3")
    characters = len(load_text())
    if args.seq_len > characters - 2:
        p.error(f"--seq-len {args.seq_len}: the training text (launch/data/corpus.txt) has "
                f"{characters:,} characters; a sequence and its targets (the same sequence one "
                f"character on) take at most {characters - 2:,} of them")
    if args.dim % args.heads:
        p.error(f"--heads {args.heads}: --dim {args.dim} must be a multiple of it (each head "
                "takes dim/heads channels)")
    if args.oom_dump_dir and pathlib.Path(args.oom_dump_dir).exists() and not pathlib.Path(args.oom_dump_dir).is_dir():
        p.error(f"--oom-dump-dir {args.oom_dump_dir}: is a file, not a folder; name a folder "
                "(it is created if missing)")
    if not isinstance(args.device_memory, _Default) and not args.forecast:
        p.error("--device-memory is read by --forecast only (the micro-batch it forecasts to "
                "fit); add --forecast with --remat budget=F|BYTES, or drop --device-memory")
    args.device_memory = str(args.device_memory)
    try:
        remat_policy(args.remat)
    except ValueError as e:
        p.error(str(e))
    if args.remat == "budget=auto" and not torch.cuda.is_available():
        p.error("--remat budget=auto plans within the free CUDA memory, and no CUDA device is "
                "available: on CPU give a fraction of the no-remat activation bytes "
                "(budget=0.3) or a number of bytes (budget=2000000)")
    if args.forecast and not args.remat.startswith("budget=") or args.remat == "budget=auto" and args.forecast:
        p.error("--forecast plans like --remat budget=F or budget=BYTES (e.g. --remat budget=0.3 "
                "--forecast); budget=auto reads a device the forecast does not run on")
    if args.offload is not None:
        if not args.remat.startswith("budget="):
            p.error(f"--offload is a choice the planner makes: it needs --remat budget=F|BYTES "
                    f"(got --remat {args.remat}); e.g. --remat budget=0.3 --offload")
        if "tp" in args.parallel:
            p.error(f"--offload with --parallel {args.parallel}: tensor-parallel activations are "
                    "DTensors, which the offloader does not move; offload under --parallel fsdp2, "
                    "ddp or none, or drop --offload")
        if args.offload and not args.offload.isdigit():
            p.error(f"--offload {args.offload}: expected MIN_BYTES, an integer >= 0 (the smallest "
                    "tensor moved to host memory), or nothing for the default")
    if args.device_profile is not None:
        if not args.remat.startswith("budget="):
            p.error(f"--device-profile is what the planner predicts step times for: it needs "
                    f"--remat budget=F|BYTES (got --remat {args.remat})")
        try:
            device_profile(args.device_profile)
        except ValueError as e:
            p.error(str(e))
    if args.overwrite_log_json and not args.log_json:
        p.error("--overwrite-log-json lets a new run replace the file at --log-json: give "
                "--log-json FILE too, or drop --overwrite-log-json")
    if args.keep_checkpoints < 0:
        p.error(f"--keep-checkpoints {args.keep_checkpoints}: expected K >= 0 (0: keep all)")
    return args


def tp_size(parallel: str, world: int) -> int:
    """The tensor-parallel ranks of ``--parallel`` on ``world`` ranks (1: none)."""
    if parallel == "tp":
        return world
    if parallel == "fsdp2+tp":
        return 2 if world % 2 == 0 else 1
    return 1


def check_layout(args, world: int, rank: int) -> None:
    """Usage error where the model cannot be split as ``--parallel`` asks on ``world`` ranks."""
    tp = tp_size(args.parallel, world)
    if tp > 1 and args.heads % tp:
        usage_error(f"--parallel {args.parallel} on {world} ranks: --heads {args.heads} must be "
                    f"a multiple of the {tp} tensor-parallel ranks (each rank takes heads/{tp} "
                    "of them); change the number of ranks (NPROC) or --heads", rank)


def check_one_process_per_run(args, world: int, rank: int) -> None:
    """Usage error where torchrun started ``world`` > 1 processes for ``--parallel
    none``: each would train the whole model alone as rank 0, printing every line
    the others print and saving over their --log-json and --checkpoint-dir."""
    if args.parallel != "none" or world <= 1:
        return
    usage_error(f"--parallel none under torchrun with {world} processes: each would train the "
                "whole model alone, writing the same files as the others. Pass --parallel fsdp2, "
                "ddp, tp or fsdp2+tp to train one model on all of them (launch/run.sh passes "
                "fsdp2), or start one process (--nproc-per-node 1)", rank)


def layout_line(args, world: int) -> str | None:
    """How ``--parallel fsdp2+tp`` lays out ``world`` ranks (None for other modes)."""
    if args.parallel != "fsdp2+tp":
        return None
    tp = tp_size(args.parallel, world)
    line = f"torch_remat train: --parallel fsdp2+tp on {world} ranks: mesh dp={world // tp} x tp={tp}"
    if tp == 1:
        line += " (an odd number of ranks has no pairs for tensor parallelism: FSDP2 alone)"
    elif world == tp:
        line += " (one pair: tensor parallelism alone; 4 or more ranks shard with FSDP2 too)"
    return line


def check_log_json(path: str, rank: int) -> None:
    """Fail at start, not after training, where rank 0 cannot write ``--log-json``."""
    if rank != 0 or not path:
        return
    target = pathlib.Path(path)
    error = "it is a folder" if target.is_dir() else None
    if error is None:
        probe = pathlib.Path(path + ".tmp")  # Log.write writes there, then renames
        try:
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            error = e.strerror or str(e)
    if error is not None:
        usage_error(f"--log-json {path}: cannot write there ({error}); name a file in an "
                    "existing, writable folder", rank)


def log_json_refusal(path: str, overwrite: bool) -> str | None:
    """Why a new run (not a resume) does not write ``--log-json`` ``path``: a file
    there that is not empty, which another run wrote (or that is no log at all), is
    not replaced without ``--overwrite-log-json``. None where it may write."""
    if not path or overwrite:
        return None
    target = pathlib.Path(path)
    try:
        if target.stat().st_size == 0:  # (one made by mktemp)
            return None
        log = json.loads(target.read_text())
        steps = sorted(int(step) for step in log["losses"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        what = "the file exists and is not a log this launcher wrote"
    else:
        what = ("the file holds another run's log "
                + (f"(steps {steps[0]}-{steps[-1]})" if steps else "(no steps)"))
    return (f"--log-json {path}: {what}; this new run would replace it: pass "
            "--overwrite-log-json to replace it, or name another file (a run resumed from "
            "its --checkpoint-dir writes on in its own log)")


def memory_report(loss, distributed: bool) -> str | None:
    """The saved-for-backward report of ``loss``'s graph: on rank 0 across ranks under
    torchrun (every rank must call it), the local one in a single process."""
    if not distributed:
        return remat.saved_tensors_report(loss).format()
    report = gather_memory_report([loss])
    return None if report is None else report.format()


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached this process (raised by its handler, ``run.signum``)."""


@dataclasses.dataclass
class RunState:
    """Where a run is, for the line it prints when a signal ends it."""

    steps: int = 0  # --steps
    step: int = 0  # the step being trained (0: none yet)
    completed: int = 0  # the last step trained to its end
    saved: int | None = None  # the newest checkpoint of this run's folder (resumed or saved)
    checkpoint_dir: pathlib.Path | None = None
    signum: int | None = None  # the signal received (the first)
    deferring: bool = False  # inside a save: the signal is acted on after it


_run = RunState()


def _on_signal(signum: int, frame) -> None:
    if _run.signum is not None:
        return  # already stopping (Ctrl-C under torchrun: the terminal's SIGINT, then torchrun's)
    _run.signum = signum
    if not _run.deferring:
        raise Interrupted(signum)


@contextlib.contextmanager
def signals_deferred():
    """A save runs to its end when a signal comes in the middle of it (no step is left
    half-written in its final place); the signal is acted on after it."""
    _run.deferring = True
    try:
        yield
    finally:
        _run.deferring = False
    if _run.signum is not None:
        raise Interrupted(_run.signum)


def interrupted_line(state: RunState, rank: int | None) -> str:
    """What a rank prints when a signal ends the run."""
    name = signal.Signals(state.signum).name
    who = f"rank {rank}: " if rank is not None else ""
    if not state.step:
        where = "before training started"
    elif state.completed == state.step:
        where = f"after step {state.step} of {state.steps}"
    else:
        where = f"at step {state.step} of {state.steps}"
    if state.checkpoint_dir is None:
        saved = "nothing was saved (no --checkpoint-dir)"
    elif state.saved:
        saved = (f"the last saved checkpoint is step {state.saved} "
                 f"({state.checkpoint_dir / f'step{state.saved}'}); the same command resumes from it")
    elif state.step:
        saved = f"no checkpoint was saved yet in {state.checkpoint_dir}; the same command starts afresh"
    else:
        saved = "no checkpoint was loaded or saved"
    return f"torch_remat train: {who}interrupted by {name} {where}; {saved}"


def main(argv=None) -> None:
    """Train (see the module's docstring). SIGINT (Ctrl-C) or SIGTERM ends the run with
    one line per rank, saying where it was and which checkpoint a restart resumes from,
    and the conventional status, 128 + the signal's number (130, 143)."""
    global _run
    _run = RunState()
    handlers = {}
    if threading_main():
        handlers = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _main(argv)
    except BaseException as e:
        if _run.signum is None and isinstance(e, Exception) and dist.is_initialized() and peer_left(e):
            # another rank stopped first: when the launch is ending every rank, this
            # rank's own signal is on its way
            with contextlib.suppress(Interrupted):
                time.sleep(2)
        if _run.signum is None:
            raise
        rank = None
        if "WORLD_SIZE" in os.environ and (dist.is_initialized() or "RANK" in os.environ):
            rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
        write_line(interrupted_line(_run, rank))
        status = 128 + _run.signum
        if dist.is_initialized():
            sys.stdout.flush()
            os._exit(status)  # no teardown of a group whose peers are gone (see finish)
        sys.exit(status)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def threading_main() -> bool:
    """Signal handlers can be set: this is the main thread."""
    import threading

    return threading.current_thread() is threading.main_thread()


def _main(argv=None) -> None:
    args = parse_args(argv)
    _run.steps = args.steps
    distributed = "WORLD_SIZE" in os.environ and args.parallel != "none"
    use_cuda = torch.cuda.is_available()
    launch_rank = int(os.environ.get("RANK", "0"))
    check_layout(args, int(os.environ.get("WORLD_SIZE", "1")) if distributed else 1, launch_rank)
    check_one_process_per_run(args, int(os.environ.get("WORLD_SIZE", "1")), launch_rank)
    check_log_json(args.log_json, launch_rank)
    if args.forecast:
        forecast_before_launch(
            args, len(sorted(set(load_text()))), int(os.environ.get("RANK", "0")),
            int(os.environ.get("WORLD_SIZE", "1")) if distributed else 1,
        )
    if distributed:
        init_process_group("nccl" if use_cuda else "gloo")
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    elif args.parallel != "none":
        usage_error(f"--parallel {args.parallel} needs torchrun (launch/run.sh), or pass "
                    "--parallel none to train in this one process")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    text = load_text()
    config = model_config(args, len(sorted(set(text))), world)
    model, dp_rank, dp_size = build(args, config["vocab"], device, world)
    batches = Batches(text, args.seq_len, args.batch_size, args.seed, dp_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ckpt_dir = pathlib.Path(args.checkpoint_dir) if args.checkpoint_dir else None
    oom_dumps = None
    if args.oom_dump_dir:
        check_writable(pathlib.Path(args.oom_dump_dir), rank, "--oom-dump-dir")
        oom_dumps = oom.install(args.oom_dump_dir)
    start, skipped = 0, Skipped()
    if ckpt_dir is not None:
        check_writable(ckpt_dir, rank)
        lock_checkpoint_dir(ckpt_dir, rank)
        start = load_checkpoint(ckpt_dir, model, opt, rank, config, skipped)
        _run.checkpoint_dir, _run.saved = ckpt_dir, start or None
    if start and start >= args.steps:
        if rank == 0:
            print(f"torch_remat train: {ckpt_dir} holds step {start} and --steps is {args.steps}: "
                  "this run is finished (raise --steps to train further, or start afresh "
                  "in another --checkpoint-dir)", flush=True)
        del model, opt
        finish(distributed)
        return
    # rank 0's finding, on every rank: all of them stop, or go on, together
    refusal = first_error(log_json_refusal(args.log_json, args.overwrite_log_json)
                          if rank == 0 and not start else None)
    if refusal is not None:
        usage_error(refusal, rank)
    log = Log(args.log_json if rank == 0 else "", start, world,
              ckpt_dir / f"step{start}" if start and ckpt_dir is not None else None)
    if rank == 0:
        print(
            f"torch_remat train: parallel={args.parallel} remat={args.remat} ranks={world} "
            f"device={device.type} layers={args.layers} dim={args.dim} seq={args.seq_len}"
            + (f" (resumed at step {start})" if start else ""),
            flush=True,
        )
        if layout_line(args, world):
            print(layout_line(args, world), flush=True)
    report = None
    tokens = args.batch_size * args.seq_len * dp_size
    t0 = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        _run.step = step
        x, y = (t.to(device) for t in batches(step))
        if step == start + 1 and args.remat.startswith("budget="):
            planning = time.perf_counter()
            plan_on_first_step(args.remat, model, x, y, rank, args.verify_plan, args.offload,
                               args.device_profile)
            t0 += time.perf_counter() - planning  # tok/s counts training steps only
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
        log.losses[step] = loss_avg
        if log_step:
            all_saved = [saved]
            if distributed:
                all_saved = [None] * world
                dist.all_gather_object(all_saved, saved)
            log.saved_bytes[step] = all_saved
            if rank == 0:
                rate = tokens * (step - start) / (time.perf_counter() - t0)
                bar = "#" * (20 * step // args.steps)
                mem = " ".join(f"r{r}={b / 2**20:.2f}MiB" for r, b in enumerate(all_saved))
                print(
                    f"[{bar:<20}] step {step:>4}/{args.steps}  loss {loss_avg:.4f}  "
                    f"{rate:,.0f} tok/s  saved for backward {mem}",
                    flush=True,
                )
        if ckpt_dir is not None and (step % args.save_every == 0 or step == args.steps):
            with signals_deferred():
                save_checkpoint(ckpt_dir, model, opt, step, rank, args.keep_checkpoints, config,
                                log, skipped)
                _run.saved = _run.completed = step
                log.write()  # up to the step a restart resumes from
        _run.completed = step
    log.write()
    if report is not None:
        print(report, flush=True)
    # Free the wrapped model (DDP's reducer holds work on the group) before the
    # group goes away; destroying it afterwards could hang at exit.
    del model, opt
    finish(distributed)


class Log:
    """``--log-json``: the losses of every step, what each rank saved for backward at
    the logged steps, and the steps a run resumed at. A resumed run starts from the
    log its checkpoint holds (log.json: every step up to it), not from the file at
    ``--log-json``, which may be another run's: that file is read only for a
    checkpoint from before folders held their log, and rank 0 says where it
    disagrees with the checkpoint's (its entries are dropped)."""

    def __init__(self, path: str, start: int, world: int, checkpoint: pathlib.Path | None = None) -> None:
        self.path, self.world = path, world
        self.losses, self.saved_bytes, self.resumed_at = {}, {}, []
        if not start:
            return
        saved = _read_log(checkpoint / "log.json", start) if checkpoint is not None else None
        given = _read_log(pathlib.Path(path), start) if path else None
        if saved is None:
            saved = given or ({}, {}, [])  # a checkpoint without its log: the file is all there is
        elif given is not None and (detail := _disagreement(given, saved)):
            print(f"torch_remat train: --log-json {path} is not the log of the run saved in "
                  f"{checkpoint} ({detail}): it is rewritten with that checkpoint's log up to "
                  f"step {start}, then this run's steps", flush=True)
        self.losses, self.saved_bytes, self.resumed_at = saved
        self.resumed_at.append(start)

    def data(self) -> dict:
        return {"losses": self.losses, "saved_bytes": self.saved_bytes, "world": self.world,
                "resumed_at": self.resumed_at}

    def write(self) -> None:
        if not self.path:
            return
        tmp = pathlib.Path(self.path + ".tmp")
        tmp.write_text(json.dumps(self.data()))
        tmp.replace(self.path)


def _read_log(path: pathlib.Path, start: int) -> tuple[dict, dict, list] | None:
    """The losses, saved bytes (by step, up to ``start``) and earlier resume points of
    the log at ``path``; None where it is missing or cannot be read."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
        old = json.loads(path.read_text())
        losses = {int(k): v for k, v in old["losses"].items() if int(k) <= start}
        saved = {int(k): v for k, v in old["saved_bytes"].items() if int(k) <= start}
        return losses, saved, sorted({int(s) for s in old.get("resumed_at", []) if int(s) < start})
    return None


def _disagreement(given: tuple[dict, dict, list], saved: tuple[dict, dict, list]) -> str | None:
    """Where the log ``given`` (the file at --log-json, up to the resume step) is not
    part of the checkpoint's log ``saved``: it may hold fewer steps and resume points
    (written before the save), none other. None where it agrees."""
    for (entries, own), what in zip(zip(given[:2], saved[:2]), ("loss", "saved bytes")):
        for step in sorted(entries):
            if step not in own:
                return f"it holds step {step}'s {what}, which the checkpoint's log lacks"
            if entries[step] != own[step]:
                return f"step {step}'s {what}: {entries[step]} there, {own[step]} in the checkpoint's log"
    extra = sorted(set(given[2]) - set(saved[2]))
    if extra:
        return f"it lists a resume at step {extra[0]}, which the checkpoint's log does not"
    return None


def finish(distributed: bool) -> None:
    release_checkpoint_dir()
    if distributed:
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
