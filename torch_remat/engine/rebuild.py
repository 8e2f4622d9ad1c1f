"""SAVE-region saves that the replay rebuilds instead of keeping.

A SAVE region's body is never replayed, but an argument produced by bare code or a
RECOMPUTE region is computed again before the replay reaches the region call. So a
save of the body that shares storage with such an argument (the argument, or a view
like the flattened input ``nn.Linear`` saves) is packed as a :class:`RebuiltSave`,
refilled at the region call as the same view of the replay's value. What the body
creates (its internal activations) is kept as before.

The decision is final when the forward ends (:func:`finish_rebuilds`). Until then a
candidate save holds its tensor; it is kept after all (as a ``RegionSaved``) when

* the argument's storage was modified in place after the save (backward must see
  that error, as without the checkpoint);
* the replay could not recompute the argument: its autograd history reaches an
  output of a SAVE region that is not kept (a placeholder in the replay);
* rebuilding would make the replay run an op with FLOPs (a matmul, a convolution,
  attention) that early stop skips today. Beyond the last tensor the replay must
  recreate anyway, it may only run ops ``FlopCounterMode`` counts as free
  (elementwise ops, copies, views): the user made the region SAVE to avoid recompute
  FLOPs, and a rebuild must not add them back. With ``early_stop=False`` the replay
  runs every op anyway, so this rule never keeps a save; ``rebuild="always"`` turns
  it off (more replayed FLOPs for fewer bytes), ``rebuild="never"`` keeps every save.

Only top-level SAVE regions (called from replayed code) rebuild: a save anywhere in
their extent, nested SAVE regions included, that shares storage with one of their
arguments is refilled at that region call. Arguments that are checkpoint inputs or
SAVE outputs are kept by the checkpoint already, so saves of them alias the kept
tensor and cost nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .._compat import autograd_sequence_nr
from .._errors import CLONE_FIRST, RecomputeMismatchError, modified_in_place
from .._tensors import TensorMeta, describe_tensor, is_parameter, storage_root
from .placeholder import Placeholder
from .records import RegionSaved


def region_leaves(args: tuple, kwargs: dict) -> list[Any]:
    """A region call's arguments as one flat list, the same in forward and replay."""
    if kwargs or any(isinstance(a, (list, tuple, dict)) for a in args):
        return tree_flatten((args, kwargs))[0]
    return list(args)


def _layout(t: torch.Tensor) -> tuple:
    return (
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        t.dtype,
        t.device,
        t.untyped_storage().nbytes(),
    )


class RebuildArg:
    """One argument of a SAVE region call that the replay recomputes."""

    __slots__ = ("index", "tensor", "root", "node", "layout", "version", "checksum", "saves")

    def __init__(self, index: int, t: torch.Tensor) -> None:
        self.index = index
        # Strong references only while the forward runs (the caller holds them then).
        self.tensor: torch.Tensor | None = t
        self.root: torch.Tensor | None = storage_root(t)
        self.node = t.grad_fn
        self.layout = _layout(t)
        self.version = t._version
        self.checksum: Any = None
        self.saves: list[weakref.ref] = []

    def live_saves(self) -> list[RebuiltSave]:
        return [s for s in (r() for r in self.saves) if s is not None and s.kept is None]


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
    rebuilt (``recomputed[gid]`` is refilled per backward, like a ``Holder``) or it
    is kept after all as ``kept`` (a ``RegionSaved``).
    """

    __slots__ = ("frame", "arg", "region", "meta", "version", "pending", "kept", "hooks",
                 "recomputed", "__weakref__")

    def __init__(self, frame: Any, arg: RebuildArg, region: Any, t: torch.Tensor) -> None:
        self.frame = frame
        self.arg = arg
        self.region = region
        self.meta = TensorMeta.of(t)
        self.version = t._version
        self.pending: torch.Tensor | None = t.detach()
        self.kept: RegionSaved | None = None
        # the hooks a kept save would get, as of the save (if it is kept after all)
        self.hooks = frame.kept_hooks.region_save(region.qualname, t) or frame.outer_hooks
        self.recomputed: dict[Any, tuple[torch.Tensor, int]] | None = None

    def unpack(self) -> torch.Tensor:
        if self.kept is not None:
            return self.kept.unpack()
        if self.pending is not None:  # backward inside the forward: still held
            return self.pending
        return self.frame.unpack_rebuilt(self)


def reset(frame: Any) -> None:
    """A frame's rebuild state, empty: the SAVE region running now, the rebuilt
    saves per replay position, where early stop would end without them, and the
    SAVE outputs' autograd edges (for the walk)."""
    frame.rebuild = None
    frame.rebuilds = {}
    frame.last_needed_seq = 0
    frame.output_edges = {}


