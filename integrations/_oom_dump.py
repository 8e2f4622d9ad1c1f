"""One rank's OOM dump: what goes into it, how its size is bounded, how it is written.

A dump is one JSON object (never a pickle: the merge command reads dumps with
``json`` only). Its fields, in the order they are written:

``format``, ``version``
    ``"torch_remat.oom_dump"`` and the schema version (1).
``job_id``, ``attempt``
    ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT`` (torchrun sets both;
    None elsewhere unless ``install(job_id=...)``).
``rank``, ``world_size``, ``local_rank``, ``host``, ``pid``
    Who wrote it.
``time``, ``time_utc``, ``step``
    When: seconds since the epoch, the same in ISO 8601 UTC, and the training step
    the guard was given (None without one).
``source``
    ``"exception"`` (the guard caught the error) or ``"cuda_observer"`` (the CUDA
    caching allocator called the observer before raising).
``device``, ``requested_bytes``, ``requested_bytes_exact``
    The device that ran out and the size of the failed request: exact from the
    CUDA observer and from the CPU allocator's message, rounded to two decimals
    when parsed from a CUDA message ("Tried to allocate 2.00 GiB"), None when the
    message does not say.
``error``
    ``type``, ``message`` and ``traceback`` of the exception; None for an observer
    dump that no exception has confirmed yet.
``site``
    ``file:line function`` of the innermost frame outside torch and torch_remat
    where the failing allocation was made.
``location``
    The checkpoint, phase and region running (:func:`torch_remat.active_checkpoint`),
    or None outside checkpoints.
``allocator``
    CUDA: the caching allocator's counters and the device's usable and free bytes;
    CPU: the process's resident and peak memory and the machine's available memory
    (from ``/proc``), where the platform has them.
``regions``, ``largest_tensors``
    Summaries computed from the full saved-tensors report before any trimming:
    bytes per checkpoint name (and ``(outside regions)``), and the largest saved
    storages with their allocation sites.
``saved_tensors``, ``saved_tensors_text``
    :func:`torch_remat.saved_tensors_report` (no roots: every live graph) as
    ``to_dict()`` and as its text.
``errors``, ``truncated``, ``build_seconds``
    What could not be collected, what was trimmed to respect the size bound, and
    how long building the dump took.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch

import torch_remat as remat

from ._oom_bound import clip
from .reports import OUTSIDE_REGIONS

FORMAT = "torch_remat.oom_dump"
VERSION = 1
MIN_DUMP_BYTES = 4096
LARGEST_TENSORS = 20
_MESSAGE_CHARS = 2000
_TRACEBACK_FRAMES = 30

_UNIT_BYTES = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# c10's DefaultCPUAllocator: "you tried to allocate 1125899906842624 bytes"
_CPU_REQUEST = re.compile(r"you tried to allocate (\d+) bytes")
# CUDA, XPU and MPS: "Tried to allocate 20.00 MiB" (c10::format_size, two decimals)
_ROUNDED_REQUEST = re.compile(r"Tried to allocate ([0-9.]+) (bytes|B|KiB|MiB|GiB|TiB)")
_CPU_ALLOCATOR_FAILURE = re.compile(r"DefaultCPUAllocator: (can't allocate memory|not enough memory)")
_CUDA_DEVICE = re.compile(r"\bGPU (\d+)\b")

# The CUDA caching allocator's counters worth keeping (torch.cuda.memory_stats keys).
_CUDA_STATS = (
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
    "active_bytes.all.current",
    "inactive_split_bytes.all.current",
    "requested_bytes.all.current",
    "num_alloc_retries",
    "num_ooms",
    "num_device_alloc",
    "num_device_free",
)
_PROC_STATUS = {"VmRSS": "process_resident_bytes", "VmHWM": "process_peak_resident_bytes",
                "VmSize": "process_virtual_bytes"}
_PROC_MEMINFO = {"MemTotal": "machine_total_bytes", "MemAvailable": "machine_available_bytes"}

T = TypeVar("T")


# ------------------------------------------------------------------ what failed


def is_out_of_memory(exc: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` and for the CPU allocator's failure,
    which torch reports as a plain ``RuntimeError`` ("DefaultCPUAllocator: can't
    allocate memory")."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and bool(_CPU_ALLOCATOR_FAILURE.search(str(exc)))


def requested_bytes(message: str) -> tuple[int | None, bool]:
    """The size of the failed request named in an allocator's message, and whether
    it is exact (the CPU allocator prints bytes; CUDA rounds to two decimals)."""
    m = _CPU_REQUEST.search(message)
    if m:
        return int(m.group(1)), True
    m = _ROUNDED_REQUEST.search(message)
    if m:
        return int(float(m.group(1)) * _UNIT_BYTES[m.group(2)]), m.group(2) in ("bytes", "B")
    return None, False


def request_matches(message: str, nbytes: Any) -> bool:
    """Whether an allocator's message names a request of ``nbytes`` (exact bytes, as
    the CUDA observer gets them): the size it prints, which is rounded to two
    decimals of its unit ("Tried to allocate 2.50 GiB"), is ``nbytes`` so rounded.
    False when the message names no size."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        return False
    m = _CPU_REQUEST.search(message)
    if m:
        return int(m.group(1)) == nbytes
    m = _ROUNDED_REQUEST.search(message)
    if not m:
        return False
    unit = _UNIT_BYTES[m.group(2)]
    # c10::format_size prints size / unit with two decimals: within half a hundredth
    return abs(nbytes / unit - float(m.group(1))) <= 0.005 + 1e-9


