"""Walk autograd graphs and collect what their nodes saved, without unpacking.

``node._saved_x`` would call the unpack hook, and for a tensor a checkpoint dropped
that means running the recompute. ``node._raw_saved_x`` instead returns the
``SavedTensor`` and its ``.data`` is what was packed: the tensor itself when no
hooks were active, a torch_remat ``Holder``/``RegionSaved`` inside a checkpoint, or
whatever the user's own ``saved_tensors_hooks`` returned. Nothing is recomputed,
copied or moved.

Saves packed by torch_remat are accounted by the checkpoint reports (see
_holdings); everything else is a save "outside regions" and is listed here per
autograd node. Parameters (from the graph's AccumulateGrad nodes, and saved
parameters or views of them) are collected so reports can leave their storages out.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _compat
from ..engine.compiled import compiled_saves_of, is_compiled_node, unchecked_saves
from ..engine.rebuild import RebuiltSave
from ..engine.records import Holder, RegionSaved
from .storage import is_parameter, storages_of, tensors_in

_saved_attrs_of: dict[type, tuple[str, ...]] = {}


def _saved_attrs(node: Any) -> tuple[str, ...]:
    tp = type(node)
    attrs = _saved_attrs_of.get(tp)
    if attrs is None:
        attrs = tuple(a for a in dir(tp) if a.startswith("_raw_saved_"))
        _saved_attrs_of[tp] = attrs
    return attrs


@dataclass
class NodeSaves:
    node_type: str
    tensors: list[torch.Tensor]


@dataclass
class CompiledHeld:
    """A tensor a compiled graph saved inside a remat checkpoint."""

    checkpoint: str
    region: str | None  # None: traced in the checkpoint, outside its regions
    is_input: bool  # traced before the checkpoint, read only by its backward
    node: str  # the forward graph node it is the output of
    data: Any  # what autograd holds: the tensor, or what an outer pack hook returned
    offloaded: bool = False  # the graph copied it to the host (an offloaded region's)


@dataclass
class GraphSaves:
    outside: list[NodeSaves] = field(default_factory=list)
    compiled: list[CompiledHeld] = field(default_factory=list)
    parameter_storages: set[int] = field(default_factory=set)
    nodes: int = 0
    # what torch_remat packed in these graphs, to tell which checkpoints they reach
    frames: dict[int, Any] = field(default_factory=dict)
    region_records: dict[int, Any] = field(default_factory=dict)
    # saves packed by torch.utils.checkpoint: what holds them (its inputs) is not
    # reachable from the graph, so the report says how many it did not count
    torch_checkpoint_saves: int = 0

    def reaches(self, entry: Any) -> bool:
        """Whether the walked graphs hold something the checkpoint call packed."""
        frame = entry.frame()
        if frame is not None:
            if id(frame) in self.frames:
                return True
            return any(id(rec) in self.region_records for rec in frame.regions)
        for ref in entry.dead_saved or ():
            rs = ref()
            if rs is not None and id(rs.region) in self.region_records:
                return True
        return False


def root_nodes(roots: Any) -> list[Any]:
    """Autograd nodes to start from: tensors' ``grad_fn``\\ s, or nodes themselves."""
    if roots is None:
        return []
    if isinstance(roots, torch.Tensor) or not isinstance(roots, Iterable):
        roots = [roots]
    nodes = []
    for r in roots:
        if isinstance(r, torch.Tensor):
            if r.grad_fn is not None:
                nodes.append(r.grad_fn)
        elif r is not None and hasattr(r, "next_functions"):
            nodes.append(r)
    return nodes


def live_graph_tensors() -> list[torch.Tensor]:
    """Every live tensor with a ``grad_fn`` that the garbage collector tracks,
    FakeTensors excepted (their graphs hold fake tensors of a tracing mode that
    may be gone, whose storages must not be touched)."""
    FakeTensor = _compat.fake_tensor_type()

    out = []
    tensor = torch.Tensor
    for obj in gc.get_objects():
        # type(), not isinstance(): proxies that fake __class__ (deprecated
        # attributes) would warn or run code.
        tp = type(obj)
        if issubclass(tp, tensor) and not issubclass(tp, FakeTensor):
            try:
                fn = obj.grad_fn
            except Exception:
                continue
            if fn is not None:
                out.append(obj)
    return out


def live_graph_roots() -> list[Any]:
    """``grad_fn`` of every live tensor (:func:`live_graph_tensors`): the roots of
    all autograd graphs the program can still reach, found without a loss handle."""
    return [t.grad_fn for t in live_graph_tensors()]


