"""``remat.collect_trace``: record the configured region hierarchy of a forward.

The trace shows which calls are SAVE and which are RECOMPUTE regions, nested as
they ran, inside named scopes opened with :func:`trace_scope`::

    torch_remat trace
    scope [test_flag]
      sin: save
      cos: recompute

Only the original forward is recorded: the replay that backward runs during a
recompute is not. Regions are recorded inside and outside checkpoints (outside a
checkpoint a region is a plain call, but the configuration is still shown).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ..engine.context import is_recomputing
from ..engine.observers import CheckpointObserver, observe

if TYPE_CHECKING:
    from ..engine.frame import CheckpointFrame
    from ..engine.records import RegionRecord


class _TraceState(threading.local):
    def __init__(self) -> None:
        self.trace: Trace | None = None  # the innermost collect_trace of this thread


_trace_state = _TraceState()

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class TraceNode:
    """One entry of a trace: a scope, a region or (optionally) a checkpoint."""

    kind: str  # "scope", "save", "recompute" or "checkpoint"
    name: str
    metadata: Any = None
    children: list[TraceNode] = field(default_factory=list)

    def label(self) -> str:
        name = self.name if self.metadata is None else f"{self.name} [{self.metadata}]"
        return name if self.kind == "scope" else f"{name}: {self.kind}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "metadata": None if self.metadata is None else str(self.metadata),
            "children": [c.to_dict() for c in self.children],
        }


@dataclass
class OpTrace:
    """A region in :attr:`Trace.entries`: its name and whether it recomputes."""

    name: str
    recompute: bool


@dataclass
class ScopeTrace:
    """A :func:`trace_scope` in :attr:`Trace.entries`, with what ran inside it."""

    name: str
    metadata: Any
    entries: list[OpTrace | ScopeTrace] = field(default_factory=list)


def _entries(nodes: list[TraceNode]) -> list[OpTrace | ScopeTrace]:
    out: list[OpTrace | ScopeTrace] = []
    for node in nodes:
        if node.kind == "scope":
            out.append(ScopeTrace(node.name, node.metadata, _entries(node.children)))
        elif node.kind == "checkpoint":
            out.extend(_entries(node.children))
        else:
            out.append(OpTrace(node.name, node.kind == "recompute"))
    return out


class Trace(CheckpointObserver):
    """What :func:`collect_trace` recorded; ``format()`` renders it as text."""

    def __init__(self, checkpoints: bool = False) -> None:
        self.roots: list[TraceNode] = []
        self.checkpoints = checkpoints
        self._open: list[TraceNode] = []

    # -------------------------------------------------------------- recording
    # A Trace is an engine observer (torch_remat.engine.observers) for the
    # checkpoints and regions that start inside its collect_trace block.

    def _recording(self) -> bool:
        return _trace_state.trace is self and not is_recomputing()

    def _open_node(self, node: TraceNode) -> None:
        (self._open[-1].children if self._open else self.roots).append(node)
        self._open.append(node)

    def _close_node(self) -> None:
        self._open.pop()

    def _call(self, node: TraceNode, fn: Callable[..., Any], args, kwargs) -> Any:
        self._open_node(node)
        try:
            return fn(*args, **kwargs)
        finally:
            self._close_node()

    def forward_entered(self, frame: CheckpointFrame | None) -> None:
        if self.checkpoints and self._recording():
            self._open_node(TraceNode("checkpoint", frame.name))

    def forward_exited(self, frame: CheckpointFrame | None) -> None:
        if self.checkpoints and self._recording():
            self._close_node()

    def region_entered(self, frame: CheckpointFrame | None, record: RegionRecord) -> None:
        if self._recording():
            self._open_node(TraceNode(record.kind, record.name))

    def region_exited(self, frame: CheckpointFrame | None, record: RegionRecord) -> None:
        if self._recording():
            self._close_node()

    def scope(self, fn: Callable[..., Any], name: str, metadata: Any, args, kwargs) -> Any:
        if not self._recording():
            return fn(*args, **kwargs)
        return self._call(TraceNode("scope", name, metadata), fn, args, kwargs)

    # -------------------------------------------------------------- reading

    def format(self) -> str:
        """The trace as text: a ``torch_remat trace`` header, then one line per
        scope (``name [metadata]``) or region (``name: save`` / ``name: recompute``),
        children indented by two spaces."""
        lines = ["torch_remat trace"]

        def emit(node: TraceNode, depth: int) -> None:
            lines.append("  " * depth + node.label())
            for child in node.children:
                emit(child, depth + 1)

        for root in self.roots:
            emit(root, 0)
        return "\n".join(lines)

    @property
    def entries(self) -> list[OpTrace | ScopeTrace]:
        """What was recorded, as upstream torch-remat lists it: an :class:`OpTrace`
        per region and a :class:`ScopeTrace` per scope, nested as they ran (a
        checkpoint shown with ``checkpoints=True`` contributes its regions). A new
        list on each read."""
        return _entries(self.roots)

    def to_dict(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.roots]

    def __str__(self) -> str:
        return self.format()


@contextlib.contextmanager
def collect_trace(*, checkpoints: bool = False) -> Iterator[Trace]:
    """Record, in this thread, the regions and scopes the forward runs through.

    ::

        with remat.collect_trace() as trace:
            output = model(inputs)
        print(trace.format())

    With ``checkpoints=True`` each ``remat.checkpoint`` call also appears, as
    ``<region_name>: checkpoint`` with its regions under it. The recompute that
    backward triggers is never recorded, so running backward inside the block is
    fine. Nested ``collect_trace`` blocks record into the innermost one.
    """
    trace = Trace(checkpoints)
    previous = _trace_state.trace
    _trace_state.trace = trace
    try:
        with observe(trace):
            yield trace
    finally:
        _trace_state.trace = previous


def trace_scope(fn: F, name: str, metadata: Any = None) -> F:
    """Wrap ``fn`` so that its calls open a named scope in :func:`collect_trace`.

    ``remat.trace_scope(block, "scope", metadata="test_flag")(x)`` calls
    ``block(x)``; while a trace is collected, the regions it runs are shown under
    ``scope [test_flag]``. Without a trace (and during a recompute) it is a plain call.
    """
    if not callable(fn):
        raise TypeError(
            f"remat.trace_scope: the first argument must be the callable to run, got "
            f"{type(fn).__name__}. Write remat.trace_scope(fn, 'name')(*args)."
        )
    if not isinstance(name, str) or not name:
        raise ValueError(f"remat.trace_scope: name must be a non-empty string, got {name!r}.")

    def scoped(*args: Any, **kwargs: Any) -> Any:
        trace = _trace_state.trace
        if trace is None:
            return fn(*args, **kwargs)
        return trace.scope(fn, name, metadata, args, kwargs)

    scoped.__wrapped__ = fn  # type: ignore[attr-defined]
    return scoped  # type: ignore[return-value]
