"""The end-of-forward decision for SAVE-region saves the replay may rebuild
(:mod:`.rebuild`): each candidate is rebuilt, or kept after all when

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
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .._compat import autograd_sequence_nr
from .rebuild import keep_all


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


def _flop_limit(frame: Any, out: Any, lo: int) -> int:
    """:func:`_first_flop_node` for this forward, memoized per checkpointed function
    by the forward's shape: autograd nodes created, where its SAVE regions rebuild and
    the kinds of node that made their arguments, where early stop would end
    (sequence numbers relative to the checkpoint's start).
    A forward of another graph with the same shape could reuse a wrong answer; that
    only keeps a save or replays a matmul it need not (bytes or FLOPs, never a
    gradient), so it is worth the walk per step it saves."""
    s0 = frame.start_seq
    parts: list[Any] = [lo - s0, autograd_sequence_nr() - s0, len(frame.holders)]
    for r in frame.rebuilds.values():
        parts.append(r.seq - s0)
        parts.append(r.qualname)
        for a in r.args:
            parts.append(type(a.node))
    key = tuple(parts)
    memo = frame.flop_limits
    if memo is not None and key in memo:
        return s0 + memo[key]
    roots = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    arg_nodes = [a.node for r in frame.rebuilds.values() for a in r.args]
    stop = {id(n) for n in frame.save_output_nodes}
    limit = _first_flop_node([*roots, *frame.walk_roots, *arg_nodes], stop, lo)
    if memo is not None:
        if len(memo) >= 32:  # forwards of ever new shapes: start over
            memo.clear()
        memo[key] = limit - s0
    return limit


def finish_rebuilds(frame: Any, output_edges: dict, out: Any) -> None:
    """End of forward (``out``: the checkpoint's output): rebuild each candidate
    save, or keep it after all."""
    clean: set[int] = set()
    # Where early stop would end the replay without rebuilds (the node of the op
    # that saved the last tensor to recreate), and the first op with FLOPs after it.
    # (Nodes before the checkpoint's start are not replayed.)
    lo = max(frame.last_needed_seq - 1, frame.start_seq)
    # Without early stop the replay runs every op anyway: any rebuild is free. So is
    # one the replay reaches before the last tensor it recreates anyway.
    limit = 2**63
    if frame.early_stop and frame.rebuild_policy == "free":
        for r in frame.rebuilds.values():
            if r.seq > lo:
                limit = _flop_limit(frame, out, lo)
                break
    floor = None
    if output_edges:
        unkept = [k[0] for k, src in output_edges.items() if not src.keep]
        if unkept:
            nodes = {id(n): n for n in frame.save_output_nodes}
            floor = max(min(nodes[k]._sequence_nr() for k in unkept), frame.start_seq)
    for rebuild in list(frame.rebuilds.values()):
        rebuilt = []
        for arg in rebuild.args:
            saves = []  # arg.live_saves(), inlined
            for ref in arg.saves:
                s = ref()
                if s is not None and s.kept is None:
                    saves.append(s)
            node, arg.node = arg.node, None
            keep = rebuild.seq > limit or (
                floor is not None
                and node._sequence_nr() >= floor
                and _reaches_unkept_output(node, output_edges, floor, clean)
            )
            if not keep:
                for s in saves:
                    if s.pending._version != s.version:
                        keep = True
                        break
            if keep:
                keep_all(frame, arg)
                continue
            for s in saves:
                s.pending = None
            if saves:
                rebuilt.append(arg)
        rebuild.args = rebuilt
        if not rebuilt:
            del frame.rebuilds[rebuild.pos]


def settle_rebuilds(frame: Any, out: Any) -> None:
    """End of forward: decide the rebuilds; drop the inputs if nothing replays."""
    if frame.rebuilds:
        finish_rebuilds(frame, frame.output_edges, out)
    if not frame.rebuilds and all(r() is None or r().static is not None for r in frame.holders):
        # Backward never replays this checkpoint: no input is read again (one
        # modified in place stays, so that storing it reports the modification).
        for s in frame.inputs:
            s.keep = s.ref._version != s.version
