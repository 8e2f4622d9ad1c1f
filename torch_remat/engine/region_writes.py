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

from collections.abc import Sequence
from typing import Any

import torch

from .._errors import modified_in_place


class SaveRegionWatch:
    """Set up before a (top-level) SAVE region's body runs, checked after it.
    ``leaves``: the call's arguments, flattened (``region_io.region_leaves``)."""

    __slots__ = ("module_state", "arguments", "buffers")

    def __init__(self, module_state: Any, leaves: Sequence[Any]) -> None:
        self.module_state = module_state
        # (position, tensor, version) of every tensor argument
        self.arguments = [(i, t, t._version) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        self.buffers = (
            module_state.buffers_now() if module_state is not None and module_state.buffer_groups else None
        )

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
