"""The public calls of the engine: ``remat.checkpoint`` (the decorator users put
around a block, built once and called many times), ``remat.region`` and
``remat.recompute_needs_tensor`` (the annotations used inside a checkpointed
function), with their option checks."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from .. import _compat
from .._errors import RematError
from . import compiled
from .context import current_pass, current_prefixes, prefixed_name, without_prefixes
from .frame import CheckpointFrame
from .module_state import BufferMemo, CaptureMemo
from .observers import thread_observers
from .records import RegionRecord
from .rng import unhooked_generators, validate_state_hooks
from .saved_hooks import as_hook_pair

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
    memory_budget: float | None = None,
) -> CheckpointOptions:
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
            (costs a checksum per dropped tensor in forward; a fused kernel's byte
            workspace, a 1-D ``uint8`` tensor such as oneDNN's LSTM workspace, is
            compared by metadata only: its padding is never written); ``"none"``
            checks nothing.
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
        input_saved_tensors_hooks: the same, for the checkpoint inputs only
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
        memory_budget: under ``torch.compile`` only: a ratio in ``(0, 1]`` for the
            partitioner, which then chooses what the code outside SAVE regions keeps
            (``torch.autograd.graph.region_activation_memory_budget``: smaller
            recomputes more, 1 is its runtime-optimized choice); SAVE regions and
            random ops are kept (SAVE regions offloaded) as without it. 0 is refused:
            torch's partitioner then ignores the tags that keep them. torch applies one budget per compiled
            graph and wants it on every forward op of the graph: compile the
            checkpointed block itself (``block.compile()`` after ``apply_remat``).
            An eager call with gradients enabled raises :class:`RematError` (the
            eager engine recomputes all code outside SAVE regions; there is no
            partitioner to give a budget). None (default): no budget.

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
    if memory_budget is not None:
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)):
            raise TypeError(
                f"remat.checkpoint: memory_budget must be a float in (0, 1] or None, got "
                f"{memory_budget!r} ({type(memory_budget).__name__})."
            )
        if not 0.0 < memory_budget <= 1.0:
            raise ValueError(
                f"remat.checkpoint: memory_budget must be in (0, 1] (a ratio of the "
                f"partitioner's default activation memory), got {memory_budget!r}. "
                "Exactly 0 is refused: torch's partitioner then keeps only the graph "
                "inputs, ignoring the tags that keep SAVE regions and random ops (a "
                "recomputed dropout would draw a new mask); pass a small positive "
                "budget instead."
            )
        memory_budget = float(memory_budget)
    hooks = validate_state_hooks(recompute_state_hooks)
    kept = (
        as_hook_pair(saved_tensors_hooks, "remat.checkpoint: saved_tensors_hooks"),
        as_hook_pair(input_saved_tensors_hooks, "remat.checkpoint: input_saved_tensors_hooks"),
    )
    return CheckpointOptions(
        region_name, hooks, early_stop, determinism_check, kept, rebuild, memory_budget
    )


class CheckpointOptions:
    """What ``remat.checkpoint(...)`` returns: the validated options, and the
    decorator that makes a :class:`CheckpointedFunction` of a function.

    Build it once and decorate many functions, or decorate once and call many
    times: the options are checked here, never on a call."""

    __slots__ = (
        "region_name",
        "state_hooks",
        "early_stop",
        "check_metadata",
        "bitwise_check",
        "kept_hooks",
        "rebuild",
        "guarded_generators",
        "memory_budget",
    )

    def __init__(
        self,
        region_name: str | None,
        state_hooks: tuple[Any, ...],
        early_stop: bool,
        determinism_check: str,
        kept_hooks: tuple[Any, Any],
        rebuild: str,
        memory_budget: float | None = None,
    ) -> None:
        self.region_name = region_name
        self.state_hooks = state_hooks
        self.early_stop = early_stop
        self.check_metadata = determinism_check != "none"
        self.bitwise_check = determinism_check == "bitwise"
        # (saved_tensors_hooks, input_saved_tensors_hooks) options (saved_hooks.py)
        self.kept_hooks = kept_hooks
        self.rebuild = rebuild  # "free", "always" or "never" (rebuild.py)
        # the default generators no state hook restores: the RNG guard watches these
        self.guarded_generators = unhooked_generators(state_hooks)
        self.memory_budget = memory_budget  # under torch.compile only (compiled.py)

    def __call__(self, fn: F) -> F:
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
        return CheckpointedFunction(fn, self.region_name or _default_name(fn), self)  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"remat.checkpoint(region_name={self.region_name!r})"


class CheckpointedFunction:
    """``remat.checkpoint(...)(fn)``: calls ``fn`` as a checkpoint.

    Built once; each call only runs. It holds what the calls share: the options,
    the memo of the rebuild decision's FLOP walks and which modules' buffers the
    forward was seen not to write (those are not copied on later calls). Used as a
    class attribute it binds like a function (a checkpointed method)."""

    def __init__(self, fn: Callable[..., Any], name: str, options: CheckpointOptions) -> None:
        self.__wrapped__ = fn
        self.__name__ = f"remat_checkpoint_{name}"
        self.__qualname__ = self.__name__
        if not torch.compiler.is_compiling():  # Dynamo cannot read a partial's __doc__
            self.__doc__ = getattr(fn, "__doc__", None)
        self.name = name
        self.options = options
        self.flop_memo: dict[tuple, int] = {}
        self.unwritten_buffers: BufferMemo = {}
        self.capture_memo = CaptureMemo()  # its last module-state capture, reused where valid
        # Built here, not while Dynamo traces (see compiled.option_refusal).
        self.compile_refusal = compiled.option_refusal(name, options.state_hooks, options.kept_hooks)
        # An ActivationOffloader as saved_tensors_hooks: what compiled regions offload.
        self.compile_offload = compiled.offload_spec(options.kept_hooks[0])
        # memory_budget as a string, which Dynamo never makes symbolic (see OffloadSpec)
        budget = options.memory_budget
        self.compile_budget = None if budget is None else repr(budget)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            if not compiled.eager_checkpoint_running():
                return compiled.run_checkpoint(
                    self.__wrapped__, self.name, self.compile_refusal, args, kwargs,
                    self.compile_offload, self.compile_budget,
                )
            return _run_eagerly(self, args, kwargs)
        return _run(self, args, kwargs)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)

    def __repr__(self) -> str:
        return f"<remat checkpoint {self.name!r} of {self.__wrapped__!r}>"


def _run(checkpointed: CheckpointedFunction, args: tuple, kwargs: dict) -> Any:
    fn = checkpointed.__wrapped__
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if checkpointed.options.memory_budget is not None:
        raise RematError(
            f"torch_remat: checkpoint '{checkpointed.name}' was given memory_budget="
            f"{checkpointed.options.memory_budget}, which only applies under "
            "torch.compile: it is a budget for AOTAutograd's partitioner, and the "
            "eager engine has none (it keeps the SAVE regions and recomputes the "
            "rest). Compile around the checkpoint (block.compile(), torch.compile(model)), "
            "or drop memory_budget to run it eagerly."
        )
    frame = CheckpointFrame(fn, checkpointed)
    try:
        return frame.run_forward(args, kwargs)
    except RuntimeError as e:
        if _FUNCTORCH_REFUSES_HOOKS not in str(e) or isinstance(e, RematError):
            raise
        raise RematError(
            f"torch_remat: torch.func transforms (grad, vjp, jacrev, hessian) were called "
            f"inside checkpoint '{checkpointed.name}', where remat's saved-tensor hooks are "
            "active, and torch.func refuses to run under saved-tensor hooks. Call the "
            "transform outside remat.checkpoint (checkpoint the function it differentiates "
            "only with ordinary autograd), or run that part without remat.checkpoint."
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


# ------------------------------------------------------------------ regions

F = TypeVar("F", bound=Callable[..., Any])


_MISSING: Any = object()


def region(fn: F = _MISSING, name: str = _MISSING, *, recompute: bool, function: F = _MISSING) -> F:
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

    ``function=`` (upstream torch-remat's keyword) is another spelling of ``fn``.
    """
    if function is not _MISSING:
        if fn is not _MISSING:
            raise TypeError(
                "remat.region: got both fn and function (the same argument under two "
                "names); pass the callable once."
            )
        fn = function
    if fn is _MISSING:
        raise TypeError(
            "remat.region: missing the callable to run. Write remat.region(fn, 'name', "
            "recompute=False)(*args)."
        )
    if name is _MISSING:
        raise TypeError(
            "remat.region: missing the region name. Write remat.region(fn, 'name', "
            "recompute=False)(*args)."
        )
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
        full, body = name, fn
        prefixes = current_prefixes()
        if prefixes:  # inside remat.name_scope
            full, body = prefixed_name(name, prefixes), without_prefixes(fn)
        if torch.compiler.is_compiling():
            return compiled.run_region(body, full, recompute, args, kwargs)
        active = current_pass()
        if active is not None:
            return active.run_region(body, full, recompute, args, kwargs)
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
    # a SAVE region's body is skipped by the replay: the state of what it wraps is
    # not read there (see module_state._held_state)
    call_region.__remat_save_region__ = not recompute  # type: ignore[attr-defined]
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
    policy is applied. (A checkpoint nested in another runs its forward again in the
    outer one's recompute: there the call keeps what it kept in the forward, so call
    it the same way whether or not ``is_recomputing()``.)

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
    active = current_pass()
    if active is not None:
        for t in tensors:
            active.keep(t)
    return tensors[0] if len(tensors) == 1 else tensors

