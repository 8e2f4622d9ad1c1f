"""How torch's ``apply_activation_checkpointing`` reads its arguments, reproduced
for :func:`~torch_remat.integrations.apply_remat`: which modules a ``check_fn`` or
``auto_wrap_policy`` selects (same order, same ``nonwrapped_numel`` bookkeeping),
and what a ``checkpoint_wrapper_fn`` (possibly a ``functools.partial`` with
options) asks for, translated into ``remat.checkpoint`` options."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy
from torch.utils.checkpoint import checkpoint as torch_utils_checkpoint
from torch.utils.checkpoint import noop_context_fn

from torch_remat._integration import (
    CheckpointImpl,
    CheckpointWrapper,
    FSDPPolicy,
    OffloadWrapper,
    checkpoint_wrapper,
    offload_wrapper,
    run_fsdp_policy,
)


def wrapper_spec(checkpoint_wrapper_fn: Any) -> tuple[bool, dict[str, Any]]:
    """Read ``checkpoint_wrapper_fn`` as torch would use it: (offload?, wrapper kwargs)."""
    fn, args, kwargs = checkpoint_wrapper_fn, (), {}
    if isinstance(fn, functools.partial):
        fn, args, kwargs = fn.func, fn.args, dict(fn.keywords)
    if fn is None or fn is checkpoint_wrapper or fn is CheckpointWrapper:
        if args:
            if len(args) > 2:
                raise TypeError(
                    "apply_remat: checkpoint_wrapper_fn is a partial of checkpoint_wrapper "
                    f"with {len(args)} positional arguments; pass its options by keyword."
                )
            names = ("checkpoint_impl", "checkpoint_fn")
            kwargs.update(dict(zip(names, args)))
        return False, kwargs
    if fn is offload_wrapper or fn is OffloadWrapper:
        if args or kwargs:
            raise TypeError("apply_remat: offload_wrapper takes no options.")
        return True, {}
    raise TypeError(
        f"apply_remat: cannot use checkpoint_wrapper_fn={checkpoint_wrapper_fn!r}. "
        "apply_remat does not wrap modules; it understands torch's checkpoint_wrapper "
        "and offload_wrapper (alone or as functools.partial(checkpoint_wrapper, "
        "**options)). Pass None, or one of those."
    )


def checkpoint_options(wrapper_kwargs: dict[str, Any], where: str) -> tuple[dict, bool | None]:
    """Translate checkpoint_wrapper's kwargs into remat.checkpoint options.

    Returns (options, preserve_rng_state or None when not given).
    """
    kw = dict(wrapper_kwargs)
    impl = kw.pop("checkpoint_impl", CheckpointImpl.NO_REENTRANT)
    if impl != CheckpointImpl.NO_REENTRANT:
        raise ValueError(
            f"apply_remat ({where}): checkpoint_impl={impl} is not supported; torch_remat "
            "is non-reentrant only. Use CheckpointImpl.NO_REENTRANT (the default)."
        )
    fn = kw.pop("checkpoint_fn", None)
    # (torch's, as torch_checkpointing_as_remat shows it while it is open)
    if fn is not None and fn is not torch_utils_checkpoint and not getattr(fn, "torch_remat_switch", False):
        raise ValueError(
            f"apply_remat ({where}): a custom checkpoint_fn ({fn!r}) cannot be honoured; "
            "apply_remat always checkpoints with torch_remat.checkpoint. Drop checkpoint_fn."
        )
    context_fn = kw.pop("context_fn", noop_context_fn)
    if context_fn is not noop_context_fn:
        raise ValueError(
            f"apply_remat ({where}): context_fn (selective activation checkpointing "
            "policies) is not supported. Mark what to keep by module with "
            "apply_remat(..., remat=RematConfig(save_modules=...)), or by source region with "
            "torch_remat.region(fn, name, recompute=False) in the model code."
        )
    if kw.pop("debug", False):
        raise ValueError(
            f"apply_remat ({where}): debug=True has no torch_remat equivalent; use "
            "determinism_check='bitwise' to verify the recompute."
        )
    preserve = kw.pop("preserve_rng_state", None)
    use_reentrant = kw.pop("use_reentrant", None)
    if use_reentrant:
        raise ValueError(
            f"apply_remat ({where}): use_reentrant=True is not supported; torch_remat is "
            "non-reentrant only."
        )
    options = {}
    for key in ("early_stop", "determinism_check"):
        if key in kw:
            options[key] = kw.pop(key)
    if kw:
        raise TypeError(
            f"apply_remat ({where}): unsupported checkpoint option(s) {sorted(kw)}; "
            "supported: checkpoint_impl, checkpoint_fn, preserve_rng_state, use_reentrant, "
            "early_stop, determinism_check, context_fn (default only), debug (False only)."
        )
    return options, preserve


def policy_of(auto_wrap_policy: Any) -> Any:
    """``auto_wrap_policy`` as torch reads it. A set, frozenset, list or tuple of module
    classes (the form torchtune's and Lightning's checkpointing options take) is
    torch's ``ModuleWrapPolicy`` over those classes; anything else is left as it is."""
    if not isinstance(auto_wrap_policy, (set, frozenset, list, tuple)):
        return auto_wrap_policy
    classes = list(auto_wrap_policy)
    wrong = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if wrong:
        raise TypeError(
            "apply_remat: auto_wrap_policy as a collection must hold module classes "
            f"(nn.Module subclasses), got {', '.join(repr(w) for w in wrong)}. Pass the "
            "classes of the blocks to checkpoint, e.g. {TransformerBlock}, or a policy "
            "(ModuleWrapPolicy, CustomPolicy, or a callable like torch's)."
        )
    if not classes:
        raise ValueError(
            "apply_remat: auto_wrap_policy is an empty collection, which selects nothing; "
            "pass the classes of the blocks to checkpoint, or leave it None to select "
            "with check_fn."
        )
    return ModuleWrapPolicy(set(classes))


