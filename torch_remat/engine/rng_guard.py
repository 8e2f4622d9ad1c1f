"""Random numbers drawn inside a checkpoint without a state hook for their generator.

The replay draws from the generator again. Unless a ``recompute_state_hooks``
entry put the generator back where the forward started, it draws other numbers
(another dropout mask) and the gradients would be wrong; and without a hook
nothing would put the caller's generator back after the replay.

Copying every generator's state around every checkpoint (``preserve_rng_state``)
is refused on purpose (see ``remat.checkpoint``). Instead, the default generators
are fingerprinted when the checkpoint starts and when its forward ends: a CUDA
generator by its seed and Philox offset, the CPU generator by its state (a
5056-byte read and compare; nothing is kept unless it changed). Only a forward that
drew from a generator keeps a hash of its starting state. Its replay then:

* saves the caller's state of that generator, and restores it after the replay
  (whatever the hooks do, the caller's next random number is the one it would
  have drawn without remat);
* after the hooks restored their entry snapshots, compares the generator with the
  forward's starting state. If they differ and the replay draws from it, the
  replay cannot be exact: :class:`RecomputeMismatchError` names the checkpoint and
  the generator and says which hook to pass. A forward that drew only inside SAVE
  regions (whose bodies the replay skips) is not refused.

Generators passed explicitly (``torch.rand(..., generator=g)``) are not seen.

With a state hook for a default generator (``CPURNGStateHook``,
``DeviceRNGStateHook``), the replay draws from the forward's starting state; that
is exact only if nothing else drew from the generator while the forward ran.
Another thread drawing from the shared generator in between would make the replay
draw another mask. So the generator is also fingerprinted at each top-level SAVE
region call, at the last tensor saved outside SAVE regions (where the replay stops
early) and at the end of the forward: the replay of a forward that drew compares
at the same points and raises :class:`RecomputeMismatchError` where the generator
is elsewhere (:func:`check_position`).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from .._errors import RecomputeMismatchError


class _CPUGenerator:
    name = "the CPU generator (torch.default_generator)"
    fix = "remat.CPURNGStateHook()"

    @staticmethod
    def fingerprint() -> bytes:
        # Below dispatch modes: a recording mode (gradient_checkpoint_scope) would
        # otherwise hold on to the state tensor.
        with _compat.DisableTorchDispatch():
            return torch.default_generator.get_state().numpy().tobytes()

    @staticmethod
    def get_state() -> torch.Tensor:
        return torch.default_generator.get_state()

    @staticmethod
    def set_state(state: torch.Tensor) -> None:
        torch.default_generator.set_state(state)


class _CUDAGenerator:
    def __init__(self, index: int) -> None:
        self.index = index
        self.name = f"the CUDA generator of cuda:{index}"
        self.fix = f"remat.DeviceRNGStateHook('cuda:{index}')"

    def fingerprint(self) -> tuple[int, int]:
        g = torch.cuda.default_generators[self.index]
        return g.initial_seed(), g.get_offset()

    def get_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.index)

    def set_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state, self.index)


_CPU = _CPUGenerator()
_cuda_generators: list[_CUDAGenerator] = []


def _generators() -> list[Any]:
    # CUDA generators exist only once CUDA is initialized; never initialize it here.
    if torch.cuda.is_initialized() and torch.cuda.is_available():
        n = torch.cuda.device_count()
        while len(_cuda_generators) < n:
            _cuda_generators.append(_CUDAGenerator(len(_cuda_generators)))
        return [_CPU, *_cuda_generators[:n]]
    return [_CPU]


def fingerprints() -> list[tuple[Any, Any]]:
    """``(generator, fingerprint)`` of every default generator, now."""
    return [(g, g.fingerprint()) for g in _generators()]


class RNGUse:
    """The generators a checkpoint's forward drew from, with a hash of their
    starting states."""

    __slots__ = ("used",)

    def __init__(self, used: list[tuple[Any, int]]) -> None:
        self.used = used

    @staticmethod
    def of_forward(start: list[tuple[Any, Any]]) -> RNGUse | None:
        """None if the forward drew from no default generator."""
        used = [(g, hash(fp)) for g, fp in start if g.fingerprint() != fp]
        return RNGUse(used) if used else None

    def caller_states(self) -> list[Any]:
        """Before the replay (and before the hooks restore anything)."""
        return [g.get_state() for g, _ in self.used]

    def unrestored(self) -> list[tuple[Any, Any]]:
        """After the hooks restored their entry snapshots: the generators not back
        at the forward's starting state, with their current fingerprint."""
        out = []
        for g, start in self.used:
            fp = g.fingerprint()
            if hash(fp) != start:
                out.append((g, fp))
        return out

    def finish(
        self, checkpoint: str, unrestored: list[tuple[Any, Any]], caller: list[Any]
    ) -> RecomputeMismatchError | None:
        """After the replay: give the caller its generator states back. Returns the
        error for a replay that drew from a generator no hook restored."""
        drawn = [g for g, fp in unrestored if g.fingerprint() != fp]
        for (g, _), state in zip(self.used, caller):
            g.set_state(state)
        if not drawn:
            return None
        names = " and ".join(g.name for g in drawn)
        fixes = ", ".join(g.fix for g in drawn)
        return RecomputeMismatchError(
            f"torch_remat: the recompute of checkpoint '{checkpoint}' draws random "
            f"numbers from {names}, which the forward drew from too, but no "
            "recompute_state_hooks entry restores that generator: the replay would "
            "draw other numbers (another dropout mask) and the gradients would be "
            f"wrong. Pass recompute_state_hooks=({fixes},) to remat.checkpoint "
            "(apply_remat attaches the RNG hooks by default: rng_state_hooks=True). "
            "The caller's generator state is unchanged."
        )


def hook_fingerprint(hook: Any) -> Any:
    """Where the generator a ``DeviceRNGStateHook`` replays stands now."""
    device = hook.device
    if device.type == "cuda":
        return _CUDAGenerator(device.index).fingerprint()
    return hash(_CPU.fingerprint())


def position(hooks: tuple[Any, ...], indices: list[int]) -> list[Any]:
    """The fingerprints of the generators of ``hooks[i]`` for ``i`` in ``indices``."""
    return [hook_fingerprint(hooks[i]) for i in indices]


def check_position(checkpoint: str, hooks: tuple[Any, ...], indices: list[int], forward: list[Any],
                   where: str) -> None:
    """In the replay, at ``where``: raise if a generator is not where the forward's was."""
    for i, fp in zip(indices, forward):
        if hook_fingerprint(hooks[i]) != fp:
            device = hooks[i].device
            name = _CPU.name if device.type == "cpu" else _CUDAGenerator(device.index).name
            raise RecomputeMismatchError(
                f"torch_remat: the recompute of checkpoint '{checkpoint}' reached {where} "
                f"with {name} in another state than the forward had there: while the "
                "forward ran, random numbers were drawn from it by code the replay does "
                "not run, usually another thread drawing from the shared generator (or "
                "code that draws only when not remat.is_recomputing()). The replay would "
                "draw other random numbers (another dropout mask) and the gradients would "
                "be wrong. Run the forwards of threads that draw random numbers one at a "
                "time (a lock around each forward), or train them in separate processes."
            )
