"""``forecast_remat``: the planner's measurements, run on fake tensors, so a model
too large for the planning machine can be planned on it.

Everything ``plan_remat`` runs, ``forecast_remat`` runs under ``FakeTensorMode``
(see ``_fake``): the same configurations through the same engine, counting the
same storages, so on a model that fits both give the same bytes and FLOPs. On top
it runs each hand policy and the plan once more for the step's peak and, given a
device memory, finds the largest micro-batch each one fits.
"""

from __future__ import annotations

import contextlib
import functools
import re
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torch_remat._integration import format_bytes, storage_key

from . import _report
from ._fake import (
    FakeMeasurement,
    fake_forward,
    faked,
    local_tensor,
    measure_fake,
    resized,
    storage_bytes,
)
from ._layout import Layout, sharded
from ._measure import LossFn, Placement, blocks_drawing_no_random_numbers, refuse_applied_remat
from ._offload import OffloadOptions, resolve_profile, timed
from ._offload import compute_dtype as default_dtype
from ._offload import resolve as resolve_offload
from ._space import BlockSelector, Candidates, group_blocks, select_blocks
from ._state import preserved_python_state
from ._time import DeviceProfile
from .plan import (
    REFUSED_OPTION_ERRORS,
    Budget,
    InfeasibleBudgetError,
    PlanMismatchError,
    RematPlan,
    _solve_or_error,
    _within_peak,
    block_groups,
    check_budget,
    first_line,
    in_call_order,
    measure_table,
    verified_plan,
)

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(value: int | str) -> int:
    """``80 * 2**30``, ``"80GiB"``, ``"80 GB"`` (powers of 10), ``"512MiB"`` -> bytes."""
    if isinstance(value, bool):
        raise TypeError(f"forecast_remat: device_memory must be bytes or a size, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"forecast_remat: device_memory must be > 0 bytes, got {value}.")
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"forecast_remat: device_memory {value!r} is not a size; pass bytes (int) or a "
            "string such as '80GiB', '40GB' or '512MiB'."
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class PolicyForecast:
    """One policy on every block, run on fake tensors at the example's batch."""

    name: str
    config: Placement
    bytes_by_block: dict[str, int]
    """Bytes kept after the forward, by block (``""``: outside every block)."""
    peak_bytes: int
    """Most bytes the step's own storages held at once (activations, temporaries and
    the parameters' gradients), forward and backward."""
    flops: int
    """Recompute FLOPs per step."""
    max_batch: int | None = None
    """The largest micro-batch whose step fits the device memory (None: not asked;
    0: not even a micro-batch of 1)."""
    peak_margin: int = 0
    """``peak_bytes`` is at most this many bytes above the real step's peak (and
    never below it): real storages the forward keeps outside the dispatcher (a
    Python number saved for backward, 8 B each), counted for the whole step."""
    added_seconds: float | None = None
    """The plan's predicted added time where it offloads (recompute and exposed
    copies, from the plan's time model); None: recompute FLOPs alone."""

    @property
    def kept_bytes(self) -> int:
        return sum(self.bytes_by_block.values())

    def predicted_seconds(self, profile: DeviceProfile, dtype: torch.dtype | str) -> float:
        """Added step time on ``profile``: the recompute FLOPs at its peak FLOP/s
        for ``dtype`` (the forecast counts FLOPs, not the bytes the recompute moves,
        so this is the compute-bound side of the roofline), plus, for a plan that
        offloads, its copies' exposed time (:attr:`added_seconds`)."""
        if self.added_seconds is not None:
            return self.added_seconds
        return self.flops / profile.peak_flops(dtype)


@dataclass
class Forecast:
    """What ``forecast_remat`` found: the plan, and each policy's bytes, peak and
    recompute FLOPs."""

    plan: RematPlan
    policies: dict[str, PolicyForecast]
    """``"no remat"``, the hand policies the candidates allow, and ``"plan"``."""
    parameter_bytes: int
    optimizer_bytes: int
    batch: int
    """The example's micro-batch (size of dimension ``batch_dim``)."""
    device_memory: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    layout: Layout | None = None
    """The parallel layout forecast (None: one process, nothing sharded); the bytes
    are then those of rank ``layout.rank``."""
    gradient_bytes: int = 0
    """The parameters' gradients after a backward (this rank's shards under FSDP2
    and tensor parallelism); part of the step peak."""
    bucket_bytes: int = 0
    """DDP's gradient buckets, held for the whole run (0 in other layouts)."""
    profile: DeviceProfile | None = None
    """The device profile the table's predicted added time is for (None: no column)."""
    dtype: torch.dtype = torch.float32
    """The dtype the recompute runs in (the model's first floating parameter's)."""
    max_batch_limit: int | None = None
    """Where the largest-micro-batch search stopped (``max_batch``): a policy whose
    answer is this fits at least this batch, maybe more."""
    refused: dict[str, str] = field(default_factory=dict)
    """Hand policies whose run raised, with the error's first line: the engine refused
    their SAVE regions on this model (Falcon adds into its MLP's output in place, so
    saving the MLP's Linears is refused). Not in :attr:`policies`."""

    @property
    def fixed_bytes(self) -> int:
        """Parameters, optimizer state and DDP's buckets: held whatever the batch."""
        return self.parameter_bytes + self.optimizer_bytes + self.bucket_bytes

    def format(self, by_block: bool = True) -> str:
        """The table of policies; ``by_block``: also each block's kept bytes and the
        plan's table (else the plan's summary lines only)."""
        fb = format_bytes
        where = "" if self.layout is None else (
            f" on rank {self.layout.rank} of {self.layout.describe()}"
        )
        lines = [
            f"remat forecast for {len(self.plan.blocks)} blocks at micro-batch {self.batch}"
            f"{where} (fake tensors: nothing allocated)",
            f"  parameters {fb(self.parameter_bytes)}, "
            + ("" if self.layout is None else f"gradients {fb(self.gradient_bytes)}, ")
            + (f"DDP buckets {fb(self.bucket_bytes)}, " if self.bucket_bytes else "")
            + f"optimizer state {fb(self.optimizer_bytes)}"
            + ("" if self.device_memory is None else f", device memory {fb(self.device_memory)}"),
            "",
        ]
        head = ["policy", "kept after forward", "step peak", "recompute FLOPs"]
        if self.profile is not None:
            head.append(f"predicted added time ({self.profile.name})")
        if self.device_memory is not None:
            head.append("largest micro-batch")
        rows = [head]
        for p in self.policies.values():
            row = [p.name, f"{p.kept_bytes:,}", f"{p.peak_bytes:,}", f"{p.flops:,}"]
            if self.profile is not None:
                row.append(f"{p.predicted_seconds(self.profile, self.dtype) * 1e3:,.3f} ms")
            if self.device_memory is not None:
                capped = p.max_batch is not None and p.max_batch == self.max_batch_limit
                # The search stops at its cap: a larger batch may fit too.
                row.append(f">= {p.max_batch:,} (max_batch)" if capped else f"{p.max_batch:,}")
            rows.append(row)
        lines += ["  " + r for r in _report._rows(rows, set(range(1, len(head))))]
        for name, why in self.refused.items():
            lines.append(f"  {name}: refused on this model ({why})")
        if not by_block:
            plan_lines = self.plan.format().splitlines()[:2]
            lines += ["", *("  " + line for line in plan_lines)]
            return "\n".join(line.rstrip() for line in lines)
        lines += ["", "  kept bytes by block:"]
        names = list(self.policies)
        rows = [["block", *names]]
        for block in [*self.plan.blocks, ""]:
            rows.append(
                [block or "(outside blocks)"]
                + [f"{self.policies[n].bytes_by_block.get(block, 0):,}" for n in names]
            )
        lines += ["  " + r for r in _report._rows(rows, set(range(1, len(names) + 1)))]
        lines += ["", *("  " + line for line in self.plan.format().splitlines())]
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.format()


def _hand_configs(
    plan: RematPlan, groups: Sequence[Any], rng_free: frozenset[str] = frozenset()
) -> dict[str, Placement]:
    """The hand policies on every block (save sets over each group's candidates);
    a policy whose save set is empty where it should name modules is left out."""
    configs: dict[str, Placement] = {}
    per_group = [_report.hand_save_sets(dict(zip(g.candidates, g.kinds))) for g in groups]
    for name in ("full checkpoint", "save linears", "Megatron-style"):
        sets = {b: s[name] for g, s in zip(groups, per_group) for b in g.blocks}
        if name != "full checkpoint" and not any(sets.values()):
            continue
        if any(c.checkpointed == sets for c in configs.values()):
            continue  # the same save sets as a policy already listed
        configs[name] = Placement({b: sets[b] for b in plan.blocks}, rng_free)
    return configs


def forecast_remat(
    model: nn.Module,
    example_args: Any,
    loss_fn: LossFn = lambda out: out.sum(),
    budget: Budget = 0.5,
    *,
    blocks: BlockSelector = None,
    candidates: Candidates = None,
    device: torch.device | str | None = None,
    device_memory: int | str | None = None,
    optimizer_states: int = 2,
    batch_dim: int = 0,
    max_batch: int = 1 << 16,
    layout: Layout | None = None,
    profile: DeviceProfile | str | None = None,
    compute_dtype: torch.dtype | None = None,
    offload: bool | OffloadOptions | None = None,
    peak_budget: Budget | None = None,
) -> Forecast:
    """Plan as :func:`plan_remat` does, with every run on fake tensors: no parameter
    or activation memory is allocated, so the model may be larger than this
    machine's memory. The model may hold real, meta or fake parameters (meta ones
    are forecast on ``device``, default CPU); it is left as it was.

    Args:
        budget: as for ``plan_remat`` (a fraction, bytes; ``"auto"`` is refused,
            there is no device to ask).
        device_memory: bytes or a size (``"80GiB"``): find, per policy, the largest
            micro-batch whose parameters, optimizer state and step peak fit.
        optimizer_states: optimizer tensors per parameter, each of its size (Adam: 2).
        batch_dim: the dimension of the tensor arguments that is the micro-batch.
        max_batch: where the largest-micro-batch search stops; a policy that fits
            it is shown as ``>= max_batch``.
        layout: forecast one rank of a parallel layout (:class:`Layout`: FSDP2,
            tensor parallel, both, or DDP, over any number of ranks) without a
            process group: a copy of the model is sharded by the real
            ``fully_shard`` / ``parallelize_module`` on a fake process group, and
            ``example_args`` are what that rank's forward receives. The bytes are
            the rank's: its parameter shards, gradients and optimizer state, its
            activations (DTensor shards, FSDP2's unsharded parameters while a unit
            runs). Needs no process group initialized in this process.
        profile: a :class:`~integrations.planner._time.DeviceProfile` or the name of
            one in ``PROFILES`` (``"H100 SXM"``): the table then shows each
            policy's predicted added step time on that device.
        compute_dtype: the dtype the recompute runs in, for ``profile``'s peak
            FLOP/s (default: the model's first floating parameter's; pass
            ``torch.bfloat16`` where mixed precision computes in bf16).
        offload: as for ``plan_remat``: offloaded options join the table (their
            host buffers are followed apart from device memory), and the plan is
            chosen by predicted time on ``profile``, which is then required.
        peak_budget: as for ``plan_remat``, on the forecast's step peak.
    """
    if profile is not None:  # (None: no time column; the forecast calibrates nothing)
        profile = resolve_profile(profile, torch.device("cpu"), torch.float32, "forecast_remat")
    if budget == "auto":
        raise ValueError(
            "forecast_remat: budget='auto' reads the free memory of a device this "
            "forecast does not run on; pass a fraction or bytes (device_memory= finds "
            "the largest micro-batch that fits a device)."
        )
    check_budget(budget, "budget", "forecast_remat")
    check_budget(peak_budget, "peak_budget", "forecast_remat")
    offload_options = resolve_offload(offload)
    if offload_options is not None and profile is None:
        raise ValueError(
            "forecast_remat: offload needs a device profile to weigh copies against "
            "recompute; pass profile= (a name in _time.PROFILES, e.g. 'H100 SXM', or a "
            "DeviceProfile)."
        )
    peaks = offload_options is not None or peak_budget is not None
    refuse_applied_remat(model)
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    memory = None if device_memory is None else parse_bytes(device_memory)
    names = select_blocks(model, blocks)
    batches = {
        a.shape[batch_dim] for a in args if isinstance(a, torch.Tensor) and a.dim() > batch_dim
    }
    if len(batches) != 1:
        raise ValueError(
            f"forecast_remat: the tensor arguments must share one micro-batch size along "
            f"batch_dim={batch_dim}; got sizes {sorted(batches)}. Pass batch_dim= or "
            "arguments of one batch."
        )
    batch = batches.pop()
    if layout is not None and not isinstance(layout, Layout):
        raise TypeError(f"forecast_remat: layout must be a Layout, got {layout!r}.")
    context = (
        _unsharded(model, args, device) if layout is None
        else sharded(model, args, layout, names, device)
    )
    with preserved_python_state(model), context as (target, mode, fargs):
        params = list(target.parameters())
        parameter_bytes = storage_bytes(params)
        optimizer_bytes = optimizer_states * _distinct_bytes(p for p in params if p.requires_grad)
        # Grouped as plan_remat groups them: sibling projections found by one
        # forward, here a fake one (after the parameters are counted: FSDP2 leaves
        # the root's unsharded after a forward without gradients).
        groups = group_blocks(
            target, names, candidates, fargs,
            forward=functools.partial(fake_forward, target, fargs, mode),
        )
        run = _Runs(functools.partial(measure_fake, mode=mode), fargs)
        # The blocks that draw no random numbers, seen in a first full step, which is
        # also the option table's warm-up (lazy state: FSDP2's, first-call caches).
        order: list[str] = []
        rng_free = frozenset(blocks_drawing_no_random_numbers(
            target, fargs, names, forward=lambda: run.warm_up(target, fargs, loss_fn, names),
            order=order,
        ))
        names = in_call_order(names, order, "forecast_remat")
        base, checkpoint_base, table, refused = measure_table(
            target, fargs, loss_fn, names, groups, rng_free, measure=run,
            offload=offload_options, peaks=peaks,
        )
        dtype = compute_dtype or default_dtype(model)
        if offload_options is not None:
            table = timed(table, block_groups(names, groups), profile, dtype, offload_options)
        measured = RematPlan(
            names, table, [0] * len(names), base, 0,
            {g.blocks[0]: dict(zip(g.candidates, g.kinds)) for g in groups}, None,
            weakref.ref(model), rng_free=sorted(rng_free, key=names.index),
            checkpoint_base_bytes=checkpoint_base, offload=offload_options,
            time_profile=profile.name if offload_options is not None else None,
            refused=refused,
        )
        plan, error = _solve_or_error(measured, budget, peak_budget)
        if error is not None:
            raise InfeasibleBudgetError(error)
        configs = {"no remat": Placement(), **_hand_configs(plan, groups, rng_free)}
        policies: dict[str, PolicyForecast] = {}
        refused_policies: dict[str, str] = {}
        gradient_bytes = 0
        for name, config in configs.items():
            try:
                m: FakeMeasurement = run(target, fargs, loss_fn, config, names)
            except REFUSED_OPTION_ERRORS as e:
                if name == "full checkpoint":
                    raise
                refused_policies[name] = first_line(e)
                continue
            gradient_bytes = m.gradient_bytes
            policies[name] = PolicyForecast(
                name, config, m.bytes_by_block, m.peak_bytes, sum(m.flops_by_block.values()),
                peak_margin=m.peak_margin,
            )
        plan_runs: dict[tuple[int, ...], PolicyForecast] = {}

        def run_plan(candidate: RematPlan) -> dict[str, int]:
            config = candidate.config()
            m = run(target, fargs, loss_fn, config, names, measuring=False)
            candidate.measured_peak = m.peak_bytes
            policy = PolicyForecast(
                "plan", config, m.bytes_by_block, m.peak_bytes, sum(m.flops_by_block.values()),
                peak_margin=m.peak_margin,
                added_seconds=candidate.predicted_seconds if candidate.offload is not None else None,
            )
            plan_runs[tuple(candidate.choices)] = policy
            return {"": policy.kept_bytes}  # what the verification compares: the total

        plan, mismatch = verified_plan(plan, block_groups(names, groups), run_plan)
        if mismatch is not None:
            raise PlanMismatchError(_mismatch_message(plan))
        if plan.peak_budget_bytes is not None:
            plan, mismatch = _within_peak(measured, plan, budget, block_groups(names, groups), run_plan)
            if mismatch is not None:
                raise PlanMismatchError(mismatch)
        policies["plan"] = plan_runs[tuple(plan.choices)]
        trainable = storage_bytes([p for p in params if p.requires_grad])
        ddp = layout is not None and layout.ddp and layout.world_size > 1
        bucket_bytes = trainable if ddp and not layout.gradient_as_bucket_view else 0
        if memory is not None:
            fixed = parameter_bytes + optimizer_bytes + bucket_bytes
            for p in policies.values():
                peaks = {batch: p.peak_bytes}

                def peak(b: int, _p: PolicyForecast = p, _peaks: dict = peaks) -> int:
                    if b not in _peaks:
                        sized = resized(fargs, mode, b, batch_dim)
                        _peaks[b] = run(target, sized, loss_fn, _p.config, names).peak_bytes
                    return _peaks[b]

                p.max_batch = _largest(lambda b, _peak=peak: fixed + _peak(b) <= memory,
                                       _affine_guess(peak, batch, memory - fixed, max_batch), max_batch)
    return Forecast(
        plan, policies, parameter_bytes, optimizer_bytes, batch, memory,
        layout=layout, gradient_bytes=gradient_bytes, bucket_bytes=bucket_bytes,
        max_batch_limit=max_batch if memory is not None else None,
        profile=profile, dtype=dtype, refused=refused_policies,
    )


def _mismatch_message(plan: RematPlan) -> str:
    return (
        f"forecast_remat: the chosen plan, run on fake tensors, held {plan.measured_bytes:,} B "
        f"after the forward, not the {plan.predicted_bytes:,} B its blocks' options add up "
        "to: the blocks' bytes interact in a way per-block measurement does not capture "
        "(a block keeping its neighbour's output, say). Plan: "
        + "; ".join(f"{n}: {o.label}" for n, o in plan.options.items())
        + ". Pass blocks= with coarser blocks (one holding both neighbours), or "
        "candidates= with fewer SAVE regions."
    )


def _distinct_bytes(params: Any) -> int:
    """Bytes of the parameters' elements (DTensors: this rank's shard), each tensor
    counted once however many parameter objects view it (weights tied by sharing
    one tensor's data)."""
    seen: set[tuple] = set()
    total = 0
    for p in params:
        t = local_tensor(p)
        key = (storage_key(t.untyped_storage()), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


class _Runs:
    """Fake runs of configurations, each run once at the example's arguments: the
    hand policies and the plan are often configurations the option table ran
    already (every block of a group with one option). The first run, whose numbers
    lazy initialisation changes, is never reused; ``warm_up`` makes it the step
    that finds the blocks drawing no random numbers, so the table's warm-up is an
    ordinary step, reused as its run without checkpoints."""

    def __init__(self, measure: Any, args: tuple) -> None:
        self.measure, self.args = measure, args
        self.done: dict[Any, FakeMeasurement] = {}
        self.first = True

    def warm_up(self, model: nn.Module, args: Any, loss_fn: Any, names: Sequence[str]) -> None:
        """The first step (its numbers carry lazy initialisation): the table's warm-up
        then runs as an ordinary, reusable step."""
        self.measure(model, args, loss_fn, Placement(), names)
        self.first = False

    def __call__(self, model: nn.Module, args: Any, loss_fn: Any, config: Placement,
                 names: Sequence[str], *, measuring: bool = True) -> FakeMeasurement:
        key = (tuple(sorted(config.checkpointed.items())), config.rng_free, config.offloaded,
               measuring or not config.offloaded)
        if args is not self.args:
            return self.measure(model, args, loss_fn, config, names, measuring=measuring)
        if self.first:
            self.first = False
            return self.measure(model, args, loss_fn, config, names, measuring=measuring)
        if key not in self.done:
            self.done[key] = self.measure(model, args, loss_fn, config, names, measuring=measuring)
        return self.done[key]


@contextlib.contextmanager
def _unsharded(
    model: nn.Module, args: Sequence[Any], device: torch.device | str | None
) -> Iterator[tuple[nn.Module, Any, tuple[Any, ...]]]:
    with faked(model, args, device) as (mode, fargs):
        yield model, mode, fargs


def _affine_guess(peak: Any, batch: int, room: int, limit: int, refinements: int = 2) -> int:
    """The batch at which the step peak, taken as affine in the batch (through the
    peaks at ``batch`` and ``2 * batch``), reaches ``room``; then again through the
    last two batches tried, ``refinements`` times (the peak per sample at a large
    batch differs from a small one's by a few percent: the first guess can be
    hundreds of samples off, the next within a few). ``limit`` where the guess
    reaches it: the search goes no further."""
    a, b = batch, 2 * batch
    low, high = peak(a), peak(b)
    guess = b
    for i in range(refinements + 1):
        per_sample = (high - low) / (b - a)
        if per_sample <= 0:
            return batch if i == 0 else guess
        guess = max(1, b + int((room - high) // per_sample))
        if guess >= limit:
            return limit
        if i == refinements or guess in (a, b):
            return guess
        a, low, b, high = b, high, guess, peak(guess)
    return guess


def _largest(fits: Any, guess: int, limit: int) -> int:
    """The largest ``b`` in ``[1, limit]`` with ``fits(b)`` (``fits`` is monotone:
    a larger batch never needs less), 0 if none. Starts at ``guess`` (the peak is
    close to affine in the batch, so the answer is near it) and steps away from it
    by 1, 2, 4, ... to a bracket, then bisects it: about twice the logarithm of the
    guess's error in calls, not of the batch."""
    guess = min(max(1, guess), limit)
    step = 1
    if fits(guess):
        lo = guess
        while True:
            if lo == limit:
                return limit
            b = min(lo + step, limit)
            if not fits(b):
                hi = b
                break
            lo, step = b, 2 * step
    else:
        hi = guess
        while True:
            if hi == 1:
                return 0
            b = max(hi - step, 1)
            if fits(b):
                lo = b
                break
            hi, step = b, 2 * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