def open_rebuild(frame: Any, qualname: str, args: tuple, kwargs: dict) -> RegionRebuild | None:
    """Start the call of a top-level SAVE region (the last of ``frame.replay_regions``).

    Its rebuildable arguments are those replayed code produced: created by a recorded
    op of this checkpoint's forward, and neither a checkpoint input, a SAVE output
    (those are kept anyway) nor a parameter."""
    if frame.rebuild_policy == "never":
        return None
    found = []
    sources, start = frame.sources, frame.start_seq
    for i, x in enumerate(region_leaves(args, kwargs)):
        if not isinstance(x, torch.Tensor) or x.grad_fn is None:
            continue
        if x.grad_fn._sequence_nr() < start or is_parameter(x):
            continue
        if sources and sources.lookup(x) is not None:
            continue
        found.append(RebuildArg(i, x))
    if not found:
        return None
    frame.rebuild = RegionRebuild(len(frame.replay_regions) - 1, qualname, found)
    return frame.rebuild


def match_save(frame: Any, rebuild: RegionRebuild, t: torch.Tensor) -> RebuiltSave | None:
    """A :class:`RebuiltSave` if ``t`` is (a view of) an argument of ``rebuild`` not
    modified in place since the region call, else None."""
    root = storage_root(t)
    for arg in rebuild.args:
        if arg.root is root and t.dtype == arg.layout[3] and t._version == arg.version:
            saved = RebuiltSave(frame, arg, frame.region_stack[-1], t)
            arg.saves.append(weakref.ref(saved))
            return saved
    return None


def close_rebuild(frame: Any, rebuild: RegionRebuild, ok: bool) -> None:
    """The region body returned (``ok``) or raised. Keep its candidates' records."""
    frame.rebuild = None
    if not ok:
        # The replay re-raises the body's error at this call; nothing to refill.
        for arg in rebuild.args:
            _keep_all(frame, arg)
    used = []
    for arg in rebuild.args:
        if arg.saves and ok:
            if frame.bitwise_check:
                from .determinism import checksum

                arg.checksum = checksum(arg.tensor)
            used.append(arg)
        arg.tensor = arg.root = None
    if used:
        rebuild.args = used
        frame.rebuilds[rebuild.pos] = rebuild


