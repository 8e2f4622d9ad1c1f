"""Per-rank RNG state hooks, so that dropout inside a checkpoint replays exactly.

The core does not snapshot any RNG by itself (``preserve_rng_state=True`` is refused,
see torch_remat's README); it replays whatever ``recompute_state_hooks`` restore.
This module holds the stock hooks for distributed jobs:

* :class:`DeviceRNGStateHook` snapshots and restores the default generator of one
  device: the CPU generator (``torch.default_generator``, a 5056-byte Mersenne
  Twister state) or a CUDA device's Philox generator (16 bytes: seed and offset).
* :func:`local_device` picks the device a rank draws from: ``cuda:LOCAL_RANK`` when
  CUDA is available (modulo the visible device count, for jobs that expose one GPU
  per process), else the CPU.
* :func:`prepare_dtensor_rng` sets up DTensor's RNG tracker before the first
  checkpoint. On a CUDA mesh the tracker keeps no state of its own: it reads the
  device generator, shifts the Philox offset per shard for the op, and writes the
  advanced state back, so the device hook replays DTensor random ops too. It must
  exist before the first checkpoint because DTensor creates it lazily at the first
  random op with a broadcast of rank 0's generator state; if that happened inside a
  checkpoint's forward, the entry snapshot would predate the broadcast on ranks
  other than 0 and their recompute would draw different numbers. On a CPU mesh
  DTensor has no tracker: random ops on DTensors draw from each rank's CPU
  generator, which the CPU hook replays.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from torch_remat import DeviceRNGStateHook
from torch_remat._integration import (
    create_dtensor_rng_tracker,
    dtensor_rng_supported_mesh,
    dtensor_rng_tracker,
)


def local_device() -> torch.device:
    """The device whose generator this rank draws from.

    ``cuda:(LOCAL_RANK % device_count)`` when CUDA is available (``LOCAL_RANK`` as
    set by torchrun; the current device when it is unset), else ``cpu``.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", int(local_rank) % torch.cuda.device_count())


def default_rng_state_hooks(device: torch.device | str | None = None) -> tuple[Any, ...]:
    """The stock RNG hooks the adapters hand every checkpoint: one
    :class:`DeviceRNGStateHook` for ``device`` (default :func:`local_device`)."""
    return (DeviceRNGStateHook(local_device() if device is None else device),)


def prepare_dtensor_rng(mesh: Any) -> bool:
    """Create DTensor's RNG tracker for ``mesh`` now, before any checkpoint runs.

    Must be called on every rank (the tracker broadcasts rank 0's generator state,
    exactly as DTensor's lazy initialisation would). Returns True if DTensor uses a
    tracker on this mesh (CUDA-like devices), False on CPU meshes, where DTensor
    random ops draw from each rank's CPU generator. Idempotent.
    """
    # DTensor exposes no public constructor for its tracker; this is what its own
    # dispatcher does at the first random op (torch/distributed/tensor/_dispatch.py).
    if dtensor_rng_tracker() is not None:
        return True
    if mesh.device_type == "cpu":
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        supported = dtensor_rng_supported_mesh(mesh)
    if not supported:
        return False
    create_dtensor_rng_tracker(mesh)
    return True
