"""Memory reports across ranks: what every rank holds for backward, side by side.

Each rank builds its own saved-tensors report (:func:`torch_remat.saved_tensors_report`:
every live checkpoint by region name, plus saves outside checkpoints), reduces it
to a compact record (:func:`rank_summary`: its total and the bytes and calls per
region), and :func:`gather_memory_report` collects the records on one rank as a
:class:`ClusterMemoryReport` (``_cluster_report``).

The records travel through the process group's key-value store
(``ProcessGroup.get_group_store()``), not through collectives, so the gathering
rank can wait with a deadline: a rank that never arrives is named in an error after
``timeout``, and because no collective was left half-done the process group stays
usable. The cost on the gathering rank must not grow with the world size beyond
reading the records themselves, so a gathering uses three keys whatever the number
of ranks (:func:`gather_over_store`):

* every rank appends its record, one JSON line, to ``<tag>/records``
  (``Store.append`` is atomic on the store's server), then counts itself in with
  ``add(<tag>/arrived, 1)``; the rank whose ``add`` returns the world size sets
  ``<tag>/complete``;
* the gathering rank waits for ``<tag>/complete`` with the deadline, reads
  ``<tag>/records`` once and deletes the three keys. After the deadline it reads
  the records that did arrive, so the ranks that did not are named.

That is seven or eight store round trips on the gathering rank and two or three on
every other rank, which return at once, whatever the world size.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

import torch.distributed as dist

import torch_remat as remat

from ._cluster_report import OUTSIDE_REGIONS, CheckpointAcrossRanks, ClusterMemoryReport
from ._rank_groups import rank_label

__all__ = [
    "ClusterMemoryReport",
    "MemoryReportTimeout",
    "OUTSIDE_REGIONS",
    "CheckpointAcrossRanks",
    "gather_memory_report",
    "gather_over_store",
    "rank_summary",
]

_KEY_PREFIX = "torch_remat/memory_report"
_calls_per_group: dict[str, int] = {}


class MemoryReportTimeout(RuntimeError):
    """Some ranks did not send their report to ``dst`` before the timeout."""

    def __init__(self, message: str, missing_ranks: list[int]) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks


def rank_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The compact record one rank sends: ``{"total": bytes, "regions": [[name,
    bytes, calls], ...]}`` from a ``SavedTensorsReport.to_dict()``, checkpoint calls
    of one name summed, saves outside checkpoints under ``(outside regions)``.

    Its size grows with the number of region names, not with the tensors held."""
    held: dict[str, list[Any]] = {}
    for block in report["checkpoints"]:
        entry = held.setdefault(block["name"], [block["name"], 0, 0])
        entry[1] += int(block["bytes"])
        entry[2] += 1
    held[OUTSIDE_REGIONS] = [OUTSIDE_REGIONS, int(report["outside_bytes"]), len(report["outside"])]
    return {"total": int(report["total_bytes"]), "regions": list(held.values())}


