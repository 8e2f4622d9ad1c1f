"""One policy for every rank: rank 0's choice, broadcast; one verdict on it.

Every rank measures its own option table (the same runs in the same order, so a
forward that communicates, as under FSDP2, stays in step). Rank 0 solves; its
chosen option indices (or its infeasibility message) go to every rank, which
builds its plan from them and its own measurements, so each rank's prediction is
of its own bytes and every rank installs the same policy. Each rank then verifies
its own bytes, and every rank learns every rank's verdict (a collective all ranks
reach), so that a mismatch on one rank is raised on all of them, with one message,
instead of leaving the others waiting in the next collective.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from .plan import RematPlan


def agree(
    measured: RematPlan, plan: RematPlan, error: str | None
) -> tuple[RematPlan, str | None]:
    """Rank 0's ``(plan, error)`` on every rank (unchanged without a process group)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return plan, error
    message = [
        (list(plan.choices), plan.budget_bytes, plan.peak_budget_bytes, error)
        if dist.get_rank() == 0 else None
    ]
    dist.broadcast_object_list(message, src=0)
    choices, budget_bytes, peak_budget_bytes, error = message[0]
    if error is not None:
        return measured, f"rank 0: {error}"
    if len(choices) != len(measured.table):
        raise ValueError(
            f"plan_remat: rank 0 planned {len(choices)} blocks and rank "
            f"{dist.get_rank()} has {len(measured.table)}; every rank must plan the same "
            "model (pass per_rank=True to plan each rank for itself)."
        )
    return dataclasses.replace(
        measured, choices=choices, budget_bytes=budget_bytes, peak_budget_bytes=peak_budget_bytes
    ), None


def in_group() -> bool:
    """Under an initialized process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1



def agree_on_verification(mismatch: str | None) -> str | None:
    """The first failing rank's message on every rank (``None``: no rank failed):
    of the verification (every rank measured what it predicted), or, for plans of
    each rank's own (``per_rank``), of the planning itself; unchanged without a
    process group."""
    if not in_group():
        return mismatch
    verdicts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, mismatch)
    failed = [(rank, m) for rank, m in enumerate(verdicts) if m is not None]
    if not failed:
        return None
    ranks = ", ".join(str(r) for r, _ in failed)
    rank, message = failed[0]
    return f"rank {rank} (of the failing ranks {ranks}): {message}"
