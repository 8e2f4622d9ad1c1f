"""The protocol for state that a recompute must replay (RNG, counters)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from .. import _compat


@runtime_checkable
class RecomputeStateHook(Protocol):
    """State that code inside a checkpoint reads and that the recompute must replay.

    ``snapshot()`` returns an opaque value describing the current state;
    ``restore(state)`` makes a state current again. Restores are absolute, so the
    same snapshot may be restored any number of times (a second backward with
    ``retain_graph=True`` replays identically).

    torch_remat snapshots each hook when a checkpoint starts and after each SAVE
    region returns. When backward recomputes the checkpoint it snapshots the
    caller's state, restores the entry snapshot, restores each skipped SAVE
    region's exit snapshot in turn, and finally restores the caller's state (fork
    semantics: the recompute never moves the caller's RNG).

    Example, for the CUDA generator of one device::

        class CudaRNGStateHook:
            def __init__(self, device):
                self.device = device

            def snapshot(self):
                return torch.cuda.get_rng_state(self.device)

            def restore(self, state):
                torch.cuda.set_rng_state(state, self.device)
    """

    def snapshot(self) -> Any: ...

    def restore(self, state: Any) -> None: ...


class DeviceRNGStateHook:
    """A :class:`RecomputeStateHook` for one device's default generator.

    ``DeviceRNGStateHook("cpu")`` replays ``torch.default_generator``;
    ``DeviceRNGStateHook("cuda:1")`` replays the generator of CUDA device 1.
    Restores are absolute, so a snapshot can be restored any number of times.
    """

    def __init__(self, device: torch.device | str | int) -> None:
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"DeviceRNGStateHook({device}): CUDA is not available in this process."
                )
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cpu":
            raise ValueError(
                f"DeviceRNGStateHook: device type '{device.type}' is not supported; "
                "use 'cpu' or 'cuda[:N]', or write a RecomputeStateHook for it."
            )
        self.device = device

    def snapshot(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def restore(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def __repr__(self) -> str:
        return f"DeviceRNGStateHook({str(self.device)!r})"


class CPURNGStateHook(DeviceRNGStateHook):
    """Replays torch's default CPU generator (what dropout on CPU tensors draws from).

    Each snapshot is a 5056-byte copy of the Mersenne Twister state; snapshots that
    did not change since the previous one are shared, not stored again.
    """

    def __init__(self) -> None:
        super().__init__("cpu")

    def __repr__(self) -> str:
        return "CPURNGStateHook()"


def same_state(a: Any, b: Any) -> bool:
    """True if two snapshots are certainly equal (CPU tensors, scalars, tuples of
    them). Never synchronizes a device: device tensors compare unequal."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.device.type != "cpu" or b.device.type != "cpu":
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        # Below any dispatch mode: a recording mode (gradient_checkpoint_scope)
        # would otherwise keep both snapshots alive as inputs it read.
        with _compat.DisableTorchDispatch():
            return bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_state, a, b))
    if isinstance(a, (int, float, str, bytes, type(None))) and type(a) is type(b):
        return a == b
    return False


def validate_state_hooks(hooks: Iterable[Any]) -> tuple[Any, ...]:
    if hooks is None:
        return ()
    if isinstance(hooks, (str, bytes)) or not hasattr(hooks, "__iter__"):
        raise TypeError(
            "remat.checkpoint: recompute_state_hooks must be a tuple of objects with "
            f"snapshot() and restore(state), got {type(hooks).__name__}."
        )
    hooks = tuple(hooks)
    for i, h in enumerate(hooks):
        if not (callable(getattr(h, "snapshot", None)) and callable(getattr(h, "restore", None))):
            raise TypeError(
                f"remat.checkpoint: recompute_state_hooks[{i}] ({type(h).__name__}) "
                "needs both snapshot() and restore(state) methods (see "
                "remat.RecomputeStateHook)."
            )
    return hooks
