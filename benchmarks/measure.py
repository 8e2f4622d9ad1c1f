"""Exact bytes, FLOPs and aten op counts of one training step, and time ratios.

Bytes come from the CPU allocator's events in ``torch.profiler`` (``profile_memory=
True``): every allocation and free with its address and size. Pairing them gives
the bytes of storages still alive at a point (a storage is one allocation, so views
are counted once) and the running peak. Saved-tensor hooks are not used for this:
from outside a checkpoint they cannot see what it keeps inside. The profiler reports
only frees made on threads it profiles, which is why FSDP2's communication buffers
(freed by gloo's worker threads) are counted apart.

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode``, which counts matmul-like
ops only; the aten op count beside it shows the pointwise work it ignores.

Times are only ever ratios against a peer measured in the same process, with the
modes interleaved round by round; the median over rounds is reported.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

Forward = Callable[[], torch.Tensor]
"""Runs the forward of one step and returns the scalar loss."""


@dataclass
class StepBytes:
    """Allocator bytes of one training step (forward, then ``loss.backward()``).

    Counted from the profiler's allocation events, relative to the memory alive
    when the step starts. "Held" numbers pair each allocation of the step with its
    free; the peak is the running net change, which also subtracts frees of memory
    allocated before the step (state a previous step left behind). Communication
    buffers handed to gloo are left out (see ``_COMMUNICATION_RANGES``).
    """

    live_after_forward: int
    """Bytes allocated during the forward and still held when it returns."""
    peak_forward: int
    peak_step: int
    """Peak net bytes above the step's start, over forward and backward."""
    live_after_backward: int
    """Bytes allocated during the step and still held after backward."""
    net_after_step: int
    """Net change over the whole step; 0 in a steady state."""
    freed_from_before: int
    """Bytes freed during the step that were allocated before it."""
    collective_bytes: int
    """Bytes of FSDP2/gloo communication buffers allocated in the step; not in the
    other numbers (see ``_COMMUNICATION_RANGES``)."""
    allocations: int
    """Number of allocations in the step."""


class _Ledger:
    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.in_collectives: set[int] = set()
        self.collective_bytes = 0
        self.held = 0
        self.net = 0
        self.peak = 0
        self.freed_from_before = 0
        self.allocations = 0

    def feed(self, prof: profile) -> None:
        for _, ptr, size, communication in _allocation_events(prof):
            if communication and size > 0:
                self.in_collectives.add(ptr)
                self.collective_bytes += size
                continue
            if size > 0:
                self.in_collectives.discard(ptr)
                self.live[ptr] = size
                self.held += size
                self.net += size
                self.allocations += 1
                self.peak = max(self.peak, self.net)
                continue
            if ptr in self.in_collectives:
                self.in_collectives.discard(ptr)
                continue
            own = self.live.pop(ptr, None)
            if own is None:
                # Allocated before the step; its size is known only when that
                # allocation happened under a profiler too (the warm-up step).
                self.freed_from_before -= size
            else:
                self.held -= own
            self.net += size


# FSDP2 hands these buffers to gloo, whose worker threads may drop the last
# reference, so their frees can happen where the profiler does not look: the
# all-gather output, the reduce-scatter input/output, and gloo's own copies
# inside c10d ops. (The unsharded parameters, from FSDP::all_gather_copy_out, are
# freed on the training thread and are counted.)
_COMMUNICATION_RANGES = ("FSDP::all_gather", "FSDP::post_backward_reduce")


def _is_communication(range_name: str | None) -> bool:
    if range_name is None:
        return False
    return range_name.startswith("c10d::") or range_name.split(" (")[0] in _COMMUNICATION_RANGES


