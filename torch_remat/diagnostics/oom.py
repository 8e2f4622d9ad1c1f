"""An out-of-memory observer for the CUDA caching allocator.

``remat.attach_oom_observer()`` registers :func:`oom_observer` with
``torch._C._cuda_attach_out_of_memory_observer``. When an allocation fails, the
allocator calls it (before raising ``torch.OutOfMemoryError``) and it prints to
stderr the failed request, the checkpoint and region running at the time, and the
saved-tensors report of every live autograd graph, found without a loss handle.

An observer that raised would replace the OOM error with its own, so it never
raises: if building the report fails, it prints one failure line instead.
"""

from __future__ import annotations

import sys
import warnings
from typing import IO, Any

import torch

from .. import _compat
from ..engine.context import active_checkpoint
from .format import format_bytes

_FAILED = "torch_remat: OOM observer failed while building its report"


def format_oom_saved_tensors_report(
    exception: BaseException | None = None, annotate: Any = None
) -> str:
    """What the OOM observer prints after the allocator's request: the checkpoint
    (and region) running, then the saved-tensors report of everything alive.

    Call it where no allocator observer exists (CPU, or any ``except`` block)::

        except torch.OutOfMemoryError as e:
            print(remat.format_oom_saved_tensors_report(e))

    With ``exception``, the checkpoint is the one the exception was raised in (read
    from its traceback, see :func:`active_checkpoint`); without, the one running
    now. The ``while running ...`` line is left out when there is none.
    ``annotate`` labels rows (see :func:`saved_tensors_report`); a callable given
    in place of ``exception`` is taken as ``annotate``, as upstream torch-remat's
    ``format_oom_saved_tensors_report(annotate)`` is called."""
    from .saved_report import saved_tensors_report

    if annotate is None and callable(exception) and not isinstance(exception, BaseException):
        exception, annotate = None, exception

    active = active_checkpoint(exception)
    lines = [] if active is None else [f"while running {active.format()}"]
    report = saved_tensors_report(None) if annotate is None else saved_tensors_report(None, annotate)
    lines.append(report.format())
    return "\n".join(lines)


def format_oom_report(device: int, alloc: int, device_alloc: int, device_free: int) -> str:
    # c10's OutOfMemoryObserver passes (device, requested bytes, device total or the
    # per-process memory-fraction limit, free bytes reported by cudaMemGetInfo).
    header = (
        f"torch_remat: CUDA out of memory on device {device}: a request for "
        f"{format_bytes(alloc)} failed ({format_bytes(device_free)} free of "
        f"{format_bytes(device_alloc)} usable on the device)"
    )
    return f"{header}\n{format_oom_saved_tensors_report()}"


def oom_observer(
    device: int, alloc: int, device_alloc: int, device_free: int, *, file: IO[str] | None = None
) -> None:
    """Print the failed request and the saved-tensors report of all live graphs.

    The signature is the one ``torch._C._cuda_attach_out_of_memory_observer``
    calls: the device index, the bytes requested, the memory the process may use on
    the device (its total, or the ``set_per_process_memory_fraction`` limit) and the
    bytes free on it. It never raises; a failure of its own is printed as one line starting
    with ``torch_remat: OOM observer failed``.
    """
    out = file if file is not None else sys.stderr
    try:
        text = format_oom_report(device, alloc, device_alloc, device_free)
    except BaseException as e:  # an observer must never raise
        try:
            text = (
                f"{_FAILED} ({type(e).__name__}: {e}); the allocator's request for "
                f"{int(alloc)} bytes on device {device} failed"
            )
        except BaseException:
            text = _FAILED
    try:
        print(text, file=out, flush=True)
    except BaseException:
        pass


def attach_oom_observer(observer: Any = None) -> bool:
    """Attach :func:`oom_observer` (or ``observer``) to the CUDA caching allocator.

    Returns True when attached. Where no CUDA device is available (a CPU-only build,
    or a CUDA build on a machine without a visible GPU) there is no allocator to
    observe: it warns, and returns False; on CPU catch ``torch.OutOfMemoryError``
    and call ``remat.print_saved_tensors_report()`` instead.
    """
    reason = None
    attach = _compat.cuda_oom_observer_attacher()
    # The device decides, not what torch was built with: a CUDA build runs on
    # machines without a GPU too.
    if not torch.cuda.is_available():
        reason = "no CUDA device is available"
    elif attach is None:
        reason = "this PyTorch build has no CUDA out-of-memory observer"
    if reason is not None:
        warnings.warn(
            f"torch_remat.attach_oom_observer: not attached, {reason}. The observer "
            "hooks the CUDA caching allocator; elsewhere catch torch.OutOfMemoryError "
            "and call remat.print_saved_tensors_report().",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    attach(observer if observer is not None else oom_observer)
    return True
