"""The engine is cut by ownership (docs/architecture.md), checked on the source:
only the module that defines ``CheckpointFrame`` assigns its attributes, no function
takes an untyped frame, and every engine module is named in the architecture page."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "torch_remat" / "engine"
FRAME_MODULE = "frame.py"
MAX_ENGINE_MODULES = 16


def _is_frame_expr(node: ast.AST) -> bool:
    """``frame``, ``outer`` (a frame of an enclosing checkpoint) or ``<x>.frame``."""
    if isinstance(node, ast.Name):
        return node.id in ("frame", "outer")
    return isinstance(node, ast.Attribute) and node.attr == "frame"


def frame_attribute_assignments(source: str, filename: str) -> list[str]:
    """Every ``frame.x = ...`` (also augmented, annotated, deleted, or through
    ``setattr``/``delattr``) in ``source``, as ``file:line``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and _is_frame_expr(node.args[0])
        ):
            found.append(f"{filename}:{node.lineno}")
            continue
        flat: list[ast.AST] = []
        for t in targets:
            flat.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        for t in flat:
            if isinstance(t, ast.Attribute) and _is_frame_expr(t.value):
                found.append(f"{filename}:{node.lineno}")
    return found


def untyped_frame_parameters(source: str, filename: str) -> list[str]:
    """Function parameters named ``frame`` without an annotation or annotated ``Any``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            for a in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                if a.arg != "frame":
                    continue
                ann = a.annotation
                if ann is None or (isinstance(ann, ast.Name) and ann.id == "Any"):
                    found.append(f"{filename}:{a.lineno} ({getattr(node, 'name', 'lambda')})")
    return found


def _engine_sources() -> list[tuple[str, str]]:
    return [(p.name, p.read_text()) for p in sorted(ENGINE.glob("*.py"))]


def test_only_the_frame_module_assigns_frame_attributes():
    offending = []
    for name, source in _engine_sources():
        if name != FRAME_MODULE:
            offending += frame_attribute_assignments(source, name)
    assert not offending, f"frame attributes assigned outside {FRAME_MODULE}: {offending}"


def test_no_engine_function_takes_an_untyped_frame():
    offending = []
    for name, source in _engine_sources():
        offending += untyped_frame_parameters(source, name)
    assert not offending, f"untyped frame parameters: {offending}"


def test_the_checks_catch_a_planted_violation():
    planted = (
        "def settle(frame: Any, out):\n"
        "    frame.rebuilds = {}\n"
        "    scope.frame.forward_done, x = True, 1\n"
        "    setattr(frame, 'name', 'x')\n"
    )
    assert frame_attribute_assignments(planted, "planted.py") == [
        "planted.py:2",
        "planted.py:3",
        "planted.py:4",
    ]
    assert untyped_frame_parameters(planted, "planted.py") == ["planted.py:1 (settle)"]
    assert untyped_frame_parameters("def f(frame): pass", "p.py") == ["p.py:1 (f)"]
    assert untyped_frame_parameters("def f(frame: CheckpointFrame): pass", "p.py") == []


def test_engine_modules_are_few_and_each_is_named_in_the_architecture_page():
    modules = [p.name for p in sorted(ENGINE.glob("*.py")) if p.name != "__init__.py"]
    assert len(modules) <= MAX_ENGINE_MODULES, modules
    page = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\b([a-z_]+\.py)\b", page))
    missing = [m for m in modules if m not in named]
    assert not missing, f"engine modules not named in docs/architecture.md: {missing}"
    stale = sorted(
        m for m in named
        if m not in modules and m not in ("__init__.py",) and _looks_like_engine_module(page, m)
    )
    assert not stale, f"docs/architecture.md names engine modules that do not exist: {stale}"


def _looks_like_engine_module(page: str, module: str) -> bool:
    """Is ``module`` listed under ``engine/`` in the layout block of the page?"""
    layout = page.split("```")[1] if "```" in page else ""
    engine_part = layout.split("engine/", 1)[1] if "engine/" in layout else ""
    engine_part = re.split(r"\n  \S", engine_part, maxsplit=1)[0]
    return re.search(rf"^\s+{re.escape(module)}\b", engine_part, re.M) is not None