def _allocation_events(prof: profile) -> list[tuple[int, int, int, bool]]:
    """``(time_ns, address, size, is a communication buffer)``; size < 0 for frees."""
    events = []
    stack = [(e, None) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        e, innermost = stack.pop()
        if e.name.startswith(("FSDP::", "c10d::")):
            innermost = e.name
        stack.extend((c, innermost) for c in e.children)
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type == "cpu":
                events.append((e.start_time_ns, f.ptr, f.alloc_size, _is_communication(innermost)))
    events.sort(key=lambda ev: ev[0])
    return events


def _profiler() -> profile:
    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


def step_bytes(forward: Forward, *, warmup: bool = True) -> StepBytes:
    """Count the bytes of one step: ``loss = forward()`` then ``loss.backward()``.

    With ``warmup`` a step runs under the profiler first, so that the measured step
    sees the sizes of any buffers the previous step left for it to free (without a
    profiled allocation, its free is not reported at all).
    """
    if warmup:
        with _profiler():
            forward().backward()
    gc.collect()
    ledger = _Ledger()
    with _profiler() as p:
        loss = forward()
    ledger.feed(p)
    live_after_forward, peak_forward = ledger.held, ledger.peak
    with _profiler() as p:
        loss.backward()
        del loss
    ledger.feed(p)
    return StepBytes(
        live_after_forward=live_after_forward,
        peak_forward=peak_forward,
        peak_step=ledger.peak,
        live_after_backward=ledger.held,
        net_after_step=ledger.net,
        freed_from_before=ledger.freed_from_before,
        collective_bytes=ledger.collective_bytes,
        allocations=ledger.allocations,
    )


class AtenOpCounter(TorchDispatchMode):
    """Counts every aten op call, views included (used only in counting runs, never
    timed)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # aten only: a profiler running around the step adds profiler.* range ops.
        if func.namespace == "aten":
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class StepCounts:
    flops_forward: int
    flops_step: int
    """Forward, backward and every recompute."""
    ops_forward: int
    ops_step: int
    flops_by_op: dict[str, int] = field(default_factory=dict)
    flops_forward_by_op: dict[str, int] = field(default_factory=dict)
    ops_by_name: dict[str, int] = field(default_factory=dict)


def step_counts(forward: Forward) -> StepCounts:
    """Run one step under ``FlopCounterMode`` and an aten op counter."""
    with FlopCounterMode(display=False) as flops, AtenOpCounter() as ops:
        loss = forward()
        flops_forward = flops.get_total_flops()
        forward_by_op = _flops_by_op(flops)
        ops_forward = sum(ops.counts.values())
        loss.backward()
        del loss
    return StepCounts(
        flops_forward=flops_forward,
        flops_step=flops.get_total_flops(),
        ops_forward=ops_forward,
        ops_step=sum(ops.counts.values()),
        flops_by_op=_flops_by_op(flops),
        flops_forward_by_op=forward_by_op,
        ops_by_name=dict(sorted(ops.counts.items())),
    )


def measure_step(forward: Forward) -> tuple[StepCounts, StepBytes]:
    """Counts, then bytes, of one step each. The counting step (under the profiler,
    so it also registers allocation sizes) is the bytes step's warm-up."""
    with _profiler():
        counts = step_counts(forward)
    return counts, step_bytes(forward, warmup=False)


def _flops_by_op(flops: FlopCounterMode) -> dict[str, int]:
    by_op = flops.get_flop_counts().get("Global", {})
    return dict(sorted((str(k), v) for k, v in by_op.items()))


@dataclass
class TimeRatio:
    ratio: float
    """Median over rounds of (this mode's step time / the peer's, same round)."""
    ratio_low: float
    ratio_high: float
    """Quartiles of the per-round ratios."""
    median_step_s: float
    peer_median_step_s: float
    rounds: int


def time_samples(
    steps: dict[str, Callable[[], None]],
    *,
    rounds: int,
    steps_per_sample: int = 1,
    setup: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per step of each mode, one sample per round, modes interleaved.

    Each round runs every mode once (``steps_per_sample`` steps timed together), in
    an order rotated by one per round so no mode always follows the same neighbour.
    ``setup(name)`` runs untimed before a mode's sample.
    """
    if rounds < 10:
        raise ValueError("time ratios need the median of at least 10 rounds")
    names = list(steps)
    samples: dict[str, list[float]] = {n: [] for n in names}
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                if setup is not None:
                    setup(name)
                fn = steps[name]
                t0 = time.perf_counter()
                for _ in range(steps_per_sample):
                    fn()
                samples[name].append((time.perf_counter() - t0) / steps_per_sample)
            gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def time_ratio(samples: dict[str, list[float]], name: str, peer: str) -> TimeRatio:
    """Median of the per-round ratios ``name / peer``."""
    ratios = [a / b for a, b in zip(samples[name], samples[peer])]
    q = statistics.quantiles(ratios, n=4)
    return TimeRatio(
        ratio=statistics.median(ratios),
        ratio_low=q[0],
        ratio_high=q[2],
        median_step_s=statistics.median(samples[name]),
        peer_median_step_s=statistics.median(samples[peer]),
        rounds=len(ratios),
    )


def preallocate_grads(module: torch.nn.Module, *extra: torch.Tensor) -> None:
    """Give every parameter (and ``extra`` leaf) a zero ``.grad``.

    Backward then accumulates in place, so the step's peak measures activations and
    transient buffers, not the gradient buffers every mode needs alike.
    """
    for t in [*module.parameters(), *extra]:
        if t.requires_grad:
            if t.grad is None:
                t.grad = torch.zeros_like(t)
            else:
                t.grad.zero_()
