"""Merge a folder of OOM dumps into one view of the cluster.

``python -m torch_remat.integrations.oom DIR`` (or ``torch-remat-oom DIR``) reads every
``*.json`` file in ``DIR`` with ``json`` only (a dump is never unpickled nor passed to
``torch.load``), keeps dumps of different jobs apart by their job id, and prints per
job which ranks ran out first, the bytes each checkpoint region held across those
ranks (min / max / which rank), and the largest tensors with their allocation sites.
A region that a rank's dump left out to stay within its size bound is unknown on
that rank: it is named in the row and counts in neither its min nor its max. Files it
cannot use (corrupt, cut off, half-written, malformed, not a dump, from a newer
version) are listed with the reason and skipped.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from torch_remat._integration import format_bytes

from ._oom_read import RankDump, SkippedFile, is_int, read_dumps
from ._rank_groups import rank_label, span_ranges

NO_JOB = "(no job id)"
ORDER_ROWS = 10
"""Dumps listed one per row; the rest are counted by step and place."""
NOTE_ROWS = 5
SKIPPED_ROWS = 20


@dataclass
class RegionAcrossDumps:
    """One region over the ranks of a job (their first dumps): bytes and calls per
    rank, None where the rank's dump left the region out to stay within its size
    bound (unknown there, not 0). ``min_bytes`` / ``max_bytes`` are over the ranks
    whose bytes are known."""

    name: str
    bytes_per_rank: list[int | None]
    calls_per_rank: list[int | None]

    @property
    def known(self) -> list[int]:
        return [b for b in self.bytes_per_rank if b is not None]

    @property
    def min_bytes(self) -> int:
        return min(self.known)

    @property
    def max_bytes(self) -> int:
        return max(self.known)

    @property
    def min_index(self) -> int:
        return self.bytes_per_rank.index(self.min_bytes)

    @property
    def max_index(self) -> int:
        return self.bytes_per_rank.index(self.max_bytes)

    @property
    def left_out_indexes(self) -> list[int]:
        return [i for i, b in enumerate(self.bytes_per_rank) if b is None]


@dataclass
class JobOOMReport:
    """The dumps of one job, earliest first."""

    job_id: str | None
    dumps: list[RankDump]
    top: int = 10
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dumps.sort(key=lambda d: (d.time, d.rank))

    @property
    def first_per_rank(self) -> list[RankDump]:
        """Each rank's earliest dump, in the order the ranks ran out."""
        seen: dict[int, RankDump] = {}
        for d in self.dumps:
            seen.setdefault(d.rank, d)
        return list(seen.values())

    @property
    def world_size(self) -> int | None:
        sizes = [d.data.get("world_size") for d in self.dumps if is_int(d.data.get("world_size"))]
        return max(sizes) if sizes else None

    def missing_spans(self) -> list[tuple[int, int]]:
        """The ranks of ``world_size`` without a dump, as ``(first, last)`` spans,
        found from the ranks with one (never by walking every rank)."""
        if self.world_size is None:
            return []
        spans, start = [], 0
        for rank in sorted({d.rank for d in self.dumps}):
            if rank > start:
                spans.append((start, rank - 1))
            start = rank + 1
        if start < self.world_size:
            spans.append((start, self.world_size - 1))
        return spans

    @property
    def ranks_without_dump(self) -> list[int]:
        # world_size is at most _oom_read.MAX_WORLD_SIZE: the read skips larger ones
        return [r for first, last in self.missing_spans() for r in range(first, last + 1)]

    def regions(self) -> tuple[list[int], list[RegionAcrossDumps]]:
        """Bytes per region over the ranks whose first dump has a report; None for a
        region a rank's dump left out (``regions_left_out``): unknown there."""
        with_report = [d for d in self.first_per_rank if d.data.get("regions")]
        ranks = [d.rank for d in with_report]
        per_rank = [{r["name"]: r for r in d.data["regions"]} for d in with_report]
        absent = [None if isinstance(d.data.get("regions_left_out"), dict) else 0 for d in with_report]
        names = list(dict.fromkeys(name for held in per_rank for name in held))
        regions = [
            RegionAcrossDumps(
                name,
                [held[name]["bytes"] if name in held else none for held, none in zip(per_rank, absent)],
                [held[name].get("calls") or 0 if name in held else none
                 for held, none in zip(per_rank, absent)],
            )
            for name in names
        ]
        return ranks, regions

    def largest_tensors(self) -> list[dict[str, Any]]:
        """The ``top`` largest rows of every rank's ``largest_tensors``, with their rank."""
        rows = (
            (row, d.rank)
            for d in self.first_per_rank
            for row in d.data.get("largest_tensors") or []
            if isinstance(row, dict) and is_int(row.get("bytes"))
        )
        top = heapq.nsmallest(self.top, rows, key=lambda pair: (-pair[0]["bytes"], pair[1]))
        return [{**row, "rank": rank} for row, rank in top]

    def _report_notes(self) -> list[str]:
        notes = list(self.notes)
        without: dict[str, list[int]] = {}
        trimmed: list[tuple[int, int, int]] = []
        for d in self.first_per_rank:
            if not d.data.get("regions"):
                why = "; ".join(str(e) for e in d.data.get("errors") or []) or "none recorded"
                without.setdefault(why, []).append(d.rank)
            left = d.data.get("regions_left_out")
            if isinstance(left, dict):
                trimmed.append((d.rank, left["count"], left["bytes"]))
        for why, ranks in without.items():
            whose = f"{rank_label(ranks)}'s dump has" if len(ranks) == 1 else f"the dumps of {rank_label(ranks)} have"
            notes.append(f"{whose} no saved-tensors report ({why})")
        for rank, count, nbytes in trimmed[:NOTE_ROWS]:
            notes.append(f"rank {rank}'s dump left out {count} smaller regions "
                         f"({format_bytes(nbytes)}) to stay within its size bound; the regions "
                         f"it does not list are unknown on rank {rank} and not in their min / max")
        if len(trimmed) > NOTE_ROWS:
            notes.append(f"{len(trimmed) - NOTE_ROWS} more dumps left out smaller regions (--json: regions_left_out)")
        later = len(self.dumps) - len(self.first_per_rank)
        if later:
            notes.append(f"{later} later dump(s) of ranks that had already run out are not in the tables")
        return notes

    def format(self) -> str:
        first = self.dumps[0]
        name = f"job '{self.job_id}'" if self.job_id is not None else NO_JOB
        ranks_out = len(self.first_per_rank)
        total = f" of {self.world_size}" if self.world_size is not None else ""
        head = f"{name}: {ranks_out}{total} rank(s) ran out of memory"
        missing = self.missing_spans()
        if missing:
            head += f"; no dump from rank(s) {span_ranges(missing)}"
        lines = [head, "", "ran out of memory, earliest first:", *self._order_lines()]
        lines += ["", f"first: rank {first.rank} ({first.data.get('host')}, "
                      f"{os.path.basename(first.path)})", f"  {first.error_line()}"]
        lines += self._region_lines() + self._tensor_lines()
        notes = self._report_notes()
        if notes:
            lines += ["", "notes:"] + [f"  {n}" for n in notes]
        return "\n".join(lines)

    def _order_lines(self) -> list[str]:
        """The first ``ORDER_ROWS`` dumps one per row; beyond, the others by step and place."""
        first = self.dumps[0]
        rows = [["#", "rank", "step", "time (UTC)", "after", "device", "requested", "where", "site"]]
        for i, d in enumerate(self.dumps[:ORDER_ROWS], 1):
            after = "" if i == 1 else f"+{d.time - first.time:.3f} s"
            step = d.data.get("step")
            rows.append([str(i), str(d.rank), "-" if step is None else str(step),
                         str(d.data.get("time_utc", "")), after, str(d.data.get("device")),
                         d.requested(), d.where(), str(d.data.get("site") or "")])
        lines = _table(rows, right={0, 1, 2, 4, 6})
        rest = self.dumps[ORDER_ROWS:]
        if rest:
            lines.append(f"  ... {len(rest)} more dump(s), the last +{rest[-1].time - first.time:.3f} s "
                         "after the first (--json lists every dump); all dumps by step and place:")
            places: dict[tuple[Any, str], list[int]] = {}
            for d in self.dumps:
                places.setdefault((d.data.get("step"), d.where()), []).append(d.rank)
            for (step, where), ranks in places.items():
                lines.append(f"    step {'-' if step is None else step}, {where}: {rank_label(ranks)}")
        return lines

    def _region_lines(self) -> list[str]:
        ranks, regions = self.regions()
        if not regions:
            return []
        rows = [["region", "min", "on", "max", "on"]]
        any_left_out = any(r.left_out_indexes for r in regions)
        if any_left_out:
            rows[0].append("not in the dump of")
        for r in regions:
            low = [rank for rank, b in zip(ranks, r.bytes_per_rank) if b == r.min_bytes]
            high = [rank for rank, b in zip(ranks, r.bytes_per_rank) if b == r.max_bytes]
            left_out = [ranks[i] for i in r.left_out_indexes]
            if len(ranks) > 1 and r.min_bytes == r.max_bytes and not left_out:
                on_low = on_high = "all ranks"
            else:
                on_low, on_high = rank_label(low, limit=2), rank_label(high, limit=2)
            rows.append([r.name, format_bytes(r.min_bytes), on_low,
                         format_bytes(r.max_bytes), on_high])
            if any_left_out:
                rows[-1].append(f"{rank_label(left_out, limit=2)} (left out)" if left_out else "")
        return ["", "saved for backward when each rank ran out (its first dump):", *_table(rows, right={1, 3})]

    def _tensor_lines(self) -> list[str]:
        if self.top == 0:
            return ["", "largest tensors: left out (--top 0)"]
        tensors = self.largest_tensors()
        if not tensors:
            return []
        rows = [["bytes", "rank", "region", "tensor", "shape", "dtype", "site"]]
        for t in tensors:
            shape = t.get("shape")
            rows.append([format_bytes(t["bytes"]), str(t["rank"]), str(t.get("region")),
                         str(t.get("tensor")), "" if shape is None else str(tuple(shape)),
                         str(t.get("dtype") or ""), str(t.get("site") or "")])
        return ["", "largest tensors held for backward:", *_table(rows, right={0, 1})]

    def to_dict(self) -> dict[str, Any]:
        first_time = self.dumps[0].time
        ranks, regions = self.regions()
        return {
            "job_id": self.job_id,
            "world_size": self.world_size,
            "ranks_with_dump": sorted({d.rank for d in self.dumps}),
            "ranks_without_dump": self.ranks_without_dump,
            "ran_out": [d.summary(i, first_time) for i, d in enumerate(self.dumps, 1)],
            "regions": [
                {
                    "name": r.name,
                    "ranks": ranks,
                    "bytes_per_rank": r.bytes_per_rank,
                    "calls_per_rank": r.calls_per_rank,
                    "min": r.min_bytes,
                    "min_rank": ranks[r.min_index],
                    "max": r.max_bytes,
                    "max_rank": ranks[r.max_index],
                    "ranks_left_out": [ranks[i] for i in r.left_out_indexes],
                }
                for r in regions
            ],
            "largest_tensors": self.largest_tensors(),
            "notes": self._report_notes(),
        }


