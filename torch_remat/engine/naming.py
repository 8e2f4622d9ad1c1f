"""``remat.name_scope``: prefixes for region names, so one sub-block called twice in
a checkpoint gets distinct regions.

The prefixes are per thread. A checkpoint remembers the prefixes active when its
forward started and its replay runs under the same ones, wherever backward runs.
A region's body starts with no prefixes of its own (its regions are already
qualified by the region's name), so ``name_scope("a")`` around ``region("outer")``
whose body calls ``region("inner")`` names them ``a/outer`` and ``a/outer.inner``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


class _Prefixes(threading.local):
    def __init__(self) -> None:
        self.active: tuple[str, ...] = ()


_prefixes = _Prefixes()


@contextlib.contextmanager
def name_scope(prefix: str) -> Iterator[None]:
    """Name the regions called inside the block ``prefix/name``.

    ::

        with remat.name_scope("mlp_in"):
            h = mlp(x)          # its region "up" is named "mlp_in/up"
        with remat.name_scope("mlp_out"):
            y = mlp(h)          # ... and here "mlp_out/up"

    Nested scopes join with ``/`` (``outer/inner/name``). Reports, traces and error
    messages show the full name. Only ``remat.region`` names change; checkpoint
    names (``region_name``) do not.
    """
    if not isinstance(prefix, str) or not prefix:
        raise TypeError(f"remat.name_scope: prefix must be a non-empty string, got {prefix!r}.")
    previous = _prefixes.active
    _prefixes.active = (*previous, prefix)
    try:
        yield
    finally:
        _prefixes.active = previous


def current_prefixes() -> tuple[str, ...]:
    return _prefixes.active


def scoped_name(name: str, prefixes: tuple[str, ...]) -> str:
    return "/".join((*prefixes, name))


@contextlib.contextmanager
def prefixes_set_to(prefixes: tuple[str, ...]) -> Iterator[None]:
    """Run the block under ``prefixes`` (a replay under its forward's prefixes)."""
    previous = _prefixes.active
    _prefixes.active = prefixes
    try:
        yield
    finally:
        _prefixes.active = previous


def without_prefixes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with no prefixes active (a region body)."""

    def body(*args: Any, **kwargs: Any) -> Any:
        previous = _prefixes.active
        _prefixes.active = ()
        try:
            return fn(*args, **kwargs)
        finally:
            _prefixes.active = previous

    return body
