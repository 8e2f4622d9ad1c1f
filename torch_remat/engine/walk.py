"""Which checkpoint inputs does code outside SAVE regions read?

A checkpoint input consumed only by SAVE regions need not be kept: SAVE regions are
not replayed. Telling "only" apart needs to know every consumer, and without a
dispatch mode the only record of consumers is the autograd graph. So for each such
candidate input that requires grad, walk the nodes the forward created outside SAVE
regions (from the checkpoint's outputs and from the arguments replayed code handed to
regions, not entering SAVE region outputs and not leaving the checkpoint) and look
for an edge into the input. Results that leave the function only through a side
channel (a list the caller reads) are not seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten


def mark_inputs_read_by_replayed_code(
    out: Any,
    candidates: Sequence[Any],
    save_output_nodes: Sequence[Any],
    start_seq: int,
    extra_roots: Sequence[Any] = (),
) -> None:
    """Set ``keep`` on every candidate input source that replayed code consumes."""
    targets: dict[tuple[int, int], list[Any]] = {}
    alive: list[Any] = []  # keeps node wrappers alive so their ids stay unique
    for s in candidates:
        edge = get_gradient_edge(s.ref)
        alive.append(edge.node)
        targets.setdefault((id(edge.node), edge.output_nr), []).append(s)
    stop = {id(n) for n in save_output_nodes}
    seen: dict[int, Any] = {}
    stack: list[Any] = []
    roots = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    for node in [*roots, *extra_roots]:
        if node is None:
            continue
        if id(node) not in seen and id(node) not in stop and node._sequence_nr() >= start_seq:
            seen[id(node)] = node
            stack.append(node)
    unfound = len(targets)
    while stack and unfound:
        node = stack.pop()
        for nxt, nr in node.next_functions:
            if nxt is None:
                continue
            hit = targets.pop((id(nxt), nr), None)
            if hit is not None:
                unfound -= 1
                for s in hit:
                    s.keep = True
            k = id(nxt)
            if k in seen or k in stop:
                continue
            seen[k] = nxt
            if nxt._sequence_nr() >= start_seq:
                stack.append(nxt)
