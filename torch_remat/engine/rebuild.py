"""SAVE-region saves that the replay rebuilds instead of keeping.

A SAVE region's body is never replayed, but an argument produced by bare code or a
RECOMPUTE region is computed again before the replay reaches the region call. So a
save of the body that shares storage with such an argument (the argument, or a view
like the flattened input ``nn.Linear`` saves) is packed as a :class:`RebuiltSave`,
refilled at the region call as the same view of the replay's value. What the body
creates (its internal activations) is kept as before.

Only top-level SAVE regions (called from replayed code) rebuild: a save anywhere in
their extent, nested SAVE regions included, that shares storage with one of their
arguments is refilled at that region call. Arguments that are checkpoint inputs or
SAVE outputs are kept by the checkpoint already, so saves of them alias the kept
tensor and cost nothing. ``rebuild="never"`` keeps every save as a ``RegionSaved``.

Until the forward ends a candidate save holds its tensor. Then
(:meth:`Rebuilds.settle`) each candidate is rebuilt, or kept after all when

* the argument's storage was modified in place after the save (backward must see
  that error, as without the checkpoint);
* the replay could not recompute the argument: its autograd history reaches an
  output of a SAVE region that is not kept (a placeholder in the replay);
* rebuilding would make the replay run an op with FLOPs (a matmul, a convolution,
  attention) that early stop skips (``rebuild="free"``, the default). Beyond the last
  tensor the replay must recreate anyway, it may only run ops ``FlopCounterMode``
  counts as free (elementwise ops, copies, views): the user made the region SAVE to
  avoid recompute FLOPs, and a rebuild must not add them back. With
  ``early_stop=False`` the replay runs every op anyway, so this rule never keeps a
  save; ``rebuild="always"`` turns it off (more replayed FLOPs for fewer bytes).

One :class:`Rebuilds` per checkpoint call, owned by its ``CheckpointFrame``, holds
all of it; the frame is passed to its methods (never stored: the frame would then be
part of a reference cycle, and its kept tensors freed only by the garbage collector).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import _compat
from .._compat import autograd_sequence_nr, sequence_nr, version_of, view_base
from .._errors import CLONE_FIRST, RecomputeMismatchError, modified_in_place
from .._tensors import TensorMeta, describe_tensor
from .placeholder import Placeholder
from .records import Recreated, RegionRecord, RegionSaved, TensorSource, region_leaves

tree_flatten = _compat.tree_flatten

if TYPE_CHECKING:
    from .frame import CheckpointFrame
    from .replay import ReplayPass


class RebuildArg:
    """One argument of a SAVE region call that the replay recomputes."""

    __slots__ = ("index", "tensor", "root", "node", "layout", "version", "checksum", "saves")

    def __init__(self, index: int, t: torch.Tensor, root: torch.Tensor, node: Any) -> None:
        self.index = index
        # Strong references only while the forward runs (the caller holds them then).
        self.tensor: torch.Tensor | None = t
        self.root: torch.Tensor | None = root  # storage_root(t)
        self.node = node
        # (shape, stride, storage offset, dtype, device, storage bytes)
        self.layout = (
            t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.untyped_storage().nbytes()
        )
        self.version = version_of(t)
        self.checksum: Any = None
        self.saves: list[weakref.ref] = []

    def live_saves(self) -> list[RebuiltSave]:
        out = []
        for r in self.saves:
            s = r()
            if s is not None and s.kept is None:
                out.append(s)
        return out


class RegionRebuild:
    """The rebuildable arguments of one top-level SAVE region call."""

    __slots__ = ("pos", "qualname", "args", "seq")

    def __init__(self, pos: int, qualname: str, args: list[RebuildArg]) -> None:
        self.pos = pos
        self.qualname = qualname
        self.args = args
        # the autograd sequence number at the call: nodes before it ran before it
        self.seq = autograd_sequence_nr()


class RebuiltSave:
    """Packed in place of a SAVE-region save that the replay refills.

    ``pending`` holds the tensor until the forward ends; then either the save is
    rebuilt (each backward's replay puts it in the frame's store for that backward,
    slot ``slot``, like a ``Holder``) or it is kept after all as ``kept`` (a
    ``RegionSaved``).
    """

    __slots__ = ("frame", "arg", "region", "view", "requires_grad", "version", "pending",
                 "kept", "hooks", "slot", "__weakref__")

    def __init__(self, frame: CheckpointFrame, arg: RebuildArg, region: RegionRecord, t: torch.Tensor) -> None:
        self.frame = frame
        self.arg = arg
        self.region = region
        # (shape, stride, storage offset) in the argument's storage; None when the
        # save is laid out as the argument itself
        layout = arg.layout
        shape, stride, offset = t.shape, t.stride(), t.storage_offset()
        if shape == layout[0] and stride == layout[1] and offset == layout[2]:
            self.view: tuple | None = None
        else:
            self.view = (shape, stride, offset)
        self.requires_grad = t.requires_grad
        self.version = version_of(t)
        self.pending: torch.Tensor | None = t
        self.kept: RegionSaved | None = None
        # the hooks a kept save would get, as of the save (if it is kept after all)
        self.hooks = frame.scratch.kept_hooks.region_save(region.qualname, t) or frame.scratch.outer_hooks
        self.slot = frame.rebuilds.new_slot()  # in the frame's stores (records.Recreated)

    @property
    def meta(self) -> TensorMeta:
        shape, stride, offset, dtype, device, _ = self.arg.layout
        if self.view is not None:
            shape, stride, offset = self.view
        return TensorMeta(tuple(shape), stride, offset, dtype, device, self.requires_grad)

    def unpack(self) -> torch.Tensor:
        if self.kept is not None:
            return self.kept.unpack()
        if self.pending is not None:  # backward inside the forward: still held
            return self.pending.detach()
        return self.frame.take_refill(self)




class Rebuilds:
    """The rebuilt saves of one checkpoint call, from the SAVE region calls of its
    forward to the refills of each backward's replay."""

    __slots__ = ("policy", "running", "by_pos", "output_edges", "flop_memo", "slots")

    def __init__(self, policy: str, flop_memo: dict | None) -> None:
        self.policy = policy  # "free", "always" or "never"
        # the top-level SAVE region running now (its candidates are matched by pack)
        self.running: RegionRebuild | None = None
        # replay position of a SAVE region -> its rebuilt arguments
        self.by_pos: dict[int, RegionRebuild] = {}
        # (id(node), output_nr) of each SAVE output -> its source (for the settle walk)
        # (sequence number of a SAVE output's node, output_nr) -> its source
        self.output_edges: dict[tuple[int, int], TensorSource] = {}
        # FLOP-walk results per forward shape, shared by the calls of one
        # checkpointed function (see _flop_limit)
        self.flop_memo = flop_memo
        self.slots = 0  # rebuilt saves made, for their slots in the frame's stores

    def __bool__(self) -> bool:
        return bool(self.by_pos)

    def new_slot(self) -> int:
        """A slot for a new rebuilt save in the frame's stores (``records.Recreated``):
        negative, apart from the holders' indices."""
        self.slots += 1
        return -self.slots

    # ------------------------------------------------------------------ forward

    def open(self, frame: CheckpointFrame, qualname: str, leaves: Sequence[Any]) -> RegionRebuild | None:
        """Start the call of a top-level SAVE region (the last of
        ``frame.replay_regions``; ``leaves``: its arguments, flattened by
        ``region_leaves``).

        Its rebuildable arguments are those replayed code produced: created by a
        recorded op of this checkpoint's forward, strided (a sparse or jagged nested
        tensor has no storage view to refill; its saves are kept), not a wrapper of
        other tensors (a DTensor: its saves are kept), and neither a
        checkpoint input, a SAVE output (those are kept anyway) nor a parameter."""
        if self.policy == "never":
            return None
        found = None
        by_root, start = frame.scratch.sources.by_root, frame.scratch.start_seq
        i = -1
        for x in leaves:
            i += 1
            if not isinstance(x, torch.Tensor):
                continue
            node = x.grad_fn  # None for parameters and other leaves
            if node is None or sequence_nr(node) < start:
                continue
            if x.layout is not torch.strided:
                continue  # sparse, jagged nested: no storage view to rebuild from; kept
            if type(x) is not torch.Tensor and hasattr(type(x), "__tensor_flatten__"):
                continue  # a wrapper of other tensors (DTensor): no storage of its own; kept
            base = view_base(x)
            root = x if base is None else base
            if type(root) is not torch.Tensor and isinstance(root, torch.nn.Parameter):
                continue  # (a view of) a parameter: is_parameter(x)
            entry = by_root.get(id(root)) if by_root else None  # SourceIndex.lookup
            if entry is not None and entry[0]() is root:
                continue  # a checkpoint input or SAVE output (or a view of one)
            if found is None:
                found = []
            found.append(RebuildArg(i, x, root, node))
        if found is None:
            return None
        self.running = RegionRebuild(len(frame.replay_regions) - 1, qualname, found)
        return self.running

    def close(self, frame: CheckpointFrame, rebuild: RegionRebuild, ok: bool) -> None:
        """The region body returned (``ok``) or raised. Keep its candidates' records."""
        self.running = None
        if not ok:
            # The replay re-raises the body's error at this call; nothing to refill.
            for arg in rebuild.args:
                self.keep_all(frame, arg)
        used = []
        for arg in rebuild.args:
            if arg.saves and ok:
                if frame.bitwise_check:
                    from .replay import checksum

                    arg.checksum = checksum(arg.tensor)
                used.append(arg)
            arg.tensor = arg.root = None
        if used:
            rebuild.args = used
            self.by_pos[rebuild.pos] = rebuild

    def keep_all(self, frame: CheckpointFrame, arg: RebuildArg) -> None:
        """Keep ``arg``'s saves after all, as ``RegionSaved``\\ s."""
        for saved in arg.live_saves():
            # detached: the pending tensor may be an output of the node holding the save
            t, saved.pending = saved.pending.detach(), None
            region = saved.region
            # Modified in place since the save: hooks would pack the new value now and
            # backward would use it. Held as it is instead, with the version of the
            # save, so that backward raises as autograd does without remat.
            modified = version_of(t) != saved.version
            kept = RegionSaved(region, f"saved.{len(region.saved)}", t, None if modified else saved.hooks)
            if kept.tensor is not None:
                kept.expect_version(saved.version)  # an in-place change since the save is an error
            region.add_saved(kept)
            saved.kept = kept
            for observer in frame.observers.kept:
                observer.tensor_kept(frame, kept, t)

    def abandon(self) -> None:
        """The forward raised: saves still pending let go of their tensors (a save
        that is an output of the node holding it would form a cycle through autograd
        nodes, which the garbage collector cannot see); nothing is rebuilt."""
        for s in self.live_saves():
            s.pending = None
        self.running = None
        self.by_pos = {}
        self.output_edges = {}

    def settle(self, frame: CheckpointFrame, out: Any) -> None:
        """End of forward (``out``: the checkpoint's output): rebuild each candidate
        save, or keep it after all (see the module docstring)."""
        output_edges, self.output_edges = self.output_edges, {}
        if not self.by_pos:
            return
        clean: set[int] = set()
        # Where early stop would end the replay without rebuilds (the node of the op
        # that saved the last tensor to recreate), and the first op with FLOPs after it.
        # (Nodes before the checkpoint's start are not replayed.)
        lo = max(frame.scratch.last_needed_seq - 1, frame.scratch.start_seq)
        # Without early stop the replay runs every op anyway: any rebuild is free. So is
        # one the replay reaches before the last tensor it recreates anyway.
        limit = 2**63
        if frame.early_stop and self.policy == "free":
            for r in self.by_pos.values():
                if r.seq > lo:
                    limit = self._flop_limit(frame, out, lo)
                    break
        floor = None
        if output_edges:
            unkept = [k[0] for k, src in output_edges.items() if not src.keep]
            if unkept:  # (keys are (sequence number, output_nr))
                floor = max(min(unkept), frame.scratch.start_seq)
        for rebuild in list(self.by_pos.values()):
            rebuilt = []
            for arg in rebuild.args:
                saves = arg.live_saves()
                node, arg.node = arg.node, None
                keep = rebuild.seq > limit or (
                    floor is not None
                    and sequence_nr(node) >= floor
                    and _reaches_unkept_output(node, output_edges, floor, clean)
                )
                if not keep:
                    for s in saves:
                        if version_of(s.pending) != s.version:
                            keep = True
                            break
                if keep:
                    self.keep_all(frame, arg)
                    continue
                for s in saves:
                    s.pending = None
                if saves:
                    rebuilt.append(arg)
            rebuild.args = rebuilt
            if not rebuilt:
                del self.by_pos[rebuild.pos]

    def _flop_limit(self, frame: CheckpointFrame, out: Any, lo: int) -> int:
        """:func:`_first_flop_node` for this forward, memoized per checkpointed
        function by the forward's shape: autograd nodes created, where its SAVE
        regions rebuild and the kinds of node that made their arguments, where early
        stop would end (sequence numbers relative to the checkpoint's start).
        A forward of another graph with the same shape could reuse a wrong answer;
        that only keeps a save or replays a matmul it need not (bytes or FLOPs, never
        a gradient), so it is worth the walk per step it saves."""
        s0 = frame.scratch.start_seq
        parts: list[Any] = [lo - s0, autograd_sequence_nr() - s0, len(frame.holders)]
        for r in self.by_pos.values():
            parts.append(r.seq - s0)
            parts.append(r.qualname)
            for a in r.args:
                parts.append(type(a.node))
        key = tuple(parts)
        memo = self.flop_memo
        if memo is not None and key in memo:
            return s0 + memo[key]
        roots = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        arg_nodes = [a.node for r in self.by_pos.values() for a in r.args]
        limit = _first_flop_node([*roots, *frame.scratch.walk_roots, *arg_nodes], frame.scratch.save_output_seqs, lo)
        if memo is not None:
            if len(memo) >= 32:  # forwards of ever new shapes: start over
                memo.clear()
            memo[key] = limit - s0
        return limit

    # ----------------------------------------------------------------- backward

    def live_saves(self) -> list[RebuiltSave]:
        """The saves the replay rebuilds, with those of the SAVE region running now
        (still held until the forward ends)."""
        rebuilds = list(self.by_pos.values())
        if self.running is not None:
            rebuilds.append(self.running)
        out: list[RebuiltSave] = []
        for r in rebuilds:
            for a in r.args:
                out.extend(a.live_saves())
        return out

    def count_to_refill(self, store: Recreated) -> int:
        """How many rebuilt saves a replay must put in ``store`` (the count of
        :meth:`live_saves` not in it yet, without building the list)."""
        n = 0
        for r in self.by_pos.values():
            for a in r.args:
                for ref in a.saves:
                    s = ref()
                    if s is not None and s.kept is None and s.slot not in store:
                        n += 1
        return n

    def refill(self, replay: ReplayPass, pos: int, args: tuple, kwargs: dict) -> int:
        """The replay reached the SAVE region call at replay position ``pos``:
        refill its saves from the replay's arguments, after checking they are laid
        out as in the forward. Returns how many saves it refilled."""
        rebuild = self.by_pos.get(pos)
        if rebuild is None:
            return 0
        frame, store = replay.frame, replay.store
        leaves = region_leaves(args, kwargs)
        filled = 0
        for arg in rebuild.args:
            d = None
            for ref in arg.saves:
                s = ref()
                if s is None or s.kept is not None:
                    continue
                if s.slot in store:
                    continue
                if d is None:
                    x = leaves[arg.index] if arg.index < len(leaves) else None
                    if not (
                        type(x) is torch.Tensor
                        and version_of(x) == arg.version
                        and arg.checksum is None
                        and _same_layout(x, arg.layout)
                    ):
                        _check_argument(frame, rebuild, arg, x)  # raises why, or passes the slow checks
                    d = x.detach()
                view = s.view
                t = d if view is None else d.as_strided(*view)  # the argument, or a view of it
                store.put(s.slot, t)
                filled += 1
        return filled


