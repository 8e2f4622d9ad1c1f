"""The public surface: the top level is upstream torch-remat 0.2.2's names, the
errors, and the additions docs/api/core.md justifies; no name is exported by two
namespaces; torch_remat.integrations exports at most 15."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import torch_remat

ROOT = Path(__file__).resolve().parents[2]

# upstream torch-remat 0.2.2's torch_remat/__init__.py, name for name
UPSTREAM = {
    "checkpoint", "region", "recompute_needs_tensor", "is_recomputing", "is_placeholder",
    "name_scope", "RecomputeStateHook", "saved_tensors_hooks", "current_saved_tensor_info",
    "SavedTensorInfo", "SavedTensorKind", "save_for_backward", "collect_trace", "trace_scope",
    "format_current_memory_report", "print_current_memory_report",
    "format_saved_tensors_report", "print_saved_tensors_report", "oom_observer",
    "format_oom_saved_tensors_report", "discover_autograd_roots", "memory_snapshot_annotate",
    "clear_memory_snapshot_cache",
}
NAMESPACES = [
    "torch_remat", "torch_remat.diagnostics", "torch_remat.offload",
    "torch_remat.integrations", "torch_remat.integrations.planner",
]


def _justified() -> set[str]:
    """The names in the first column of docs/api/core.md's table of additions."""
    text = (ROOT / "docs" / "api" / "core.md").read_text()
    table = text.split("| addition | why it is public |", 1)[1].split("\n\n", 1)[0]
    names = set()
    for row in table.splitlines()[2:]:
        names |= set(re.findall(r"`([A-Za-z_]+)`", row.split("|")[1]))
    return names


def test_the_top_level_is_upstreams_names_and_the_justified_additions():
    exported = set(torch_remat.__all__)
    assert len(UPSTREAM) == 23
    assert UPSTREAM <= exported, sorted(UPSTREAM - exported)
    assert exported - UPSTREAM == _justified(), (
        sorted(exported - UPSTREAM - _justified()), sorted(_justified() - exported))
    for name in exported:
        assert hasattr(torch_remat, name), name


def test_no_name_is_exported_by_two_namespaces():
    where: dict[str, str] = {}
    twice = []
    for module in NAMESPACES:
        for name in importlib.import_module(module).__all__:
            if name in where:
                twice.append(f"{name}: {where[name]} and {module}")
            where[name] = module
    assert not twice, twice


def test_integrations_export_at_most_15_names_each_importable():
    import torch_remat.integrations as integrations

    assert len(integrations.__all__) <= 15, integrations.__all__
    assert len(set(integrations.__all__)) == len(integrations.__all__)
    for name in integrations.__all__:
        assert hasattr(integrations, name), name


def test_no_shim_for_names_moved_in_a_release_never_published():
    # (Trace, SavedTensorsReport and ActiveCheckpoint are the diagnostics' own)
    for name in ("Trace", "SavedTensorsReport", "ActiveCheckpoint"):
        assert not hasattr(torch_remat, name), name
