"""Exact resident bytes of a forward on one rank, from the profiler's allocation events.

The plain sum of memory events is not exact under FSDP2 on gloo: the all-gather
output buffers are also referenced by gloo's work objects, and whether the main
thread or a gloo worker thread drops the last reference (inside or after the
profiled window) depends on timing. So this counts allocations made by the main
thread outside FSDP2's own scopes (``FSDP::all_gather``, ``FSDP::pre_forward``,
``FSDP::post_forward``, ...) that were not freed when the window closed: the
activations the forward leaves behind and its output, not FSDP2's parameter
buffers.
"""

from __future__ import annotations

from torch._C._profiler import _EventType


def resident_bytes_outside_fsdp(prof, main_thread_op: str = "aten::pow") -> int:
    """``prof``: a finished ``torch.profiler.profile(profile_memory=True)``;
    ``main_thread_op``: the name of an op the main thread ran inside the window."""
    events = []

    def flatten(event, in_fsdp: bool) -> None:
        in_fsdp = in_fsdp or event.name.startswith("FSDP::")
        events.append((event.start_time_ns, event, in_fsdp))
        for child in event.children:
            flatten(child, in_fsdp)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        flatten(root, False)
    events.sort(key=lambda item: item[0])
    main = next(e.start_tid for _, e, _ in events if e.name == main_thread_op)
    alive: dict[int, int] = {}
    for _, event, in_fsdp in events:
        if event.typed[0] != _EventType.Allocation:
            continue
        fields = event.extra_fields
        if fields.alloc_size > 0:
            if event.start_tid == main and not in_fsdp:
                alive[fields.ptr] = fields.alloc_size
        else:
            alive.pop(fields.ptr, None)
    return sum(alive.values())
