"""What a SAVE region changes besides its outputs: in-place writes to tensors it
was handed, and buffers of the modules behind the checkpoint.

The replay skips a SAVE region's body, so an update it made in place to an
argument (a fused ``h.add_(b)`` on a tensor computed before the region) is not
made again: replayed code after the region would read the argument without the
update, and the gradients would be wrong. The forward therefore compares the
versions of the region's tensor arguments before and after the body and refuses
a write with an error naming the region and the argument. Writes to tensors the
region reaches otherwise (a closure, a module attribute) are not seen.

Buffers a SAVE region updates (a BatchNorm inside it) are copied when it returns;
the replay installs the copies where it skips the region, so replayed code after
it reads the values the forward read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .._errors import modified_in_place


def argument_versions(args: tuple, kwargs: dict) -> list[tuple[int, torch.Tensor, int]]:
    """``(position, tensor, version)`` of every tensor among the arguments."""
    if kwargs or any(isinstance(a, (list, tuple, dict)) for a in args):
        leaves = tree_flatten((args, kwargs))[0]
    else:
        leaves = args
    return [(i, t, t._version) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]


class SaveRegionWatch:
    """Set up before a (top-level) SAVE region's body runs, checked after it."""

    __slots__ = ("module_state", "arguments", "buffers")

    def __init__(self, module_state: Any, args: tuple, kwargs: dict) -> None:
        self.module_state = module_state
        self.arguments = argument_versions(args, kwargs)
        self.buffers = module_state.buffers_now() if module_state is not None else None

    def check(self, frame: Any, region: str) -> None:
        refuse_argument_writes(self.arguments, region, frame.name)
        if self.buffers:
            updated = self.module_state.updated_in_region(self.buffers)
            if updated:
                frame.region_buffers[len(frame.replay_regions) - 1] = updated


def refuse_argument_writes(
    watched: list[tuple[int, torch.Tensor, int]], region: str, checkpoint: str
) -> None:
    for i, t, version in watched:
        if t._version != version:
            raise modified_in_place(
                f"argument {i} of SAVE region '{region}' of checkpoint '{checkpoint}'",
                "by the region's body",
                "The recompute skips SAVE regions, so replayed code after the region "
                "would read the argument without that update. Return the result "
                "instead of updating the argument (h = h + b rather than h.add_(b)), "
                "or make the region recompute=True.",
                (version, t._version),
            )