def device_of_error(message: str, fallback: str) -> str:
    if _CPU_ALLOCATOR_FAILURE.search(message):
        return "cpu"
    m = _CUDA_DEVICE.search(message)
    if m and "CUDA" in message:
        return f"cuda:{m.group(1)}"
    return fallback


def error_record(exc: BaseException) -> dict[str, Any]:
    frames = traceback.extract_tb(exc.__traceback__)
    return {
        "type": type(exc).__name__,
        "message": clip(str(exc), _MESSAGE_CHARS),
        "traceback": traceback.format_list(frames[-_TRACEBACK_FRAMES:]),
    }


def user_site(frames: list[traceback.FrameSummary]) -> str | None:
    """``file:line function`` of the innermost frame outside torch and torch_remat."""
    library = tuple(
        os.path.join(os.path.dirname(os.path.abspath(m.__file__ or "")), "")
        for m in (torch, remat)
    ) + (os.path.join(os.path.dirname(os.path.abspath(__file__)), ""),)
    for f in reversed(frames):
        if f.filename.endswith(".py") and not os.path.abspath(f.filename).startswith(library):
            return f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
    return None


# --------------------------------------------------------------- what was held


def allocator_statistics(device: str) -> dict[str, Any]:
    """Counters of the allocator that served ``device`` (never raises)."""
    stats: dict[str, Any] = {}
    if device.startswith("cuda") and torch.cuda.is_available():
        try:
            index = int(device.split(":")[1]) if ":" in device else None
            raw = torch.cuda.memory_stats(index)
            stats.update({k: int(raw[k]) for k in _CUDA_STATS if k in raw})
        except Exception as e:
            stats["error"] = f"torch.cuda.memory_stats failed: {type(e).__name__}: {e}"
    stats.update(_proc_fields("/proc/self/status", _PROC_STATUS))
    stats.update(_proc_fields("/proc/meminfo", _PROC_MEMINFO))
    return stats


