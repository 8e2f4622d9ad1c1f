"""DistributedDataParallel with remat.

Remat is applied to the blocks before DDP wraps the model, so region names are
the model's own qualified names (not ``module.``-prefixed). Non-reentrant
checkpointing needs none of the DDP workarounds reentrant checkpointing does:
``static_graph`` on or off, ``find_unused_parameters`` on or off and gradient
accumulation under ``no_sync()`` all behave as without remat, because the
recompute happens inside the autograd nodes of the original graph, so every
parameter's gradient hook fires exactly once per backward, in the same graph.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ._selection import ModuleSelector
from .apply import RematConfig, apply_remat_to_blocks, remat_config


def ddp_with_remat(
    model: nn.Module,
    blocks: ModuleSelector,
    *,
    remat: RematConfig | None = None,
    **ddp_kwargs: Any,
) -> DistributedDataParallel:
    """Apply remat to the ``blocks`` of ``model``, then wrap it in DDP.

    Args:
        blocks: the modules to checkpoint: a class, a tuple of classes or a predicate.
        remat: how to checkpoint (None: the default :class:`RematConfig()`;
            ``RematConfig(enabled=False)`` checkpoints nothing).
        **ddp_kwargs: passed to ``DistributedDataParallel`` unchanged
            (``device_ids``, ``static_graph``, ``find_unused_parameters``, ...).
    """
    apply_remat_to_blocks(model, blocks, remat_config(remat, "ddp_with_remat"))
    return DistributedDataParallel(model, **ddp_kwargs)
