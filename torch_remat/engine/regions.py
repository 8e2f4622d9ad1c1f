"""``remat.region`` and ``remat.recompute_needs_tensor``: the annotations used inside
a checkpointed function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from . import compiled
from .naming import current_prefixes, scoped_name, without_prefixes
from .observers import thread_observers
from .records import RegionRecord
from .state import current_scope

F = TypeVar("F", bound=Callable[..., Any])


def region(fn: F, name: str, *, recompute: bool) -> F:
    """Mark one call inside a checkpoint as a named region.

    ``remat.region(self.attention, "attention", recompute=False)(x)`` calls
    ``self.attention(x)`` as a SAVE region: the tensors it saves for backward are
    kept, and during the recompute its body is not run again; it hands back its
    kept outputs (or placeholders for outputs that were not kept). With
    ``recompute=True`` the call is an ordinary part of the replay, named so that
    reports and traces can refer to it.

    Outside a checkpoint (or under ``no_grad``) the wrapper is a plain call, so the
    same model code runs with and without checkpointing.

    Region names must be unique within one forward of a checkpoint; nested regions
    are named ``outer.inner``, and inside ``remat.name_scope(prefix)`` a region is
    named ``prefix/name``.
    """
    # Dynamo cannot trace callable() on an autograd Function's apply (a builtin):
    # under compilation the check ran when the model was first called eagerly, or
    # the call below reports it.
    if not torch.compiler.is_compiling() and not callable(fn):
        raise TypeError(
            f"remat.region: the first argument must be the callable to run, got "
            f"{type(fn).__name__}. Write remat.region(fn, 'name', recompute=False)(*args)."
        )
    if not isinstance(name, str):
        raise TypeError(f"remat.region: name must be a string, got {type(name).__name__}.")
    if not name:
        raise ValueError(
            "remat.region: name must be a non-empty string; it identifies the region "
            "between the forward and the recompute and in reports."
        )
    if recompute is not True and recompute is not False:
        raise TypeError(
            f"remat.region '{name}': recompute must be True or False, got {recompute!r}. "
            "Use recompute=False to keep the region's activations, recompute=True to "
            "replay it in backward."
        )

    def call_region(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return compiled.run_region(fn, name, recompute, args, kwargs)
        full, body = name, fn
        prefixes = current_prefixes()
        if prefixes:  # inside remat.name_scope
            full, body = scoped_name(name, prefixes), without_prefixes(fn)
        scope = current_scope()
        if scope is not None:
            return scope.run_region(body, full, recompute, args, kwargs)
        observers = thread_observers()
        if not observers:
            return fn(*args, **kwargs)
        # Outside any checkpoint a region is a plain call; observers (a trace) still
        # see it, with no checkpoint.
        record = RegionRecord(None, full, full, recompute)
        for observer in observers:
            observer.region_entered(None, record)
        try:
            return body(*args, **kwargs)
        finally:
            for observer in observers:
                observer.region_exited(None, record)

    call_region.__wrapped__ = fn  # type: ignore[attr-defined]
    return call_region  # type: ignore[return-value]


def recompute_needs_tensor(*tensors: torch.Tensor) -> Any:
    """Declare that the recompute reads ``tensors``, outputs of SAVE regions.

    SAVE regions are not replayed, so their outputs exist during the recompute only
    if they were kept. Outputs consumed by a later ``remat.region`` or saved for
    backward are kept automatically; call this for an output that bare code (not a
    region) reads during the replay, e.g. ``h = h + attn``. It may also be called on
    a checkpoint input, or inside a SAVE region on a tensor the region returns.
    Outside a checkpoint, during the recompute, and for tensors that are recomputed
    anyway (produced outside SAVE regions, e.g. by a region that is switched to
    ``recompute=True``) it does nothing, so model code can keep the call whatever
    policy is applied.

    Returns the tensor when given one (``h = recompute_needs_tensor(h)``), otherwise
    the tuple of the tensors given (``a, b = recompute_needs_tensor(a, b)``).
    ``TypeError`` names the position of an argument that is not a tensor.

    If you forget it, the recompute raises :class:`PlaceholderReadError` naming the
    region and output.
    """
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"remat.recompute_needs_tensor expects a tensor for each argument; argument {i + 1} of "
                f"{len(tensors)} is a {type(t).__name__}. Pass tensors as separate "
                "arguments (recompute_needs_tensor(*tensors) for a list)."
            )
    if torch.compiler.is_compiling():
        # the compiled graph names every dependency (engine/compiled.py)
        return tensors[0] if len(tensors) == 1 else tensors
    scope = current_scope()
    if scope is not None:
        for t in tensors:
            scope.keep(t)
    return tensors[0] if len(tensors) == 1 else tensors
