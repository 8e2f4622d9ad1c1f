"""What one checkpoint call holds for backward, read without unpacking anything.

A checkpoint holds (a) the tensors its SAVE regions saved (``RegionSaved``), (b) the
SAVE-region outputs and checkpoint inputs it keeps for the recompute
(``TensorSource.saved``), and (c) the state-hook snapshots taken at entry and after
each SAVE region. Holders of dropped tensors hold nothing, and neither do SAVE-region
saves the replay rebuilds (``RebuiltSave``) once the forward has ended: they are
counted apart, as saves not held. This module lists those
items per region, in forward order, for a live frame (during or after its forward)
or for a frame that died while its SAVE regions' tensors live on (see _registry).
Reading never calls an unpack hook, so it never triggers a recompute or a copy
back from offloaded memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .._tensors import TensorMeta, storage_ptr
from ..engine.records import Holder
from .registry import FrameEntry
from .storage import tensors_in

if TYPE_CHECKING:
    from ..engine.frame import CheckpointFrame

INPUTS = "(inputs)"
STATE_SNAPSHOTS = "(state snapshots)"
NO_REGION = "(no region)"  # a compiled checkpoint's save traced outside its regions


@dataclass
class HeldItem:
    """One tensor a checkpoint holds: a saved tensor, a kept output or input."""

    name: str
    meta: TensorMeta | None
    tensors: list[torch.Tensor]  # what occupies memory: the tensor, or those packed for it
    site: str | None = None
    parameter: bool = False
    output_index: int | None = None  # a saved tensor sharing storage with this output
    kept_output: int | None = None  # this item *is* the kept output at this index


@dataclass
class HeldGroup:
    region: str  # a region's qualified name, INPUTS or STATE_SNAPSHOTS
    items: list[HeldItem] = field(default_factory=list)


@dataclass
class Holdings:
    name: str
    serial: int
    groups: list[HeldGroup]
    rebuilt: int = 0  # SAVE-region saves the replay rebuilds, not held
    rebuilt_bytes: int = 0  # their storages' bytes, each storage once


def _source_tensors(src: Any, forward_done: bool) -> list[torch.Tensor]:
    if forward_done:
        saved = src.saved
        return [] if saved is None else tensors_in(saved.data)
    if not src.keep:
        return []
    t = src.ref if src.kind == "input" else src.kept_tensor
    return [] if t is None else [t]


def _saved_item(rs: Any) -> HeldItem | None:
    tensors = [rs.tensor] if rs.tensor is not None else tensors_in(rs.packed)
    if not tensors and type(rs.packed) is Holder:
        # the save of a checkpoint nested in an outer one's replayed code, dropped
        # by the outer one (whose replay runs the nested one again): held nowhere
        return None
    return HeldItem(
        rs.name,
        rs.meta,
        tensors,
        site=rs.site,
        parameter=bool(getattr(rs, "parameter", False)),
        output_index=getattr(rs, "output_index", None),
    )


def _region_group(rec: Any, forward_done: bool, pending: list[Any] = ()) -> HeldGroup:
    group = HeldGroup(rec.qualname)
    for rs in rec.live_saved():
        item = _saved_item(rs)
        if item is not None:
            group.items.append(item)
    for s in pending:
        # Held until the forward ends, when it becomes a rebuilt save.
        name = f"(argument {s.arg.index}, rebuilt on recompute)"
        group.items.append(HeldItem(name, s.meta, [s.pending]))
    for src in rec.outputs:
        if not hasattr(src, "saved"):
            continue  # a constant leaf
        tensors = _source_tensors(src, forward_done)
        if tensors:
            name = f"(output at idx {src.index})"
            group.items.append(HeldItem(name, src.meta, tensors, kept_output=src.index))
    return group


def _state_items(name: str, states: Any) -> list[HeldItem]:
    return [HeldItem(name, TensorMeta.of(t), [t]) for t in tensors_in(list(states or ()))]


def _state_group(
    entry_states: Any, regions: list[Any], frame: CheckpointFrame | None = None
) -> HeldGroup:
    group = HeldGroup(STATE_SNAPSHOTS)
    group.items.extend(_state_items("entry", entry_states))
    for rec in regions:
        group.items.extend(_state_items(f"after {rec.qualname}", rec.exit_states))
    if frame is not None:
        group.items.extend(_buffer_copies(frame))
    return group


def _buffer_copies(frame: CheckpointFrame) -> list[HeldItem]:
    """The copies of module buffers the checkpoint keeps for its replay: each
    buffer's value at the checkpoint's start (a batch norm's running statistics,
    which its forward updates in place) and the values after each SAVE region that
    updated one. They occupy memory until the backward, like the RNG snapshots."""
    items = []
    state = frame.module_state
    for s in state.slots if state is not None else ():
        if s.copy is not None:
            items.append(HeldItem(f"buffer {s.name} (entry)", TensorMeta.of(s.copy), [s.copy]))
    for updated in frame.region_buffers.values():
        for s, value, _ in updated:
            if value is not None:
                items.append(HeldItem(f"buffer {s.name} (after a region)", TensorMeta.of(value), [value]))
    return items


def frame_holdings(frame: CheckpointFrame, serial: int = -1) -> Holdings:
    """Holdings of a live ``CheckpointFrame`` (during or after its forward)."""
    done = frame.forward_done
    inputs = HeldGroup(INPUTS)
    for s in frame.inputs:
        tensors = _source_tensors(s, done)
        if tensors:
            held = s.held_anyway
            param = held is not None and all(storage_ptr(t) == held for t in tensors)
            inputs.items.append(HeldItem(f"(input {s.index})", s.meta, tensors, parameter=param))
    for index, meta, payload, held in frame.unread_inputs or ():
        # packed by hooks when the checkpoint started; held until backward unpacks
        # it: billed unless the hooks kept the input itself, and it is a parameter or
        # a leaf that requires grad (a copy the hooks made is memory of its own)
        tensors = tensors_in(payload.data)
        if tensors:
            param = held is not None and all(storage_ptr(t) == held for t in tensors)
            inputs.items.append(HeldItem(f"(input {index})", meta, tensors, parameter=param))
    pending: dict[int, list[Any]] = {}
    rebuilt, storages = 0, {}
    for s in frame.rebuilds.live_saves():
        if s.pending is not None:
            pending.setdefault(id(s.region), []).append(s)
        else:
            rebuilt += 1
            storages[id(s.arg)] = s.arg.layout[-1]
    groups = [inputs]
    groups.extend(_region_group(rec, done, pending.get(id(rec), ())) for rec in frame.regions)
    groups.append(_state_group(frame.entry_states, frame.regions, frame))
    groups = [g for g in groups if g.items]
    return Holdings(frame.name, serial, groups, rebuilt, sum(storages.values()))


def entry_holdings(entry: FrameEntry) -> Holdings | None:
    """Holdings of a registered checkpoint, alive or not; None once it holds nothing."""
    frame = entry.frame()
    if frame is not None:
        return frame_holdings(frame, entry.serial)
    records: list[Any] = []
    seen: set[int] = set()
    for ref in entry.dead_saved or ():
        rs = ref()
        if rs is not None and id(rs.region) not in seen:
            seen.add(id(rs.region))
            records.append(rs.region)
    if not records:
        return None
    groups = [_region_group(rec, True) for rec in records]
    groups.append(_state_group((), records))
    return Holdings(entry.name, entry.serial, [g for g in groups if g.items])


def compiled_holdings(saves: list[Any]) -> list[Holdings]:
    """Holdings of compiled checkpoints, one per checkpoint name, from a graph
    walk's ``CompiledHeld`` items (in the order the walk found them): one group per
    region (and ``(inputs)``), one item per saved forward-graph output, named
    ``node (compiled)``, or ``node (compiled, offloaded to host)`` for the host copy
    the graph saves instead of ``node`` in an offloaded region."""
    by_name: dict[str, dict[str, HeldGroup]] = {}
    for save in saves:
        groups = by_name.setdefault(save.checkpoint, {})
        region = INPUTS if save.is_input else (save.region or NO_REGION)
        group = groups.setdefault(region, HeldGroup(region))
        tensors = tensors_in(save.data)  # what an outer pack hook returned, if any
        meta = TensorMeta.of(tensors[0]) if len(tensors) == 1 else None
        how = "compiled, offloaded to host" if save.offloaded else "compiled"
        group.items.append(HeldItem(f"{save.node} ({how})", meta, tensors))
    return [Holdings(name, -1, list(groups.values())) for name, groups in by_name.items()]
