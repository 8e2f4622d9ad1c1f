"""One rank of a parallel layout, in this process: the real sharding code on fake
tensors over a fake process group.

``dist.init_process_group("fake", rank=r, world_size=N)`` gives a group whose
collectives move no data, for any ``N``, in one process; under ``FakeTensorMode``
the model's parameters have sizes and no data. On a copy of the model (meta
tensors, made fake) ``parallelize_module`` and ``fully_shard`` then run as they run
on rank ``r`` of ``N``: parameters become DTensors holding rank ``r``'s shards,
FSDP2 allocates and frees each unit's unsharded parameters around its forward and
backward and reduce-scatters the gradients, DTensor redistributes activations, and
the planner measures that rank's storages as on one process (``_fake``).

DDP is not run: every rank holds the whole model, so its activations are the
single-process ones at the rank's micro-batch, and it adds gradient buckets (one
flat buffer per bucket, the trainable parameters' bytes in all; none with
``gradient_as_bucket_view=True``, where the gradients are views of them).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_remat._integration import FakeTensorMode, register_fake_process_group

from ._fake import faked


@dataclass(frozen=True, eq=False)
class Layout:
    """How the model is split over ``world_size`` ranks, and which rank to forecast.

    * FSDP2: ``Layout(64)`` or ``Layout(64, fsdp=64)``: parameters sharded over 64
      ranks, one ``fully_shard`` unit per planned block plus the root.
    * FSDP2 + tensor parallel: ``Layout(64, fsdp=8, tp=8, tp_plan=...)``: a 2-D mesh
      ``("dp", "tp")`` of 8 x 8 (rank ``r`` at ``(r // 8, r % 8)``);
      ``parallelize_module(model, mesh["tp"], tp_plan)`` first, then FSDP2 over
      ``mesh["dp"]``.
    * Tensor parallel alone: ``Layout(8, tp=8, tp_plan=...)``.
    * DDP: ``Layout(8, ddp=True)``.

    ``tp_plan`` is what ``parallelize_module`` takes (a ``ParallelStyle`` or a dict
    of module patterns to styles: sequence parallel where its styles say so).
    ``fully_shard_kwargs`` go to every ``fully_shard`` call (``mp_policy=``,
    ``reshard_after_forward=``: the blocks' only; the root keeps FSDP2's default).
    The example arguments of the forecast are what this rank's forward receives.
    """

    world_size: int
    fsdp: int | None = None
    tp: int = 1
    ddp: bool = False
    tp_plan: Any = None
    rank: int = 0
    fully_shard_kwargs: dict[str, Any] = field(default_factory=dict)
    gradient_as_bucket_view: bool = False
    """DDP only: the gradients are views of the buckets (no second copy)."""

    def __post_init__(self) -> None:
        def positive(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout: {name} must be an integer >= 1, got {value!r}.")

        positive("world_size", self.world_size)
        positive("tp", self.tp)
        if self.fsdp is not None:
            positive("fsdp", self.fsdp)
        if self.ddp:
            if self.tp != 1 or self.fsdp not in (None, 1):
                raise ValueError(
                    "Layout: ddp=True replicates the whole model on every rank; it is not "
                    f"combined with tp={self.tp} or fsdp={self.fsdp} here (use fsdp= and tp= "
                    "for a sharded layout)."
                )
        elif self.world_size % self.tp:
            raise ValueError(
                f"Layout: tp={self.tp} does not divide world_size={self.world_size}."
            )
        elif self.fsdp_size * self.tp != self.world_size:
            raise ValueError(
                f"Layout: fsdp={self.fsdp} x tp={self.tp} is {self.fsdp_size * self.tp} "
                f"ranks, not world_size={self.world_size}; replicated shards (HSDP) are not "
                f"forecast. Pass fsdp={self.world_size // self.tp} (or leave it out)."
            )
        if (self.tp > 1) != (self.tp_plan is not None):
            raise ValueError(
                "Layout: pass tp_plan (what parallelize_module takes) with tp > 1, and only "
                f"then (tp={self.tp}, tp_plan={'given' if self.tp_plan is not None else None})."
            )
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not (
            0 <= self.rank < self.world_size
        ):
            raise ValueError(
                f"Layout: rank must be in [0, {self.world_size}), got {self.rank!r}."
            )

    @property
    def fsdp_size(self) -> int:
        """Ranks each parameter is sharded over by FSDP2 (1: not sharded by it)."""
        if self.ddp:
            return 1
        return self.fsdp if self.fsdp is not None else self.world_size // self.tp

    def describe(self) -> str:
        if self.ddp:
            return f"DDP over {self.world_size} ranks"
        parts = []
        if self.fsdp_size > 1:
            parts.append(f"FSDP2 {self.fsdp_size}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        return f"{' x '.join(parts) or 'one rank'} ({self.world_size} ranks)"


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors of the
    same shapes, dtypes and strides (nothing of the model's data is copied)."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if hasattr(t, "device_mesh"):
            raise ValueError(
                "forecast_remat(layout=...): the model is sharded already (its parameters "
                "are DTensors); pass the model as built, before fully_shard or "
                "parallelize_module: the forecast shards a copy of it."
            )
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(
            t, nn.Parameter
        ) else meta
    return copy.deepcopy(model, memo)


@contextlib.contextmanager
def sharded(
    model: nn.Module,
    args: Sequence[Any],
    layout: Layout,
    block_names: Sequence[str],
    device: torch.device | str | None = None,
) -> Iterator[tuple[nn.Module, FakeTensorMode, tuple[Any, ...]]]:
    """``(copy of the model sharded as rank layout.rank holds it, the fake mode, the
    fake arguments)``, on a fake process group of ``layout.world_size`` ranks that
    is destroyed on exit. The model itself is not touched."""
    if dist.is_initialized():
        raise RuntimeError(
            "forecast_remat(layout=...): a process group is initialized in this process; "
            f"the forecast runs rank {layout.rank} of {layout.world_size} on a fake process "
            "group of its own, which needs none. Forecast before init_process_group (or in "
            "a process of its own)."
        )
    shadow = _meta_copy(model)
    if layout.ddp or layout.world_size == 1:
        with faked(shadow, args, device) as (mode, fargs):
            yield shadow, mode, fargs
        return
    register_fake_process_group()
    hook = sys.excepthook  # init_process_group prefixes tracebacks with the (fake) rank
    dist.init_process_group(
        "fake", store=dist.HashStore(), rank=layout.rank, world_size=layout.world_size
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        with faked(shadow, args, device) as (mode, fargs):
            dev = next((t.device.type for t in shadow.parameters()), "cpu")
            if layout.tp > 1 and layout.fsdp_size > 1:
                mesh = init_device_mesh(
                    dev, (layout.fsdp_size, layout.tp), mesh_dim_names=("dp", "tp")
                )
                dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
            else:
                mesh = init_device_mesh(dev, (layout.world_size,))
                dp_mesh, tp_mesh = mesh, mesh
            # Outside the fake mode: the sharding's own ops on the fake parameters
            # give fakes, and its device-mesh arithmetic stays on real tensors.
            if layout.tp > 1:
                parallelize_module(shadow, tp_mesh, layout.tp_plan)
            if layout.fsdp_size > 1:
                kwargs = dict(layout.fully_shard_kwargs)
                for name in reversed(block_names):
                    fully_shard(shadow.get_submodule(name), mesh=dp_mesh, **kwargs)
                kwargs.pop("reshard_after_forward", None)
                fully_shard(shadow, mesh=dp_mesh, **kwargs)
            yield shadow, mode, fargs
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
