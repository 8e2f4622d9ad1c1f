"""torch_remat: activation rematerialization for PyTorch.

``remat.checkpoint`` is non-reentrant activation checkpointing in which regions of
source code can be marked to keep their activations
(``remat.region(fn, name, recompute=False)``) instead of being recomputed.
"""

from ._checkpoint import checkpoint
from ._errors import (
    PlaceholderReadError,
    RecomputeMismatchError,
    RematError,
    SavedTensorModifiedError,
)
from ._region import recompute_needs_tensor, region
from ._state import is_recomputing
from ._state_hooks import RecomputeStateHook

__version__ = "0.2.0"

__all__ = [
    "checkpoint",
    "region",
    "recompute_needs_tensor",
    "RecomputeStateHook",
    "is_recomputing",
    "RematError",
    "PlaceholderReadError",
    "RecomputeMismatchError",
    "SavedTensorModifiedError",
]
