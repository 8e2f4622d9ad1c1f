"""Remat for Hugging Face ``transformers`` models, through their own per-layer hook.

A ``transformers.PreTrainedModel`` that supports gradient checkpointing calls
``self._gradient_checkpointing_func(function, *args)`` for each of its layers when
``layer.gradient_checkpointing`` is True and the model is training.
``model.gradient_checkpointing_enable()`` (``activation_checkpointing_enable()`` in
transformers 5) sets those flags and installs ``torch.utils.checkpoint.checkpoint``
as that function. :func:`enable_remat` lets transformers choose and flag the layers
exactly as it always does (``every_n_layers`` included) and then installs
``remat.checkpoint`` as the function, one callable per module, so each checkpoint is
named after its layer (``model.layers.0``).

Nothing in the module tree changes: ``state_dict()``, ``named_parameters()``,
``save_pretrained`` and FSDP2's wrapping see the model exactly as without
checkpointing. transformers 5 checkpoints each layer's ``forward`` (module hooks,
FSDP2's included, stay outside the checkpoint); transformers 4.52 to 4.57 checkpoint
its ``__call__``; older models call the function from their model-level loop. The
function receives the layer's callable in each case; :func:`enable_remat` works
with all three, and the region name is always the layer's qualified name.

``transformers`` is imported only when a function here is called.
"""

from __future__ import annotations

import functools
import operator
import sys
import warnings
import weakref
from typing import Any

from torch import nn

from ._forwards import SaveRegionForward, _ModuleForward, install_save_regions, installed_forward
from ._repeated_calls import run_counting_calls
from ._validation import validate_apply_options
from .apply import RematConfig, remat_config, remat_module_names
from .rng import default_rng_state_hooks


class RematLayerCheckpoint:
    """The ``_gradient_checkpointing_func`` :func:`enable_remat` installs on a module.

    Called by transformers as ``func(layer_callable, *args, **kwargs)``; runs it under
    ``remat.checkpoint(region_name=<the layer's qualified name>)``, built once per
    layer and reused by every call. It holds its module weakly (as ``apply_remat``'s
    forwards do), so a deleted model is freed at once; ``copy.deepcopy`` and pickling
    carry it along with the model.
    """

    def __init__(
        self,
        owner: nn.Module,
        owner_name: str,
        state_hooks: tuple[Any, ...],
        checkpoint_options: dict[str, Any],
    ) -> None:
        self._owner = weakref.ref(owner)
        self.region_name = owner_name
        self.state_hooks = state_hooks
        self.checkpoint_options = checkpoint_options
        # Region names of the owner's submodules, for models whose model-level loop
        # calls its own hook with each layer (transformers < 4.52). Built on first use.
        self._submodule_names: weakref.WeakKeyDictionary[nn.Module, str] | None = None
        # region name -> the checkpointed layer call, built on its first call
        self._checkpoints: dict[str, Any] = {}

    build_checkpoint = _ModuleForward.build_checkpoint

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_owner"] = self._owner()
        state["_submodule_names"] = None
        state["_checkpoints"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["_owner"] = weakref.ref(state["_owner"])
        self.__dict__.update(state)

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        name, module = self.layer_of(function)
        checkpointed = self._checkpoints.get(name)
        if checkpointed is None:
            checkpointed = self.build_checkpoint(name, _LayerCall(name, module))
            self._checkpoints[name] = checkpointed
        return checkpointed(function, *args, **kwargs)

    def region_name_for(self, function: Any) -> str:
        """The qualified name of the layer ``function`` runs (the owner's by default)."""
        return self.layer_of(function)[0]

    def layer_of(self, function: Any) -> tuple[str, nn.Module | None]:
        """The qualified name and module of the layer ``function`` runs."""
        module = _module_of(function)
        owner = self._owner()
        if module is None or owner is None or module is owner:
            return self.region_name, owner if module is None else module
        if self._submodule_names is None:
            self._submodule_names = weakref.WeakKeyDictionary(
                (m, n) for n, m in owner.named_modules() if n
            )
        relative = self._submodule_names.get(module)
        if relative is None:
            return self.region_name, module
        return (f"{self.region_name}.{relative}" if self.region_name else relative), module

    def __repr__(self) -> str:
        return f"RematLayerCheckpoint({self.region_name!r})"


class _LayerCall:
    """What a layer's checkpoint runs: the callable transformers hands over (its
    first argument, so one checkpointed function serves every call), for one layer,
    whose parameters and buffers the checkpoint checks and replays."""

    __slots__ = ("region_name", "_module")

    def __init__(self, region_name: str, module: nn.Module | None) -> None:
        self.region_name = region_name
        self._module = None if module is None else weakref.ref(module)

    @property
    def __remat_module__(self) -> tuple[str, nn.Module] | None:
        module = None if self._module is None else self._module()
        return None if module is None else (self.region_name, module)

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        # a save_modules match called twice in the layer (a dropout) gets its own
        # region names for each call, counted afresh in the forward and each replay
        return run_counting_calls(function, args, kwargs)


def _module_of(function: Any) -> nn.Module | None:
    """The module a layer callable belongs to: ``partial(forward, layer, ...)``
    (transformers 5), ``partial(layer.__call__, ...)`` (4.52+), ``layer.__call__``."""
    while isinstance(function, functools.partial):
        if function.args and isinstance(function.args[0], nn.Module):
            return function.args[0]
        function = function.func
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _is_layer(module: nn.Module) -> bool:
    """True for transformers' repeated per-layer blocks (``GradientCheckpointingLayer``,
    transformers 4.52+). Model-level modules carry the flag too but run no checkpoint."""
    layers = sys.modules.get("transformers.modeling_layers")
    base = getattr(layers, "GradientCheckpointingLayer", None)
    return base is not None and isinstance(module, base)


def _hooked_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules whose checkpoint flag is on and whose hook is torch_remat's."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if getattr(module, "gradient_checkpointing", False) is True
        and isinstance(module.__dict__.get("_gradient_checkpointing_func"), RematLayerCheckpoint)
    ]


