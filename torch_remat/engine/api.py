"""``remat.checkpoint``: the decorator users put around a block."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from .. import _compat
from .._errors import RematError
from . import compiled
from .frame import CheckpointFrame
from .saved_hooks import as_hook_pair
from .state_hooks import validate_state_hooks

F = TypeVar("F", bound=Callable[..., Any])

_DETERMINISM_CHECKS = ("default", "none", "bitwise")
_REBUILD_CHOICES = ("free", "always", "never")


def _refuse_positional(args: tuple) -> None:
    what = type(args[0]).__name__ if args else ""
    raise TypeError(
        f"remat.checkpoint takes keyword arguments only and returns a decorator; it was "
        f"called with a positional argument ({what}). Write "
        "remat.checkpoint(region_name=...)(fn)(*args, **kwargs). The form "
        "remat.checkpoint(fn) is refused on purpose: it reads like "
        "torch.utils.checkpoint.checkpoint(fn, *args), whose arguments mean something else."
    )


def checkpoint(
    *args: Any,
    region_name: str | None = None,
    recompute_state_hooks: Iterable[Any] = (),
    early_stop: bool = True,
    determinism_check: str = "default",
    use_reentrant: bool | None = None,
    preserve_rng_state: bool | None = None,
    saved_tensors_hooks: Any = None,
    input_saved_tensors_hooks: Any = None,
    rebuild: str = "free",
) -> Callable[[F], F]:
    """Return a decorator that runs a function as a non-reentrant checkpoint.

    ``remat.checkpoint(region_name="layers.0")(block)(x)`` runs ``block(x)`` keeping
    only what backward cannot recreate: the inputs the replay reads and whatever
    ``remat.region(..., recompute=False)`` calls inside ``block`` save. Everything
    else is dropped after the forward and recomputed when backward first needs it.

    Args:
        region_name: name of this checkpoint in reports and error messages
            (``apply_remat`` uses the module's qualified name). Defaults to the
            function's name.
        recompute_state_hooks: objects with ``snapshot()`` and ``restore(state)``
            (see :class:`RecomputeStateHook`). They are snapshotted when the
            checkpoint starts and after each SAVE region, and restored at the start
            of the recompute and at each skipped SAVE region, so code that reads
            mutable state (RNG) sees the same values in forward and recompute.
        early_stop: stop the recompute as soon as every tensor backward still needs
            has been recreated (default True).
        determinism_check: ``"default"`` compares shape, dtype and device of each
            recreated tensor with the forward; ``"bitwise"`` also compares their bits
            (costs a checksum per dropped tensor in forward); ``"none"`` checks nothing.
        use_reentrant: accepted for compatibility with ``torch.utils.checkpoint``;
            only ``False`` (or None) is supported.
        preserve_rng_state: only ``False`` (or None) is supported; pass RNG state
            hooks through ``recompute_state_hooks`` instead.
        saved_tensors_hooks: ``(pack, unpack)``, ``(pack, unpack, capture_context)``
            or an object with ``pack_hook``/``unpack_hook`` (an offloader): hooks for
            every tensor this checkpoint keeps resident (SAVE-region saves, kept
            SAVE outputs, kept inputs), with the semantics of
            :class:`remat.saved_tensors_hooks`, ahead of any such context. None (the
            default): no hooks of its own.
        input_saved_tensors_hooks: the same, for the kept checkpoint inputs only
            (ahead of ``saved_tensors_hooks``). The checkpoint then keeps only what
            the pack hook returns, not the input tensor: an input the caller drops
            after the forward is freed (an offloading hook moves it off the device).
        rebuild: what a SAVE region's save of an argument that replayed code produces
            becomes (``nn.Linear`` saves its input). ``"free"`` (default): the replay
            refills it at the region call, unless that makes the replay run an op with
            FLOPs (a matmul) that early stop would skip; then it is kept.
            ``"always"``: refilled even then (the replay may run further matmuls: as
            Megatron's attention-core recompute, fewer bytes for more FLOPs).
            ``"never"``: kept, as a region body's own activations are.

    Under ``torch.no_grad()`` or ``torch.inference_mode()`` the function simply runs
    once. Errors: ``TypeError`` for a positional argument (``remat.checkpoint(fn)``)
    or unknown option types, ``ValueError`` for unsupported option values.
    """
    if args:
        _refuse_positional(args)
    if region_name is not None and (not isinstance(region_name, str) or not region_name):
        raise ValueError(
            f"remat.checkpoint: region_name must be a non-empty string or None, got "
            f"{region_name!r}."
        )
    for option, value in (
        ("early_stop", early_stop),
        ("use_reentrant", use_reentrant),
        ("preserve_rng_state", preserve_rng_state),
    ):
        if not isinstance(value, bool) and not (value is None and option != "early_stop"):
            raise TypeError(
                f"remat.checkpoint: {option} must be True or False, got {value!r} "
                f"({type(value).__name__}); a string such as 'False' is not a boolean."
            )
    if preserve_rng_state:
        raise ValueError(
            "remat.checkpoint does not support preserve_rng_state=True. The recompute "
            "restores state many times per checkpoint (at entry and at every skipped "
            "SAVE region), and snapshotting the CPU generator costs a 5 KB copy each "
            "time while modern code samples RNG on the device. Pass the state you need "
            "restored as recompute_state_hooks=(hook, ...), objects with snapshot() and "
            "restore(state) (see remat.RecomputeStateHook)."
        )
    if use_reentrant:
        raise ValueError(
            "remat.checkpoint is always non-reentrant; use_reentrant=True is not "
            "supported. Drop the argument or pass use_reentrant=False."
        )
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"remat.checkpoint: determinism_check must be one of {_DETERMINISM_CHECKS}, "
            f"got {determinism_check!r}."
        )
    if rebuild not in _REBUILD_CHOICES:
        raise ValueError(
            f"remat.checkpoint: rebuild must be one of {_REBUILD_CHOICES}, got {rebuild!r}."
        )
    hooks = validate_state_hooks(recompute_state_hooks)
    kept = (
        as_hook_pair(saved_tensors_hooks, "remat.checkpoint: saved_tensors_hooks"),
        as_hook_pair(input_saved_tensors_hooks, "remat.checkpoint: input_saved_tensors_hooks"),
    )
    check_metadata = determinism_check != "none"
    bitwise = determinism_check == "bitwise"

    def decorator(fn: F) -> F:
        if not callable(fn):
            raise TypeError(
                f"remat.checkpoint(...) must decorate a callable, got {type(fn).__name__}."
            )
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn) or (
            inspect.iscoroutinefunction(fn)
        ):
            raise TypeError(
                f"remat.checkpoint(...) cannot checkpoint {_default_name(fn)!r}: it is a "
                "generator (or async) function, so calling it only creates a generator "
                "and none of its body would run inside the checkpoint. Checkpoint a "
                "function that computes and returns its tensors."
            )
        name = region_name or _default_name(fn)
        # (early stop, rebuild choice, this function's memo of rebuild_decide's FLOP walks)
        replay = (early_stop, rebuild, {})
        # Built here, not while Dynamo traces (see compiled.option_refusal).
        refusal = compiled.option_refusal(name, hooks, kept)

        def checkpointed(*a: Any, **kw: Any) -> Any:
            if torch.compiler.is_compiling() and not compiled.eager_checkpoint_running():
                return compiled.run_checkpoint(fn, name, refusal, a, kw)
            if torch.compiler.is_compiling():
                return _run_eagerly(fn, name, hooks, replay, check_metadata, bitwise, kept, a, kw)
            return _run(fn, name, hooks, replay, check_metadata, bitwise, kept, a, kw)

        checkpointed.__wrapped__ = fn  # type: ignore[attr-defined]
        checkpointed.__name__ = f"remat_checkpoint_{name}"
        checkpointed.__qualname__ = checkpointed.__name__
        if not torch.compiler.is_compiling():  # Dynamo cannot read a partial's __doc__
            checkpointed.__doc__ = getattr(fn, "__doc__", None)
        return checkpointed  # type: ignore[return-value]

    return decorator


def _run(fn, name, hooks, replay, check_metadata, bitwise, kept, args, kwargs) -> Any:
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    early_stop, rebuild, flop_limits = replay
    frame = CheckpointFrame(
        fn, name, hooks, early_stop, check_metadata, bitwise, kept, rebuild, flop_limits
    )
    try:
        return frame.run_forward(args, kwargs)
    except RuntimeError as e:
        if _FUNCTORCH_REFUSES_HOOKS not in str(e) or isinstance(e, RematError):
            raise
        raise RematError(
            f"torch_remat: torch.func transforms (grad, vjp, jacrev, hessian) were called "
            f"inside checkpoint '{name}', where remat's saved-tensor hooks are active, and "
            "torch.func refuses to run under saved-tensor hooks. Call the transform "
            "outside remat.checkpoint (checkpoint the function it differentiates only "
            "with ordinary autograd), or run that part without remat.checkpoint."
        ) from e


# torch.func's error when a transform runs under saved-tensor hooks (torch 2.13).
_FUNCTORCH_REFUSES_HOOKS = "support saved tensor hooks"


# Under torch.compile a checkpoint lowers to torch's checkpoint op (compiled.py).
# A checkpoint nested in code that torch.compile(block) compiles inside an eager
# checkpoint is the exception: the eager frame's hooks own the regions there, so
# the inner one runs eagerly too, as a graph break.
_run_eagerly = _compat.disable_dynamo(_run)


def _default_name(fn: Any) -> str:
    # A plain string in eager and traced code alike: while Dynamo traces, the
    # __qualname__ of a bound method reads as the descriptor of the function type and
    # that of a closure as None; the code object's co_qualname (Python 3.11+) is what
    # __qualname__ says in eager code.
    code = getattr(fn, "__code__", None)
    for name in (
        getattr(fn, "__qualname__", None),
        getattr(code, "co_qualname", None),
        getattr(fn, "__name__", None),
    ):
        if isinstance(name, str) and name:
            return name
    return type(fn).__name__
