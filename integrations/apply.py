"""``apply_remat``: a drop-in replacement for torch's ``apply_activation_checkpointing``.

torch's function replaces each selected module by a ``CheckpointWrapper`` around it.
That changes the module tree: parameter and state-dict keys gain a
``_checkpoint_wrapped_module`` infix that torch then strips again with hooks, and
code that walks ``named_modules()`` or indexes ``model.layers[0]`` sees the wrapper.

``apply_remat`` leaves the tree alone. It replaces the selected modules' ``forward``
(an instance attribute, not ``__call__``) by ``remat.checkpoint(region_name=<FQN>)``
around the original forward. Everything ``nn.Module.__call__`` does (forward
hooks, FSDP2's pre/post-forward all-gather and reshard) stays outside the
checkpoint, so remat can be applied before or after ``fully_shard`` and the
recompute in backward issues no all-gather of its own (FSDP2 has already gathered
the block's parameters for its backward when the recompute runs).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from torch_remat._integration import CheckpointWrapper, FSDPPolicy

from ._forwards import (
    RematForward,
    SaveRegionForward,
    install_save_regions,
    installed_forward,
)
from ._selection import ModuleSelector, module_matcher, qualified_names
from ._torch_arguments import checkpoint_options, select_like_torch, wrapper_spec
from ._validation import validate_apply_options
from .rng import default_rng_state_hooks, prepare_dtensor_rng


def _refuse_torch_wrappers(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, CheckpointWrapper):
            raise ValueError(
                f"apply_remat: module '{name or '<root>'}' is already wrapped by torch's "
                "CheckpointWrapper (from apply_activation_checkpointing or "
                "checkpoint_wrapper). Applying torch_remat as well would checkpoint it "
                "twice, and the wrapper renames its parameters "
                "('…_checkpoint_wrapped_module.…'). Build the model without torch's "
                "wrapper and call apply_remat instead (replace the wrapper by its "
                "._checkpoint_wrapped_module to unwrap an existing model)."
            )


@dataclass
class RematConfig:
    """How remat checkpoints each block: the one way to pass remat options, taken by
    :func:`apply_remat`, :func:`~torch_remat.integrations.enable_remat` and every
    adapter (FSDP2, DDP, tensor parallel, accelerate) as ``remat=``."""

    enabled: bool = True
    """False: no remat is applied (an adapter still shards / parallelizes)."""

    save_modules: ModuleSelector | None = None
    """Submodules of a block that run as SAVE regions (see :func:`apply_remat`)."""

    recompute_state_hooks: tuple[Any, ...] = ()
    """Extra state hooks for every checkpoint, besides the RNG hooks."""

    rng_state_hooks: bool = True
    """Attach the stock per-rank RNG hooks (and set up DTensor's RNG tracker)."""

    early_stop: bool | None = None
    """Forwarded to ``remat.checkpoint`` (None: its default)."""

    determinism_check: str | None = None
    """Forwarded to ``remat.checkpoint`` (None: its default)."""

    rebuild: str | None = None
    """Forwarded to ``remat.checkpoint`` (None: its default, ``"free"``)."""

    saved_tensors_hooks: Any = None
    """Forwarded to ``remat.checkpoint``: hooks for what each checkpoint keeps, e.g.
    a ``torch_remat.offload.ActivationOffloader`` (under ``torch.compile`` it turns
    into CPU-offload tags for the SAVE regions its ``regions=`` patterns match)."""

    memory_budget: float | None = None
    """Forwarded to ``remat.checkpoint``: the partitioner's activation memory budget
    for each checkpoint under ``torch.compile`` (an eager call raises; see
    docs/compilation.md)."""

    def checkpoint_options(self) -> dict[str, Any]:
        """The ``remat.checkpoint`` keywords these fields set."""
        options: dict[str, Any] = {}
        if self.early_stop is not None:
            options["early_stop"] = self.early_stop
        if self.determinism_check is not None:
            options["determinism_check"] = self.determinism_check
        if self.saved_tensors_hooks is not None:
            options["saved_tensors_hooks"] = self.saved_tensors_hooks
        if self.rebuild is not None:
            options["rebuild"] = self.rebuild
        if self.memory_budget is not None:
            options["memory_budget"] = self.memory_budget
        return options

    def save_matcher(self, where: str) -> Callable[[nn.Module], bool] | None:
        """``save_modules`` as a predicate (None when unset)."""
        if self.save_modules is None:
            return None
        return module_matcher(self.save_modules, f"{where}: save_modules")


def remat_config(remat: Any, who: str) -> RematConfig:
    """``remat=`` as received by ``who`` (a public function): the defaults for None; a
    ``TypeError`` naming ``who`` for anything but a :class:`RematConfig`."""
    if remat is None:
        return RematConfig()
    if not isinstance(remat, RematConfig):
        raise TypeError(
            f"{who}: remat must be a torch_remat.integrations.RematConfig (or None for the "
            f"defaults), got {type(remat).__name__} {remat!r:.80}. Pass the options as "
            "remat=RematConfig(...), e.g. RematConfig(save_modules=[...])."
        )
    return remat


def apply_remat_to_blocks(
    model: nn.Module, blocks: ModuleSelector, config: RematConfig | None
) -> list[str]:
    """What the adapters call: :func:`apply_remat` on the ``blocks`` of ``model`` with
    ``config``. Does nothing when ``config`` is None or disabled, or when remat is
    already applied to ``model`` (the caller applied it, before or after sharding)."""
    if config is None or not config.enabled or remat_module_names(model):
        return []
    return apply_remat(model, check_fn=module_matcher(blocks, "blocks"), remat=config)


def apply_remat(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[..., Any] | None = None,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Callable[..., bool] | FSDPPolicy | set[type] | list[type] | None = None,
    *,
    remat: RematConfig | None = None,
) -> list[str]:
    """Checkpoint selected submodules of ``model`` with ``torch_remat.checkpoint``.

    Accepts every argument of torch's
    ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing``
    with the same meaning, so changing the import is enough::

        from torch_remat.integrations import apply_remat as apply_activation_checkpointing

    Modules are selected exactly as torch selects them (``auto_wrap_policy`` wins
    over ``check_fn``; the root is never selected; nested selections nest). Each
    selected module's ``forward`` becomes ``remat.checkpoint(region_name=<FQN>)``
    around its original forward; the module tree, ``state_dict()``,
    ``named_parameters()``, ``named_modules()`` and DCP keys do not change.

    Args:
        auto_wrap_policy: torch's policy (``ModuleWrapPolicy``, ``CustomPolicy``, a
            callable like ``size_based_auto_wrap_policy``), or a set or list of module
            classes as torchtune and Lightning take it (read as
            ``ModuleWrapPolicy(classes)``).
        checkpoint_wrapper_fn: None, torch's ``checkpoint_wrapper`` or
            ``offload_wrapper``, or ``functools.partial(checkpoint_wrapper, **options)``.
            Its options are translated: ``preserve_rng_state=False`` turns the stock
            RNG hooks off, ``determinism_check`` and ``early_stop`` pass through;
            reentrant checkpointing and custom ``checkpoint_fn``/``context_fn`` are
            refused with an explanation. ``offload_wrapper`` keeps the activations of
            the selected modules on the CPU (``save_on_cpu``) instead of checkpointing,
            as torch's does.
        remat: the remat options (:class:`RematConfig`; default ``RematConfig()``),
            the same object every adapter takes:

            * ``save_modules``: a module class, a tuple of classes, or a predicate.
              Matching submodules inside a selected module run as SAVE regions
              (``remat.region(..., recompute=False)``, named by their path inside
              the selected module) and their outputs are kept, since their consumers
              are unknown. The outermost match wins; matches outside selected
              modules run normally.
            * ``recompute_state_hooks``: extra
              :class:`torch_remat.RecomputeStateHook` objects for every checkpoint.
            * ``rng_state_hooks``: also hand every checkpoint the stock per-rank RNG
              hooks (:func:`torch_remat.integrations.default_rng_state_hooks`: this
              rank's CUDA generator, or the CPU generator), so dropout replays
              exactly. If the model has DTensor parameters, DTensor's RNG tracker is
              set up now too (:func:`~torch_remat.integrations.prepare_dtensor_rng`;
              on a CUDA mesh that broadcasts rank 0's generator state, so call it on
              every rank). Options of a ``checkpoint_wrapper`` partial win over it.
            * ``early_stop``, ``determinism_check``: forwarded to ``remat.checkpoint``.
            * ``enabled=False``: nothing is applied (returns ``[]``).

    Returns the qualified names of the checkpointed modules. Raises ``ValueError`` if
    remat is already applied anywhere in ``model`` (see :func:`remove_remat`) or if a
    module is wrapped by torch's ``CheckpointWrapper``.
    """
    return checkpoint_selected(model, checkpoint_wrapper_fn, check_fn, auto_wrap_policy, remat)


def checkpoint_selected(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[..., Any] | None,
    check_fn: Callable[[nn.Module], bool],
    auto_wrap_policy: Any,
    remat: RematConfig | None,
    *,
    config_decides_rng: bool = False,
    framework: str | None = None,
) -> list[str]:
    """:func:`apply_remat`. ``config_decides_rng``: ``remat.rng_state_hooks`` wins over
    a wrapper's ``preserve_rng_state`` (a config given to the switch). ``framework``:
    how the call was made, for the refusal of random numbers in a forward whose RNG
    hooks a wrapper's ``preserve_rng_state=False`` turned off (None: the engine's own
    refusal in backward)."""
    config = remat_config(remat, "apply_remat")
    if check_fn is None:
        raise TypeError("apply_remat: check_fn must be a callable module -> bool.")
    if not config.enabled:
        return []
    validate_apply_options(
        config.recompute_state_hooks, config.rng_state_hooks, config.early_stop,
        config.determinism_check, config.rebuild,
    )
    _refuse_torch_wrappers(model)
    already = remat_module_names(model)
    if already:
        raise ValueError(
            f"apply_remat: remat is already applied to {already} in this model. Applying "
            "it twice would nest a checkpoint in itself; call "
            "torch_remat.integrations.remove_remat(model) first to change the selection."
        )
    offload, base_kwargs = wrapper_spec(checkpoint_wrapper_fn)
    if offload:
        _refuse_checkpoint_options_when_offloading(config)
    is_save = config.save_matcher("apply_remat")
    names = qualified_names(model)
    selected = select_like_torch(model, check_fn, auto_wrap_policy)

    plans = []
    for module, policy_kwargs in selected:
        name = names[module]
        if is_save is not None and is_save(module):
            raise ValueError(
                f"apply_remat: module '{name}' is selected for checkpointing and also "
                "matches save_modules. A module is either a checkpoint or a SAVE region "
                "inside one; narrow check_fn or save_modules."
            )
        options, preserve = checkpoint_options({**base_kwargs, **policy_kwargs}, name)
        options.update(config.checkpoint_options())
        use_rng = config.rng_state_hooks
        rng_off_by = None
        if preserve is not None and not config_decides_rng:
            use_rng = bool(preserve)
            if not use_rng and framework is not None:
                rng_off_by = framework
        plans.append((module, name, options, use_rng, rng_off_by))

    rng_hooks: tuple[Any, ...] = ()
    if any(p[3] for p in plans):
        rng_hooks = default_rng_state_hooks()
        mesh = _dtensor_mesh(model)
        if mesh is not None:
            prepare_dtensor_rng(mesh)
    extra_hooks = tuple(config.recompute_state_hooks)
    for module, name, options, use_rng, rng_off_by in plans:
        hooks = (rng_hooks if use_rng else ()) + extra_hooks
        module.forward = RematForward(module, name, hooks, options, offload, checkpointed=not offload)
        module.forward.rng_off_by = rng_off_by
    if is_save is not None and not offload:
        install_save_regions((p[0] for p in plans), is_save)
    return [p[1] for p in plans]


def _refuse_checkpoint_options_when_offloading(config: RematConfig) -> None:
    """``offload_wrapper`` checkpoints nothing: options that only a checkpoint reads
    would be dropped without a word."""
    unused = [f"{name}=" for name, value in (
        ("save_modules", config.save_modules),
        ("recompute_state_hooks", tuple(config.recompute_state_hooks) or None),
        *((name, value) for name, value in config.checkpoint_options().items()),
    ) if value is not None]
    if unused:
        raise ValueError(
            f"apply_remat: checkpoint_wrapper_fn=offload_wrapper keeps the selected "
            f"modules' activations on the CPU and checkpoints nothing, so RematConfig's "
            f"{', '.join(unused)} would have no effect. Drop them, or checkpoint with "
            "checkpoint_wrapper (or None) and move what the checkpoints keep to the host "
            "with RematConfig(saved_tensors_hooks=torch_remat.offload.ActivationOffloader(...))."
        )


def _dtensor_mesh(model: nn.Module) -> Any:
    """The mesh of the model's first DTensor parameter (tensor parallel or FSDP2)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return mesh
    return None


def remove_remat(model: nn.Module) -> list[str]:
    """Undo :func:`apply_remat` on ``model``: every module gets its original forward
    back. Returns the qualified names of the modules that were checkpointed.

    If transformers' own gradient checkpointing was switched on for some of them as
    well (the state :class:`RematForward` refuses to run in), it stays on, and a
    ``UserWarning`` names those modules."""
    removed = []
    for name, module in model.named_modules():
        fwd = installed_forward(module)
        if fwd is not None:
            if isinstance(fwd, RematForward):
                removed.append(name)
            fwd.uninstall()
    still = [
        name
        for name, module in model.named_modules()
        if name in removed and module.__dict__.get("gradient_checkpointing") is True
    ]
    if still:
        warnings.warn(
            f"remove_remat: removed remat from {removed}; transformers' own gradient "
            f"checkpointing (torch.utils.checkpoint) is still on for {still}. Call "
            "model.gradient_checkpointing_disable() to switch it off too.",
            stacklevel=2,
        )
    return removed


def remat_module_names(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that :func:`apply_remat` checkpoints.

    Raises ``ValueError`` for a checkpointed module inside torch's
    ``CheckpointWrapper`` (``apply_activation_checkpointing`` applied after
    :func:`apply_remat`): it would be checkpointed twice."""
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(installed_forward(module), RematForward)
    ]
    wrapped = [n for n in names if "_checkpoint_wrapped_module" in n.split(".")]
    if wrapped:
        name = wrapped[0]
        parts = name.split(".")
        wrapper = ".".join(parts[: parts.index("_checkpoint_wrapped_module")]) or "<root>"
        raise ValueError(
            f"remat_module_names: the remat block '{name}' is inside torch's "
            f"CheckpointWrapper '{wrapper}' (apply_activation_checkpointing or "
            "checkpoint_wrapper applied after apply_remat), so it is checkpointed twice "
            f"({len(wrapped)} such blocks). Apply only one of them: turn the framework's "
            "activation checkpointing off, or do not apply remat."
        )
    return names


def save_region_names(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that run as SAVE regions."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(installed_forward(module), SaveRegionForward)
    ]
