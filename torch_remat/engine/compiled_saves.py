"""Which checkpoint and region each tensor a compiled graph saves was traced in.

A compiled forward hands its backward one autograd node
(``CompiledFunctionBackward``) holding every saved tensor, in the order of the
partitioned forward graph's outputs after the user outputs. The graph's nodes
carry the ``remat.region``/``remat.checkpoint`` annotations
(``node.meta["custom"]``, see compiled.py), but the graph is gone by run time.
So when AOTAutograd partitions a graph, the checkpoint and region of each saved
output are recorded here, keyed by the metadata object that the compiled
function keeps; the reports look the record up from the autograd node.

A saved tensor that carries no checkpoint of its own (a graph input, or the output
of code before the checkpoint) is recorded as the input of a checkpoint when every
node of the backward graph that reads it was traced in that checkpoint: then it is
held for that checkpoint alone. Read by anything else, it stays unattributed.

A record describes the graph, not one call: tensors are matched to it by
position, and a mismatch in count, dtype or a static size makes the lookup say
"not attributed" instead of guessing.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .. import _compat
from .compiled import CHECKPOINT_KEY, REGION_KEY


@dataclass(frozen=True)
class CompiledSave:
    """One tensor output of a partitioned forward graph saved for backward."""

    node: str  # the forward graph node's name (``tanh``, ``primals_1``)
    checkpoint: str | None  # the remat checkpoint it was traced in, or is an input of
    region: str | None  # the qualified name of its innermost region, if any
    dtype: torch.dtype | None
    shape: tuple[int | None, ...] | None  # None for a symbolic size
    is_input: bool = False  # traced outside ``checkpoint``, read only by its backward

    def matches(self, t: torch.Tensor) -> bool:
        if self.dtype is not None and t.dtype != self.dtype:
            return False
        if self.shape is None:
            return True
        return len(self.shape) == t.dim() and all(
            s is None or s == n for s, n in zip(self.shape, t.shape)
        )


@dataclass(frozen=True)
class CompiledSaves:
    """The saved tensors of one compiled graph, in the order its autograd node
    holds them: ``save_for_backward``'s, then those kept without a version check."""

    checked: tuple[CompiledSave, ...]
    unchecked: tuple[CompiledSave, ...]


# id(metadata) -> (a weak reference to it, its record)
_records: dict[int, tuple[Any, CompiledSaves]] = {}


def _static(size: Any) -> int | None:
    return size if isinstance(size, int) else None


def _checkpoint_of(node: Any) -> str | None:
    return (getattr(node, "meta", {}).get("custom") or {}).get(CHECKPOINT_KEY)


def _sole_reader(placeholder: Any) -> str | None:
    """The checkpoint every backward node reading ``placeholder`` was traced in."""
    if placeholder is None or not placeholder.users:
        return None
    readers = {_checkpoint_of(user) for user in placeholder.users}
    return readers.pop() if len(readers) == 1 else None


def _describe(node: Any, backward_inputs: dict[str, Any]) -> CompiledSave | None:
    """None for what is not a tensor (a symbolic int, an opaque object)."""
    val = getattr(node, "meta", {}).get("val")
    if not isinstance(val, torch.Tensor):
        return None
    checkpoint = _checkpoint_of(node)
    is_input = False
    if checkpoint is None:
        # The backward graph's placeholder for a saved tensor has its forward name.
        checkpoint = _sole_reader(backward_inputs.get(node.name))
        is_input = checkpoint is not None
    return CompiledSave(
        node.name,
        checkpoint,
        None if is_input else (node.meta.get("custom") or {}).get(REGION_KEY),
        val.dtype,
        tuple(_static(s) for s in val.shape),
        is_input,
    )


def _record(fw_module: Any, bw_module: Any, fw_metadata: Any, num_forward_outputs: int) -> None:
    try:
        (output,) = fw_module.graph.find_nodes(op="output")
        backward_inputs = {p.name: p for p in bw_module.graph.find_nodes(op="placeholder")}
        checked: list[CompiledSave] = []
        unchecked: list[CompiledSave] = []
        for node in output.args[0][num_forward_outputs:]:
            save = _describe(node, backward_inputs)
            if save is not None:
                unchecked_save = node.meta.get("saved_tensor_with_no_vc_check", False)
                (unchecked if unchecked_save else checked).append(save)
        key = id(fw_metadata)
        ref = weakref.ref(fw_metadata, lambda _ref, key=key: _records.pop(key, None))
    except Exception:
        # A graph this code does not understand (another torch release): its saves
        # are reported as not attributed; compiling must not fail over a report.
        return
    _records[key] = (ref, CompiledSaves(tuple(checked), tuple(unchecked)))


def observe_compiled_partitions() -> None:
    """Record the saves of every graph AOTAutograd partitions from now on."""
    _compat.observe_saved_tensor_partition(_record)


def is_compiled_node(node: Any) -> bool:
    """True for the autograd node of an AOTAutograd-compiled graph."""
    return _compat.compiled_function_metadata(node) is not None


def compiled_saves_of(node: Any) -> CompiledSaves | None:
    """The record of a compiled graph's autograd node; None for other nodes and for
    graphs partitioned before recording began (or loaded from a cache)."""
    metadata = _compat.compiled_function_metadata(node)
    if metadata is None:
        return None
    entry = _records.get(id(metadata))
    if entry is None or entry[0]() is not metadata:
        return None
    return entry[1]


def unchecked_saves(node: Any) -> list[Any]:
    """The tensors a compiled node keeps without a version check."""
    return _compat.unchecked_compiled_saves(node)
