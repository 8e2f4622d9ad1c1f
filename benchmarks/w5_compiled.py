"""W5: the GPT stack compiled with ``torch.compile``, one checkpoint per block.

Compiled peers: no AC, ``torch.utils.checkpoint``, SAC saving mm/addmm, and
``remat.checkpoint`` with no regions ("full") and with SAVE regions around the four
linear layers. Under compilation each checkpoint is a graph region whose saves the
min-cut partitioner chooses, steered by the checkpoint's tags (SAC's policy, or
remat's regions). Per mode: bytes alive after the forward (allocator events), the
FLOPs of the compiled forward and backward graphs (the backward graph holds the
recompute), and, in a full run, the step time under inductor as a ratio against
compiled ``torch.utils.checkpoint`` (interleaved rounds, median).

Bytes and FLOPs are measured with AOTAutograd and the min-cut partitioner but
without inductor (its fusions would change which buffers exist, not what is saved).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import modes as M
from benchmarks.gpt import GPTConfig, GPTStack
from benchmarks.measure import StepBytes, preallocate_grads, step_bytes, time_ratio, time_samples
from benchmarks.report import Check, Table, WorkloadResult

# Smaller than W1: every mode compiles twice (aot_eager for bytes and FLOPs,
# inductor for time), and compile time grows with the number of blocks.
FULL = GPTConfig(d_model=128, n_heads=4, seq_len=128, batch=8, n_layers=2)
QUICK = GPTConfig(d_model=64, n_heads=4, seq_len=64, batch=2, n_layers=1)
MODES = [M.NO_AC, M.TORCH_CHECKPOINT, M.SAC_LINEARS, M.REMAT_FULL, M.REMAT_SAVE_LINEARS]
TIME_ROUNDS = 10


class GraphFlops:
    """A backend like ``aot_eager`` (AOTAutograd, min-cut partitioner, no inductor)
    that counts the FLOPs each compiled graph runs while ``counting`` is set."""

    def __init__(self) -> None:
        from functorch.compile import min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        self.counting = False
        self.forward = self.backward = 0
        self.backend = aot_autograd(
            fw_compiler=self._compiler("forward"),
            bw_compiler=self._compiler("backward"),
            partition_fn=min_cut_rematerialization_partition,
        )

    def _compiler(self, which: str) -> Callable:
        def compile_graph(gm: torch.fx.GraphModule, _example_inputs) -> Callable:
            def run(args):
                if not self.counting:
                    return gm(*args)
                with FlopCounterMode(display=False) as flops:
                    out = gm(*args)
                setattr(self, which, getattr(self, which) + flops.get_total_flops())
                return out

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return compile_graph


def _compiled_step(stack: GPTStack, x: torch.Tensor, backend: Callable | str) -> Callable:
    return torch.compile(lambda: stack(x).sum(), backend=backend, fullgraph=True)


def _measure(
    base: GPTStack, x: torch.Tensor, mode: M.Mode
) -> tuple[StepBytes, tuple[int, int], list[torch.Tensor]]:
    torch._dynamo.reset()
    stack = copy.deepcopy(base)
    M.install(stack, mode, rng=False)
    preallocate_grads(stack)
    counter = GraphFlops()
    forward = _compiled_step(stack, x, counter.backend)
    forward().backward()  # compile outside the measurements
    bytes_ = step_bytes(forward)
    counter.counting = True
    preallocate_grads(stack, x)
    forward().backward()
    grads = [t.grad.clone() for t in [*stack.parameters(), x]]
    return bytes_, (counter.forward, counter.backward), grads


def _eager_bytes(base: GPTStack, x: torch.Tensor, mode: M.Mode) -> StepBytes:
    """The same mode without compilation, for the eager-versus-compiled column."""
    stack = copy.deepcopy(base)
    M.install(stack, mode, rng=False)
    preallocate_grads(stack, x)
    return step_bytes(lambda: stack(x).sum())


def _times(base: GPTStack, x: torch.Tensor) -> dict:
    torch._dynamo.reset()
    steps = {}
    for mode in MODES:
        stack = copy.deepcopy(base)
        M.install(stack, mode, rng=False)
        forward = _compiled_step(stack, x, "inductor")
        forward().backward()  # compile before timing

        def step(forward=forward) -> None:
            forward().backward()

        steps[mode.name] = step
    samples = time_samples(steps, rounds=TIME_ROUNDS)
    return {m.name: time_ratio(samples, m.name, M.TORCH_CHECKPOINT.name) for m in MODES}


def run(quick: bool) -> WorkloadResult:
    cfg = QUICK if quick else FULL
    torch.manual_seed(0)
    base = GPTStack(cfg)
    x = base.example_input()
    b, flops, grads, eager = {}, {}, {}, {}
    for mode in MODES:
        b[mode.name], flops[mode.name], grads[mode.name] = _measure(base, x, mode)
        eager[mode.name] = _eager_bytes(base, x, mode)
    times = {} if quick else _times(base, x)
    torch._dynamo.reset()

    base_b, base_f = b[M.NO_AC.name], sum(flops[M.NO_AC.name])
    columns = [
        "mode",
        "live after fwd (B)",
        "vs no AC",
        "eager live after fwd (B)",
        "FLOPs fwd",
        "FLOPs bwd",
        "extra FLOPs",
    ]
    if times:
        columns.append("inductor time / torch.ckpt [q1, q3]")
    rows = []
    for m in MODES:
        f = flops[m.name]
        row = [
            m.name,
            b[m.name].live_after_forward,
            b[m.name].live_after_forward / base_b.live_after_forward,
            eager[m.name].live_after_forward,
            f[0],
            f[1],
            f"{100 * (sum(f) - base_f) / base_f:+.2f}%",
        ]
        if times:
            t = times[m.name]
            row.append(f"{t.ratio:.3f} [{t.ratio_low:.2f}, {t.ratio_high:.2f}]")
        rows.append(row)
    notes = [f"compiled {m.name}: {m.description}" for m in MODES]
    notes.append(
        "bytes and FLOPs: AOTAutograd + min-cut partitioner without inductor; FLOPs of "
        "the compiled graphs (the backward graph includes the recompute)"
    )
    notes.append("eager live after fwd: the same mode run without torch.compile")
    if times:
        notes.append(
            f"time: inductor, median over {TIME_ROUNDS} interleaved rounds of the "
            "per-round ratio, quartiles in brackets"
        )
    table = Table(
        f"W5 compiled: GPT stack d={cfg.d_model}, s={cfg.seq_len}, batch {cfg.batch}, "
        f"{cfg.n_layers} block(s), torch.compile(fullgraph=True)",
        columns,
        rows,
        notes,
    )

    differ = [n for n, g in grads.items() if not all(map(torch.equal, g, grads[M.NO_AC.name]))]
    checks = [
        Check(
            "every compiled mode computes bitwise the gradients of compiled no AC",
            "gradients",
            f"differ: {differ}" if differ else f"equal in all {len(grads)} modes",
            not differ,
        )
    ]
    remat_modes = (M.REMAT_FULL.name, M.REMAT_SAVE_LINEARS.name)
    checks.append(
        Check(
            "compiled remat keeps no more bytes after forward than eager remat",
            "bytes",
            ", ".join(
                f"{n}: {b[n].live_after_forward:,} vs {eager[n].live_after_forward:,} B"
                for n in remat_modes
            ),
            all(b[n].live_after_forward <= eager[n].live_after_forward for n in remat_modes),
        )
    )
    for remat_mode, peer, why in (
        (M.REMAT_FULL, M.TORCH_CHECKPOINT, "both recompute everything"),
        (M.REMAT_SAVE_LINEARS, M.SAC_LINEARS, "both tag the linear layers' outputs must-save"),
    ):
        r, p = remat_mode.name, peer.name
        live_r, live_p = b[r].live_after_forward, b[p].live_after_forward
        checks.append(
            Check(
                f"compiled {r} saves exactly what compiled {p} saves ({why})",
                "bytes",
                f"{live_r:,} vs {live_p:,} B",
                live_r == live_p,
            )
        )
        checks.append(
            Check(
                f"compiled {r} runs the FLOPs of compiled {p}",
                "flops",
                f"{sum(flops[r]):,} vs {sum(flops[p]):,}",
                flops[r] == flops[p],
            )
        )
    return WorkloadResult(
        name="W5",
        title="compiled: torch.compile around every checkpointing mode",
        config=asdict(cfg),
        tables=[table],
        checks=checks,
        data={
            "bytes": {k: asdict(v) for k, v in b.items()},
            "flops": {k: {"forward": f[0], "backward": f[1]} for k, f in flops.items()},
            "times": {k: asdict(v) for k, v in times.items()},
            "eager_bytes": {k: asdict(v) for k, v in eager.items()},
        },
    )
