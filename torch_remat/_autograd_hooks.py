"""Saved-tensor-hook primitives shared by the checkpoint engine and the scope API.

Both push their own default hooks (no context manager per call), key recomputed
tensors by the backward that needs them, and unpack outside Dynamo.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import _compat
from ._compat import INFERENCE_VERSION, any_version, version_of

push_hooks = _compat.push_saved_tensors_hooks
pop_hooks = _compat.pop_saved_tensors_hooks
top_hooks = _compat.top_saved_tensors_hooks
disabled_message = _compat.saved_tensors_hooks_disabled_message


_graph_exec_group = _compat.get_graph_exec_group
_graph_task_id = _compat.current_graph_task_id


def graph_task_key() -> Any:
    """Which backward is unpacking: the one answer the engine and the scope API key
    recreated tensors by.

    * an ``int``: the graph task id of a plain backward;
    * ``(id(group),)``: a ``torch.utils.checkpoint.GraphExecGroup``, whose
      backwards share one replay (its id, not the group, so that what is recreated
      for it does not keep the group alive);
    * a fresh ``object()``: an unpack outside any backward (``grad_fn._saved_self``),
      which nothing else will share."""
    group = _graph_exec_group()
    if group is not None:
        return (id(group),)
    gid = _graph_task_id()
    if gid == -1:
        return object()
    return gid


def when_backward_ends(key: Any, forget: Callable[[], None]) -> None:
    """Call ``forget`` when the backward ``key`` (:func:`graph_task_key`) is over, to
    free what was recreated for it and not unpacked (a backward that reached only
    part of the graph): at the end of a graph task; when a graph-exec group dies
    (its backwards may come one after the other). Nothing for an ``object()`` key:
    its unpack is the only one."""
    if type(key) is int:
        _compat.queue_backward_callback(forget)
    elif type(key) is tuple:
        group = _graph_exec_group()
        if group is not None:
            weakref.finalize(group, forget)


def in_backward() -> bool:
    return _compat.current_graph_task_id() != -1


def unpack_packed(packed: Any) -> torch.Tensor:
    """The unpack hook of both subsystems: ``packed.unpack()``, run eagerly.

    Eager backward calls it directly (Dynamo's disable wrapper costs several
    microseconds per unpack); when Dynamo traces it (compiled autograd), the traced
    branch calls the disabled function, which runs outside the graph."""
    if "torch._dynamo" in sys.modules and torch.compiler.is_compiling():
        return _unpack_outside_dynamo(packed)
    return packed.unpack()


@_compat.disable_dynamo
def _unpack_outside_dynamo(packed: Any) -> torch.Tensor:
    # Compiled autograd calls unpack hooks from a graph that Dynamo compiles, and
    # Dynamo would then compile the recompute too (the function, regions and all):
    # an AOT-compiled replay saves other tensors than the eager forward did. The
    # replay must run eagerly; functions the user compiled stay compiled.
    return packed.unpack()


class VersionedTensor:
    """A tensor held for later with the version it had then: the one way the engine
    and the scope API keep a tensor and refuse it once it was modified in place
    (what an autograd ``SavedTensor`` checks, without the autograd bookkeeping).
    ``data`` is the name ``SavedTensor`` uses, which the reports look for."""

    __slots__ = ("data", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.data = t
        try:
            self.version = version_of(t)
        except RuntimeError:  # an inference tensor: never updated outside inference mode
            self.version = any_version(t)

    def intact(self) -> bool:
        """False once the tensor was modified in place since it was held."""
        return self.version == INFERENCE_VERSION or version_of(self.data) == self.version

    def unpack(self) -> torch.Tensor:
        t = self.data
        if self.version != INFERENCE_VERSION and version_of(t) != self.version:
            from ._errors import CLONE_FIRST, modified_in_place
            from ._tensors import describe_tensor

            raise modified_in_place(
                f"a tensor saved for backward ({describe_tensor(t.shape, t.dtype)})",
                "after it was saved",
                CLONE_FIRST,
                (self.version, version_of(t)),
            )
        return t


class PackedPayload:
    """What a pack hook returned for a tensor, with the unpack hook that turns it
    back into the tensor: the one packed form the engine's kept tensors and the
    scope API's delegated saves share. ``data`` is what is held (the reports look
    for tensors in it, as in ``SavedTensor.data``)."""

    __slots__ = ("packed", "unpack_fn")

    def __init__(self, packed: Any, unpack_fn: Any) -> None:
        self.packed = packed
        self.unpack_fn = unpack_fn

    @property
    def data(self) -> Any:
        return self.packed

    def unpack(self) -> torch.Tensor:
        return self.unpack_fn(self.packed)
