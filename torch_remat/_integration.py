"""The one internal module ``torch_remat.integrations`` may import besides the
public API: helpers the adapters share with the core's reports, and the private
torch names they need, which ``_compat`` holds (each with its reason there). None of
it is part of the public surface."""

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
    disable_current_modes,
    dtensor_rng_supported_mesh,
    dtensor_rng_tracker,
    register_fake_process_group,
    run_fsdp_policy,
    tree_flatten,
    tree_map,
    tree_unflatten,
)
from .diagnostics.format import format_bytes

# torch.distributed names that _compat imports on first use
_LAZY = ("CheckpointImpl", "CheckpointWrapper", "OffloadWrapper", "checkpoint_wrapper", "offload_wrapper", "FSDPPolicy")

__all__ = [
    "format_bytes",
    "TorchDispatchMode",
    "FakeTensor",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "FakeTensorMode",
    "disable_current_modes",
    "tree_map",
    "tree_flatten",
    "tree_unflatten",
    "run_fsdp_policy",
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