def discover_autograd_roots() -> list[torch.Tensor]:
    """Every live tensor with a ``grad_fn`` (found through the garbage collector,
    without a loss handle): the outputs, losses and intermediates whose graphs
    backward can still run. Leaves (parameters, inputs) have no ``grad_fn`` and are
    not roots; FakeTensors (tracing leftovers) are skipped. Over-complete on
    purpose: the reports walk each graph once however many of its tensors are
    given. Pass the result as ``roots`` to :func:`saved_tensors_report`."""
    return live_graph_tensors()


def _saved_values(node: Any) -> list[Any]:
    out = []
    for attr in _saved_attrs(node):
        try:
            value = getattr(node, attr)
        except Exception:  # freed by a backward, or not saved
            continue
        for st in value if isinstance(value, (list, tuple)) else (value,):
            if st is None:
                continue
            try:
                data = st.data
            except Exception:
                continue
            if data is not None:
                out.append(data)
    return out


def _non_parameters(data: Any, result: GraphSaves) -> list[torch.Tensor]:
    """The tensors in ``data``; parameters go to ``result.parameter_storages``."""
    out = []
    for t in tensors_in(data):
        if is_parameter(t):
            result.parameter_storages.update(s.key for s in storages_of(t))
        else:
            out.append(t)
    return out


NOT_ATTRIBUTED = "not attributed: its compiled graph's record does not match these saves"


def _compiled_saves(node: Any, result: GraphSaves) -> None:
    """A compiled graph's saves: those traced inside a checkpoint to
    ``result.compiled``, the rest outside regions under the node's type.

    A graph without a record was partitioned before any remat checkpoint was
    traced (recording starts then) or loaded from AOTAutograd's cache, which a
    graph with a remat checkpoint bypasses: either way none of its saves is a
    checkpoint's."""
    values = _saved_values(node) + unchecked_saves(node)
    record = compiled_saves_of(node)
    node_type = type(node).__name__
    entries: tuple[Any, ...] = (None,) * len(values)
    if record is not None:
        recorded = record.checked + record.unchecked
        if len(recorded) == len(values) and all(
            e.matches(v) for e, v in zip(recorded, values) if isinstance(v, torch.Tensor)
        ):
            entries = recorded
        else:
            node_type = f"{node_type} ({NOT_ATTRIBUTED})"
    outside: list[torch.Tensor] = []
    for entry, data in zip(entries, values):
        tensors = _non_parameters(data, result)
        if not tensors:
            continue
        if entry is not None and entry.checkpoint is not None:
            result.compiled.append(
                CompiledHeld(
                    entry.checkpoint, entry.region, entry.is_input, entry.node, data, entry.offloaded
                )
            )
        else:
            outside.extend(tensors)
    if outside:
        result.outside.append(NodeSaves(node_type, outside))


_TORCH_CHECKPOINT_HOLDER = _compat.torch_checkpoint_holder_type


def walk_graph_saves(roots: Iterable[Any]) -> GraphSaves:
    """Every node reachable from ``roots``, once; see the module docstring."""
    if not hasattr(_compat.SavedTensor, "data"):
        raise RuntimeError(
            f"torch_remat: the saved-tensors report reads SavedTensor.data, which this "
            f"PyTorch ({torch.__version__}) lacks; without it the report would have to "
            "unpack saved tensors and so recompute checkpoints. Upgrade PyTorch."
        )
    result = GraphSaves()
    seen: dict[int, Any] = {}  # holds the node objects, so ids stay unique
    stack = []
    for node in roots:
        if id(node) not in seen:
            seen[id(node)] = node
            stack.append(node)
    while stack:
        node = stack.pop()
        result.nodes += 1
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):  # AccumulateGrad: a leaf
            if is_parameter(variable):
                result.parameter_storages.update(s.key for s in storages_of(variable))
            continue
        if is_compiled_node(node):
            _compiled_saves(node, result)
            values: list[Any] = []
        else:
            values = _saved_values(node)
        tensors = []
        for data in values:
            if isinstance(data, Holder):  # a checkpoint's; its report counts it
                result.frames[id(data.frame)] = data.frame
                continue
            if isinstance(data, RegionSaved):
                result.region_records[id(data.region)] = data.region
                continue
            if isinstance(data, RebuiltSave):  # refilled by the replay, or kept
                result.frames[id(data.frame)] = data.frame
                continue
            if type(data) is _TORCH_CHECKPOINT_HOLDER:
                result.torch_checkpoint_saves += 1
                continue
            tensors.extend(_non_parameters(data, result))
        if tensors:
            result.outside.append(NodeSaves(type(node).__name__, tensors))
        try:
            nexts = node.next_functions
        except Exception:
            continue
        for nxt, _ in nexts:
            if nxt is not None and id(nxt) not in seen:
                seen[id(nxt)] = nxt
                stack.append(nxt)
    return result
