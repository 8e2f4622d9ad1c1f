"""``torch_checkpointing_as_remat``: one switch for code that calls torch's activation
checkpointing itself.

torchtune's ``training.set_activation_checkpointing`` and its ``checkpoint_wrapper``,
and Lightning's FSDP strategy (``activation_checkpointing_policy=``), call torch's
``apply_activation_checkpointing`` or ``checkpoint_wrapper``, some through names
they imported when they were imported. Inside the switch those calls apply remat:
torch's module attributes, and every name any imported module bound to those two
functions, are replaced, and put back on exit.

* ``apply_activation_checkpointing(model, checkpoint_wrapper_fn, check_fn,
  auto_wrap_policy)`` is :func:`~torch_remat.integrations.apply_remat` with the same
  arguments: the same modules are selected, and no wrapper enters the module tree.
* ``checkpoint_wrapper(module, **options)`` installs remat on ``module`` and returns
  ``module`` itself (not a wrapper), so the caller registers the module it already
  had. The function is not told the module's qualified name: its checkpoint takes
  the module's path in the model that first calls it (found among the modules being
  called around it), or keeps the module's class name when no calling module holds it.
* ``torch.utils.checkpoint.checkpoint(**options)(fn)``, the curried form (torch 2.15
  and later), returns ``remat.checkpoint(**options)(fn)`` (named after ``fn``). A
  direct call, ``checkpoint(fn, *args)``, runs torch's checkpoint as before: it is a
  forward, not the setup the switch is opened around. Besides torch's attribute,
  the names modules outside torch bound to the function are replaced (torch's own
  modules call it directly only).

Options torch's wrapper takes are translated as ``apply_remat`` translates them; a
custom ``checkpoint_fn`` other than torch's ``torch.utils.checkpoint.checkpoint``,
``context_fn`` (selective checkpointing policies) and reentrant checkpointing are
refused with the reason. ``preserve_rng_state``: a :class:`RematConfig` given to the
switch decides (its ``rng_state_hooks``, True by default, replays dropout exactly
whatever the framework passes). Without one the framework's flag holds, and a
forward that draws random numbers under ``preserve_rng_state=False`` (OLMo-core,
torchtune's ``ac_mode``, accelerate's FSDP2 plugin pass it) makes the backward raise
``RecomputeMismatchError`` naming the checkpoint and that config, before any
recompute. The curried form's options are translated the same way; its
``respect_saved_tensors_hooks`` concerns only selective checkpointing, which remat
refuses, and is accepted.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint
from torch import nn

from torch_remat import checkpoint as remat_checkpoint
from torch_remat._integration import checkpoint_wrapper_module

from ._forwards import RematForward, installed_forward
from ._torch_arguments import checkpoint_options
from .apply import RematConfig, checkpoint_selected, remat_config
from .rng import default_rng_state_hooks

_NAMES = ("apply_activation_checkpointing", "checkpoint_wrapper")
_FRAMEWORK = (
    "the code that checkpointed it through torch_checkpointing_as_remat (a call of "
    "torch's checkpoint_wrapper or apply_activation_checkpointing)"
)

# torch 2.15 made `function` optional: checkpoint(**options) returns a decorator.
_TORCH_HAS_CURRIED_CHECKPOINT = (
    inspect.signature(torch.utils.checkpoint.checkpoint).parameters["function"].default is None
)


def _curried_checkpoint(
    original: Callable[..., Any], config: RematConfig, is_open: Callable[[], bool]
) -> Callable[..., Any]:
    """torch's ``checkpoint`` with its curried form made remat's while the switch is open."""
    accepted = {
        p.name for p in inspect.signature(original).parameters.values() if p.kind is p.KEYWORD_ONLY
    }

    def checkpoint(function: Any = None, *args: Any, **kwargs: Any) -> Any:
        if function is not None or args or not is_open():
            return original(function, *args, **kwargs)
        unexpected = sorted(set(kwargs) - accepted)
        if unexpected:
            # what torch's own curried form raises
            raise ValueError("Unexpected keyword arguments: " + ",".join(unexpected))
        options = dict(kwargs)
        respect = options.pop("respect_saved_tensors_hooks", None)
        if respect not in (None, True, False):
            raise TypeError(
                "torch.utils.checkpoint.checkpoint: respect_saved_tensors_hooks must be "
                f"None, True or False, got {respect!r}."
            )
        where = "torch.utils.checkpoint.checkpoint(...)(fn) inside torch_checkpointing_as_remat"
        translated, preserve = checkpoint_options(options, where)
        translated.update(config.checkpoint_options())
        use_rng = config.rng_state_hooks if preserve is None else bool(preserve)
        hooks = (default_rng_state_hooks() if use_rng else ()) + tuple(config.recompute_state_hooks)
        return remat_checkpoint(recompute_state_hooks=hooks, **translated)

    return checkpoint


@contextlib.contextmanager
def torch_checkpointing_as_remat(remat: RematConfig | None = None) -> Iterator[None]:
    """Within the block, torch's ``apply_activation_checkpointing`` and
    ``checkpoint_wrapper`` apply remat (``remat``: the options, as for
    :func:`~torch_remat.integrations.apply_remat`; given, its ``rng_state_hooks`` wins
    over the framework's ``preserve_rng_state``). On exit every name bound to the
    replacements, also in modules first imported inside the block, is torch's
    function again, and a replacement kept elsewhere calls torch's. Not thread-safe:
    it replaces module attributes for the whole process while it is open."""
    remat_config(remat, "torch_checkpointing_as_remat")  # (refuses anything but a RematConfig)
    _torch = checkpoint_wrapper_module()
    originals = {name: getattr(_torch, name) for name in _NAMES}
    if any(getattr(f, "torch_remat_switch", False) for f in originals.values()):
        raise RuntimeError(
            "torch_checkpointing_as_remat: the switch is already on (nested use); "
            "open it once around the code that checkpoints."
        )
    original_wrapper = originals["checkpoint_wrapper"]

    def unswitched(fn: Any) -> Any:
        # The framework may hand our replacement (or a partial of it) back to us.
        if fn is replacements["checkpoint_wrapper"]:
            return original_wrapper
        if isinstance(fn, functools.partial) and fn.func is replacements["checkpoint_wrapper"]:
            return functools.partial(original_wrapper, *fn.args, **fn.keywords)
        return fn

    open_ = [True]
    # A config given to the switch decides the RNG hooks, whatever preserve_rng_state
    # the framework passes; without one the framework's flag holds, as in torch.
    decides = remat is not None

    def apply_activation_checkpointing(
        model: nn.Module, checkpoint_wrapper_fn: Any = None,
        check_fn: Any = lambda _: True, auto_wrap_policy: Any = None,
    ) -> None:
        if not open_[0]:  # a reference kept past the switch: torch's own again
            originals["apply_activation_checkpointing"](
                model, unswitched(checkpoint_wrapper_fn), check_fn, auto_wrap_policy
            )
            return
        checkpoint_selected(
            model, unswitched(checkpoint_wrapper_fn), check_fn, auto_wrap_policy, remat,
            config_decides_rng=decides, framework=_FRAMEWORK,
        )

    def checkpoint_wrapper(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if not open_[0]:
            return original_wrapper(module, *args, **kwargs)
        holder = nn.Module()
        holder.add_module(type(module).__name__, module)
        checkpoint_selected(
            holder, functools.partial(original_wrapper, *args, **kwargs),
            lambda m: m is module, None, remat,
            config_decides_rng=decides, framework=_FRAMEWORK,
        )
        forward = installed_forward(module)
        if isinstance(forward, RematForward):
            forward.name_from_callers = True
        return module

    replacements = {
        "apply_activation_checkpointing": apply_activation_checkpointing,
        "checkpoint_wrapper": checkpoint_wrapper,
    }
    names = list(_NAMES)
    if _TORCH_HAS_CURRIED_CHECKPOINT:
        originals["checkpoint"] = torch.utils.checkpoint.checkpoint
        replacements["checkpoint"] = _curried_checkpoint(
            originals["checkpoint"], remat_config(remat, "torch_checkpointing_as_remat"), lambda: open_[0]
        )
        names.append("checkpoint")
    for fn in replacements.values():
        fn.torch_remat_switch = True  # type: ignore[attr-defined]
    by_original = {id(originals[n]): replacements[n] for n in names}
    replaced: list[tuple[Any, str, Any]] = []
    for name, module in list(sys.modules.items()):
        top = name.split(".")[0]
        if top == "torch_remat":
            continue  # its own references are how apply_remat recognises torch's wrapper
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            new = by_original.get(id(value))
            if new is None or not any(value is originals[n] for n in names):
                continue
            if value is originals.get("checkpoint") and top == "torch" and name != "torch.utils.checkpoint":
                # torch's modules call it directly (and Dynamo recognises it by identity)
                continue
            replaced.append((module, attr, value))
            setattr(module, attr, new)
    try:
        yield
    finally:
        open_[0] = False
        for module, attr, value in replaced:
            if getattr(module, attr, None) is by_original[id(value)]:
                setattr(module, attr, value)
        # Modules first imported while the switch was open bound the replacements.
        back = {id(replacements[n]): originals[n] for n in names}
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                original = back.get(id(value))
                if original is not None and any(value is r for r in replacements.values()):
                    setattr(module, attr, original)
