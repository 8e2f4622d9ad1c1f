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

import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp.wrap import _Policy
from torch.utils._pytree import tree_flatten

import torch_remat as remat

from ._torch_arguments import checkpoint_options, select_like_torch, wrapper_spec
from .rng import default_rng_state_hooks, prepare_dtensor_rng

ModuleSelector = type | tuple | list | set | frozenset | Callable[[nn.Module], bool]


# --------------------------------------------------------------------------- forwards


class _ModuleForward:
    """Base of the callables ``apply_remat`` installs as ``module.forward``.

    They are objects rather than closures so that ``copy.deepcopy(model)`` and
    ``torch.save(model)`` carry them along: the module is pickled (and deep-copied
    through the memo) as part of their state, so a copy's forward runs the copy.
    They hold the module through a weak reference: a strong one would make every
    checkpointed module part of a reference cycle, and a deleted model would keep
    its parameters alive until the garbage collector's next cycle pass.
    """

    def __init__(self, module: nn.Module, region_name: str) -> None:
        self._module = weakref.ref(module)
        self.region_name = region_name
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

    def __init__(
        self,
        module: nn.Module,
        region_name: str,
        state_hooks: tuple[Any, ...],
        checkpoint_options: dict[str, Any],
        offload: bool = False,
        checkpointed: bool = True,
    ) -> None:
        super().__init__(module, region_name)
        self.state_hooks = state_hooks
        self.checkpoint_options = checkpoint_options
        # offload: keep what the forward saves on the host (save_on_cpu).
        # checkpointed=False with offload is torch's offload_wrapper: offload only.
        self.offload = offload
        self.checkpointed = checkpointed
        self.compile_options: dict[str, Any] | None = None
        self._compiled: Callable[..., Any] | None = None

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
        return state

    def _function(self) -> Callable[..., Any]:
        if self.compile_options is None:
            return self.original_forward
        if self._compiled is None:
            self._compiled = torch.compile(self.original_forward, **self.compile_options)
        return self._compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.checkpointed:
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return self._function()(*args, **kwargs)
        # Decorated per call (cheap: the options were validated at apply time) so that
        # no closure ties this object to itself.
        fn = remat.checkpoint(
            region_name=self.region_name,
            recompute_state_hooks=self.state_hooks,
            **self.checkpoint_options,
        )(self._function())
        if self.offload:
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)


class SaveRegionForward(_ModuleForward):
    """``module.forward`` of a ``save_modules`` match: a SAVE region whose outputs are
    kept, since ``apply_remat`` cannot know which of their consumers are replayed."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = remat.region(self.original_forward, self.region_name, recompute=False)(
            *args, **kwargs
        )
        if remat.is_recomputing():
            return out
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                remat.recompute_needs_tensor(leaf)
        return out


def _installed(module: nn.Module) -> _ModuleForward | None:
    fwd = module.__dict__.get("forward")
    return fwd if isinstance(fwd, _ModuleForward) else None


def _matcher(selector: ModuleSelector, what: str) -> Callable[[nn.Module], bool]:
    if isinstance(selector, type):
        return lambda m: isinstance(m, selector)
    if isinstance(selector, (tuple, list, set, frozenset)):
        classes = tuple(selector)
        if not all(isinstance(c, type) for c in classes):
            raise TypeError(f"{what} must hold module classes only, got {selector!r}.")
        return lambda m: isinstance(m, classes)
    if callable(selector):
        return selector
    raise TypeError(
        f"{what} must be a module class, a tuple of classes or a predicate "
        f"module -> bool, got {type(selector).__name__}."
    )


def _save_modules_of(
    block: nn.Module, blocks: set[nn.Module], is_save: Callable[[nn.Module], bool]
) -> Iterator[tuple[str, nn.Module]]:
    """Outermost save-module matches inside ``block``, not inside a nested block."""

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
        for name, child in module.named_children():
            if child in blocks:
                continue
            path = f"{prefix}{name}"
            if is_save(child):
                yield path, child
            else:
                yield from walk(child, path + ".")

    yield from walk(block, "")


def _names(model: nn.Module) -> dict[nn.Module, str]:
    names: dict[nn.Module, str] = {}
    for name, module in model.named_modules():
        names.setdefault(module, name)
    return names


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


# --------------------------------------------------------------------------- public


@dataclass
class RematConfig:
    """How the adapters (FSDP2, DDP, tensor parallel) checkpoint each block."""

    enabled: bool = True
    """False: the adapter applies no remat (it still shards / parallelizes)."""

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


def select_modules(model: nn.Module, blocks: ModuleSelector) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` for every non-root module of ``model`` matched by
    ``blocks`` (a class, a tuple of classes, or a predicate), in ``named_modules`` order."""
    match = _matcher(blocks, "blocks")
    return [(n, m) for n, m in model.named_modules() if m is not model and match(m)]


