"""Remat for Hugging Face ``accelerate``: ``Accelerator`` with DDP or the FSDP2 plugin.

Usage: one call where ``accelerator.prepare`` was::

    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch_remat.integrations import prepare_with_remat

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"], activation_checkpointing=True))
    model, optimizer, loader = prepare_with_remat(accelerator, model, optimizer, loader)

or, to keep the ``prepare`` call as it is, :func:`apply_remat_for_accelerator`
before it::

    apply_remat_for_accelerator(accelerator, model)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

What accelerate does with ``activation_checkpointing=True`` (FSDP2 plugin,
``Accelerator._prepare_fsdp2`` -> ``accelerate.utils.fsdp_utils.fsdp2_apply_ac``):
it replaces each module its auto-wrap policy selects by
``checkpoint_wrapper(module, preserve_rng_state=False)`` (inside an
``offload_wrapper`` with ``activation_checkpointing_offload=True``), then calls
``fully_shard`` on the same modules. This adapter takes the place of that step:

* It selects the same modules with accelerate's own policy function
  (``fsdp2_prepare_auto_wrap_policy``, after the plugin's ``set_auto_wrap_policy``,
  exactly as ``fsdp2_apply_ac`` does) and checkpoints their ``forward`` with
  :func:`~torch_remat.integrations.apply_remat`, region names being their qualified
  names. The module tree is unchanged, so FSDP2's shard units, ``state_dict()``,
  ``accelerator.save_state`` and ``get_state_dict`` keys are those of the model
  without checkpointing (no ``_checkpoint_wrapped_module``).
* It sets the plugin's ``activation_checkpointing`` (and
  ``activation_checkpointing_offload``) to False, so ``prepare`` does not wrap the
  modules a second time. ``activation_checkpointing_offload=True`` is honoured:
  ``save_on_cpu`` around each checkpoint moves what the checkpoint keeps to the host.
* Dropout replays exactly: every checkpoint gets this rank's RNG state hooks
  (accelerate's own wrapper uses ``preserve_rng_state=False``, so its recompute draws
  new dropout masks). ``RematConfig(rng_state_hooks=False)`` turns them off.

With DDP (``MULTI_GPU``, ``MULTI_CPU``) or one process, ``prepare`` never
checkpoints; pass ``blocks`` (a class, classes or a predicate), or let the model's
``_no_split_modules`` (the transformers convention accelerate's
``transformer_based_wrap`` reads too) name the block classes; the same holds for an
FSDP2 plugin without ``auto_wrap_policy``. Remat is applied before DDP wraps the
model, so region names carry no ``module.`` prefix.

A ``transformers`` model on which :func:`~torch_remat.integrations.enable_remat` was
called already runs remat through its layers' own hook; the adapter then only turns
the plugin's flag off. A model with transformers' own gradient checkpointing
(``torch.utils.checkpoint``) switched on is refused, since its layers would be
checkpointed twice.

Not supported: FSDP1 (``fsdp_version=1``; accelerate applies its checkpointing after
wrapping) and DeepSpeed. Under accelerate's ``dynamo_backend`` the whole model is
compiled around the checkpoints, which trace into its graph (docs/compilation.md). On a CPU-only
machine accelerate 1.x never selects FSDP: with ``Accelerator(cpu=True,
fsdp_plugin=...)`` the distributed type is ``MULTI_CPU``, the plugin is dropped and
``prepare`` wraps the model in DDP (the tests run the FSDP2 path on CPU by setting
the state's distributed type to FSDP).

``accelerate`` is imported only when a function here is called.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ._forwards import RematForward
from ._selection import ModuleSelector, module_matcher
from .apply import RematConfig, apply_remat_to_blocks, remat_config, remat_module_names
from .transformers import remat_layer_names, torch_checkpointed_layer_names


def _fsdp_plugin(accelerator: Any) -> Any:
    """The accelerator's FSDP plugin when it will shard with FSDP, else None."""
    from accelerate.utils import DistributedType

    if accelerator.state.distributed_type != DistributedType.FSDP:
        return None
    return accelerator.state.fsdp_plugin


