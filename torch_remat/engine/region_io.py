"""What a SAVE region's call reads and returns, as the checkpoint's forward records
it (``CheckpointFrame.run_region``): the producer-responsibility bookkeeping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .._tensors import storage_root
from .outputs import flatten_region_outputs
from .records import RegionRecord
from .sources import OUTPUT, TensorSource


def region_leaves(args: tuple, kwargs: dict) -> Sequence[Any]:
    """A region call's arguments as one flat list, the same in forward and replay."""
    if not kwargs:
        for a in args:
            if isinstance(a, (list, tuple, dict)):
                break
        else:
            return args
    return tree_flatten((args, kwargs))[0]


def consume_region_args(frame, leaves: Sequence[Any], by_replayed_code: bool, replay_level: bool) -> None:
    """A region call's tensor arguments (``leaves``: :func:`region_leaves`), as
    producer responsibility sees them: SAVE outputs it reads are kept; checkpoint
    inputs are kept when replayed code reads them, else marked as consumed by a SAVE
    region (the input walk decides)."""
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sources = frame.sources.lookup(x)
            if sources is None:
                # Computed by replayed code and handed to a region: where the
                # input walk starts too, besides the checkpoint's outputs.
                if replay_level and x.grad_fn is not None:
                    frame.walk_roots.append(x.grad_fn)
                continue
            for s in sources:
                if s.kind == OUTPUT or by_replayed_code:
                    s.mark_kept(x)
                else:
                    s.save_consumed = True


def record_region_outputs(frame, record: RegionRecord, out: Any) -> None:
    """A top-level SAVE region returned: observe each output tensor as a source the
    replay may need (kept later if producer responsibility says so)."""
    leaves, record.output_spec = flatten_region_outputs(out, record.qualname, frame.name)
    pending = [r() for r in record.pending_keep]
    hooks = frame.kept_hooks.bind_outputs()
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            src = TensorSource(OUTPUT, i, leaf, record.qualname)
            src.hooks = hooks
            frame.sources.add(leaf, src)
            frame.output_sources.append(src)
            node = leaf.grad_fn
            if node is not None:
                frame.save_output_nodes.append(node)
                frame.output_edges[(id(node), leaf.output_nr)] = src
            if pending and any(p is storage_root(leaf) for p in pending):
                src.mark_kept(leaf)
            record.outputs.append(src)
        else:
            record.outputs.append(leaf)
    record.pending_keep = []
