"""The layering of docs/architecture.md, checked on the source: the engine imports
neither the scope API nor diagnostics, and the integrations use only public names."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "torch_remat"


def _imported_modules(path: Path, package: str) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_the_engine_imports_neither_scope_nor_diagnostics():
    offending = []
    for path in sorted((PACKAGE / "engine").glob("*.py")):
        for module in _imported_modules(path, "torch_remat.engine"):
            if module.startswith(("torch_remat.scope", "torch_remat.diagnostics")):
                offending.append(f"{path.name} imports {module}")
    assert not offending


def test_scope_api_does_not_import_diagnostics():
    offending = []
    for path in sorted((PACKAGE / "scope").glob("*.py")):
        for module in _imported_modules(path, "torch_remat.scope"):
            if module.startswith("torch_remat.diagnostics"):
                offending.append(f"{path.name} imports {module}")
    assert not offending


def test_private_torch_api_is_used_only_through_compat():
    offending = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                value = node.value
                if isinstance(value, ast.Name) and value.id == "torch":
                    offending.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.{node.attr}")
                if isinstance(value, ast.Attribute) and value.attr == "_C":
                    offending.append(f"{path.relative_to(ROOT)}:{node.lineno} _C.{node.attr}")
    assert not offending


# What the integrations may use of the core: the public names of the top level and of
# the second tier, and the one internal module that exists for them.
_OPEN_TO_INTEGRATIONS = ("torch_remat", "torch_remat.diagnostics", "torch_remat.offload", "torch_remat._integration")


def _public_names(module: str) -> set[str]:
    return set(importlib.import_module(module).__all__)


def test_integrations_use_only_public_core_names():
    public = {m: _public_names(m) for m in _OPEN_TO_INTEGRATIONS}
    public["torch_remat"] |= {"__version__"} | {m.split(".")[1] for m in _OPEN_TO_INTEGRATIONS[1:3]}
    offending = []
    for path in sorted((ROOT / "integrations").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {"torch_remat": "torch_remat"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("torch_remat.integrations"):
                        continue
                    if alias.name in public:
                        aliases[alias.asname or alias.name] = alias.name
                    elif alias.name.startswith("torch_remat"):
                        offending.append(f"{path.name}: import {alias.name}")
            elif isinstance(node, ast.ImportFrom) and not node.level:
                module = node.module or ""
                if module.startswith("torch_remat.integrations"):
                    continue
                if module in public:
                    offending += [
                        f"{path.name}: from {module} import {a.name}"
                        for a in node.names
                        if a.name not in public[module]
                    ]
                elif module.startswith("torch_remat"):
                    offending.append(f"{path.name}: from {module} import ...")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr not in public[aliases[node.value.id]]
            ):
                offending.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    assert not offending
