"""GPU checks: ``python benchmarks/gpu_check.py [--only offload,rng,sites,oom] [--json PATH]``.

One script for one CUDA GPU (under five minutes) that measures what the CPU test
suite cannot, and exercises every CUDA-only path of the project:

* ``offload``: a stack of checkpointed blocks whose SAVE regions keep large
  activations, trained with and without ``torch_remat.offload.ActivationOffloader``.
  Reports the median step time of each (interleaved steps, as a ratio), the peak
  allocated memory of each, whether gradients are bitwise equal, and from the
  profiler how much of the device-to-host and host-to-device copy time overlaps
  compute kernels on another stream.
* ``calibrate``: the planner's time model measures this GPU's profile
  (``integrations.planner._time.calibrate``: matmul FLOP/s in bfloat16 and
  float32, memory bandwidth, pinned host-link bandwidth) and sets it beside the
  published profile of the same device, where the table has one.
* ``rng``: ``DeviceRNGStateHook("cuda")`` replays dropout inside a checkpoint
  exactly (bitwise gradients against the uncheckpointed run).
* ``sites``: with the allocator's memory history on, the memory report names this
  file as the allocation site of kept tensors, ``memory_snapshot_annotate``'s
  labeller gives that site for a kept tensor and as the ``annotate=`` of the
  saved-tensors report, and ``label_memory_snapshot`` labels the blocks of a real
  snapshot.
* ``oom``: ``attach_oom_observer`` prints its report when an allocation fails.
* ``w1``: W1's GPT block stack on the GPU (float32, attention dropout drawn from
  the CUDA generator): per mode, the bytes alive after the forward and the step's
  peak (``torch.cuda`` allocator statistics), gradients against no AC
  (``torch.equal``), and the median step time as a ratio against
  ``torch.utils.checkpoint`` and SAC with the same save set (interleaved steps).
* ``plan``: ``plan_remat`` with offload among its options on a stack of MLP
  blocks, under a step-peak budget, the profile calibrated on this GPU: the plan
  installed gives ``torch.equal`` gradients, and its step peak (allocator
  statistics) and added step time are set beside what it predicted.

Prints one line per check and a JSON summary; exits 1 if a check fails, 2 when no
CUDA device is available. Numbers are only meaningful from a real GPU run.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def _older_torch_shim() -> str | None:
    """On a torch older than the 2.13 this package needs (a GPU image may ship one),
    stand in for the one binding the package imports that such a torch lacks:
    ``torch._C._autograd._make_saved_tensor``, which the engine uses only to store a
    kept input while the user's own saved-tensor hooks are active. The stand-in packs
    with the active hooks and unpacks with theirs (no version check). Returns what
    was done, for the summary; None on a torch that has the binding."""
    if hasattr(torch._C._autograd, "_make_saved_tensor"):
        return None

    class PackedByActiveHooks:
        __slots__ = ("data", "_unpack")

        def __init__(self, t: torch.Tensor, is_output: bool = False) -> None:
            hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
            pack, self._unpack = hooks if hooks is not None else (None, None)
            self.data = t if pack is None else pack(t)

        def unpack(self) -> torch.Tensor:
            return self.data if self._unpack is None else self._unpack(self.data)

    torch._C._autograd._make_saved_tensor = PackedByActiveHooks
    return f"torch {torch.__version__} lacks _make_saved_tensor: a stand-in packs with the active hooks"


SHIM = _older_torch_shim()

import torch_remat as remat  # noqa: E402

CHECKS = ("calibrate", "offload", "rng", "sites", "oom", "w1", "plan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="torch_remat checks that need a CUDA GPU")
    p.add_argument("--only", default=",".join(CHECKS), help="comma-separated subset of " + ",".join(CHECKS))
    p.add_argument("--layers", type=int, default=8, help="checkpointed blocks in the offload model")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--pool-gib", type=float, default=8.0)
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    p.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the w1 and plan checks on the CPU at tiny sizes (the code path, no numbers)",
    )
    args = p.parse_args(argv)
    only = [c for c in args.only.split(",") if c]
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        p.error(f"unknown check(s) {unknown}; choose from {list(CHECKS)}")
    args.only = only
    return args


# ------------------------------------------------------------------- offload


def _offload_model(args: argparse.Namespace, device: torch.device) -> tuple[list[torch.Tensor], Any]:
    torch.manual_seed(0)
    d = args.dim
    # Parameters: the offloader leaves them where they are.
    weights = [torch.nn.Parameter(torch.randn(d, 4 * d, device=device) / d**0.5) for _ in range(args.layers)]

    def block(w):
        def fn(x):
            # The SAVE region keeps its internal activations (gelu's input and
            # output), which the offloader moves.
            h = remat.region(lambda t: torch.nn.functional.gelu(t @ w) @ w.t(), "mlp", recompute=False)(x)
            return remat.recompute_needs_tensor(h).tanh() + x

        return fn

    def model(x, hooks=None):
        for k, w in enumerate(weights):
            x = remat.checkpoint(region_name=f"layers.{k}", saved_tensors_hooks=hooks)(block(w))(x)
        return x.float().square().mean()

    return weights, model


def _step(model, weights, x, hooks) -> list[torch.Tensor]:
    for w in weights:
        w.grad = None
    model(x, hooks).backward()
    return [w.grad for w in weights]


def _overlap(prof: Any) -> dict[str, float]:
    """Share of memcpy time (per direction) that overlaps a kernel of another stream."""
    copies: dict[str, list[tuple[float, float, int]]] = {"DtoH": [], "HtoD": []}
    kernels: list[tuple[float, float, int]] = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (e.time_range.start, e.time_range.end, getattr(e, "device_resource_id", -1))
        name = e.name
        if "Memcpy DtoH" in name:
            copies["DtoH"].append(span)
        elif "Memcpy HtoD" in name:
            copies["HtoD"].append(span)
        elif "Memcpy" not in name and "Memset" not in name:
            kernels.append(span)
    out = {}
    for direction, spans in copies.items():
        total = sum(end - start for start, end, _ in spans)
        covered = 0.0
        for start, end, stream in spans:
            pieces = sorted((max(s, start), min(e, end)) for s, e, ks in kernels if ks != stream and s < end and e > start)
            cursor = start
            for s, e in pieces:
                if e > cursor:
                    covered += e - max(s, cursor)
                    cursor = e
        out[direction] = covered / total if total else 0.0
        out[f"{direction}_us"] = total
    return out


def check_offload(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from torch_remat.offload import ActivationOffloader

    weights, model = _offload_model(args, device)
    x = torch.randn(args.batch * args.seq, args.dim, device=device)
    pool = int(args.pool_gib * (1 << 30))
    offloader = ActivationOffloader(pool, prefetch=args.prefetch, min_bytes=1 << 20)
    variants = {"resident": None, "offload": offloader}
    grads = {name: [g.clone() for g in _step(model, weights, x, hooks)] for name, hooks in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    peaks: dict[str, int] = {}
    for _ in range(args.steps):
        for name, hooks in variants.items():  # interleaved: both see the same noise
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            _step(model, weights, x, hooks)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            peaks[name] = torch.cuda.max_memory_allocated()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _step(model, weights, x, offloader)
        torch.cuda.synchronize()
    median = {name: statistics.median(ts) for name, ts in times.items()}
    bitwise = all(torch.equal(a, b) for a, b in zip(grads["resident"], grads["offload"]))
    result = {
        "step_time_ratio_offload_vs_resident": median["offload"] / median["resident"],
        "median_step_s": median,
        "peak_allocated_bytes": peaks,
        "gradients_bitwise_equal": bitwise,
        "offloaded_bytes": dict(offloader.stats.offloaded_bytes),
        "sync_fetches": offloader.stats.sync_fetches,
        "pool_high_water_bytes": offloader.pool.high_water_bytes,
        "copy_overlap": _overlap(prof),
        "held_after_backward": offloader.held_tensors(),
    }
    result["ok"] = bitwise and result["held_after_backward"] == 0 and peaks["offload"] < peaks["resident"]
    return result


# ---------------------------------------------------------------- other paths


def check_rng(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    w = torch.randn(256, 256, device=device, requires_grad=True)
    x = torch.randn(64, 256, device=device)

    def fn(t):
        return torch.nn.functional.dropout(t @ w, 0.5, True).sin()

    def grad(checkpointed: bool) -> torch.Tensor:
        w.grad = None
        torch.cuda.manual_seed(0)
        hooks = (remat.DeviceRNGStateHook("cuda"),)
        f = remat.checkpoint(region_name="rng", recompute_state_hooks=hooks)(fn) if checkpointed else fn
        f(x).sum().backward()
        return w.grad.clone()

    ok = torch.equal(grad(True), grad(False))
    return {"gradients_bitwise_equal": ok, "ok": ok}


def check_sites(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    torch.cuda.memory._record_memory_history(max_entries=100000)
    try:
        remat.clear_memory_snapshot_cache()
        x = torch.randn(512, 512, device=device, requires_grad=True)
        reports: list[str] = []
        kept: list[torch.Tensor] = []

        def fn(t):
            h = remat.region(lambda u: u.exp().sin(), "kept", recompute=False)(t)
            reports.append(remat.format_current_memory_report())
            kept.append(h)
            return h.sum()

        loss = remat.checkpoint(region_name="sites")(fn)(x)
        label = remat.memory_snapshot_annotate(torch.cuda.memory._snapshot())
        site = label(kept[0])
        annotated = remat.format_saved_tensors_report(loss, annotate=label)
        snapshot = remat.diagnostics.label_memory_snapshot(torch.cuda.memory._snapshot())
        labels = [lab for seg in snapshot["segments"] for b in seg.get("blocks", ()) for lab in b.get("remat", ())]
        loss.backward()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        remat.clear_memory_snapshot_cache()
    here = Path(__file__).name
    named = here in reports[0]
    site_named = site is not None and site.startswith(here) and f"@ {site}" in annotated
    labelled = any(lab["checkpoint"] == "sites" and lab["region"] == "kept" for lab in labels)
    return {
        "report_names_this_file": named,
        "labeller_site": site,
        "snapshot_labels": len(labels),
        "ok": named and site_named and labelled,
    }


def check_calibrate(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from torch_remat.integrations.planner import _time

    profile = _time.calibrate(device, dtypes=(torch.bfloat16, torch.float32))
    measured = {
        "flops_bf16_tflops": profile.flops["bfloat16"] / 1e12,
        "flops_fp32_tflops": profile.flops["float32"] / 1e12,
        "memory_bandwidth_gbs": profile.memory_bandwidth / 1e9,
        "host_link_gbs": profile.host_link_bandwidth / 1e9,
    }
    name = torch.cuda.get_device_name(device)
    published = next((p for key, p in _time.PROFILES.items() if key.split()[0] in name), None)
    result: dict[str, Any] = {"ok": all(v > 0 for v in measured.values()), "measured": measured}
    if published is not None:
        result["published"] = published.name
        result["fraction_of_published"] = {
            "flops_bf16": profile.flops["bfloat16"] / published.flops["bfloat16"],
            "memory_bandwidth": profile.memory_bandwidth / published.memory_bandwidth,
            "host_link": profile.host_link_bandwidth / published.host_link_bandwidth,
        }
    return result


def check_oom(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    out = io.StringIO()

    def observer(dev: int, alloc: int, device_alloc: int, device_free: int) -> None:
        remat.oom_observer(dev, alloc, device_alloc, device_free, file=out)

    attached = remat.attach_oom_observer(observer)
    raised = False
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device=device)  # 1 PiB
    except torch.OutOfMemoryError:
        raised = True
    text = out.getvalue()
    printed = text.startswith("torch_remat: CUDA out of memory")
    return {"attached": attached, "raised": raised, "printed": printed, "ok": attached and raised and printed}

# ------------------------------------------------------------ W1 and the planner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _w1_calls(stack: Any, mode: Any, device: torch.device) -> None:
    """``modes.install`` with the state hook of the device the dropout draws on."""
    from benchmarks import modes as M

    M.install(stack, mode, rng=True)
    if mode.kind == "remat" and device.type == "cuda":
        hooks = (remat.DeviceRNGStateHook("cuda"),)
        stack.block_calls = [
            remat.checkpoint(region_name=f"blocks.{i}", recompute_state_hooks=hooks, rebuild=mode.rebuild)(b)
            for i, b in enumerate(stack.blocks)
        ]


def check_w1(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from benchmarks import modes as M
    from benchmarks.gpt import GPTConfig, GPTStack
    from benchmarks.w1_gpt_stack import MODES as W1_MODES

    if device.type == "cuda":
        cfg = GPTConfig(d_model=1024, n_heads=16, seq_len=512, batch=8, n_layers=8, attention_dropout=0.1)
    else:
        cfg = GPTConfig(d_model=64, n_heads=4, seq_len=64, batch=2, n_layers=2, attention_dropout=0.1)
    # W1's modes but the two Megatron-style ones, which have no SAC peer
    modes = [m for m in W1_MODES if m.policy is not M.MEGATRON]
    torch.manual_seed(0)
    stack = GPTStack(cfg).to(device)
    x = stack.example_input().detach().to(device).requires_grad_()
    params = [*stack.parameters(), x]

    def step(mode: Any, record: dict[str, Any] | None = None) -> list[torch.Tensor]:
        _w1_calls(stack, mode, device)
        for t in params:
            t.grad = None
        torch.manual_seed(1234)
        torch.cuda.manual_seed(1234) if device.type == "cuda" else None
        _sync(device)
        before = _allocated(device)
        _reset_peak(device)
        loss = stack(x).float().square().mean()
        _sync(device)
        after_forward = _allocated(device) - before
        loss.backward()
        _sync(device)
        if record is not None:
            record["bytes_after_forward"] = after_forward
            record["step_peak_bytes"] = _peak(device) - before
        return [t.grad for t in params]

    records: dict[str, dict[str, Any]] = {}
    grads: dict[str, list[torch.Tensor]] = {}
    for mode in modes:
        records[mode.name] = {}
        grads[mode.name] = [g.clone() for g in step(mode, records[mode.name])]
    reference = grads[M.NO_AC.name]
    for mode in modes:
        records[mode.name]["gradients_equal_no_ac"] = all(
            torch.equal(a, b) for a, b in zip(grads[mode.name], reference)
        )
    del grads
    times: dict[str, list[float]] = {mode.name: [] for mode in modes}
    for _ in range(args.steps):
        for mode in modes:
            _w1_calls(stack, mode, device)
            _sync(device)
            start = time.perf_counter()
            step(mode)
            times[mode.name].append(time.perf_counter() - start)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    for mode in modes:
        records[mode.name]["median_step_ms"] = round(median[mode.name] * 1e3, 3)
    ratios = {
        "remat full / torch.utils.checkpoint": median[M.REMAT_FULL.name] / median[M.TORCH_CHECKPOINT.name],
        "remat save linears / SAC mm,addmm": median[M.REMAT_SAVE_LINEARS.name] / median[M.SAC_LINEARS.name],
        "remat save matmuls / SAC mm,addmm,bmm": median[M.REMAT_SAVE_MATMULS.name] / median[M.SAC_MATMULS.name],
    }
    bytes_ratios = {
        "save linears vs SAC mm,addmm": records[M.REMAT_SAVE_LINEARS.name]["bytes_after_forward"]
        / max(records[M.SAC_LINEARS.name]["bytes_after_forward"], 1),
        "save matmuls vs SAC mm,addmm,bmm": records[M.REMAT_SAVE_MATMULS.name]["bytes_after_forward"]
        / max(records[M.SAC_MATMULS.name]["bytes_after_forward"], 1),
    }
    exact = all(r["gradients_equal_no_ac"] for r in records.values())
    return {
        "config": vars(cfg) if hasattr(cfg, "__dict__") else str(cfg),
        "modes": records,
        "step_time_ratios": {k: round(v, 3) for k, v in ratios.items()},
        "bytes_after_forward_ratios": {k: round(v, 3) for k, v in bytes_ratios.items()},
        "ok": exact,
    }


class _PlanBlock(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _PlanModel(torch.nn.Module):
    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_PlanBlock(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def check_plan(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from torch_remat.integrations import plan_remat, remove_remat
    from torch_remat.integrations.planner import OffloadOptions, _time

    cuda = device.type == "cuda"
    dim, depth, batch, seq = (args.dim, args.layers, args.batch // 2, args.seq) if cuda else (32, 4, 2, 16)
    torch.manual_seed(0)
    model = _PlanModel(dim, depth).to(device)
    x = torch.randn(batch, seq, dim, device=device)
    params = list(model.parameters())

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.float().square().mean()

    def step() -> tuple[list[torch.Tensor], int]:
        for p in params:
            p.grad = None
        _sync(device)
        before = _allocated(device)
        _reset_peak(device)
        loss_fn(model(x)).backward()
        _sync(device)
        return [p.grad for p in params], _peak(device) - before

    reference, plain_peak = step()
    reference = [g.clone() for g in reference]
    profile = _time.calibrate(device) if cuda else None
    options = OffloadOptions(prefetch=args.prefetch) if cuda else OffloadOptions(prefetch=1, min_bytes=0)
    from torch_remat.integrations import InfeasibleBudgetError

    start = time.perf_counter()
    refused = []
    for fraction in (0.5, 0.7, 0.9, 0.95):  # the lowest of these the planner can reach
        try:
            plan = plan_remat(
                model, (x,), loss_fn=loss_fn, budget=None, peak_budget=fraction, candidates=["up"],
                offload=options, profile=profile,
            )
            break
        except InfeasibleBudgetError as e:
            refused.append(f"{fraction}: {e}")
    else:
        return {"ok": False, "refused": refused}
    plan_s = time.perf_counter() - start
    text = str(plan)
    plan.apply()
    got, planned_peak = step()
    exact = all(torch.equal(a, b) for a, b in zip(got, reference))
    held = plan.offloader.held_tensors() if plan.offloader is not None else 0

    def timed(n: int) -> float:
        samples = []
        for _ in range(n):
            _sync(device)
            start = time.perf_counter()
            step()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    # The same plan with every offloaded block at its resident twin (same save
    # set, nothing moved): the difference is the copies' measured exposed time.
    twin_choices = [
        next(i for i, m in enumerate(opts) if m.option == opts[c].option.resident)
        for opts, c in zip(plan.table, plan.choices)
    ]
    twin = plan.with_choices(twin_choices)
    planned_s, plain_s, twin_s = [], [], []
    for _ in range(3):  # blocks of steps: the plan, no remat, the resident twin
        planned_s.append(timed(args.steps))
        remove_remat(model)
        plain_s.append(timed(args.steps))
        twin.apply(model)
        twin_s.append(timed(args.steps))
        remove_remat(model)
        plan.apply(model)
    remove_remat(model)
    added = statistics.median(planned_s) - statistics.median(plain_s)
    exposed = statistics.median(planned_s) - statistics.median(twin_s)
    predicted_exposed = plan.predicted_seconds - twin.predicted_seconds
    result = {
        "model": {"dim": dim, "depth": depth, "batch": batch, "seq": seq},
        "plan_seconds": round(plan_s, 2),
        "peak_budgets_refused": refused,
        "offloaded_blocks": [b for b, m in enumerate(plan.chosen) if m.option.offload],
        "peak_budget_bytes": plan.peak_budget_bytes,
        "predicted_peak_bytes": plan.predicted_peak,
        "planner_measured_peak_bytes": plan.measured_peak,
        "allocator_step_peak_bytes": {"no remat": plain_peak, "plan": planned_peak},
        "predicted_added_ms": round(plan.predicted_seconds * 1e3, 3),
        "predicted_added_ms_per_block": [round(m.seconds * 1e3, 3) for m in plan.chosen],
        "host_bytes": plan.host_bytes,
        "measured_added_ms": round(added * 1e3, 3),
        "predicted_copy_exposed_ms": round(predicted_exposed * 1e3, 3),
        "measured_copy_exposed_ms": round(exposed * 1e3, 3),
        "median_step_ms": {"no remat": round(statistics.median(plain_s) * 1e3, 3),
                           "plan": round(statistics.median(planned_s) * 1e3, 3),
                           "plan, nothing offloaded": round(statistics.median(twin_s) * 1e3, 3)},
        "gradients_bitwise_equal": exact,
        "held_after_backward": held,
        "plan": text,
    }
    within = plan.measured_peak is None or plan.peak_budget_bytes is None or plan.measured_peak <= plan.peak_budget_bytes
    result["ok"] = exact and held == 0 and within
    return result


RUNNERS = {
    "calibrate": check_calibrate,
    "offload": check_offload,
    "rng": check_rng,
    "sites": check_sites,
    "oom": check_oom,
    "w1": check_w1,
    "plan": check_plan,
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_dry_run:
        device = torch.device("cpu")
        ok = True
        for name in [c for c in args.only if c in ("w1", "plan")]:
            result = RUNNERS[name](args, device)
            ok = ok and result["ok"]
            print(f"{name} (CPU dry run): {'ok' if result['ok'] else 'FAILED'} {json.dumps(result, default=str)}")
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device available; these checks need one.", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    summary: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    if SHIM is not None:
        summary["shim"] = SHIM
        print(f"gpu_check: {SHIM}", flush=True)
    failed = False
    for name in args.only:
        start = time.perf_counter()
        try:
            result = RUNNERS[name](args, device)
        except Exception as e:  # report and go on with the other checks
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result["seconds"] = round(time.perf_counter() - start, 2)
        summary[name] = result
        failed = failed or not result["ok"]
        print(f"{name}: {'ok' if result['ok'] else 'FAILED'} {json.dumps(result, default=str)}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