def _proc_fields(path: str, wanted: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in wanted and value.strip().endswith("kB"):
                    out[wanted[key]] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def saved_tensors() -> tuple[dict[str, Any], str]:
    """The saved-tensors report of every live graph, as a dict and as text."""
    report = remat.saved_tensors_report()
    return report.to_dict(), report.format()


def region_totals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Bytes and calls per checkpoint name, then ``(outside regions)``."""
    totals: dict[str, dict[str, Any]] = {}
    for block in report.get("checkpoints", []):
        entry = totals.setdefault(block["name"], {"name": block["name"], "bytes": 0, "calls": 0})
        entry["bytes"] += int(block["bytes"])
        entry["calls"] += 1
    outside = report.get("outside", [])
    totals[OUTSIDE_REGIONS] = {
        "name": OUTSIDE_REGIONS,
        "bytes": int(report.get("outside_bytes", 0)),
        "calls": len(outside),
    }
    return list(totals.values())


def largest_tensors(report: dict[str, Any], limit: int = LARGEST_TENSORS) -> list[dict[str, Any]]:
    """The largest storages held for backward (rows counted in the report; saves
    outside checkpoints by node type), with their allocation sites."""
    rows = []
    for block in report.get("checkpoints", []):
        for region in block.get("regions", []):
            for t in region.get("tensors", []):
                if t.get("kind") == "storage":
                    rows.append(
                        {
                            "bytes": int(t["bytes"]),
                            "region": f"{block['name']}::{region['region']}",
                            "tensor": t.get("name"),
                            "shape": t.get("shape"),
                            "dtype": t.get("dtype"),
                            "site": t.get("site"),
                        }
                    )
    for group in report.get("outside", []):
        rows.append(
            {
                "bytes": int(group["bytes"]),
                "region": OUTSIDE_REGIONS,
                "tensor": f"{group['node']} (x{group['count']})",
                "shape": None,
                "dtype": None,
                "site": group.get("site"),
            }
        )
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:limit]


def run_bounded(fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()`` in a daemon thread, waiting at most ``timeout_s``.

    Raises ``TimeoutError`` when it has not finished by then; the thread keeps
    running in the background (Python threads cannot be stopped) and its result is
    dropped. Used for the report, which scans every live object and so grows with
    the program.
    """
    result: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # handed to the caller
            result["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name="torch_remat-oom-report", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"not finished within {timeout_s:g} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def utc_iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(
        timespec="milliseconds"
    ).replace("+00:00", "Z")


# ------------------------------------------------------------------ the record


def new_dump(
    job_id: str | None, rank: int, world_size: int | None, step: int | None, source: str, device: str
) -> dict[str, Any]:
    """A dump with every field of the schema above, identified and not yet filled."""
    now = time.time()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return {
        "format": FORMAT,
        "version": VERSION,
        "job_id": job_id,
        "attempt": int(attempt) if attempt and attempt.isdigit() else None,
        "rank": rank,
        "world_size": world_size,
        "local_rank": int_env("LOCAL_RANK"),
        "host": hostname(),
        "pid": os.getpid(),
        "time": now,
        "time_utc": utc_iso(now),
        "step": step,
        "source": source,
        "device": device,
        "requested_bytes": None,
        "requested_bytes_exact": False,
        "error": None,
        "site": None,
        "location": None,
        "allocator": {},
        "regions": [],
        "largest_tensors": [],
        "saved_tensors": None,
        "saved_tensors_text": None,
        "errors": [],
        "truncated": [],
        "build_seconds": None,
    }


def int_env(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


# --------------------------------------------------------------------- writing


def safe_name(text: str | None, limit: int = 64) -> str:
    """``text`` reduced to characters safe in a file name."""
    if not text:
        return "nojob"
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:limit]


def write_atomically(folder: str, name: str, payload: bytes) -> str:
    """Write ``payload`` to ``folder/name`` so that readers see the whole file or
    none: a hidden temporary file in the same folder, flushed to disk, then
    ``os.replace`` (atomic on POSIX file systems). A writer killed midway leaves
    only ``.<name>.<pid>.tmp``, which the merge reports as half-written."""
    path = os.path.join(folder, name)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def hostname() -> str:
    try:
        return socket.gethostname()
    except OSError:
        return "unknown"
