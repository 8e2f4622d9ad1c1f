"""The callables ``apply_remat`` and ``enable_remat`` install as ``module.forward``:
a checkpointed block (:class:`RematForward`) and a SAVE region inside one
(:class:`SaveRegionForward`). Installing replaces the instance's ``forward``, not
``__call__``, so module hooks stay outside and the module tree keeps its names."""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

import torch_remat as remat
from torch_remat._integration import drew_random_numbers, generator_positions, tree_flatten

from ._repeated_calls import repeated_call_prefix, run_counting_calls
from ._selection import save_modules_of

_log = logging.getLogger("torch_remat")


class _ModuleForward:
    """Base of the callables ``apply_remat`` installs as ``module.forward``.

    They are objects rather than closures so that ``copy.deepcopy(model)`` and
    ``torch.save(model)`` carry them along: the module is pickled (and deep-copied
    through the memo) as part of their state, so a copy's forward runs the copy.
    They hold the module through a weak reference: a strong one would make every
    checkpointed module part of a reference cycle, and a deleted model would keep
    its parameters alive until the garbage collector's next cycle pass.
    """

    def __init__(
        self,
        module: nn.Module,
        region_name: str,
        state_hooks: tuple[Any, ...] = (),
        checkpoint_options: dict[str, Any] | None = None,
    ) -> None:
        self._module = weakref.ref(module)
        self.region_name = region_name
        self.state_hooks = state_hooks
        self.checkpoint_options = checkpoint_options or {}
        # A forward that was set on the instance before us (None: the class's own).
        self.previous_forward = module.__dict__.get("forward")

    @property
    def module(self) -> nn.Module:
        module = self._module()
        if module is None:
            raise RuntimeError(
                f"torch_remat: the module of checkpoint '{self.region_name}' no longer "
                "exists; its forward was called after the module was deleted."
            )
        return module

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_module"] = self.module
        return state

    def build_checkpoint(self, region_name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``remat.checkpoint`` with this forward's options, around ``fn``: built once
        (its option checks and memos then serve every call)."""
        return remat.checkpoint(
            region_name=region_name,
            recompute_state_hooks=self.state_hooks,
            **self.checkpoint_options,
        )(fn)

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["_module"] = weakref.ref(state["_module"])
        self.__dict__.update(state)

    def original_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous_forward is not None:
            return self.previous_forward(*args, **kwargs)
        module = self.module
        return type(module).forward(module, *args, **kwargs)

    def uninstall(self) -> None:
        module = self.module
        if self.previous_forward is None:
            del module.forward
        else:
            module.forward = self.previous_forward

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.region_name!r})"


class RematForward(_ModuleForward):
    """``module.forward`` under ``apply_remat``: the original forward, checkpointed."""

    # (class defaults: copies pickled before these existed read them)
    rng_off_by: str | None = None
    name_from_callers = False

    def __init__(
        self,
        module: nn.Module,
        region_name: str,
        state_hooks: tuple[Any, ...],
        checkpoint_options: dict[str, Any],
        offload: bool = False,
        checkpointed: bool = True,
    ) -> None:
        super().__init__(module, region_name, state_hooks, checkpoint_options)
        # offload: keep what the forward saves on the host (save_on_cpu).
        # checkpointed=False with offload is torch's offload_wrapper: offload only.
        self.offload = offload
        self.checkpointed = checkpointed
        self.compile_options: dict[str, Any] | None = None
        self._compiled: Callable[..., Any] | None = None
        # SAVE-region modules are installed inside (install_save_regions): their
        # repeated calls are numbered per run of the forward
        self.counts_calls = False
        # How a wrapper's preserve_rng_state=False turned the RNG hooks off (None: it
        # did not): a forward that draws random numbers is then refused by name.
        self.rng_off_by: str | None = None
        # Installed on a module alone (torch's checkpoint_wrapper through the switch):
        # the checkpoint is named by the module's class until its first call, which
        # finds the module's path in the model that calls it.
        self.name_from_callers = False
        self._checkpointed: Callable[..., Any] | None = (
            self.build_checkpoint(region_name, _CountedForward(self)) if checkpointed else None
        )

    @property
    def __remat_module__(self) -> tuple[str, nn.Module]:
        """The module behind this checkpoint and its qualified name in the model:
        the checkpoint checks and replays its parameters and buffers by these names."""
        return self.region_name, self.module

    def compile(self, **options: Any) -> None:
        """Run the checkpointed function through ``torch.compile(**options)``, inside
        the checkpoint.

        The eager checkpoint then keeps or replays the compiled function whole, and
        regions inside it are plain calls. ``module.compile()`` (compiling around the
        checkpoint) is usually better: the checkpoint traces into the module's graph
        and its regions decide what the compiled forward saves.
        """
        self.compile_options = dict(options)
        self._compiled = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_compiled"] = None  # compiled code is rebuilt on the copy's first call
        state["_checkpointed"] = None  # and so is the checkpoint (it holds this weakly)
        return state

    def _function(self) -> Callable[..., Any]:
        if self.compile_options is None:
            return self.original_forward
        if self._compiled is None:
            self._compiled = torch.compile(self.original_forward, **self.compile_options)
        return self._compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None:
            module = self.module  # raises
        if module.training and module.__dict__.get("gradient_checkpointing") is True:
            raise RuntimeError(
                f"torch_remat: checkpoint '{self.region_name}' was called inside "
                "transformers' own gradient checkpointing (torch.utils.checkpoint), "
                "switched on for this module after apply_remat (by "
                "gradient_checkpointing_enable() / activation_checkpointing_enable(), or "
                "by the Trainer for TrainingArguments(gradient_checkpointing=True) or "
                "activation_checkpointing=True); the layer would be checkpointed twice. "
                "Leave transformers' checkpointing off (call "
                "model.gradient_checkpointing_disable()), or call "
                "torch_remat.integrations.remove_remat(model) to use torch's alone."
            )
        if not self.checkpointed:
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return self._function()(*args, **kwargs)
        if self.name_from_callers:
            self.name_from_callers = False
            path = _path_in_callers(module)
            if path:
                self.region_name = path
                self._checkpointed = None
        if module.training and torch.is_grad_enabled():
            args, kwargs = without_kv_cache(args, kwargs)
        fn = self._checkpointed
        if fn is None:  # a copy (deepcopy, unpickling): built on its first call
            fn = self._checkpointed = self.build_checkpoint(self.region_name, _CountedForward(self))
        guard = (
            self.rng_off_by is not None
            and torch.is_grad_enabled()
            and not remat.is_recomputing()
            and not torch.compiler.is_compiling()
        )
        start = generator_positions() if guard else None
        if self.offload:
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                out = fn(*args, **kwargs)
        else:
            out = fn(*args, **kwargs)
        if start is not None and drew_random_numbers(start):
            _refuse_in_backward(out, self._rng_refusal())
        return out

    def _rng_refusal(self) -> str:
        return (
            f"torch_remat: checkpoint '{self.region_name}' drew random numbers (dropout) in "
            f"its forward, but {self.rng_off_by} passed preserve_rng_state=False (as "
            "OLMo-core, torchtune's ac_mode and accelerate's FSDP2 plugin do), so it runs "
            "without RNG hooks: the recompute would draw other numbers (another dropout "
            "mask) and the gradients would be wrong. Open the switch as "
            "torch_checkpointing_as_remat(RematConfig(rng_state_hooks=True)): a config "
            "given to the switch decides over the framework's preserve_rng_state, and its "
            "RNG hooks replay the forward's random numbers exactly."
        )


# The keyword arguments transformers' layers take a key/value cache by, across its
# releases (``cache`` now; ``past_key_value(s)`` and GPT-2's ``layer_past`` before).
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _is_kv_cache(value: Any) -> bool:
    """A transformers key/value cache (``DynamicCache`` and the other subclasses of
    ``transformers.cache_utils.Cache``), known by its class, so that transformers
    need not be imported."""
    return any(
        c.__name__ == "Cache" and c.__module__.startswith("transformers.")
        for c in type(value).__mro__
    )


def without_kv_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a checkpointed block's call in training, without a
    transformers key/value cache, by keyword or by position (GPT-2's model passes
    its cache as the block's second positional argument): each layer appends its
    keys and values to the cache, and the checkpoint's replay would append them a
    second time (the cache then holds every key twice after backward), while the
    cache would keep what it holds alive for the whole step. As transformers' own
    gradient checkpointing does, the block gets ``use_cache=False`` and no cache
    (``model.config.use_cache = False`` avoids building one at all)."""
    out = None
    if kwargs.get("use_cache") is True:
        out = dict(kwargs, use_cache=False)
    for key in _CACHE_KWARGS:
        value = kwargs.get(key)
        if value is not None and _is_kv_cache(value):
            out = dict(out or kwargs)
            out[key] = None
    positional = [i for i, value in enumerate(args) if value is not None and _is_kv_cache(value)]
    if positional:
        args = tuple(None if i in positional else value for i, value in enumerate(args))
    if (out is not None or positional) and not _dropped_cache_said[0]:
        _dropped_cache_said[0] = True
        _log.warning(
            "torch_remat: a checkpointed block's call in training drops its key/value "
            "cache (use_cache=False), as transformers' gradient checkpointing does. A "
            "layer that fills a cache runs other kernels (the cache's concatenation "
            "makes keys and values contiguous), so a run without remat and with a cache "
            "can differ from this one in the last bits; set model.config.use_cache = "
            "False to compare the two bitwise (and to build no cache at all)."
        )
    return args, (kwargs if out is None else out)


_dropped_cache_said = [False]  # the warning above is given once per process


def _refuse_in_backward(out: Any, message: str) -> None:
    """Make the first backward through ``out`` raise ``message``, before the recompute
    (where the engine's own refusal would name a call the user never makes)."""

    def refuse(_grad: torch.Tensor) -> None:
        raise remat.RecomputeMismatchError(message)

    for leaf in tree_flatten(out)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(refuse)


def _path_in_callers(module: nn.Module) -> str | None:
    """The qualified name of ``module`` in the outermost module whose forward runs
    around this call (the model), found on the Python stack; None when no calling
    module contains it."""
    callers: list[nn.Module] = []
    frame = sys._getframe(1)
    while frame is not None:
        # the forwards running around this call, each with its module as ``self``
        if frame.f_code.co_name == "forward":
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and owner is not module:
                callers.append(owner)
        frame = frame.f_back
    for caller in reversed(callers):  # outermost first
        for name, sub in caller.named_modules():
            if sub is module:
                return name
    return None


class _CountedForward:
    """What a :class:`RematForward` checkpoints: its module's forward (compiled if
    asked), run with a fresh count of save-module calls when SAVE-region modules are
    installed inside it. It reaches the ``RematForward`` through a weak reference, so
    the checkpointed function built once from it ties nothing to itself."""

    __slots__ = ("_owner",)

    def __init__(self, owner: RematForward) -> None:
        self._owner = weakref.ref(owner)

    @property
    def __remat_module__(self) -> tuple[str, nn.Module]:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("torch_remat: a checkpointed module forward ran after its module was deleted.")
        return owner.__remat_module__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("torch_remat: a checkpointed module forward ran after its module was deleted.")
        if owner.compile_options is not None:
            fn = owner._function()
        elif owner.previous_forward is not None:
            fn = owner.previous_forward
        else:
            module = owner._module()
            if module is None:
                module = owner.module  # raises
            fn = functools.partial(type(module).forward, module)
        if owner.counts_calls:
            return run_counting_calls(fn, args, kwargs)
        return fn(*args, **kwargs)


class SaveRegionForward(_ModuleForward):
    """``module.forward`` of a ``save_modules`` match: a SAVE region whose outputs are
    kept, since ``apply_remat`` cannot know which of their consumers are replayed."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with repeated_call_prefix(self):  # a repeated call gets its own region names
            out = remat.region(self.original_forward, self.region_name, recompute=False)(
                *args, **kwargs
            )
        # (also while recomputing: the outer checkpoint's replay runs a nested
        # checkpoint's forward again, which must keep what it kept the first time)
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                remat.recompute_needs_tensor(leaf)
        return out


def installed_forward(module: nn.Module) -> _ModuleForward | None:
    fwd = module.__dict__.get("forward")
    return fwd if isinstance(fwd, _ModuleForward) else None


def install_save_regions(
    blocks: Iterable[nn.Module], is_save: Callable[[nn.Module], bool]
) -> None:
    """Run the outermost ``is_save`` matches inside each of ``blocks`` as SAVE regions."""
    blocks = set(blocks)
    for block in blocks:
        found = False
        for path, sub in save_modules_of(block, blocks, is_save):
            found = True
            if installed_forward(sub) is None:
                sub.forward = SaveRegionForward(sub, path)
        checkpointed = installed_forward(block)
        if found and isinstance(checkpointed, RematForward):
            checkpointed.counts_calls = True
