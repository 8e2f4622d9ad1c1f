"""The engine is cut by ownership (docs/architecture.md), checked on the source:
only the module that defines ``CheckpointFrame`` assigns its attributes, no function
takes an untyped frame, and every engine module is named in the architecture page;
and at run time: every attribute write to an engine object comes from its owner."""

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


# ------------------------------------------------------------------ at run time
#
# The source checks above see ``frame.x = ...`` only. At run time every attribute
# write to an object of an engine class is seen, whatever the name it is reached by:
# a write is the owner's when the code making it is in a module that defines the
# object's class or one of its bases (a record's own methods; an observer subclass
# writes its own fields).

import contextlib  # noqa: E402
import importlib  # noqa: E402
import inspect  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from helpers import UnseenLog, recorded_replays  # noqa: E402
from torch import nn  # noqa: E402

import torch_remat as remat  # noqa: E402

ENGINE_MODULES = [f"torch_remat.engine.{p.stem}" for p in sorted(ENGINE.glob("*.py"))
                  if p.stem != "__init__"]


def _engine_classes() -> list[type]:
    out = []
    for name in ENGINE_MODULES:
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if (inspect.isclass(cls) and cls.__module__ == name
                    and not issubclass(cls, BaseException)
                    and cls.__setattr__ is object.__setattr__
                    and not getattr(cls, "_is_protocol", False)):
                out.append(cls)
    return out


@contextlib.contextmanager
def ownership_watch():
    """Every write to an attribute of an engine object by code outside the modules
    of its class's MRO, as ``(class, attribute, writer file)``."""
    foreign: list[tuple[str, str, str]] = []
    patched = []

    def owners_of(obj) -> set[str]:
        files = set()
        for c in type(obj).__mro__:
            module = sys.modules.get(c.__module__)
            if module is not None and getattr(module, "__file__", None):
                files.add(module.__file__)
        return files

    def guarded(self, name, value):
        writer = sys._getframe(1).f_code.co_filename
        if writer not in owners_of(self):
            foreign.append((type(self).__qualname__, name, writer))
        object.__setattr__(self, name, value)

    for cls in _engine_classes():
        try:
            cls.__setattr__ = guarded
        except TypeError:  # a class torch or the interpreter fixed
            continue
        patched.append(cls)
    try:
        yield foreign
    finally:
        for cls in patched:
            del cls.__setattr__


class _Block(nn.Module):
    """A block that goes through most of the engine: SAVE and RECOMPUTE regions, a
    nested region, recompute_needs_tensor, dropout, batch-norm buffers, a Python
    attribute and Python's random, an in-place SAVE region, a named save."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = remat.region(self.a, "a", recompute=False)(x)
        h = remat.region(lambda t: torch.relu_(t * 1.0), "inplace", recompute=False)(h)
        remat.recompute_needs_tensor(h)
        g = remat.region(lambda t: self.drop(torch.tanh(self.b(t))), "b", recompute=True)(h)
        g = self.norm(g) * (1 + 0.01 * random.random())
        k = remat.region(lambda t: remat.region(torch.sin, "inner", recompute=False)(t) * 2,
                         "outer", recompute=False)(g)
        remat.recompute_needs_tensor(k)
        return _Named.apply(k + h)


class _Named(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        remat.save_for_backward(ctx, kept=t)
        return t * 3

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        return grad * 3 + 0 * t


def _run_engine_workload() -> None:
    torch.manual_seed(0)
    block = _Block().train()
    x = torch.randn(6, 8, requires_grad=True)
    rng = (remat.CPURNGStateHook(),)
    for rebuild in ("free", "always", "never"):
        fn = remat.checkpoint(region_name=f"blk_{rebuild}", rebuild=rebuild, recompute_state_hooks=rng)(block)
        with remat.collect_trace(checkpoints=True), remat.record_save_sites():
            loss = fn(x).sum()
        remat.format_saved_tensors_report(loss)
        loss.backward()
    # a backward that reaches part of the graph, then the rest (refills forgotten)
    loss = remat.checkpoint(recompute_state_hooks=rng)(block)(x).sum()
    torch.autograd.grad(loss, [x], retain_graph=True)
    loss.backward()
    # a forward that raises inside a SAVE region
    def broken(t):
        remat.region(lambda u: u.reshape(-1, 7), "bad", recompute=False)(t)
    with contextlib.suppress(RuntimeError):
        remat.checkpoint()(broken)(x)


def test_engine_records_are_written_only_by_their_owners_at_run_time():
    with recorded_replays() as replayed, ownership_watch() as foreign:
        _run_engine_workload()
    # the workload ran the engine through to its replays: each checkpoint replayed
    assert replayed == ["blk_free", "blk_always", "blk_never", "_Block", "_Block"]
    assert not foreign, "engine attributes written outside their owners:\n" + "\n".join(
        f"{cls}.{name} <- {writer}" for cls, name, writer in sorted(set(foreign)))


def test_the_run_time_watch_sees_a_write_through_any_alias():
    from torch_remat.engine.records import RegionRecord, TensorSource

    with ownership_watch() as foreign:
        record = RegionRecord("blk", "r", "r", recompute=False)  # the owner's __init__
        source = TensorSource("output", 0, torch.ones(2))
        assert foreign == []
        alias = [record, source]
        alias[0].raised = None  # planted: this test module is not the owner
        holder = alias[1]
        holder.keep = True
        source.mark_needed()  # the owner's method: fine
    assert [(c, n) for c, n, _ in foreign] == [("RegionRecord", "raised"), ("TensorSource", "keep")]
    assert all(w == __file__ for _, _, w in foreign)
    record.raised = None  # no watch now: nothing recorded
    assert len(foreign) == 2


def test_the_forward_scratch_is_apart_from_the_record_and_gone_when_the_forward_ends():
    # What only the running forward needs lives in frame.scratch; the replay and the
    # reports read the frame alone, so backward runs with no scratch at all.
    from torch_remat.engine.context import current_pass
    from torch_remat.engine.frame import CheckpointFrame, ForwardScratch

    seen = UnseenLog()

    def block(x):
        seen.append(current_pass().frame)
        h = remat.region(torch.tanh, "t", recompute=False)(x * 2)
        return (h.sin() * x).sum()

    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    loss = remat.checkpoint(region_name="blk")(block)(x)
    (frame,) = {id(f): f for f in seen}.values()
    assert isinstance(frame, CheckpointFrame) and frame.scratch is None and frame.forward_done
    record = set(vars(frame))
    assert not record & set(ForwardScratch.__slots__), record & set(ForwardScratch.__slots__)
    loss.backward()  # the replay runs on the record alone
    assert len(seen) == 2  # the forward and the replay
    (ref,) = torch.autograd.grad((torch.tanh(x * 2).sin() * x).sum(), [x])
    assert torch.equal(x.grad, ref)