def _keep_all(frame: Any, arg: RebuildArg) -> None:
    for saved in arg.live_saves():
        t, saved.pending = saved.pending, None
        region = saved.region
        kept = RegionSaved(region, f"saved.{len(region.saved)}", t, saved.hooks)
        if kept.tensor is not None:
            kept.version = saved.version  # an in-place change since the save is an error
        region.saved.append(weakref.ref(kept))
        saved.kept = kept
        for observer in frame.observers.kept:
            observer.tensor_kept(frame, kept, t)


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
            src = outputs.get((id(nxt), nr))
            if src is not None:
                if not src.keep:
                    return True
                continue
            k = id(nxt)
            if k in seen or k in clean:
                continue
            seen.add(k)
            if nxt._sequence_nr() >= start:
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
    (reachable from ``roots`` without entering SAVE region outputs ``stop``)."""
    first = 2**63
    seen: set[int] = set()
    stack = [n for n in roots if n is not None]
    while stack:
        n = stack.pop()
        if id(n) in seen or id(n) in stop:
            continue
        seen.add(id(n))
        seq = n._sequence_nr()
        if seq < lo:
            continue
        if seq < first and _has_flops(n):
            first = seq
        stack.extend(nxt for nxt, _ in n.next_functions if nxt is not None)
    return first


def finish_rebuilds(frame: Any, output_edges: dict, roots: list[Any]) -> None:
    """End of forward: rebuild each candidate save, or keep it after all."""
    clean: set[int] = set()
    # Where early stop would end the replay without rebuilds (the node of the op
    # that saved the last tensor to recreate), and the first op with FLOPs after it.
    # (Nodes before the checkpoint's start are not replayed.)
    lo = max(frame.last_needed_seq - 1, frame.start_seq)
    arg_nodes = [a.node for r in frame.rebuilds.values() for a in r.args]
    stop = {id(n) for n in frame.save_output_nodes}
    # Without early stop the replay runs every op anyway: any rebuild is free.
    free_only = frame.early_stop and frame.rebuild_policy == "free"
    limit = _first_flop_node([*roots, *arg_nodes], stop, lo) if free_only else 2**63
    nodes = {id(n): n for n in frame.save_output_nodes}
    unkept = [nodes[k[0]]._sequence_nr() for k, src in output_edges.items() if not src.keep]
    floor = max(min(unkept), frame.start_seq) if unkept else None
    for rebuild in list(frame.rebuilds.values()):
        for arg in rebuild.args:
            saves = arg.live_saves()
            node, arg.node = arg.node, None
            if (
                rebuild.seq > limit
                or any(s.pending._version != s.version for s in saves)
                or (floor is not None and _reaches_unkept_output(node, output_edges, floor, clean))
            ):
                _keep_all(frame, arg)
                continue
            for s in saves:
                s.pending = None
        rebuild.args = [a for a in rebuild.args if a.live_saves()]
        if not rebuild.args:
            del frame.rebuilds[rebuild.pos]


def settle_rebuilds(frame: Any, out: Any) -> None:
    """End of forward: decide the rebuilds; drop the inputs if nothing replays."""
    if frame.rebuilds:
        roots = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        finish_rebuilds(frame, frame.output_edges, roots + frame.walk_roots)
    if not frame.rebuilds and all(r() is None or r().static is not None for r in frame.holders):
        # Backward never replays this checkpoint: no input is read again (one
        # modified in place stays, so that storing it reports the modification).
        for s in frame.inputs:
            s.keep = s.ref._version != s.version


def rebuilt_saves(frame: Any) -> list[RebuiltSave]:
    """The saves of ``frame`` the replay rebuilds, with those of the SAVE region
    running now (still held until the forward ends)."""
    rebuilds = list(frame.rebuilds.values())
    if frame.rebuild is not None:
        rebuilds.append(frame.rebuild)
    return [s for r in rebuilds for a in r.args for s in a.live_saves()]


def count_to_refill(frame: Any, key: Any) -> int:
    return sum(1 for s in rebuilt_saves(frame) if s.recomputed is None or key not in s.recomputed)


def forget_rebuilt(frame: Any, key: Any) -> None:
    for s in rebuilt_saves(frame):
        if s.recomputed:
            s.recomputed.pop(key, None)


def refill(scope: Any, rebuild: RegionRebuild, args: tuple, kwargs: dict) -> None:
    """The replay reached ``rebuild``'s region call: refill its saves from the
    replay's arguments, after checking they are laid out as in the forward."""
    frame, key = scope.frame, scope.key
    leaves = region_leaves(args, kwargs)
    for arg in rebuild.args:
        saves = [s for s in arg.live_saves() if s.recomputed is None or key not in s.recomputed]
        if not saves:
            continue
        x = leaves[arg.index] if arg.index < len(leaves) else None
        _check_argument(frame, rebuild, arg, x)
        d = x.detach()
        for s in saves:
            m = s.meta
            t = d.as_strided(m.shape, m.stride, m.storage_offset)
            if s.recomputed is None:
                s.recomputed = {}
            s.recomputed[key] = (t, t._version)
            scope.filled += 1


def _check_argument(frame: Any, rebuild: RegionRebuild, arg: RebuildArg, x: Any) -> None:
    where = (
        f"argument {arg.index} of SAVE region '{rebuild.qualname}' in checkpoint "
        f"'{frame.name}'"
    )
    if not isinstance(x, torch.Tensor) or isinstance(x, Placeholder) or _layout(x) != arg.layout:
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
    if x._version != arg.version:
        raise modified_in_place(
            where, "after the forward passed it to the region", CLONE_FIRST,
            (arg.version, x._version),
        )
    if arg.checksum is not None:
        from .determinism import checksum

        if checksum(x) != arg.checksum:
            raise RecomputeMismatchError(
                f"torch_remat: determinism check failed: {where} has different bits in "
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
