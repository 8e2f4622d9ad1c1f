"""Offload as a planner option: a checkpoint whose kept tensors move to host memory.

An offloaded option is a checkpoint option with SAVE regions whose kept tensors --
what the SAVE regions save for backward and the outputs the replay reads -- an
:class:`~torch_remat.offload.ActivationOffloader` copies to host buffers during the
forward and back before the backward needs them. It recomputes what its twin
(the same save set, resident) recomputes and holds fewer device bytes; what it adds
is the copies' exposed time.

The checkpoint's inputs stay on the device: a block's input was allocated by the
block before it, whose bytes it is counted in, so moving it would make one block's
bytes depend on its neighbour's option; what a block's SAVE regions keep was
allocated by the block itself, so each block's offloaded bytes are its own and
options still add up (a full checkpoint has nothing to move and no offloaded twin).

Measuring it: the offloader runs with ``prefetch=0``, so every tensor it accepts
moves as it is packed and each block's device bytes do not depend on its position.
A plan installs it with ``prefetch=k``: the last ``k`` offloaded checkpoint calls
of the forward stay on the device until their backward (nothing would hide their
copies). What such a call keeps on the device then is measured too: the storages
its tensors had on the device that the measuring run freed by moving them (a
storage something else still holds was counted already). The plan's prediction
adds those back for its last ``k`` offloaded blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_remat import SavedTensorKind, current_saved_tensor_info
from torch_remat.offload import ActivationOffloader, HostPool

from ._space import Option
from ._time import PROFILES, DeviceProfile, calibrate, exposed_copy_seconds

MOVED_KINDS = (SavedTensorKind.BACKWARD, SavedTensorKind.SAVE_OUTPUT)

UNBOUNDED_POOL = 1 << 62
"""Pool capacity while measuring: no tensor stays resident for want of room."""


@dataclass(frozen=True)
class OffloadOptions:
    """How an offloaded option moves its checkpoint's kept tensors
    (``plan_remat(offload=OffloadOptions(...))``; ``offload=True`` is the default)."""

    prefetch: int = 1
    """The offloader's ``prefetch``: how many checkpoint calls ahead the backward
    copies back (and how many of the forward's last offloaded calls stay)."""
    min_bytes: int = 1 << 20
    """Tensors smaller than this stay resident (the offloader's ``min_bytes``)."""
    pool_bytes: int | None = None
    """Host pool capacity; None: what the plan's offloaded blocks were measured
    to move (the pool then never refuses a tensor of the planned step)."""

    def __post_init__(self) -> None:
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"OffloadOptions: prefetch must be an int >= 0, got {self.prefetch!r}.")
        if not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"OffloadOptions: min_bytes must be an int >= 0, got {self.min_bytes!r}.")

    def to_json(self) -> dict:
        return {"prefetch": self.prefetch, "min_bytes": self.min_bytes, "pool_bytes": self.pool_bytes}

    @staticmethod
    def from_json(data: dict | None) -> OffloadOptions | None:
        return None if data is None else OffloadOptions(**data)


def resolve(offload: bool | OffloadOptions | None) -> OffloadOptions | None:
    """``plan_remat``'s ``offload=`` as options (None: offload is not an option)."""
    if offload is None or offload is False:
        return None
    if offload is True:
        return OffloadOptions()
    if isinstance(offload, OffloadOptions):
        return offload
    raise TypeError(
        f"plan_remat: offload must be True, False or an OffloadOptions, got {offload!r}."
    )


_HOST = threading.local()


def allocating_host_memory() -> bool:
    """Whether a planner offloader's pool is making a host buffer now (a forecast's
    storage ledger does not count it as device memory)."""
    return getattr(_HOST, "active", False)


@contextlib.contextmanager
def _host_allocation() -> Any:
    was = allocating_host_memory()
    _HOST.active = True
    try:
        yield
    finally:
        _HOST.active = was


class _MarkedPool(HostPool):
    """A pool whose buffers are made under :func:`allocating_host_memory`."""

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        with _host_allocation():
            return super().acquire(nbytes)