@dataclass
class OOMMerge:
    """Every job found in a folder of dumps, and the files skipped."""

    folder: str
    jobs: list[JobOOMReport]
    skipped: list[SkippedFile]
    selected: str | None = None
    """The job asked for (``--job``), or None for all."""
    others: dict[str | None, int] = field(default_factory=dict)
    """Dumps per job of the folder's other jobs, when one job was asked for."""

    def format(self) -> str:
        dumps = sum(len(j.dumps) for j in self.jobs)
        skipped = f"{len(self.skipped)} file(s) skipped"
        if not self.jobs and self.others:
            head = (f"no dump of {job_names([self.selected])}; the folder holds "
                    f"{sum(self.others.values())} dump(s) of {job_names(list(self.others))}")
        else:
            head = f"{dumps} dump(s) of {len(self.jobs)} job(s)"
        lines = [f"torch_remat OOM dumps in {self.folder}: {head}, {skipped}"]
        if len(self.jobs) > 1:
            without = any(j.job_id in (None, "") for j in self.jobs)
            lines.append("dumps of different jobs are shown apart; --job ID shows one"
                         + ("; --job '' shows those without a job id" if without else ""))
        for job in self.jobs:
            lines += ["", job.format()]
        if self.skipped:
            lines += ["", "skipped:", *self._skipped_lines()]
        return "\n".join(lines)

    def _skipped_lines(self) -> list[str]:
        """One line per file; past ``SKIPPED_ROWS`` files, one line per reason."""
        if len(self.skipped) <= SKIPPED_ROWS:
            return [f"  {os.path.basename(s.path)}: {s.reason}" for s in self.skipped]
        by_reason: dict[str, list[str]] = {}
        for s in self.skipped:
            by_reason.setdefault(s.reason, []).append(os.path.basename(s.path))
        return [f"  {len(names)} file(s), e.g. {', '.join(names[:2])}: {reason}"
                for reason, names in by_reason.items()]

    def __str__(self) -> str:
        return self.format()

    def to_dict(self) -> dict[str, Any]:
        return {
            "folder": self.folder,
            "jobs": [j.to_dict() for j in self.jobs],
            "skipped": [{"file": os.path.basename(s.path), "reason": s.reason} for s in self.skipped],
        }


