"""FSDP2 (``fully_shard``) with remat, per shard unit, in the one correct order:

    tensor parallel  ->  remat  ->  compile  ->  fully_shard (blocks, then root)

* TP first: ``parallelize_module`` turns parameters into DTensors on the TP mesh;
  FSDP2 then shards those DTensors over the data-parallel mesh (2-D parameters).
* Remat before compile: ``module.compile()`` then traces the block's checkpoint into
  the block's graph, and its regions decide what the compiled forward saves
  (docs/compilation.md).
* fully_shard last, per block and then the root: FSDP2 registers its all-gather
  and reshard as hooks around ``nn.Module.__call__``. Remat wraps the block's
  ``forward``, inside those hooks, so the recompute in backward runs after FSDP2's
  pre-backward all-gather and issues no all-gather of its own.

Remat may also be applied by the caller after ``fully_shard``
(``apply_remat(model, check_fn=...)``): FSDP2 keeps the module tree and names, and
the forward it calls is the instance's ``forward``. This adapter then skips remat.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import fully_shard

from ._selection import ModuleSelector, select_modules
from .apply import RematConfig, apply_remat_to_blocks, remat_config
from .tensor_parallel import parallelize_with_remat


def fully_shard_with_remat(
    model: nn.Module,
    blocks: ModuleSelector,
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    remat: RematConfig | None = None,
    compile: bool | dict[str, Any] = False,
    tp_mesh: Any = None,
    tp_plan: Any = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Shard ``model`` with FSDP2, one unit per block plus the root, with remat per block.

    Args:
        blocks: the shard units, also the checkpointed modules: a class, a tuple of
            classes or a predicate.
        mesh: the data-parallel ``DeviceMesh`` (1-D; default: the whole world).
        reshard_after_forward, mp_policy, offload_policy, **fully_shard_kwargs:
            passed to every ``fully_shard`` call unchanged (None values are left to
            ``fully_shard``'s defaults). ``reshard_after_forward`` applies to the
            blocks; the root gets FSDP2's default (None: kept unsharded, since
            backward needs it first).
        remat: how to checkpoint (None: the default :class:`RematConfig()`;
            ``RematConfig(enabled=False)`` checkpoints nothing).
        compile: True, or ``torch.compile`` keyword arguments: ``block.compile``
            each block after remat and before sharding (its checkpoint is traced
            into the block's graph).
        tp_mesh, tp_plan: apply tensor parallelism first
            (:func:`~torch_remat.integrations.tensor_parallel.parallelize_with_remat`).

    Returns ``model`` (its class replaced by FSDP2's ``FSDPModule`` subclass, in place).
    """
    remat = remat_config(remat, "fully_shard_with_remat")
    if (tp_mesh is None) != (tp_plan is None):
        raise ValueError("fully_shard_with_remat: pass tp_mesh and tp_plan together.")
    if tp_plan is not None:
        parallelize_with_remat(model, tp_mesh, tp_plan, blocks, remat=remat)
    else:
        apply_remat_to_blocks(model, blocks, remat)

    units = select_modules(model, blocks)
    if not units:
        raise ValueError(
            "fully_shard_with_remat: no module of the model matches blocks; nothing "
            "would be sharded per block."
        )
    if compile:
        options = compile if isinstance(compile, dict) else {}
        for _, block in units:
            block.compile(**options)

    kwargs = dict(fully_shard_kwargs)
    for key, value in (
        ("mesh", mesh),
        ("mp_policy", mp_policy),
        ("offload_policy", offload_policy),
    ):
        if value is not None:
            kwargs[key] = value
    if reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = reshard_after_forward
    # Innermost units first: fully_shard on a parent claims the parameters no child
    # unit has claimed yet.
    for _, block in reversed(units):
        fully_shard(block, **kwargs)
    root_kwargs = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}
    fully_shard(model, **root_kwargs)
    return model
