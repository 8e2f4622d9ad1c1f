"""Cluster-wide out-of-memory diagnosis: every rank writes a JSON dump, one command
merges them.

On every rank::

    from torch_remat.integrations import oom

    dumps = oom.install("/shared/oom")      # on CUDA it also attaches the allocator observer
    for step in range(1, steps + 1):
        with dumps.guard(step=step):
            loss = model(batch).sum()
            loss.backward()
            opt.step()

A rank whose step runs out of memory writes ``oom_<job>_rank<R>_<pid>_<n>.json`` into
the folder, atomically, and the error then fails the step as before (or is
swallowed with ``guard(..., suppress=True)``). Then, wherever the folder is visible::

    python -m torch_remat.integrations.oom /shared/oom      # or: torch-remat-oom /shared/oom

prints which ranks ran out first, the bytes each checkpoint region held across the
ranks, and the largest tensors with their allocation sites (``--json`` for
machines). What a dump holds is listed in ``_oom_dump``'s docstring.

Two ways in, because neither covers every case alone:

* The guard catches the error in the training step on any device:
  ``torch.OutOfMemoryError``, and the CPU allocator's failure, which torch raises as
  a plain ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory"). The
  frames between the failed allocation and the guard are still alive (the
  exception's traceback holds them), so the activations they reference are in the
  report, and :func:`torch_remat.active_checkpoint` reads the checkpoint and region
  from the traceback.
* On CUDA the caching allocator calls its out-of-memory observers when a request
  fails, before raising and before anything unwinds, also in autograd's device
  threads where no guard runs; the request size is exact. The observer writes the
  dump then; the guard that catches the same error adds the exception to that file
  instead of writing a second one. The observer also runs for requests PyTorch
  recovers from, so the guard adds a ``torch.OutOfMemoryError`` only to the newest
  observer dump of its block whose device and size are the ones the message names
  ("Tried to allocate 2.00 GiB. GPU 0"); any other error gets a dump of its own.

Dump numbers ``<n>`` count the dumps this process wrote into the folder, across
:func:`install` calls, and skip names already taken, so no dump replaces another.

Writing a dump never raises (a failure prints one line to stderr), takes about
``time_budget_s`` at most (the saved-tensors report, which scans every live object,
is built in a helper thread and left out if late), and writes at most
``max_dump_bytes`` (see ``_oom_dump.encode_bounded`` for what is trimmed first).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

import torch_remat as remat
import torch_remat.diagnostics as remat_diagnostics

from ._oom_bound import encode_bounded
from ._oom_dump import (
    MIN_DUMP_BYTES,
    allocator_statistics,
    device_of_error,
    error_record,
    int_env,
    is_out_of_memory,
    largest_tensors,
    new_dump,
    region_totals,
    request_matches,
    requested_bytes,
    run_bounded,
    safe_name,
    saved_tensors,
    user_site,
    write_atomically,
)
from ._stderr import write_line
from .rng import local_device

__all__ = ["install", "installed", "uninstall", "OOMDumps", "OOMGuard", "is_out_of_memory", "main"]

DEFAULT_MAX_DUMP_BYTES = 4 * 2**20
DEFAULT_TIME_BUDGET_S = 10.0
_OBSERVED_KEPT = 16
"""Observer dumps remembered for the guard to add their exception to."""

_numbers_lock = threading.Lock()
_last_number: dict[str, int] = {}
"""The last dump number this process used in each folder, whichever OOMDumps wrote it."""


class OOMDumps:
    """This process's OOM dumps: where they go and what identifies them.

    Made by :func:`install`; use :meth:`guard` around the training step.
    ``written`` lists the paths written so far.
    """

    def __init__(
        self,
        dump_dir: str,
        *,
        job_id: str | None = None,
        rank: int | None = None,
        max_dump_bytes: int = DEFAULT_MAX_DUMP_BYTES,
        time_budget_s: float = DEFAULT_TIME_BUDGET_S,
        record_sites: bool = False,
    ) -> None:
        if max_dump_bytes < MIN_DUMP_BYTES:
            raise ValueError(
                f"oom.install: max_dump_bytes={max_dump_bytes} is too small; a dump needs "
                f"at least {MIN_DUMP_BYTES} bytes to say which rank failed and where."
            )
        if not time_budget_s > 0:
            raise ValueError(f"oom.install: time_budget_s must be positive, got {time_budget_s!r}.")
        self.dump_dir = os.path.abspath(dump_dir)
        self.job_id = job_id
        self.rank = rank
        self.max_dump_bytes = int(max_dump_bytes)
        self.time_budget_s = float(time_budget_s)
        self.record_sites = record_sites
        self.step: int | None = None
        """The step of the innermost active guard; observer dumps record it."""
        self.written: list[str] = []
        self._observed = 0
        self._recent_observed: list[list[Any]] = []
        """[number, dump, path, id of the exception added or None] of the last
        ``_OBSERVED_KEPT`` observer dumps."""
        self._busy = threading.local()

    def guard(self, step: int | None = None, *, suppress: bool = False) -> OOMGuard:
        """A context manager (or decorator) that dumps this rank's state when the
        block runs out of memory. ``step`` goes into the dump; ``suppress=True``
        swallows the error after dumping (the default re-raises it). Other
        exceptions pass through untouched."""
        return OOMGuard(self, step, suppress)

    def observe(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        """The CUDA caching allocator's out-of-memory observer (see
        :func:`torch_remat.oom_observer` for its arguments). Writes a dump; never raises."""
        if getattr(self._busy, "active", False):
            return  # an allocation failed while this thread was writing a dump
        self._busy.active = True
        started = time.monotonic()
        try:
            dump = self._new_dump("cuda_observer", f"cuda:{int(device)}", self.step)
            dump["requested_bytes"], dump["requested_bytes_exact"] = int(alloc), True
            dump["site"] = user_site(traceback.extract_stack())
            dump["location"] = _location(remat.active_checkpoint())
            device_memory = {"device_usable_bytes": int(device_alloc),
                             "device_free_bytes": int(device_free)}
            self._collect(dump, device_memory, started)
            path = self._write(dump)
            if path is not None:
                self._observed += 1
                self._recent_observed = [
                    *self._recent_observed[-(_OBSERVED_KEPT - 1):], [self._observed, dump, path, None]]
        except BaseException as e:  # an observer must never raise
            _warn(f"the OOM observer failed ({type(e).__name__}: {e})")
        finally:
            self._busy.active = False

    def dump_exception(self, exc: BaseException, step: int | None = None) -> str | None:
        """Write a dump for ``exc``, an out-of-memory error that was just caught,
        and return its path (None if it could not be written). Never raises."""
        if getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        started = time.monotonic()
        try:
            message = str(exc)
            dump = self._new_dump("exception", device_of_error(message, str(local_device())), step)
            dump["requested_bytes"], dump["requested_bytes_exact"] = requested_bytes(message)
            dump["error"] = error_record(exc)
            dump["site"] = user_site(traceback.extract_tb(exc.__traceback__))
            dump["location"] = _location(remat.active_checkpoint(exc))
            self._collect(dump, {}, started)
            return self._write(dump)
        except BaseException as e:
            _warn(f"writing the OOM dump failed ({type(e).__name__}: {e})")
            return None
        finally:
            self._busy.active = False

    # -------------------------------------------------------------- internals

    def _on_error(self, exc: BaseException, step: int | None, observed_before: int) -> None:
        found = self._observer_dump_of(exc, observed_before)
        if found is None:
            self.dump_exception(exc, step)
            return
        # The observer dumped this error when the allocation failed; add the exception.
        dump, path = found
        try:
            dump["error"] = error_record(exc)
            if dump.get("step") is None:
                dump["step"] = step
            write_atomically(
                os.path.dirname(path), os.path.basename(path),
                encode_bounded(dump, self.max_dump_bytes),
            )
        except BaseException as e:
            _warn(f"adding the exception to {path} failed ({type(e).__name__}: {e})")

    def _observer_dump_of(
        self, exc: BaseException, observed_before: int
    ) -> tuple[dict[str, Any], str] | None:
        """The observer dump of the request whose failure ``exc`` reports: the newest
        one written since the guard was entered whose device and size are the ones the
        message names. None for anything but ``torch.OutOfMemoryError``, and for a
        message that names no size."""
        if not isinstance(exc, torch.OutOfMemoryError):
            return None
        message = str(exc)
        device = device_of_error(message, "")
        for entry in reversed(self._recent_observed):
            number, dump, path, added = entry
            if number <= observed_before:
                break
            if added is not None and added != id(exc):
                continue  # another exception was added to this one
            if device and dump.get("device") != device:
                continue
            if request_matches(message, dump.get("requested_bytes")):
                entry[3] = id(exc)  # an outer guard catching the same exception finds it again
                return dump, path
        return None

    def _new_dump(self, source: str, device: str, step: int | None) -> dict[str, Any]:
        rank, world_size = self._rank_and_world()
        job_id = self.job_id if self.job_id is not None else os.environ.get("TORCHELASTIC_RUN_ID")
        return new_dump(job_id, rank, world_size, step, source, device)

    def _rank_and_world(self) -> tuple[int, int | None]:
        try:
            if dist.is_available() and dist.is_initialized():
                rank, world = dist.get_rank(), dist.get_world_size()
                return (self.rank if self.rank is not None else rank), world
        except Exception:
            pass
        rank = self.rank if self.rank is not None else (int_env("RANK") or 0)
        return rank, int_env("WORLD_SIZE")

    def _collect(self, dump: dict[str, Any], device_memory: dict[str, int], started: float) -> None:
        try:
            dump["allocator"] = {**allocator_statistics(dump["device"]), **device_memory}
        except Exception as e:
            dump["errors"].append(f"allocator statistics: {type(e).__name__}: {e}")
        remaining = max(0.05, self.time_budget_s - (time.monotonic() - started))
        try:
            report, text = run_bounded(saved_tensors, remaining)
            dump["saved_tensors"], dump["saved_tensors_text"] = report, text
            dump["regions"] = region_totals(report)
            dump["largest_tensors"] = largest_tensors(report)
        except TimeoutError:
            dump["errors"].append(
                f"saved-tensors report: not ready within the time budget "
                f"({self.time_budget_s:g} s); left out"
            )
        except BaseException as e:
            dump["errors"].append(f"saved-tensors report: {type(e).__name__}: {e}")
        dump["build_seconds"] = round(time.monotonic() - started, 6)

    def _write(self, dump: dict[str, Any]) -> str | None:
        prefix = f"oom_{safe_name(dump['job_id'])}_rank{dump['rank']}_{dump['pid']}_"
        name = f"{prefix}<n>.json"
        try:
            payload = encode_bounded(dump, self.max_dump_bytes)
            os.makedirs(self.dump_dir, exist_ok=True)
            name = _unused_name(self.dump_dir, prefix)
            path = write_atomically(self.dump_dir, name, payload)
        except BaseException as e:
            _warn(f"could not write the OOM dump {name} to {self.dump_dir} ({type(e).__name__}: {e})")
            return None
        self.written.append(path)
        step = f" at step {dump['step']}" if dump.get("step") is not None else ""
        where = dump.get("location")
        inside = f" in {remat_diagnostics.ActiveCheckpoint(**where).format()}" if where else ""
        _warn(f"rank {dump['rank']} ran out of memory{step}{inside}; dump written to {path}")
        return path


class OOMGuard(contextlib.ContextDecorator):
    """What :meth:`OOMDumps.guard` returns: ``with dumps.guard(step=s): ...`` or
    ``@dumps.guard()`` on the step function."""

    def __init__(self, dumps: OOMDumps, step: int | None, suppress: bool) -> None:
        self.dumps = dumps
        self.step = step
        self.suppress = suppress
        self._outer: list[tuple[int | None, int, contextlib.ExitStack]] = []

    def __enter__(self) -> OOMGuard:
        sites = contextlib.ExitStack()
        if self.dumps.record_sites:
            sites.enter_context(remat.record_save_sites())
        self._outer.append((self.dumps.step, self.dumps._observed, sites))
        self.dumps.step = self.step
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        previous_step, observed_before, sites = self._outer.pop()
        sites.close()
        self.dumps.step = previous_step
        if exc is None or not is_out_of_memory(exc):
            return False
        self.dumps._on_error(exc, self.step, observed_before)
        return self.suppress


_installed: OOMDumps | None = None
_observer_attached = False


def install(
    dump_dir: str | os.PathLike[str],
    *,
    job_id: str | None = None,
    rank: int | None = None,
    max_dump_bytes: int = DEFAULT_MAX_DUMP_BYTES,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    cuda_observer: bool = True,
    record_sites: bool = False,
) -> OOMDumps:
    """Make this rank write an OOM dump into ``dump_dir``; call it on every rank.

    Creates the folder, and where CUDA is available attaches the CUDA allocator's
    out-of-memory observer (once per process: torch cannot detach one; a later
    ``install`` redirects it). Returns the :class:`OOMDumps` whose ``guard(step=...)``
    goes around the training step.

    Args:
        job_id: default ``TORCHELASTIC_RUN_ID`` (read when a dump is written). The
            merge keeps dumps of different jobs apart by it.
        rank: default the process group's rank, else ``RANK``, else 0.
        max_dump_bytes: upper bound of each dump file (at least 4096).
        time_budget_s: about how long writing one dump may take; the saved-tensors
            report is left out of the dump if it is not ready by then.
        cuda_observer: attach the CUDA observer (when CUDA is available).
        record_sites: run guarded blocks under :func:`torch_remat.record_save_sites`,
            so that tensors saved by SAVE regions carry their allocation site on any
            device (a Python stack walk per saved tensor). On CUDA, sites also come
            from the allocator when ``torch.cuda.memory._record_memory_history()`` is on.
    """
    global _installed, _observer_attached
    dumps = OOMDumps(
        os.fspath(dump_dir),
        job_id=job_id,
        rank=rank,
        max_dump_bytes=max_dump_bytes,
        time_budget_s=time_budget_s,
        record_sites=record_sites,
    )
    os.makedirs(dumps.dump_dir, exist_ok=True)
    _installed = dumps
    if cuda_observer and not _observer_attached and torch.cuda.is_available():
        _observer_attached = remat.attach_oom_observer(_observe_installed)
    return dumps


def installed() -> OOMDumps | None:
    """The :class:`OOMDumps` of the last :func:`install` in this process, if any."""
    return _installed


def uninstall() -> None:
    """Stop writing dumps (the CUDA observer stays attached but does nothing)."""
    global _installed
    _installed = None


def _observe_installed(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
    dumps = _installed
    if dumps is not None:
        dumps.observe(device, alloc, device_alloc, device_free)


def _unused_name(folder: str, prefix: str) -> str:
    """``<prefix><n>.json`` with ``n`` the next number this process uses in ``folder``
    (shared by every :class:`OOMDumps` writing there), past names already taken (a
    restarted worker may have the pid of an earlier one)."""
    with _numbers_lock:
        n = _last_number.get(folder, 0) + 1
        while os.path.lexists(os.path.join(folder, f"{prefix}{n}.json")):
            n += 1
        _last_number[folder] = n
    return f"{prefix}{n}.json"


def _location(active: remat_diagnostics.ActiveCheckpoint | None) -> dict[str, Any] | None:
    return active.to_dict() if active is not None else None


def _warn(message: str) -> None:
    try:
        write_line(f"torch_remat: {message}")
    except BaseException:
        pass


def main(argv: list[str] | None = None) -> int:
    """``python -m torch_remat.integrations.oom DIR [--json] [--job ID] [--top N] [--show R]``."""
    from ._oom_merge import main as merge_main

    return merge_main(argv)


if __name__ == "__main__":
    sys.exit(main())
