"""Tensor parallelism (DTensor) with remat: ``parallelize_module`` first, then remat.

The order matters. ``parallelize_module`` installs the input/output redistribution
of each ``ParallelStyle`` as forward hooks on the parallelized modules and swaps
their parameters for DTensors; remat wraps the block's ``forward`` afterwards, so
the checkpoint replays the block's computation on DTensors and the hooks'
collectives of modules *inside* the block are part of the replay like any other
op. Before the first checkpoint runs, DTensor's RNG tracker is set up (see
:func:`torch_remat.integrations.rng.prepare_dtensor_rng`) so that dropout on DTensors
replays exactly.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from ._selection import ModuleSelector
from .apply import RematConfig, apply_remat_to_blocks, remat_config
from .rng import prepare_dtensor_rng


def parallelize_with_remat(
    model: nn.Module,
    tp_mesh: Any,
    parallelize_plan: Any,
    blocks: ModuleSelector,
    *,
    remat: RematConfig | None = None,
) -> nn.Module:
    """Apply tensor parallelism to ``model``, then remat to its ``blocks``.

    Args:
        tp_mesh: the 1-D ``DeviceMesh`` to parallelize over (the "tp" dimension of a
            2-D mesh).
        parallelize_plan: what ``torch.distributed.tensor.parallel.parallelize_module``
            takes for the root: a ``ParallelStyle`` or a dict from module paths
            (``fnmatch`` patterns such as ``"layers.*.attention.wq"``) to styles.
        blocks: the modules to checkpoint: a class, a tuple of classes or a predicate.
        remat: how to checkpoint (default :class:`RematConfig()`); None applies no
            remat. With ``rng_state_hooks`` on (the default), DTensor's RNG tracker is
            created now, on every rank.

    Returns ``model`` (parallelized in place).
    """
    remat = remat_config(remat, "parallelize_with_remat")
    parallelize_module(model, tp_mesh, parallelize_plan)
    if remat.enabled and remat.rng_state_hooks:
        prepare_dtensor_rng(tp_mesh)
    apply_remat_to_blocks(model, blocks, remat)
    return model
