"""Reading a folder of OOM dumps: JSON only, every unusable file named with its reason.

A dump is read with ``json`` only (never unpickled nor passed to ``torch.load``),
checked against the schema of ``_oom_dump``, and kept as its summary: the detailed
saved-tensors report and its text, which make up most of a dump, are dropped once
read and read again only for ``--show``, so merging a thousand dumps holds a
thousand summaries, not a thousand reports.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch_remat.diagnostics as remat_diagnostics
from torch_remat._integration import format_bytes

from ._oom_dump import FORMAT, VERSION

READ_LIMIT_BYTES = 64 * 2**20
MAX_WORLD_SIZE = 2**20
"""The largest ``world_size`` a dump may name; a larger one is taken for a damaged file."""
DETAIL_FIELDS = ("saved_tensors", "saved_tensors_text")
"""Dropped from a dump once it is read; :meth:`RankDump.detail` reads them again."""


@dataclass
class SkippedFile:
    """A file of the folder that was not merged, and why."""

    path: str
    reason: str


@dataclass
class RankDump:
    """One valid dump: ``data`` is the JSON object as read, less ``DETAIL_FIELDS``."""

    path: str
    data: dict[str, Any]

    def detail(self) -> dict[str, Any]:
        """The fields left out when the folder was read (``DETAIL_FIELDS``), read
        again from the file (empty if it changed meanwhile)."""
        data, reason = _load(self.path)
        if reason is not None or not isinstance(data, dict):
            return {}
        return {key: data.get(key) for key in DETAIL_FIELDS}

    @property
    def rank(self) -> int:
        return self.data["rank"]

    @property
    def time(self) -> float:
        return float(self.data["time"])

    @property
    def job_id(self) -> str | None:
        return self.data.get("job_id")

    def where(self) -> str:
        location = self.data.get("location")
        if not isinstance(location, dict) or not isinstance(location.get("checkpoint"), str):
            return "outside checkpoints"
        return remat_diagnostics.ActiveCheckpoint(
            location["checkpoint"], str(location.get("phase")), location.get("region")
        ).format()

    def requested(self) -> str:
        n = self.data.get("requested_bytes")
        if not is_int(n):
            return "?"
        return ("" if self.data.get("requested_bytes_exact") else "~") + format_bytes(n)

    def error_line(self) -> str:
        error = self.data.get("error")
        if not isinstance(error, dict):
            return "(no exception recorded: written by the CUDA observer)"
        message = str(error.get("message", "")).strip().splitlines()
        return f"{error.get('type')}: {message[0] if message else ''}"

    def summary(self, order: int, first_time: float) -> dict[str, Any]:
        d = self.data
        return {
            "order": order,
            "rank": self.rank,
            "attempt": d.get("attempt"),
            "step": d.get("step"),
            "time": self.time,
            "time_utc": d.get("time_utc"),
            "seconds_after_first": self.time - first_time,
            "host": d.get("host"),
            "device": d.get("device"),
            "requested_bytes": d.get("requested_bytes"),
            "requested_bytes_exact": bool(d.get("requested_bytes_exact")),
            "location": d.get("location"),
            "site": d.get("site"),
            "source": d.get("source"),
            "error": self.error_line(),
            "file": os.path.basename(self.path),
        }


def read_dumps(folder: str) -> tuple[list[RankDump], list[SkippedFile]]:
    """Every valid dump in ``folder`` (not recursive) and every file skipped."""
    dumps, skipped = [], []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.startswith(".oom_") and entry.name.endswith(".tmp"):
            skipped.append(SkippedFile(entry.path, "half-written: its writer stopped before "
                                       "renaming it into place"))
            continue
        if not entry.name.endswith(".json") or not entry.is_file(follow_symlinks=False):
            continue
        data, reason = _load(entry.path)
        if reason is None:
            reason = _invalid(data)
        if reason is None:
            for key in DETAIL_FIELDS:
                data.pop(key, None)
            dumps.append(RankDump(entry.path, data))
        else:
            skipped.append(SkippedFile(entry.path, reason))
    return dumps, skipped


def _load(path: str) -> tuple[Any, str | None]:
    try:
        with open(path, "rb") as f:
            # read(n) allocates n bytes up front: ask for the file's size (one more
            # byte notices a file that grew past the limit meanwhile)
            size = os.fstat(f.fileno()).st_size
            raw = f.read(min(size, READ_LIMIT_BYTES) + 1)
    except OSError as e:
        return None, f"could not be read ({e.strerror or e})"
    if len(raw) > READ_LIMIT_BYTES:
        return None, f"larger than {format_bytes(READ_LIMIT_BYTES)}; not read"
    if not raw.strip():
        return None, "empty: a writer that stopped before writing, or not a dump"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8 text (binary data; dumps are JSON)"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        body = text.strip()
        if e.pos >= len(body) or (body.startswith("{") and not body.endswith("}")):
            return None, "cut off: the JSON ends early (a truncated or half-written file)"
        return None, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except RecursionError:
        return None, "not a dump (JSON nested too deeply)"


def _invalid(data: Any) -> str | None:
    """Why ``data`` is not a usable dump, or None.

    Every field the merge reads is checked here, so that the merge, its text and its
    JSON never meet a value of the wrong type: a damaged or hand-edited file is
    skipped with the reason instead of stopping the merge of the others."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return f'not a torch_remat OOM dump (no "format": "{FORMAT}")'
    version = data.get("version")
    if not is_int(version):
        return "malformed dump: version is not an integer"
    if version > VERSION:
        return f"written by a newer torch_remat (dump version {version}; this reads {VERSION})"
    if not is_int(data.get("rank")) or data["rank"] < 0:
        return "malformed dump: rank is not a non-negative integer"
    t = data.get("time")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        return "malformed dump: time is not a number"
    if data.get("job_id") is not None and not isinstance(data["job_id"], str):
        return "malformed dump: job_id is not a string"
    world_size = data.get("world_size")
    if world_size is not None:
        if not is_int(world_size):
            return "malformed dump: world_size is not an integer"
        if world_size <= data["rank"]:
            return f"malformed dump: world_size {world_size} does not include its rank {data['rank']}"
        if world_size > MAX_WORLD_SIZE:
            return (f"malformed dump: world_size {world_size} is more ranks than the merge accepts "
                    f"(at most {MAX_WORLD_SIZE})")
    step = data.get("step")
    if step is not None and not (is_int(step) or isinstance(step, str)):
        return "malformed dump: step is not an integer or a string"
    if data.get("attempt") is not None and not is_int(data["attempt"]):
        return "malformed dump: attempt is not an integer"
    if not _count_or_none(data.get("requested_bytes")):
        return "malformed dump: requested_bytes is not a non-negative integer"
    for key in ("host", "device", "time_utc", "site", "source"):
        if data.get(key) is not None and not isinstance(data[key], str):
            return f"malformed dump: {key} is not a string"
    error = data.get("error")
    if error is not None and not (
        isinstance(error, dict) and isinstance(error.get("type"), str)
        and isinstance(error.get("message", ""), str)
    ):
        return "malformed dump: error is not {type, message}"
    location = data.get("location")
    if location is not None and not (
        isinstance(location, dict) and isinstance(location.get("checkpoint"), str)
        and isinstance(location.get("phase"), str) and _str_or_none(location.get("region"))
    ):
        return "malformed dump: location is not {checkpoint, phase, region}"
    for key, kind, name in (("allocator", dict, "an object"), ("errors", list, "a list"),
                            ("largest_tensors", list, "a list")):
        if data.get(key) is not None and not isinstance(data[key], kind):
            return f"malformed dump: {key} is not {name}"
    regions = data.get("regions") or []
    if not isinstance(regions, list) or not all(
        isinstance(r, dict) and isinstance(r.get("name"), str) and _count(r.get("bytes"))
        for r in regions
    ):
        return "malformed dump: regions is not a list of {name, bytes}"
    for i, r in enumerate(regions):
        if not _count_or_none(r.get("calls")):
            return f"malformed dump: regions[{i}].calls is not a non-negative integer"
    left = data.get("regions_left_out")
    if left is not None and not (
        isinstance(left, dict) and _count(left.get("count")) and _count(left.get("bytes"))
    ):
        return "malformed dump: regions_left_out is not {count, bytes} (non-negative integers)"
    return _invalid_tensors(data.get("largest_tensors") or [])


def _invalid_tensors(rows: list[Any]) -> str | None:
    for i, row in enumerate(rows):
        where = f"largest_tensors[{i}]"
        if not isinstance(row, dict):
            return f"malformed dump: {where} is not an object"
        if not _count(row.get("bytes")):
            return f"malformed dump: {where}.bytes is not a non-negative integer"
        shape = row.get("shape")
        if shape is not None and not isinstance(shape, list):
            return f"malformed dump: {where}.shape is not a list"
        for key in ("region", "tensor", "dtype", "site"):
            if not _str_or_none(row.get(key)):
                return f"malformed dump: {where}.{key} is not a string"
    return None


def _count(x: Any) -> bool:
    return is_int(x) and x >= 0


def _count_or_none(x: Any) -> bool:
    return x is None or _count(x)


def _str_or_none(x: Any) -> bool:
    return x is None or isinstance(x, str)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
