"""Named ranges for ``torch.profiler`` that cost one C call when no profiler runs."""

from __future__ import annotations

import contextlib

import torch

from .._compat import profiler_enabled as _profiler_enabled

_NULL = contextlib.nullcontext()


def profiler_range(*name_parts: str) -> contextlib.AbstractContextManager:
    """``record_function("".join(name_parts))`` while a profiler runs; otherwise a
    shared no-op (the name is not even built)."""
    if _profiler_enabled():
        return torch.profiler.record_function("".join(name_parts))
    return _NULL