def _prefer_layers(modules: list[tuple[str, nn.Module]]) -> list[str]:
    """Names of the per-layer blocks among ``modules`` (all names when none is one):
    model-level modules carry the flag too but run no checkpoint of their own."""
    layers = [name for name, module in modules if _is_layer(module)]
    return layers if layers else [name for name, _ in modules]


def remat_layer_names(model: nn.Module) -> list[str]:
    """Qualified names of the layers of ``model`` that :func:`enable_remat` checkpoints."""
    return _prefer_layers(_hooked_modules(model))


def torch_checkpointed_layer_names(model: nn.Module) -> list[str]:
    """Qualified names of the layers of ``model`` on which transformers' own gradient
    checkpointing (``torch.utils.checkpoint``) is switched on."""
    return _prefer_layers(
        [
            (name, module)
            for name, module in model.named_modules()
            # torch's CheckpointWrapper reads the flag through to the layer it wraps
            if "gradient_checkpointing" in module.__dict__
            and module.gradient_checkpointing is True
            and not isinstance(
                module.__dict__.get("_gradient_checkpointing_func"), RematLayerCheckpoint
            )
        ]
    )


def torch_wrapped_names(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that torch's ``CheckpointWrapper``
    replaced (accelerate's FSDP plugin with ``activation_checkpointing=True``, which the
    Trainer's ``fsdp_config`` sets, or ``apply_activation_checkpointing``)."""
    from torch_remat._integration import CheckpointWrapper

    return [name for name, m in model.named_modules() if isinstance(m, CheckpointWrapper)]


def _check_supported(model: Any) -> None:
    from transformers import PreTrainedModel

    base = getattr(model, "get_base_model", None)
    if not isinstance(model, PreTrainedModel) and callable(base):
        if isinstance(base(), PreTrainedModel):
            raise TypeError(
                f"enable_remat: got a {type(model).__name__} (a PEFT-style wrapper), not the "
                "transformers model it wraps. Pass that model: "
                "enable_remat(model.get_base_model()); the adapters sit inside its layers, "
                "so they are checkpointed with them."
            )
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"enable_remat: expected a transformers.PreTrainedModel, got "
            f"{type(model).__name__}. For any other nn.Module use "
            "torch_remat.integrations.apply_remat(model, check_fn=...)."
        )
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"enable_remat: {type(model).__name__} does not support gradient checkpointing "
            "(its class sets supports_gradient_checkpointing = False), so its layers have no "
            "checkpoint hook to run remat through. Checkpoint its blocks by module instead: "
            "torch_remat.integrations.apply_remat(model, check_fn=lambda m: isinstance(m, "
            "<its layer class>))."
        )
    applied = remat_module_names(model)
    if applied:
        raise ValueError(
            f"enable_remat: apply_remat already checkpoints {applied} in this model; "
            "enabling the layers' own hook as well would checkpoint them twice. Use one of "
            "the two (torch_remat.integrations.remove_remat(model) undoes apply_remat)."
        )


