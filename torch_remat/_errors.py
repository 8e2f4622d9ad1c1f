"""Exception types raised by torch_remat at run time.

All of them derive from :class:`RematError`, itself a :class:`RuntimeError`, so code
that already catches ``RuntimeError`` around ``backward()`` keeps working. Misuse of
the API at call time (wrong argument types, bad names) raises ``TypeError`` or
``ValueError`` instead.
"""

from __future__ import annotations


class RematError(RuntimeError):
    """Base class for torch_remat's run-time errors."""


class PlaceholderReadError(RematError):
    """Recompute read the data of a tensor that torch_remat did not keep.

    Raised when replayed (RECOMPUTE) code reads an output of a SAVE region that was
    not persisted, or a checkpoint input that was dropped. The message names the
    checkpoint, the region and the output, and says where to call
    :func:`torch_remat.recompute_needs_tensor`.
    """


class RecomputeMismatchError(RematError):
    """The recompute did not follow the same path as the original forward."""


class SavedTensorModifiedError(RematError):
    """A tensor needed for backward was modified in place after it was saved."""


class RematCompileError(RematError):
    """A checkpoint under ``torch.compile`` was asked for something a compiled graph
    cannot do (a user ``RecomputeStateHook``); the message says what to do instead."""


def modified_in_place(
    tensor: str, when: str, fix: str, versions: tuple[int, int] | None = None
) -> SavedTensorModifiedError:
    """The error for a tensor backward needs that changed in place: ``tensor`` says
    which one and where it was saved, ``when`` when it changed, ``fix`` what to do."""
    changed = "" if versions is None else f" (version {versions[0]} -> {versions[1]})"
    return SavedTensorModifiedError(
        f"torch_remat: {tensor} was modified in place {when}{changed}. Its gradient "
        f"would be wrong. {fix}"
    )


CLONE_FIRST = "Clone it before modifying it."


class _StopRecompute(BaseException):
    # Raised from the replay pack hook once every needed tensor is refilled (early
    # stop). A BaseException so that a user's ``except Exception`` inside the
    # replayed function cannot swallow it.
    pass