def select_like_torch(
    model: nn.Module, check_fn: Callable[[nn.Module], bool], auto_wrap_policy: Any
) -> list[tuple[nn.Module, dict[str, Any]]]:
    """The modules torch's apply_activation_checkpointing would wrap, with per-module
    wrapper kwargs, in the order torch wraps them (post-order, never the root)."""
    auto_wrap_policy = policy_of(auto_wrap_policy)
    policy = (
        auto_wrap_policy
        if auto_wrap_policy is not None
        else functools.partial(lambda_auto_wrap_policy, lambda_fn=check_fn)
    )
    selected: list[tuple[nn.Module, dict[str, Any]]] = []
    if not callable(policy):
        if not isinstance(policy, FSDPPolicy):
            raise ValueError(f"Expected {policy} to be callable or be a pre-defined wrap policy")
        targets = run_fsdp_policy(policy, model)
        seen: set[nn.Module] = {model}

        def post_order(module: nn.Module) -> None:
            for child in module.children():
                if child not in seen:
                    seen.add(child)
                    post_order(child)
            if module in targets and module is not model:
                selected.append((module, targets[module]))

        post_order(model)
        return selected

    # Mirrors torch.distributed.fsdp.wrap._recursive_wrap(only_wrap_children=True),
    # including the nonwrapped_numel bookkeeping size-based policies read.
    def recurse(module: nn.Module, only_children: bool) -> int:
        numel = sum(p.numel() for p in module.parameters())
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(recurse(child, False) for child in module.children())
        if not only_children and policy(
            module=module, recurse=False, nonwrapped_numel=numel - wrapped
        ):
            selected.append((module, {}))
            return numel
        return wrapped

    recurse(model, True)
    unique: dict[nn.Module, dict[str, Any]] = {}
    for module, kwargs in selected:
        unique.setdefault(module, kwargs)
    return list(unique.items())