def _transformers_enable(model: Any, every_n_layers: int) -> None:
    """Switch on the model's own checkpointing, with torch's non-reentrant function."""
    extra = {} if every_n_layers == 1 else {"every_n_layers": every_n_layers}
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False}, **extra)
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}, **extra
        )


def _layer_interval(model: Any, every_n_layers: Any) -> int:
    """``every_n_layers`` checked: an int of at least 1, and 1 where the installed
    transformers has no such option (before version 5)."""
    try:
        if isinstance(every_n_layers, bool):
            raise TypeError
        n = operator.index(every_n_layers)
    except TypeError:
        raise TypeError(
            f"enable_remat: every_n_layers must be an int (checkpoint every n-th layer), "
            f"got {type(every_n_layers).__name__} {every_n_layers!r}."
        ) from None
    if n < 1:
        raise ValueError(
            f"enable_remat: every_n_layers must be at least 1 (1 checkpoints every "
            f"layer), got {n}."
        )
    if n != 1 and getattr(model, "activation_checkpointing_enable", None) is None:
        raise ValueError(
            f"enable_remat: every_n_layers={n} needs transformers 5 (its "
            "activation_checkpointing_enable takes the option); this transformers "
            "checkpoints every layer: pass every_n_layers=1, or select layers with "
            "torch_remat.integrations.apply_remat(model, check_fn=...)."
        )
    return n


def _transformers_disable(model: Any) -> None:
    disable = getattr(model, "activation_checkpointing_disable", None)  # transformers 5
    if disable is not None:
        disable()
    else:
        model.gradient_checkpointing_disable()


def enable_remat(
    model: nn.Module,
    *,
    every_n_layers: int = 1,
    remat: RematConfig | None = None,
) -> list[str]:
    """Checkpoint the layers of a ``transformers`` model with ``torch_remat``.

    Use it where you would call ``model.gradient_checkpointing_enable()``::

        from torch_remat.integrations import enable_remat

        model = LlamaForCausalLM(config)        # or .from_pretrained(...)
        enable_remat(model)                     # -> ['model.layers.0', 'model.layers.1', ...]
        model.train()                           # transformers checkpoints only in training
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    transformers flags the layers as ``gradient_checkpointing_enable()`` would (and
    makes the input embeddings' output require grad, as it does); each flagged
    module's ``_gradient_checkpointing_func`` then becomes a
    :class:`RematLayerCheckpoint` that runs the layer in
    ``remat.checkpoint(region_name=<layer's qualified name>)``. The module tree and
    every parameter name stay as they are. Calling it again replaces the previous
    settings; :func:`disable_remat` switches checkpointing off.

    Do not switch transformers' own checkpointing on afterwards
    (``TrainingArguments(gradient_checkpointing=True)`` or
    ``activation_checkpointing=True``, or ``gradient_checkpointing_enable()``): it
    reinstalls ``torch.utils.checkpoint`` in place of remat. The model's next training
    forward then raises ``RuntimeError`` naming the layers.

    Args:
        every_n_layers: checkpoint every n-th layer only (transformers 5's option of
            the same name; other versions accept only 1).
        remat: the remat options (:class:`~torch_remat.integrations.RematConfig`;
            default ``RematConfig()``), as for
            :func:`~torch_remat.integrations.apply_remat`: ``save_modules`` (matching
            submodules of a checkpointed layer, e.g. its attention, run as SAVE
            regions and keep their outputs), ``recompute_state_hooks``,
            ``rng_state_hooks`` (replay this process's device generator, so dropout
            in the recompute draws what the forward drew), ``early_stop`` and
            ``determinism_check``. ``enabled=False`` applies nothing.

    Returns the qualified names of the checkpointed layers. Raises ``TypeError`` for a
    module that is not a ``PreTrainedModel`` and ``ValueError`` for a model that does
    not support gradient checkpointing, or whose layers are already checkpointed by
    ``apply_remat``.
    """
    config = remat_config(remat, "enable_remat")
    _check_supported(model)
    every_n_layers = _layer_interval(model, every_n_layers)
    if not config.enabled:
        return []
    # Checked before anything is switched on, as apply_remat checks them.
    validate_apply_options(
        config.recompute_state_hooks, config.rng_state_hooks, config.early_stop,
        config.determinism_check, config.rebuild, who="enable_remat",
    )
    is_save = config.save_matcher("enable_remat")
    if remat_layer_names(model):
        disable_remat(model)
    options = config.checkpoint_options()
    hooks = (default_rng_state_hooks() if config.rng_state_hooks else ()) + tuple(
        config.recompute_state_hooks
    )

    _transformers_enable(model, every_n_layers)
    installed = 0
    for name, module in model.named_modules():
        if "_gradient_checkpointing_func" in module.__dict__:
            module._gradient_checkpointing_func = RematLayerCheckpoint(
                module, name, hooks, dict(options)
            )
            installed += 1
    if installed == 0:
        _transformers_disable(model)
        raise ValueError(
            f"enable_remat: {type(model).__name__} enabled gradient checkpointing without "
            "installing a per-layer _gradient_checkpointing_func (a model written for "
            "transformers' pre-4.35 checkpointing format), so there is no hook to run "
            "remat through. Use torch_remat.integrations.apply_remat(model, check_fn=...) "
            "on its layer class instead."
        )

    layer_names = remat_layer_names(model)
    if is_save is not None:
        modules = dict(model.named_modules())
        install_save_regions((modules[name] for name in layer_names), is_save)
    if not _has_refuse_hook(model):
        model.register_forward_pre_hook(_refuse_replaced_remat)
    return layer_names