def _where(frame: CheckpointFrame, rebuild: RegionRebuild, arg: RebuildArg) -> str:
    return f"argument {arg.index} of SAVE region '{rebuild.qualname}' in checkpoint '{frame.name}'"


def _same_layout(x: torch.Tensor, layout: tuple) -> bool:
    """Is ``x`` laid out as ``RebuildArg.layout`` records the forward's argument?"""
    return (
        x.shape == layout[0]
        and x.stride() == layout[1]
        and x.storage_offset() == layout[2]
        and x.dtype is layout[3]
        and x.device == layout[4]
        and x.untyped_storage().nbytes() == layout[5]
    )


def _check_argument(frame: CheckpointFrame, rebuild: RegionRebuild, arg: RebuildArg, x: Any) -> None:
    if not (
        isinstance(x, torch.Tensor) and not isinstance(x, Placeholder) and _same_layout(x, arg.layout)
    ):
        where = _where(frame, rebuild, arg)
        shape, stride, offset, dtype, device, nbytes = arg.layout
        got = (
            f"{describe_tensor(x.shape, x.dtype)}, stride {x.stride()}, storage offset "
            f"{x.storage_offset()} on {x.device} ({x.untyped_storage().nbytes()} storage "
            "bytes)"
            if isinstance(x, torch.Tensor) and not isinstance(x, Placeholder)
            else ("a placeholder" if isinstance(x, Placeholder) else type(x).__name__)
        )
        raise RecomputeMismatchError(
            f"torch_remat: {where} is {got} in the recompute but was "
            f"{describe_tensor(shape, dtype)}, stride {stride}, storage offset {offset} on "
            f"{device} ({nbytes} storage bytes) in the forward. The region's saves of "
            "that argument are rebuilt from the replay's value, which must be laid out "
            "as in the forward: the replay must compute the same tensors as the forward."
        )
    if version_of(x) != arg.version:
        raise modified_in_place(
            _where(frame, rebuild, arg), "after the forward passed it to the region", CLONE_FIRST,
            (arg.version, version_of(x)),
        )
    if arg.checksum is not None:
        from .replay import checksum

        if checksum(x) != arg.checksum:
            raise RecomputeMismatchError(
                f"torch_remat: determinism check failed: {_where(frame, rebuild, arg)} has "
                "different bits in "
                "the recompute than in the forward. Something the replay depends on "
                "changed: usually RNG state (dropout) that needs a "
                "recompute_state_hooks entry, or a non-deterministic kernel."
            )


