"""The time model: what a remat option adds to a training step, in seconds.

An option's added step time is its recompute time plus its exposed copy time:

* **recompute time**: measured per checkpoint on the device present, or predicted
  from a :class:`DeviceProfile` as the roofline
  ``max(FLOPs / peak FLOP/s, bytes / memory bandwidth)``. Measured, either the
  replay alone (:func:`recompute_seconds`, each checkpoint's replayed aten ops in
  the backward) or all a checkpoint call adds over the plain call
  (:func:`checkpoint_overhead_seconds`: the forward's bookkeeping and pack hooks,
  the replay, the unpack and the engine's work around it, as a
  :class:`CheckpointCost` per checkpoint, each call timed alone);
* **exposed copy time**: the offloaded bytes over the host link, overlapped with
  the compute between a copy's issue and its use (:func:`exposed_copy_seconds`,
  the :class:`~torch_remat.offload.ActivationOffloader` timeline with prefetch
  ``k``). Where copies are synchronous (CPU, whose "host link" is a memcpy into the
  pool) nothing overlaps and every copy is exposed.

:data:`PROFILES` holds published figures for common accelerators, each with its
source; :func:`calibrate` measures a profile for the machine present.
"""

from __future__ import annotations

import gc
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

import torch_remat as remat
from torch_remat._integration import TorchDispatchMode

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class DeviceProfile:
    """Throughputs of one device: what the time model predicts from."""

    name: str
    flops: Mapping[str, float]
    """Dense matmul FLOP/s by dtype name (``"bfloat16"``, ``"float32"``)."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    host_link_bandwidth: float
    """Host<->device copy bandwidth, bytes/s, one direction."""
    memory_bytes: int = 0
    """Device memory (0: unknown)."""
    overlap_copies: bool = True
    """Copies run beside compute (CUDA: a side stream). False: the copier is
    synchronous (CPU), so every copy is exposed."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Where each figure comes from, by field name (a datasheet URL, or
    ``"calibrate()"`` for a measured one)."""

    def peak_flops(self, dtype: torch.dtype | str) -> float:
        key = str(dtype).removeprefix("torch.")
        if key not in self.flops:
            raise KeyError(
                f"DeviceProfile {self.name!r} has no FLOP/s figure for {key}; it has "
                f"{sorted(self.flops)}. Add one (or calibrate() with that dtype)."
            )
        return self.flops[key]

    def compute_seconds(self, flops: float, nbytes: float, dtype: torch.dtype | str) -> float:
        """Roofline time of work doing ``flops`` and moving ``nbytes`` of device memory."""
        return max(flops / self.peak_flops(dtype), nbytes / self.memory_bandwidth)

    def copy_seconds(self, nbytes: float) -> float:
        """Time of one direction's copy of ``nbytes`` over the host link."""
        return nbytes / self.host_link_bandwidth


_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
_L40S = "https://www.nvidia.com/en-us/data-center/l40s/"
_L4 = "https://www.nvidia.com/en-us/data-center/l4/"
_MI300X = "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"
# PCIe x16, one direction: Gen4 32 GB/s, Gen5 64 GB/s (datasheets give both
# directions together: 64 and 128 GB/s).
_PCIE = "https://pcisig.com/specifications (x16: Gen4 64 GB/s, Gen5 128 GB/s both directions)"


def _published(name, bf16, fp32, hbm, link, mem_gb, src) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        flops={"bfloat16": bf16 * TFLOPS, "float16": bf16 * TFLOPS, "float32": fp32 * TFLOPS},
        memory_bandwidth=hbm * GB,
        host_link_bandwidth=link * GB,
        memory_bytes=int(mem_gb * GB),
        overlap_copies=True,
        sources={
            "flops": f"{src} (dense, without sparsity; float32 without TF32)",
            "memory_bandwidth": src,
            "memory_bytes": src,
            "host_link_bandwidth": f"{src}; {_PCIE}",
        },
    )


PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in [
        _published("A100 80GB SXM", 312, 19.5, 2039, 32, 80, _A100),
        _published("H100 SXM", 989, 67, 3350, 64, 80, _H100),
        _published("H200 SXM", 989, 67, 4800, 64, 141, _H200),
        _published("L40S", 362, 91.6, 864, 32, 48, _L40S),
        _published("L4", 121, 30.3, 300, 32, 24, _L4),
        _published("MI300X", 1307, 163.4, 5300, 64, 192, _MI300X),
    ]
}
"""Published vendor figures (dense FLOP/s, HBM bandwidth, PCIe host link one way)."""


# ------------------------------------------------------------------ calibration


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    # On CPU the thread's CPU time, as recompute_seconds and the time check use (on
    # one intra-op thread): other work on shared cores does not enter.
    clock = time.thread_time if device.type == "cpu" else time.perf_counter
    fn()
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        t0 = clock()
        fn()
        _sync(device)
        best = min(best, clock() - t0)
    return best


def calibrate(
    device: torch.device | str | None = None,
    *,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    matmul_size: int | None = None,
    copy_bytes: int | None = None,
    repeats: int = 5,
) -> DeviceProfile:
    """Measure a profile of ``device`` (default: CUDA if present, else CPU).

    A square matmul per dtype (FLOP/s), a device-to-device copy (memory bandwidth,
    read plus write), and a copy into a host buffer (host link: pinned memory on
    CUDA; on CPU a memcpy into a pool-like buffer, which is what the offloader
    does there). Best of ``repeats``; on CPU timed on the thread's CPU clock, so
    run it with the intra-op threads the workload uses (the time check: one).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = matmul_size or (8192 if cuda else 512)
    nbytes = copy_bytes or ((1 << 30) if cuda else (64 << 20))
    flops: dict[str, float] = {}
    # operands from a generator of its own: the caller's random streams (dropout in
    # the training that follows a plan) do not move
    generator = torch.Generator(device=device).manual_seed(0)
    for dtype in dtypes:
        a = torch.randn(n, n, device=device, generator=generator).to(dtype)
        b = torch.randn(n, n, device=device, generator=generator).to(dtype)
        s = _best_seconds(lambda a=a, b=b: a @ b, device, repeats)
        flops[str(dtype).removeprefix("torch.")] = 2 * n**3 / s
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    mem_s = _best_seconds(lambda: dst.copy_(src), device, repeats)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    host.fill_(0)
    link_s = _best_seconds(lambda: host.copy_(src, non_blocking=cuda), device, repeats)
    total = torch.cuda.get_device_properties(device).total_memory if cuda else 0
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    measured = "calibrate()"
    return DeviceProfile(
        name=f"{name} (calibrated)",
        flops=flops,
        memory_bandwidth=2 * nbytes / mem_s,
        host_link_bandwidth=nbytes / link_s,
        memory_bytes=total,
        overlap_copies=cuda,
        sources=dict.fromkeys(("flops", "memory_bandwidth", "host_link_bandwidth"), measured),
    )


# ------------------------------------------------------------------ copy overlap


def exposed_copy_seconds(
    forward: Sequence[float],
    backward: Sequence[float],
    copy_out: Sequence[float],
    copy_in: Sequence[float] | None = None,
    *,
    prefetch: int,
    overlap: bool = True,
) -> float:
    """Seconds a step waits on the offloader's copies, beyond its compute.

    Per checkpoint call ``n`` in forward order: ``forward[n]`` and ``backward[n]``
    compute seconds (backward including the recompute), ``copy_out[n]`` and
    ``copy_in[n]`` the copy seconds of what it offloads (default: ``copy_in`` as
    ``copy_out``). The offloader's timeline with ``prefetch=k``: call ``n``'s copy
    out is issued as the forward starts call ``n + k`` (the last ``k`` calls stay
    resident); its copy back is issued as the backward starts call ``n + k`` and
    must be done before the backward of call ``n`` starts. Copies run one at a
    time on one copy stream, beside the compute (``overlap=True``); only the
    excess over the compute they overlap is exposed. With ``overlap=False``
    (synchronous copies) every issued copy is exposed.
    """
    n_calls = len(forward)
    copy_in = copy_out if copy_in is None else copy_in
    if not (len(backward) == len(copy_out) == len(copy_in) == n_calls):
        raise ValueError("exposed_copy_seconds: one entry per checkpoint call in every list")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    moved = [n for n in range(n_calls - prefetch) if copy_out[n] > 0 or copy_in[n] > 0]
    if not overlap:
        return float(sum(copy_out[n] + copy_in[n] for n in moved))
    moved_set = set(moved)
    t = 0.0
    stream = 0.0  # when the copy stream is next free
    for n in range(n_calls):
        m = n - prefetch
        if m in moved_set:
            stream = max(stream, t) + copy_out[m]
        t += forward[n]
    ready: dict[int, float] = {}
    for n in reversed(range(n_calls)):
        m = n - prefetch
        if prefetch == 0 and n in moved_set:
            m = n  # issued at its own unpack: nothing to hide behind
        if m in moved_set:
            stream = max(stream, t) + copy_in[m]
            ready[m] = stream
        if n in ready:
            t = max(t, ready[n])
        t += backward[n]
    return max(0.0, t - (sum(forward) + sum(backward)))


# ------------------------------------------------------------------ measuring


class _RecomputeTimer(TorchDispatchMode):
    """Times every aten op run while a remat checkpoint recomputes, by checkpoint."""

    def __init__(self, device: torch.device, clock: Callable[[], float]) -> None:
        super().__init__()
        self.device = device
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self.ops: dict[str, int] = defaultdict(int)
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not remat.is_recomputing():
            return func(*args, **kwargs)
        active = remat.active_checkpoint()
        name = active.checkpoint if active is not None else "?"
        _sync(self.device)
        t0 = self.clock()
        out = func(*args, **kwargs)
        _sync(self.device)
        t1 = self.clock()
        self.seconds[name] += t1 - t0
        self.ops[name] += 1
        self.first.setdefault(name, t0)
        self.last[name] = t1
        return out


def recompute_seconds(
    step: Callable[[], object],
    *,
    repeats: int = 3,
    device: torch.device | str = "cpu",
    clock: Callable[[], float] | None = None,
    span: bool = True,
) -> dict[str, float]:
    """Seconds each remat checkpoint's recompute takes in one run of ``step`` (a
    forward and backward), measured on the device present while it replays its
    aten ops, by checkpoint name. Of ``repeats`` runs, the one whose replayed ops
    took the least time in all counts.

    ``clock``: default the thread's CPU time on CPU (what the step's own thread
    spends, whatever else shares the cores; the ops then run on one intra-op
    thread), wall time on CUDA. ``span``: a checkpoint's time is from the start of
    its first replayed op to the end of its last (the replay runs in one burst, so
    this includes the engine's own work between the ops); else the ops' sum."""
    device = torch.device(device)
    if clock is None:
        clock = time.thread_time if device.type == "cpu" else time.perf_counter
    best: dict[str, float] | None = None
    best_ops = math.inf
    for _ in range(repeats):
        timer = _RecomputeTimer(device, clock)
        with timer:
            step()
        if best is None or sum(timer.seconds.values()) < best_ops:
            best_ops = sum(timer.seconds.values())
            best = (
                {n: timer.last[n] - timer.first[n] for n in timer.seconds} if span else dict(timer.seconds)
            )
    return best or {}


# ------------------------------------------------------------------ per-checkpoint overhead


@dataclass(frozen=True)
class CheckpointCost:
    """What one checkpoint call adds over the same code called plainly, in seconds.

    ``forward``: the checkpointed call's forward minus the plain call's (the
    engine's bookkeeping, the pack hooks, SAVE regions' state snapshots).
    ``backward``: the checkpointed call's backward minus the plain call's (the
    replay, the unpack hooks, the engine's work around the replay)."""

    forward: float
    backward: float

    @property
    def seconds(self) -> float:
        return self.forward + self.backward


def _forward_backward_seconds(
    call: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    device: torch.device,
    clock: Callable[[], float],
    between: Callable[[], object] | None = None,
    warm: bool = False,
    history: bool = False,
) -> tuple[float, float]:
    def fresh() -> torch.Tensor:
        leaf = x.detach().requires_grad_(x.is_floating_point())
        # (made before the clock starts; its node's backward is the same for both calls)
        return leaf.clone() if history and leaf.requires_grad else leaf

    if warm:
        # An untimed forward of the same call, its graph dropped: the timed one then
        # runs the code just run, as every checkpoint of a step after the first does.
        call(fresh())
    x_in = fresh()
    _sync(device)
    t0 = clock()
    out = call(x_in)
    _sync(device)
    t1 = clock()
    if between is not None:
        between()
        _sync(device)
        t1 = clock()
    out.backward(torch.ones_like(out))
    _sync(device)
    t2 = clock()
    return t1 - t0, t2 - t1


class CacheFlush:
    """Touches ``nbytes`` of fresh memory, evicting what the caches held (call it
    between a part's forward and its backward)."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu") -> None:
        self.buffer = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device)
        self.value = 0

    def __call__(self) -> None:
        self.value = (self.value + 1) % 256
        self.buffer.fill_(self.value)


def checkpoint_overhead_seconds(
    calls: Mapping[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]],
    inputs: Mapping[str, torch.Tensor],
    *,
    repeats: int = 7,
    device: torch.device | str = "cpu",
    clock: Callable[[], float] | None = None,
    between: Mapping[str, Callable[[], object]] | None = None,
    warm: bool = False,
    fastest: float = 0.0,
    history: bool = False,
) -> dict[str, CheckpointCost]:
    """Per checkpoint, the seconds its call adds over the plain call, measured on
    the device present: ``calls[name]`` is ``(plain, checkpointed)``, two callables
    of the same code, and ``inputs[name]`` the tensor the checkpoint receives in the
    step (detached here; a fresh leaf each run). Each is run forward, then backward
    from a gradient of ones, ``repeats`` times after one warm-up, the two
    interleaved, with the garbage collector off. Estimator: over the repeats,
    separately for the forward and the backward, checkpointed minus plain, each the
    mean of its fastest ``fastest`` fraction of runs (:func:`fastest_mean`; the
    default 0 takes the minimum, the least-disturbed run).

    ``between[name]``: run untimed between that checkpoint's forward and its
    backward (both calls alike), to give the backward the cache state it meets in
    the step, where other work runs in between (:class:`CacheFlush`).

    ``warm``: before each timed forward, run the same call's forward once untimed
    and drop its graph. In a step only the first checkpoint's forward follows a
    backward (which leaves the engine's forward code and data out of the caches);
    each later one follows the forward of the one before it. ``warm=False`` measures
    the first kind, ``warm=True`` the second: on 2 AMD EPYC cores, d=96, the first
    adds 0.2 to 0.3 ms more per call than the others with SAVE regions, 0.08 ms
    plainly.

    ``history``: hand each run an input with autograd history (a clone of a fresh
    leaf) rather than the leaf itself, as a checkpoint after the first in a stack
    receives the output of the block before it: the engine keeps, walks and counts
    an input that autograd holds anyway (a leaf that requires grad) otherwise than
    one that is an intermediate result. (W1's stack at d=96, blocks 1 to 3, the
    median of four bursts: SAVE linears' parts read 0.4 ms lower in all with
    history, half in the forward; full checkpoint's and SAVE matmuls' the same
    within 0.1 ms.)

    ``clock``: default the thread's CPU time on CPU (run with the intra-op threads
    the step uses), wall time on CUDA."""
    device = torch.device(device)
    if clock is None:
        clock = time.thread_time if device.type == "cpu" else time.perf_counter
    out: dict[str, CheckpointCost] = {}
    was_enabled = gc.isenabled()
    for name, (plain, checkpointed) in calls.items():
        x = inputs[name]
        gap = (between or {}).get(name)
        runs: list[list[list[float]]] = [[[], []], [[], []]]  # [plain, checkpointed][fwd, bwd]
        for call in (plain, checkpointed):
            _forward_backward_seconds(call, x, device, clock, gap, warm, history)  # warm up
        gc.collect()
        gc.disable()
        try:
            for r in range(repeats):
                order = ((0, plain), (1, checkpointed))
                for which, call in order if r % 2 == 0 else order[::-1]:
                    f, b = _forward_backward_seconds(call, x, device, clock, gap, warm, history)
                    runs[which][0].append(f)
                    runs[which][1].append(b)
        finally:
            if was_enabled:
                gc.enable()
        (pf, pb), (cf, cb) = ((fastest_mean(xs, fastest) for xs in pair) for pair in runs)
        out[name] = CheckpointCost(cf - pf, cb - pb)
    return out


def fastest_mean(samples: Sequence[float], fraction: float = 0.0) -> float:
    """The mean of the fastest ``fraction`` of ``samples`` (at least one of them):
    0 gives the minimum. On a shared machine other work only adds to a run, so the
    fastest runs are the least disturbed; the mean of a fifth of them moves less
    from one run of a benchmark to the next than the minimum alone (W1's stack at
    d=96 on 2 shared cores, 120 rounds split in two halves: the added step times of
    the two halves differ by up to 1.1 ms with the minimum, 0.25 ms with the mean
    of the fastest fifth)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    if not samples:
        raise ValueError("fastest_mean: no samples")
    xs = sorted(samples)
    k = max(1, math.ceil(fraction * len(xs)))
    return sum(xs[:k]) / k


# ------------------------------------------------------------------ measured step time


def added_step_seconds(
    samples: Mapping[str, Sequence[float]], baseline: str, *, quantile: float = 0.0, fastest: float = 0.0
) -> dict[str, float]:
    """Added step time per option from step times sampled in interleaved rounds:
    the option's ``quantile`` of its samples minus the baseline's (default 0: the
    minimum, the least-disturbed step; on a shared machine other work only adds).
    Quantiles interpolate linearly between order statistics. With ``fastest`` > 0,
    each side is instead the mean of its fastest ``fastest`` fraction of steps
    (:func:`fastest_mean`)."""
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {quantile}")
    if baseline not in samples:
        raise KeyError(f"no samples for the baseline {baseline!r}")
    if fastest:
        if quantile:
            raise ValueError("added_step_seconds: give quantile or fastest, not both")
        base_mean = fastest_mean(samples[baseline], fastest)
        return {name: fastest_mean(xs, fastest) - base_mean for name, xs in samples.items()}

    def q(xs: Sequence[float]) -> float:
        if not xs:
            raise ValueError("added_step_seconds: an option without samples")
        xs = sorted(xs)
        pos = quantile * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    base = q(samples[baseline])
    return {name: q(xs) - base for name, xs in samples.items()}


# ------------------------------------------------------------------ ranking


def ranking(seconds: Mapping[str, float]) -> list[str]:
    """Names ordered from the least added time to the most (ties by name)."""
    return sorted(seconds, key=lambda n: (seconds[n], n))


def rankings_agree(predicted: Mapping[str, float], measured: Mapping[str, float], resolution: float) -> bool:
    """Whether ``predicted`` orders every pair of options the way ``measured`` does,
    where the measurement tells them apart: options whose measured times lie within
    ``resolution`` of each other are a tie, and either order of a tie agrees.
    ``resolution`` 0 asks for the same strict ranking (ties by name, as
    :func:`ranking`)."""
    if set(predicted) != set(measured):
        raise ValueError(
            f"rankings_agree: the options differ: {sorted(set(predicted) ^ set(measured))}"
        )
    if resolution <= 0:
        return ranking(predicted) == ranking(measured)
    names = list(measured)
    for a in names:
        for b in names:
            if measured[b] - measured[a] > resolution and not predicted[a] < predicted[b]:
                return False
    return True
