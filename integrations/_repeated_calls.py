"""Distinct region names for a ``save_modules`` match called more than once in one
checkpointed forward (a shared sub-block): its second call runs under
``remat.name_scope("call1")``, its third under ``"call2"``, and so on, so its
regions are ``lin``, ``call1/lin``, ``call2/lin``.

Counts start afresh for every run of the checkpointed function, the forward and
each replay alike, so the replay names the calls exactly as the forward did.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

import torch_remat as remat


class _Counts(threading.local):
    def __init__(self) -> None:
        self.stack: list[dict[int, int]] = []


_counts = _Counts()


def run_counting_calls(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` with a fresh count of save-module calls."""
    if torch.compiler.is_compiling():
        # Compiled code has no replay to match names with, and Dynamo cannot
        # trace a thread-local's mutation: no numbering there.
        return fn(*args, **kwargs)
    stack = _counts.stack
    stack.append({})
    try:
        return fn(*args, **kwargs)
    finally:
        stack.pop()


def repeated_call_prefix(module: Any) -> contextlib.AbstractContextManager:
    """The name scope for this call of ``module``: none for its first call in the
    running checkpointed forward, ``call<n>`` for the ones after."""
    if torch.compiler.is_compiling() or not _counts.stack:
        return contextlib.nullcontext()
    counts = _counts.stack[-1]
    n = counts.get(id(module), 0)
    counts[id(module)] = n + 1
    return remat.name_scope(f"call{n}") if n else contextlib.nullcontext()