def describe_rebuilt(saved: RebuiltSave) -> str:
    """How messages name a rebuilt save."""
    region = saved.region
    return (
        f"the tensor ({saved.meta.describe()}) saved for backward by SAVE region "
        f"'{region.qualname}' of checkpoint '{region.checkpoint}', rebuilt from argument "
        f"{saved.arg.index}"
    )


def _reaches_unkept_output(node: Any, outputs: dict, start: int, clean: set) -> bool:
    """Does the replay of ``node``'s history read a SAVE output that is not kept?
    (``start``: no such output's node is older, so older nodes need no visit.)"""
    seen = {id(node)}
    stack, visited = [node], [node]
    while stack:
        n = stack.pop()
        for nxt, nr in n.next_functions:
            if nxt is None:
                continue
            src = outputs.get((sequence_nr(nxt), nr))
            if src is not None:
                if not src.keep:
                    return True
                continue
            k = id(nxt)
            if k in seen or k in clean:
                continue
            seen.add(k)
            if sequence_nr(nxt) >= start:
                stack.append(nxt)
                visited.append(nxt)
    clean.update(id(v) for v in visited)
    return False


_FLOP_OPS: frozenset[str] | None = None


def _has_flops(node: Any) -> bool:
    """Is ``node`` the backward of an op ``FlopCounterMode`` counts (matmul-like)?"""
    global _FLOP_OPS
    if _FLOP_OPS is None:
        from torch.utils.flop_counter import flop_registry

        _FLOP_OPS = frozenset(str(op).split(".")[-1].replace("_", "").lower() for op in flop_registry)
    name = type(node).__name__.rstrip("0123456789")
    return name.endswith("Backward") and name[: -len("Backward")].lower() in _FLOP_OPS


def _first_flop_node(roots: Iterable[Any], stop: set[int], lo: int) -> int:
    """The lowest sequence number >= ``lo`` of a node with FLOPs that the replay runs
    (reachable from ``roots`` without entering SAVE region outputs, whose nodes'
    sequence numbers are ``stop``)."""
    first = 2**63
    seen: set[int] = set()
    stack = [n for n in roots if n is not None]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        seq = sequence_nr(n)
        if seq < lo or seq in stop:
            continue
        if seq < first and _has_flops(n):
            first = seq
        stack.extend(nxt for nxt, _ in n.next_functions if nxt is not None)
    return first