def gather_memory_report(
    roots: Any = None,
    group: dist.ProcessGroup | None = None,
    dst: int = 0,
    *,
    timeout: datetime.timedelta | float = 60.0,
    tag: str | int | None = None,
    imbalance_threshold: float = 0.10,
) -> ClusterMemoryReport | None:
    """Gather every rank's saved-tensors report on ``dst`` and aggregate it.

    Call it on every rank of ``group`` at the same point, after the forward and
    before the backward, with that rank's loss as ``roots`` (see
    :func:`torch_remat.saved_tensors_report`). Returns a :class:`ClusterMemoryReport`
    on ``dst`` (a global rank) and None on the other ranks, which do not wait.
    Nothing is sent between two calls: training steps never touch the store.

    Args:
        timeout: how long ``dst`` waits for the other ranks (seconds or timedelta).
            A rank that has not reported by then is named in a
            :class:`MemoryReportTimeout`; the process group stays usable.
        tag: identifies this gathering across ranks (e.g. the step number). By
            default each process counts its calls per group, so a rank that once
            skips the call stays one call behind; pass the step to recover.
        imbalance_threshold: flag ranks and regions whose (max - min) / max over
            ranks exceeds this fraction (default 10%).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "gather_memory_report needs an initialized process group "
            "(torch.distributed.init_process_group); in one process use "
            "torch_remat.print_saved_tensors_report(loss)."
        )
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    if dst not in ranks:
        raise ValueError(f"gather_memory_report: dst={dst} is not in the group (ranks {ranks}).")
    if tag is None:
        count = _calls_per_group.get(group.group_name, 0)
        _calls_per_group[group.group_name] = count + 1
        tag = f"call{count}"
    summary = rank_summary(remat.saved_tensors_report(roots).to_dict())
    summaries = gather_over_store(
        group.get_group_store(), ranks, dist.get_rank(), dst, summary, tag=tag, timeout=timeout
    )
    if summaries is None:
        return None
    return ClusterMemoryReport(ranks, summaries, imbalance_threshold)


def gather_over_store(
    store: dist.Store,
    ranks: list[int],
    rank: int,
    dst: int,
    summary: dict[str, Any],
    *,
    tag: str | int,
    timeout: datetime.timedelta | float,
) -> list[dict[str, Any]] | None:
    """The transport of :func:`gather_memory_report` on any ``torch.distributed.Store``:
    ``rank`` (one of ``ranks``) sends ``summary``; on ``dst`` it returns every rank's
    summary in the order of ``ranks`` (None elsewhere), or raises
    :class:`MemoryReportTimeout` naming the ranks missing after ``timeout``."""
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    deadline = time.monotonic() + seconds
    prefix = f"{_KEY_PREFIX}/{tag}/"
    records, arrived, complete = prefix + "records", prefix + "arrived", prefix + "complete"
    # JSON escapes newlines inside strings, so one line is one record.
    store.append(records, json.dumps({"rank": rank, **summary}, separators=(",", ":")) + "\n")
    if store.add(arrived, 1) == len(ranks):
        store.set(complete, b"1")
    if rank != dst:
        return None
    try:
        # at least a millisecond: a zero timeout means "wait forever" to the store
        store.wait([complete], datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
    except RuntimeError:  # the store's timeout (DistStoreError): read what did arrive
        pass
    by_rank, twice = _parse_records(store.get(records))
    missing = [r for r in ranks if r not in by_rank]
    if missing:
        # after the deadline; or sooner when a rank sent twice under this tag and so
        # completed the count in place of a rank that did not send
        raise MemoryReportTimeout(_timeout_message(missing, ranks, seconds, tag, twice), missing)
    for key in (records, arrived, complete):
        store.delete_key(key)
    return [by_rank[r] for r in ranks]


def _parse_records(raw: bytes) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """Each rank's record, and the ranks that sent more than one."""
    by_rank: dict[int, dict[str, Any]] = {}
    twice: list[int] = []
    for line in raw.splitlines():
        record = json.loads(line)
        rank = record.pop("rank")
        if rank in by_rank:
            twice.append(rank)
        by_rank[rank] = record
    return by_rank, twice


def _timeout_message(missing: list[int], ranks: list[int], seconds: float, tag: Any, twice: list[int]) -> str:
    absent = set(missing)
    arrived = [r for r in ranks if r not in absent]
    repeated = f"; {rank_label(sorted(set(twice)))} sent twice under this tag" if twice else ""
    return (
        f"gather_memory_report: {rank_label(missing)} did not send their memory report "
        f"within {seconds:g} s (tag {tag!r}; arrived: "
        f"{rank_label(arrived) if arrived else 'none'}{repeated}). Every rank of the group "
        "must call gather_memory_report at the same point; a rank that skipped it, crashed "
        "or is stuck in an earlier collective never arrives. The process group is unaffected."
    )
