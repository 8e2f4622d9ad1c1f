"""torch_remat.integrations: adapters that put torch_remat under distributed
training (FSDP2, DDP, tensor parallel) and training frameworks.

Adapters use only the public API of :mod:`torch_remat`. The accelerate and
transformers adapters import those packages only when one of their functions is
called, so importing this package needs neither.
"""

# Importable here for code written against earlier releases, but not part of __all__:
# the module forwards are internal, the RNG hook is torch_remat.DeviceRNGStateHook.
from ._forwards import RematForward, SaveRegionForward  # noqa: F401
from .accelerate import apply_remat_for_accelerator, prepare_with_remat
from .apply import RematConfig, apply_remat, remat_module_names, remove_remat, save_region_names
from .ddp import ddp_with_remat
from .fsdp2 import fully_shard_with_remat
from .planner import InfeasibleBudgetError, PlanMismatchError, RematPlan, plan_remat
from .reports import (
    ClusterMemoryReport,
    MemoryReportTimeout,
    RegionAcrossRanks,
    gather_memory_report,
)
from .rng import DeviceRNGStateHook, default_rng_state_hooks, local_device, prepare_dtensor_rng  # noqa: F401
from .switch import torch_checkpointing_as_remat
from .tensor_parallel import parallelize_with_remat
from .transformers import disable_remat, enable_remat, remat_layer_names

__all__: list[str] = [
    "apply_remat",
    "torch_checkpointing_as_remat",
    "remove_remat",
    "remat_module_names",
    "save_region_names",
    "RematConfig",
    "fully_shard_with_remat",
    "ddp_with_remat",
    "parallelize_with_remat",
    "default_rng_state_hooks",
    "local_device",
    "prepare_dtensor_rng",
    "gather_memory_report",
    "ClusterMemoryReport",
    "RegionAcrossRanks",
    "MemoryReportTimeout",
    "apply_remat_for_accelerator",
    "prepare_with_remat",
    "enable_remat",
    "disable_remat",
    "remat_layer_names",
    "plan_remat",
    "RematPlan",
    "InfeasibleBudgetError",
    "PlanMismatchError",
]