def _plugin_blocks(plugin: Any, model: nn.Module) -> Any:
    """The module predicate accelerate's FSDP2 path checkpoints and shards with, or
    None when the plugin has no auto-wrap policy (FSDP2 then shards only the root)."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    # Idempotent: turns a named policy into its partial; prepare() calls it again.
    plugin.set_auto_wrap_policy(model)
    return fsdp2_prepare_auto_wrap_policy(plugin, model)


def _no_split_blocks(model: nn.Module) -> tuple[type, ...]:
    names = list(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            f"apply_remat_for_accelerator: no blocks to checkpoint: pass blocks= (a module "
            f"class, classes or a predicate). {type(model).__name__} has no "
            "_no_split_modules, and no FSDP2 auto_wrap_policy selects any (DDP and an "
            "FSDP2 plugin without auto_wrap_policy select none)."
        )
    classes = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in classes]
    if missing:
        raise ValueError(
            f"apply_remat_for_accelerator: {type(model).__name__}._no_split_modules names "
            f"{missing}, which no module of the model is; pass blocks=."
        )
    return tuple(classes[n] for n in names)


def apply_remat_for_accelerator(
    accelerator: Any,
    model: nn.Module,
    blocks: ModuleSelector | None = None,
    *,
    remat: RematConfig | None = None,
) -> list[str]:
    """Checkpoint the blocks of ``model`` with remat before ``accelerator.prepare``.

    Call it on every rank, after creating the ``Accelerator`` and before ``prepare``::

        apply_remat_for_accelerator(accelerator, model)
        model, optimizer = accelerator.prepare(model, optimizer)

    Args:
        accelerator: an ``accelerate.Accelerator`` (DDP, one process, or FSDP2).
        model: the model, not yet prepared.
        blocks: the modules to checkpoint: a class, a tuple of classes or a
            predicate. Default: with an FSDP2 plugin that has an ``auto_wrap_policy``,
            the modules accelerate would checkpoint and shard with it; otherwise the
            classes named by ``model._no_split_modules``.
        remat: how to checkpoint (:class:`~torch_remat.integrations.RematConfig`;
            default ``RematConfig()``). ``RematConfig(enabled=False)`` applies nothing
            and leaves the plugin as it is.

    Returns the qualified names of the checkpointed modules. If remat is already
    applied to ``model`` (:func:`~torch_remat.integrations.apply_remat`, or
    :func:`~torch_remat.integrations.enable_remat` on a transformers model), nothing
    is applied again and those names are returned. With the FSDP2 plugin, its
    ``activation_checkpointing`` and ``activation_checkpointing_offload`` are False
    afterwards (remat took their place; offload is done by ``save_on_cpu`` around
    each checkpoint). Raises ``ValueError`` for FSDP1, when no module matches the
    blocks, and when transformers' own gradient checkpointing is on.
    """
    remat = remat_config(remat, "apply_remat_for_accelerator")
    plugin = _fsdp_plugin(accelerator)
    if plugin is not None and getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            "apply_remat_for_accelerator: FSDP1 (fsdp_version=1) is not supported: "
            "accelerate applies its checkpoint wrapper after wrapping the model in FSDP1. "
            "Use FullyShardedDataParallelPlugin(fsdp_version=2)."
        )
    if not remat.enabled:
        return []
    torch_checkpointed = torch_checkpointed_layer_names(model)
    if torch_checkpointed:
        raise ValueError(
            "apply_remat_for_accelerator: transformers' own gradient checkpointing "
            f"(torch.utils.checkpoint) is on for {torch_checkpointed}; remat on top would "
            "checkpoint those layers twice. Call model.gradient_checkpointing_disable() "
            "first, or torch_remat.integrations.enable_remat(model) to run remat through "
            "the layers' own hook."
        )

    offload = plugin is not None and getattr(plugin, "activation_checkpointing_offload", False)
    names = remat_module_names(model) or remat_layer_names(model)
    if not names:  # not applied by the caller already (apply_remat or enable_remat)
        check_fn = None
        if blocks is not None:
            check_fn = module_matcher(blocks, "apply_remat_for_accelerator: blocks")
        elif plugin is not None:
            check_fn = _plugin_blocks(plugin, model)
        if check_fn is None:
            check_fn = module_matcher(_no_split_blocks(model), "_no_split_modules")
        names = apply_remat_to_blocks(model, check_fn, remat)
        if not names:
            raise ValueError(
                f"apply_remat_for_accelerator: no module of {type(model).__name__} matches "
                "the blocks to checkpoint (blocks=, the FSDP2 plugin's auto_wrap_policy or "
                "_no_split_modules); pass blocks= naming its transformer block class."
            )
    if offload:
        forwards = [m.__dict__.get("forward") for m in model.modules()]
        forwards = [f for f in forwards if isinstance(f, RematForward)]
        if not forwards:
            raise ValueError(
                "apply_remat_for_accelerator: the FSDP2 plugin asks for "
                "activation_checkpointing_offload, which applies to modules checkpointed "
                "by apply_remat; the layers of this model are checkpointed through "
                "enable_remat. Call disable_remat(model) and let this function apply remat, "
                "or set activation_checkpointing_offload=False."
            )
        for forward in forwards:
            forward.offload = True
    if plugin is not None:
        plugin.activation_checkpointing = False
        plugin.activation_checkpointing_offload = False
    return names


def prepare_with_remat(
    accelerator: Any,
    *args: Any,
    blocks: ModuleSelector | None = None,
    remat: RematConfig | None = None,
    **prepare_kwargs: Any,
) -> Any:
    """``accelerator.prepare(*args, **prepare_kwargs)`` with remat on every model among
    ``args`` (:func:`apply_remat_for_accelerator` with ``blocks`` and ``remat``)::

        model, optimizer, loader = prepare_with_remat(accelerator, model, optimizer, loader)
    """
    for obj in args:
        if isinstance(obj, nn.Module):
            apply_remat_for_accelerator(accelerator, obj, blocks, remat=remat)
    return accelerator.prepare(*args, **prepare_kwargs)