def _refuse_replaced_remat(model: nn.Module, args: Any) -> None:
    """Forward pre-hook of a model :func:`enable_remat` set up: refuses to train once
    transformers' own checkpointing has replaced remat in its layers (a plain
    function, so that copies and pickles of the model carry it without a reference)."""
    if not model.training:
        return
    wrapped = torch_wrapped_names(model)
    if wrapped:
        raise RuntimeError(
            f"enable_remat: torch's checkpoint_wrapper wraps {wrapped} after "
            "enable_remat(model), so those layers would be checkpointed twice. This is "
            "FSDP's own activation checkpointing: accelerate's "
            "FullyShardedDataParallelPlugin(activation_checkpointing=True) (the Trainer "
            "sets it from fsdp_config={'activation_checkpointing': True}), or a call of "
            "torch's apply_activation_checkpointing. Set activation_checkpointing=False "
            "in the plugin or the fsdp_config and keep enable_remat (or prepare with "
            "torch_remat.integrations.prepare_with_remat, which turns it off), or call "
            "disable_remat(model) to train with FSDP's checkpointing instead."
        )
    replaced = torch_checkpointed_layer_names(model)
    if replaced:
        raise RuntimeError(
            f"enable_remat: transformers' own gradient checkpointing "
            f"(torch.utils.checkpoint) replaced remat in {replaced} after "
            "enable_remat(model): something called gradient_checkpointing_enable() / "
            "activation_checkpointing_enable() again, as the Trainer does for "
            "TrainingArguments(gradient_checkpointing=True) or "
            "activation_checkpointing=True. Leave those False and keep enable_remat, or "
            "call disable_remat(model) to train with torch's checkpointing instead."
        )


def _has_refuse_hook(model: nn.Module) -> bool:
    return any(hook is _refuse_replaced_remat for hook in model._forward_pre_hooks.values())


def _remove_refuse_hook(model: nn.Module) -> None:
    for key, hook in list(model._forward_pre_hooks.items()):
        if hook is _refuse_replaced_remat:
            del model._forward_pre_hooks[key]


def disable_remat(model: nn.Module) -> list[str]:
    """Switch off what :func:`enable_remat` switched on: the model's checkpointing
    (``gradient_checkpointing_disable()``) and the SAVE regions of ``save_modules``.
    Returns the qualified names of the layers that were checkpointed.

    If transformers' own checkpointing had replaced remat since (see
    :func:`enable_remat`), that is switched off too, and a ``UserWarning`` says which
    layers ran ``torch.utils.checkpoint`` and which SAVE regions were removed; the
    names returned are then those layers."""
    names = remat_layer_names(model)
    replaced = [] if names else torch_checkpointed_layer_names(model)
    if not names and not (replaced and _has_refuse_hook(model)):
        _remove_refuse_hook(model)
        return []
    modules = dict(model.named_modules())
    removed_regions = []
    for name in names or replaced:
        for path, module in modules[name].named_modules(prefix=name):
            forward = installed_forward(module)
            if isinstance(forward, SaveRegionForward):
                forward.uninstall()
                removed_regions.append(path)
    _transformers_disable(model)
    _remove_refuse_hook(model)
    if replaced:
        warnings.warn(
            f"disable_remat: remat was no longer running: transformers' own gradient "
            f"checkpointing (torch.utils.checkpoint) had replaced it in {replaced}; "
            f"switched that off, and removed the SAVE regions {removed_regions}.",
            stacklevel=2,
        )
    return names or replaced