class MeasuringOffloader(ActivationOffloader):
    """The offloader of a measuring run: also notes, per checkpoint, the bytes of
    the host buffers its tensors took."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.host: dict[str, int] = {}
        """Per checkpoint, the bytes of the host buffers its tensors took."""
        # per moved tensor still held: its checkpoint and the bytes of its copy back
        self._moved: weakref.WeakKeyDictionary[Any, tuple[str, int]] = weakref.WeakKeyDictionary()

    def pack_hook(self, t: torch.Tensor) -> Any:
        if hasattr(type(t), "__tensor_flatten__"):  # a wrapper: DTensor (tensor parallel)
            info = current_saved_tensor_info()
            raise ValueError(
                f"plan_remat: offload=... cannot move the {type(t).__name__} that checkpoint "
                f"'{info.checkpoint if info else '?'}' keeps (region "
                f"'{info.region if info else '?'}'): offloading tensor-parallel (DTensor) "
                "activations is not supported. Plan without offload= for this model, or "
                "offload only under FSDP2 or DDP, whose activations are plain tensors."
            )
        packed = super().pack_hook(t)
        if packed is not t:
            info = current_saved_tensor_info()
            buffer = getattr(packed, "buffer", None)
            if buffer is not None:  # (moved as packed: the measuring run's prefetch is 0)
                name = info.checkpoint or ""
                self.host[name] = self.host.get(name, 0) + buffer.numel() * buffer.element_size()
                self._moved[packed] = (name, packed.layout.back_nbytes(t.element_size()))
        return packed

    def back_now(self) -> dict[str, int]:
        """Per checkpoint, the device bytes its moved tensors held now (the forward
        done) take once copied back, as a prefetch copies back every one of a
        call's (``CopyLayout.back``): more than :attr:`host` where a tensor with
        gaps (the gates an LSTM or GRU cell chunks from one tensor) moved its
        elements only and comes back spanning the gaps again; less where a moved
        tensor was dropped in the forward."""
        out: dict[str, int] = {}
        for name, n in list(self._moved.values()):
            out[name] = out.get(name, 0) + n
        return out


def offloader_for(
    blocks: Iterable[str], options: OffloadOptions, *, measuring: bool, pool_bytes: int | None = None
) -> ActivationOffloader:
    """The offloader that moves what the SAVE regions of the checkpoints of
    ``blocks`` keep (by checkpoint name, which ``apply_remat`` sets to the block's
    qualified name). ``measuring``: ``prefetch=0`` and a pool with
    room for everything (see the module's docstring)."""
    if measuring:
        pool, prefetch = UNBOUNDED_POOL, 0
    else:
        pool = options.pool_bytes if options.pool_bytes is not None else (pool_bytes or 0)
        prefetch = options.prefetch
    offloader = (MeasuringOffloader if measuring else ActivationOffloader)(
        pool,
        prefetch=prefetch,
        min_bytes=options.min_bytes,
        kinds=MOVED_KINDS,
        checkpoints=[glob.escape(b) for b in blocks],
    )
    offloader.pool = _MarkedPool(pool, offloader.pool.pin_memory)
    return offloader


def resolve_profile(
    profile: Any, device: torch.device, dtype: torch.dtype, where: str = "plan_remat"
) -> DeviceProfile:
    """``profile=`` of ``where``: a :class:`DeviceProfile`, the name of one in
    ``_time.PROFILES``, or None (:func:`_time.calibrate` on ``device``)."""
    if isinstance(profile, DeviceProfile):
        return profile
    if isinstance(profile, str):
        if profile not in PROFILES:
            raise ValueError(
                f"{where}: no device profile {profile!r}; known: {sorted(PROFILES)} "
                "(or pass a DeviceProfile, e.g. from calibrate())."
            )
        return PROFILES[profile]
    if profile is None:
        return calibrate(device, dtypes=(dtype,))
    if type(profile).__name__ == DeviceProfile.__name__:
        raise TypeError(
            f"{where}: profile is a DeviceProfile of another copy of the planner module "
            f"({type(profile).__module__}, not {DeviceProfile.__module__}): the planner was "
            "imported under two names (from a source checkout, `integrations.planner` and "
            "`torch_remat.integrations.planner`). Import both from torch_remat.integrations.planner."
        )
    raise TypeError(f"{where}: profile must be a DeviceProfile, a profile name or None, got {profile!r}.")


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's first floating parameter (float32 without one)."""
    return next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)


def timed(
    table: list[list[Any]],
    groups: Sequence[Sequence[int]],
    profile: DeviceProfile,
    dtype: torch.dtype,
    options: OffloadOptions | None,
) -> list[list[Any]]:
    """``table`` (blocks in forward order) with each option's predicted added
    seconds: its recompute FLOPs at the profile's peak, plus, offloaded, its share
    of the copies' exposed time. The share is what the offloader's timeline
    (:func:`_time.exposed_copy_seconds`) exposes for the whole model's blocks, each
    moving what this option moves (the group's mean for blocks of other groups),
    divided by the number of blocks: a block's copies hide behind the compute of
    its neighbours, whichever group they are in. Each block's forward is its full
    checkpoint's recompute (the whole forward again), its backward twice that plus
    the recompute."""
    full = Option(True)
    forward = [
        profile.compute_seconds(next(m for m in opts if m.option == full).flops, 0, dtype)
        if any(m.option == full for m in opts) else 0.0
        for opts in table
    ]
    out = [list(opts) for opts in table]
    for group in groups:
        first = table[group[0]]
        for k, m0 in enumerate(first):
            if not m0.option.checkpoint:
                continue
            recompute = {b: profile.compute_seconds(table[b][k].flops, 0, dtype) for b in group}
            share = 0.0
            if m0.option.offload and options is not None:
                own = {b: profile.copy_seconds(table[b][k].host_bytes) for b in group}
                mean = sum(own.values()) / len(own)
                copies = [own.get(b, mean) for b in range(len(table))]
                backward = [2 * f + recompute.get(b, 0.0) for b, f in enumerate(forward)]
                total = exposed_copy_seconds(
                    forward, backward, copies, prefetch=options.prefetch, overlap=profile.overlap_copies
                )
                share = total / len(table)
            for b in group:
                out[b][k] = dataclasses.replace(table[b][k], seconds=recompute[b] + share)
    return out