def merge_dumps(folder: str, job_id: str | None = None, *, top: int = 10) -> OOMMerge:
    """Read ``folder`` and group its dumps by job (all jobs, or only ``job_id``; ``""``
    selects the dumps without a job id), jobs in the order their first rank ran out."""
    dumps, skipped = read_dumps(folder)
    by_job: dict[str | None, list[RankDump]] = {}
    for d in dumps:
        by_job.setdefault(d.job_id, []).append(d)
    others: dict[str | None, int] = {}
    if job_id is not None:
        wanted = (None, "") if job_id == "" else (job_id,)
        others = {k: len(v) for k, v in by_job.items() if k not in wanted}
        by_job = {k: v for k, v in by_job.items() if k in wanted}
    jobs = [JobOOMReport(k, v, top) for k, v in by_job.items()]
    jobs.sort(key=lambda j: j.dumps[0].time)
    return OOMMerge(os.path.abspath(folder), jobs, skipped, job_id, others)


def job_names(job_ids: list[str | None]) -> str:
    """``"job 'a'"``, ``"jobs 'a', 'b' and (no job id)"``."""
    quoted = [f"'{j}'" for j in job_ids if j] + ([NO_JOB] if any(not j for j in job_ids) else [])
    named = sum(1 for j in job_ids if j)
    prefix = "" if named == 0 else "job " if named == 1 else "jobs "
    return prefix + (quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1])


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        ("  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                          for i, (c, w) in enumerate(zip(r, widths)))).rstrip()
        for r in rows
    ]