def apply_remat_to_blocks(
    model: nn.Module, blocks: ModuleSelector, config: RematConfig | None
) -> list[str]:
    """What the adapters call: :func:`apply_remat` on the ``blocks`` of ``model`` with
    ``config``. Does nothing when ``config`` is None or disabled, or when remat is
    already applied to ``model`` (the caller applied it, before or after sharding)."""
    if config is None or not config.enabled or remat_module_names(model):
        return []
    match = _matcher(blocks, "blocks")
    return apply_remat(
        model,
        check_fn=match,
        save_modules=config.save_modules,
        recompute_state_hooks=config.recompute_state_hooks,
        rng_state_hooks=config.rng_state_hooks,
        early_stop=config.early_stop,
        determinism_check=config.determinism_check,
    )


def apply_remat(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[..., Any] | None = None,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Callable[..., bool] | _Policy | None = None,
    *,
    save_modules: ModuleSelector | None = None,
    recompute_state_hooks: Iterable[Any] | None = None,
    rng_state_hooks: bool = True,
    early_stop: bool | None = None,
    determinism_check: str | None = None,
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
        checkpoint_wrapper_fn: None, torch's ``checkpoint_wrapper`` or
            ``offload_wrapper``, or ``functools.partial(checkpoint_wrapper, **options)``.
            Its options are translated: ``preserve_rng_state=False`` turns the stock
            RNG hooks off, ``determinism_check`` and ``early_stop`` pass through;
            reentrant checkpointing and custom ``checkpoint_fn``/``context_fn`` are
            refused with an explanation. ``offload_wrapper`` keeps the activations of
            the selected modules on the CPU (``save_on_cpu``) instead of checkpointing,
            as torch's does.
        save_modules: a module class, a tuple of classes, or a predicate. Matching
            submodules inside a selected module run as SAVE regions
            (``remat.region(..., recompute=False)``, named by their path inside the
            selected module) and their outputs are kept, since their consumers are
            unknown. The outermost match wins; matches outside selected modules run
            normally.
        recompute_state_hooks: extra :class:`torch_remat.RecomputeStateHook` objects
            handed to every checkpoint.
        rng_state_hooks: also hand every checkpoint the stock per-rank RNG hooks
            (:func:`torch_remat.integrations.rng.default_rng_state_hooks`: this rank's
            CUDA generator, or the CPU generator), so dropout replays exactly. If the
            model has DTensor parameters, DTensor's RNG tracker is set up now too
            (:func:`~torch_remat.integrations.rng.prepare_dtensor_rng`; on a CUDA mesh
            that broadcasts rank 0's generator state, so call it on every rank).
        early_stop, determinism_check: forwarded to ``remat.checkpoint``.

    Returns the qualified names of the checkpointed modules. Raises ``ValueError`` if
    remat is already applied anywhere in ``model`` (see :func:`remove_remat`) or if a
    module is wrapped by torch's ``CheckpointWrapper``.
    """
    if check_fn is None:
        raise TypeError("apply_remat: check_fn must be a callable module -> bool.")
    _refuse_torch_wrappers(model)
    already = remat_module_names(model)
    if already:
        raise ValueError(
            f"apply_remat: remat is already applied to {already} in this model. Applying "
            "it twice would nest a checkpoint in itself; call "
            "torch_remat.integrations.remove_remat(model) first to change the selection."
        )
    offload, base_kwargs = wrapper_spec(checkpoint_wrapper_fn)
    is_save = None if save_modules is None else _matcher(save_modules, "apply_remat: save_modules")
    extra_hooks = tuple(recompute_state_hooks or ())
    names = _names(model)
    selected = select_like_torch(model, check_fn, auto_wrap_policy)
    blocks = {m for m, _ in selected}

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
        if early_stop is not None:
            options["early_stop"] = early_stop
        if determinism_check is not None:
            options["determinism_check"] = determinism_check
        use_rng = rng_state_hooks if preserve is None else bool(preserve)
        plans.append((module, name, options, use_rng))

    rng_hooks: tuple[Any, ...] = ()
    if any(p[3] for p in plans):
        rng_hooks = default_rng_state_hooks()
        mesh = _dtensor_mesh(model)
        if mesh is not None:
            prepare_dtensor_rng(mesh)
    for module, name, options, use_rng in plans:
        hooks = (rng_hooks if use_rng else ()) + extra_hooks
        module.forward = RematForward(module, name, hooks, options, offload, checkpointed=not offload)
        if is_save is None or offload:
            continue
        for path, sub in _save_modules_of(module, blocks, is_save):
            if _installed(sub) is None:
                sub.forward = SaveRegionForward(sub, path)
    return [p[1] for p in plans]


def _dtensor_mesh(model: nn.Module) -> Any:
    """The mesh of the model's first DTensor parameter (tensor parallel or FSDP2)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return mesh
    return None


def remove_remat(model: nn.Module) -> list[str]:
    """Undo :func:`apply_remat` on ``model``: every module gets its original forward
    back. Returns the qualified names of the modules that were checkpointed."""
    removed = []
    for name, module in model.named_modules():
        fwd = _installed(module)
        if fwd is not None:
            if isinstance(fwd, RematForward):
                removed.append(name)
            fwd.uninstall()
    return removed


def remat_module_names(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that :func:`apply_remat` checkpoints."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(_installed(module), RematForward)
    ]


def save_region_names(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that run as SAVE regions."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(_installed(module), SaveRegionForward)
    ]
