"""The one internal module ``torch_remat.integrations`` may import besides the
public API: helpers the adapters share with the core's reports, and the private
torch names they need, which ``_compat`` holds (each with its reason there). None of
it is part of the public surface."""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from . import _compat
from ._compat import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    TorchDispatchMode,
    checkpoint_wrapper_module,
    create_dtensor_rng_tracker,
    current_autograd_node,
    current_graph_task_id,
    disable_current_modes,
    dtensor_rng_supported_mesh,
    dtensor_rng_tracker,
    first_input_metadata,
    local_scalar_dense,
    profiler_enabled,
    register_fake_process_group,
    run_fsdp_policy,
    sequence_nr,
    storage_key,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
    version_of,
)
from .diagnostics.format import format_bytes
from .engine.frame import CheckpointFrame
from .engine.observers import CheckpointObserver, observe
from .engine.rng import DefaultGenerator, RNGUse, cpu_fingerprint_allocates, fingerprints


def generator_positions() -> list[Any]:
    """Where every default generator stands now (as the RNG guard fingerprints them)."""
    return fingerprints()


def drew_random_numbers(start: list[Any]) -> bool:
    """True if a default generator moved since ``generator_positions()`` gave ``start``."""
    return RNGUse.of_forward(start) is not None


@contextlib.contextmanager
def replays_observed(started: Callable[[str], None], ended: Callable[[str], None]) -> Iterator[None]:
    """While active, checkpoints started in this thread report each replay's start
    and end, with their names: ``started(name)``, ``ended(name)``."""

    class _Replays(CheckpointObserver):
        def replay_started(self, frame: CheckpointFrame | None) -> None:
            if frame is not None:
                started(frame.name)

        def replay_ended(self, frame: CheckpointFrame | None) -> None:
            if frame is not None:
                ended(frame.name)

    with observe(_Replays()):
        yield


@contextlib.contextmanager
def cpu_rng_state_reads(
    kept: Callable[[Any], None], read: Callable[[], None]
) -> Iterator[None]:
    """While active, the engine's reads of the CPU generator's state are reported:
    ``kept(state)`` for each copy it takes (a checkpoint's snapshot, a real tensor
    allocated outside the dispatcher), ``read()`` before each fingerprint that
    copies the state (read and freed at once; where the state's layout is known it
    is read in place, with no copy)."""
    get_state, fingerprint = DefaultGenerator.get_state, DefaultGenerator.fingerprint
    copies = cpu_fingerprint_allocates()

    def reported_get_state(self: DefaultGenerator) -> Any:
        state = get_state(self)
        if self.device.type == "cpu":
            kept(state)
        return state

    def reported_fingerprint(self: DefaultGenerator) -> Any:
        if copies and self.device.type == "cpu":
            read()
        return fingerprint(self)

    DefaultGenerator.get_state = reported_get_state  # type: ignore[method-assign]
    DefaultGenerator.fingerprint = reported_fingerprint  # type: ignore[method-assign]
    try:
        yield
    finally:
        DefaultGenerator.get_state = get_state  # type: ignore[method-assign]
        DefaultGenerator.fingerprint = fingerprint  # type: ignore[method-assign]


# torch.distributed names that _compat imports on first use
_LAZY = ("CheckpointImpl", "CheckpointWrapper", "OffloadWrapper", "checkpoint_wrapper", "offload_wrapper", "FSDPPolicy")

__all__ = [
    "format_bytes",
    "generator_positions",
    "drew_random_numbers",
    "cpu_rng_state_reads",
    "replays_observed",
    "profiler_enabled",
    "TorchDispatchMode",
    "FakeTensor",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "FakeTensorMode",
    "disable_current_modes",
    "tree_map",
    "tree_flatten",
    "tree_leaves",
    "tree_unflatten",
    "version_of",
    "run_fsdp_policy",
    "storage_key",
    "current_graph_task_id",
    "current_autograd_node",
    "first_input_metadata",
    "local_scalar_dense",
    "sequence_nr",
    "checkpoint_wrapper_module",
    "dtensor_rng_tracker",
    "dtensor_rng_supported_mesh",
    "create_dtensor_rng_tracker",
    "register_fake_process_group",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(_compat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