def _show(merge: OOMMerge, rank: int) -> str:
    for job in merge.jobs:
        for d in job.first_per_rank:
            if d.rank == rank:
                allocator = d.data.get("allocator") or {}
                stats = [f"  {k}: {format_bytes(v) if k.endswith('bytes') and is_int(v) else v}"
                         for k, v in allocator.items()]
                text = d.detail().get("saved_tensors_text") or "(no text report in this dump)"
                return "\n".join([f"rank {rank}, {os.path.basename(d.path)}", d.error_line(),
                                  f"where: {d.where()}", "allocator:", *stats, "", str(text)])
    return f"no dump from rank {rank}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="torch-remat-oom",
        description="Merge the per-rank OOM dumps of torch_remat.integrations.oom into one "
        "cluster view. Reads JSON only.",
    )
    parser.add_argument("dir", help="the folder given to oom.install (or --oom-dump-dir)")
    parser.add_argument("--json", action="store_true", help="print the merge as JSON")
    parser.add_argument("--job", help="only this job id (TORCHELASTIC_RUN_ID); '' for the dumps "
                        "without a job id")
    parser.add_argument("--top", type=_top, default=10,
                        help="largest tensors to list (default 10; 0 leaves the table out)")
    parser.add_argument("--show", type=int, metavar="RANK",
                        help="also print this rank's full saved-tensors report and allocator "
                        "statistics (text only: not with --json)")
    args = parser.parse_args(argv)
    if args.json and args.show is not None:
        parser.error("--show prints one rank's text report and cannot be combined with --json; "
                     "run it without --json (the JSON has every rank's summary)")
    if not os.path.isdir(args.dir):
        print(f"torch-remat-oom: {args.dir} is not a folder", file=sys.stderr)
        return 2
    merge = merge_dumps(args.dir, args.job, top=args.top)
    try:
        if args.json:
            print(json.dumps(merge.to_dict(), indent=1))
        else:
            print(merge.format())
            if args.show is not None:
                print("\n" + _show(merge, args.show))
        sys.stdout.flush()
    except BrokenPipeError:  # the reader (e.g. `| head`) stopped reading
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if not merge.jobs:
        which = f" of job '{args.job}'" if args.job is not None else ""
        message = f"torch-remat-oom: no usable OOM dump{which} in {args.dir}"
        if merge.others:
            message += (f"; it holds dumps of {job_names(list(merge.others))}: pass one of them "
                        "to --job")
            if any(not j for j in merge.others):
                message += " (--job '' for dumps without a job id)"
        print(message, file=sys.stderr)
        return 1
    return 0


def _top(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(
            f"must be 0 or more (0 leaves the largest tensors out), got {n}")
    return n
