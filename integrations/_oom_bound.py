"""Bounding the size of an OOM dump: what is trimmed, in which order, to fit.

A rank that runs out of memory may hold millions of saved tensors; its dump must
still fit ``max_dump_bytes`` and keep what the merge needs (who, when, where, and
the bytes per region), so the detail goes first and the identification last.
"""

from __future__ import annotations

import json
from typing import Any


def encode(dump: dict[str, Any]) -> bytes:
    return json.dumps(dump, separators=(",", ":"), default=str).encode()


def encode_bounded(dump: dict[str, Any], max_bytes: int) -> bytes:
    """``dump`` as JSON of at most ``max_bytes`` bytes.

    Trims in this order until it fits, noting each step in ``truncated``: the text
    report to a quarter of the budget, the rows of each region to its 8 largest,
    the checkpoint calls to the 64 largest (and saves outside checkpoints to the 16
    largest node types), then drops the detailed report, then the text, then
    shortens the summaries. If even that does not fit, only the fields that
    identify the event are kept. ``regions`` and ``largest_tensors`` are computed
    before trimming, so totals stay exact whatever was trimmed.
    """
    dump.setdefault("truncated", [])
    payload = encode(dump)
    for step in (_trim_text, _trim_rows, _trim_calls, _drop_detail, _drop_text, _trim_summaries):
        if len(payload) <= max_bytes:
            return payload
        note = step(dump, max_bytes)
        if note:
            dump["truncated"].append(note)
            payload = encode(dump)
    if len(payload) <= max_bytes:
        return payload
    small = _identification(dump, max_bytes)
    payload = encode(small)
    if len(payload) <= max_bytes:
        return payload
    # Names that JSON escapes six-fold (non-ASCII) can still overflow: keep numbers only.
    numbers = ("format", "version", "rank", "world_size", "pid", "time", "step", "requested_bytes")
    return encode({k: small.get(k) for k in numbers} | {"truncated": small["truncated"]})


def _trim_text(dump: dict[str, Any], max_bytes: int) -> str | None:
    text = dump.get("saved_tensors_text")
    limit = max_bytes // 4
    if not isinstance(text, str) or len(text) <= limit:
        return None
    dump["saved_tensors_text"] = clip(text, limit)
    return f"saved_tensors_text: cut to {limit} characters"


def _trim_rows(dump: dict[str, Any], max_bytes: int, keep: int = 8) -> str | None:
    report = dump.get("saved_tensors")
    if not isinstance(report, dict):
        return None
    cut = 0
    for block in report.get("checkpoints", []):
        for region in block.get("regions", []):
            rows = region.get("tensors", [])
            if len(rows) > keep:
                largest = sorted(range(len(rows)), key=lambda i: -rows[i].get("bytes", 0))[:keep]
                region["tensors"] = [rows[i] for i in sorted(largest)]
                region["tensors_left_out"] = len(rows) - keep
                cut += len(rows) - keep
    return f"saved_tensors: {cut} rows left out (the {keep} largest of each region kept)" if cut else None


def _trim_calls(dump: dict[str, Any], max_bytes: int, calls: int = 64, groups: int = 16) -> str | None:
    report = dump.get("saved_tensors")
    if not isinstance(report, dict):
        return None
    notes = []
    for key, keep in (("checkpoints", calls), ("outside", groups)):
        items = report.get(key, [])
        if len(items) > keep:
            order = sorted(range(len(items)), key=lambda i: -items[i].get("bytes", 0))
            left = [items[i] for i in order[keep:]]
            report[key] = [items[i] for i in sorted(order[:keep])]
            report[f"{key}_left_out"] = {
                "count": len(left),
                "bytes": sum(int(i.get("bytes", 0)) for i in left),
            }
            notes.append(f"{len(left)} {key} entries left out (the {keep} largest kept)")
    return "saved_tensors: " + ", ".join(notes) if notes else None


def _drop_detail(dump: dict[str, Any], max_bytes: int) -> str | None:
    if dump.pop("saved_tensors", None) is None:
        return None
    return "saved_tensors: left out (regions and largest_tensors summarise it)"


def _drop_text(dump: dict[str, Any], max_bytes: int) -> str | None:
    if dump.pop("saved_tensors_text", None) is None:
        return None
    return "saved_tensors_text: left out"


def _trim_summaries(dump: dict[str, Any], max_bytes: int, keep: int = 32) -> str | None:
    regions = dump.get("regions") or []
    if len(regions) > keep:
        order = sorted(range(len(regions)), key=lambda i: -regions[i].get("bytes", 0))
        left = [regions[i] for i in order[keep:]]
        dump["regions"] = [regions[i] for i in sorted(order[:keep])]
        dump["regions_left_out"] = {"count": len(left), "bytes": sum(r["bytes"] for r in left)}
    dump["largest_tensors"] = (dump.get("largest_tensors") or [])[:5]
    error = dump.get("error")
    if isinstance(error, dict):
        error["message"] = clip(str(error.get("message", "")), 500)
        error["traceback"] = (error.get("traceback") or [])[-3:]
    dump["errors"] = [clip(str(e), 200) for e in (dump.get("errors") or [])[:5]]
    return f"summaries: regions cut to the {keep} largest, largest_tensors to 5, messages shortened"


def _identification(dump: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    keep = ("format", "version", "job_id", "attempt", "rank", "world_size", "local_rank",
            "host", "pid", "time", "time_utc", "step", "source", "device", "requested_bytes",
            "requested_bytes_exact")
    small = {k: clip(v, 256) if isinstance(v, str) else v for k, v in dump.items() if k in keep}
    error = dump.get("error") if isinstance(dump.get("error"), dict) else {}
    small["error"] = {"type": clip(str(error.get("type")), 100),
                      "message": clip(str(error.get("message", "")), 500)} if error else None
    location = dump.get("location")
    if isinstance(location, dict):
        small["location"] = {k: clip(v, 256) if isinstance(v, str) else v for k, v in location.items()}
    small["truncated"] = [f"everything but what identifies the event: the dump exceeded {max_bytes} bytes"]
    return small


def clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f" ... ({len(text) - limit} more characters left out)"
