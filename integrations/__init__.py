"""torch_remat.integrations: adapters that put torch_remat under distributed
training (FSDP2, DDP, tensor parallel) and training frameworks.

Adapters use only the public API of :mod:`torch_remat`. The accelerate and
transformers adapters import those packages only when one of their functions is
called, so importing this package needs neither.

``__all__`` holds the 15 names a user imports from here. The planner is exported
by ``torch_remat.integrations.planner`` (``plan_remat``, ``RematPlan``,
``forecast_remat``, ...). Importable here but not exported: ``plan_remat`` and its
errors (the planner's), ``ddp_with_remat`` (``apply_remat`` then ``DDP(...)``),
``remat_layer_names`` and ``save_region_names`` (``remat_module_names`` answers
what is wrapped; the others are views of it), ``CheckpointAcrossRanks`` (the rows of a
``ClusterMemoryReport``), ``default_rng_state_hooks`` and ``local_device`` (what
``RematConfig(rng_state_hooks=True)`` uses).
"""

# Importable here for code written against earlier releases, but not part of __all__:
# the module forwards are internal, the RNG hook is torch_remat.DeviceRNGStateHook.
from ._forwards import RematForward, SaveRegionForward  # noqa: F401
from .accelerate import apply_remat_for_accelerator, prepare_with_remat
from .apply import RematConfig, apply_remat, remat_module_names, remove_remat, save_region_names  # noqa: F401
from .ddp import ddp_with_remat  # noqa: F401
from .fsdp2 import fully_shard_with_remat
from .planner import InfeasibleBudgetError, PlanMismatchError, RematPlan, plan_remat  # noqa: F401
from .reports import (
    CheckpointAcrossRanks,  # noqa: F401
    ClusterMemoryReport,
    MemoryReportTimeout,
    gather_memory_report,
)
from .rng import DeviceRNGStateHook, default_rng_state_hooks, local_device, prepare_dtensor_rng  # noqa: F401
from .switch import torch_checkpointing_as_remat
from .tensor_parallel import parallelize_with_remat
from .transformers import disable_remat, enable_remat, remat_layer_names  # noqa: F401

__all__: list[str] = [
    "apply_remat",
    "remove_remat",
    "remat_module_names",
    "RematConfig",
    "torch_checkpointing_as_remat",
    "fully_shard_with_remat",
    "parallelize_with_remat",
    "prepare_dtensor_rng",
    "gather_memory_report",
    "ClusterMemoryReport",
    "MemoryReportTimeout",
    "apply_remat_for_accelerator",
    "prepare_with_remat",
    "enable_remat",
    "disable_remat",
]
