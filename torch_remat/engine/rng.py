"""Random-number state and the replay.

``RecomputeStateHook`` is the protocol for state a replay must see as the forward
did (RNG, counters); :class:`DeviceRNGStateHook` is the stock hook for one device's
default generator (``DeviceRNGStateHook("cpu")``, ``CPURNGStateHook()``, is the CPU
one).

The RNG guard covers random numbers drawn inside a checkpoint without a state hook
for their generator. The replay draws from the generator again. Unless a
``recompute_state_hooks`` entry put the generator back where the forward started,
it draws other numbers (another dropout mask) and the gradients would be wrong; and
without a hook nothing would put the caller's generator back after the replay.

Copying every generator's state around every checkpoint (``preserve_rng_state``)
is refused on purpose (see ``remat.checkpoint``). Instead, the default generators
that no state hook of the checkpoint covers are fingerprinted when the checkpoint
starts and when its forward ends: a CUDA generator by its seed and Philox offset,
the CPU generator by its state (a 5056-byte read and compare; nothing is kept
unless it changed). Only a forward that drew from a generator keeps a hash of its
starting state. Its replay then:

* saves the caller's state of that generator, and restores it after the replay
  (whatever the hooks do, the caller's next random number is the one it would
  have drawn without remat);
* after the hooks restored their entry snapshots, compares the generator with the
  forward's starting state. If they differ and the replay draws from it, the
  replay cannot be exact: :class:`RecomputeMismatchError` names the checkpoint and
  the generator and says which hook to pass. A forward that drew only inside SAVE
  regions (whose bodies the replay skips) is not refused.

Generators passed explicitly (``torch.rand(..., generator=g)``) are not seen.

Python's ``random`` and NumPy's global generator are not guarded but replayed: their
states are read where the forward starts, where each top-level SAVE region returns
and where it ends; the replay of a forward that drew starts from the entry state,
sets the state where it skips such a region, and puts the caller's back afterwards
(see the section at the end of this module).

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

import ctypes
import sys
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from .. import _compat
from .._errors import RecomputeMismatchError


class DefaultGenerator:
    """One device's default generator: what the stock state hook snapshots and the
    RNG guard fingerprints. ``cpu`` is ``torch.default_generator``; ``cuda:N`` the
    default generator of CUDA device N."""

    __slots__ = ("device", "name", "fix")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cpu":
            self.name = "the CPU generator (torch.default_generator)"
            self.fix = "remat.CPURNGStateHook()"
        else:
            self.name = f"the CUDA generator of {device}"
            self.fix = f"remat.DeviceRNGStateHook('{device}')"

    def fingerprint(self) -> Any:
        """A cheap value that changes whenever a random number is drawn."""
        if self.device.type == "cuda":
            g = torch.cuda.default_generators[self.device.index]
            return g.initial_seed(), g.get_offset()
        read = _cpu_reader[0] if _cpu_reader else _find_cpu_reader()
        if read is not None:
            return read()
        # The state's bytes, read without numpy (an optional dependency of torch) and
        # without an aten op, so that no dispatch mode (gradient_checkpoint_scope's
        # recording mode) sees the state tensor: get_state() dispatches nothing.
        state = torch.default_generator.get_state()  # a fresh contiguous uint8 tensor
        return ctypes.string_at(state.data_ptr(), state.nbytes)

    def get_state(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.default_generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.default_generator.set_state(state)


# the CPU generator's state read in place (_compat.cpu_generator_reader), or None
# where its layout is not the one checked for; found at the first fingerprint
_cpu_reader: list[Any] = []


def _find_cpu_reader() -> Any:
    _cpu_reader[:] = [_compat.cpu_generator_reader(torch.default_generator)]
    return _cpu_reader[0]


def cpu_fingerprint_allocates() -> bool:
    """Whether a fingerprint of the CPU generator allocates a copy of its state (a
    real tensor outside the dispatcher), where its layout was not found."""
    read = _cpu_reader[0] if _cpu_reader else _find_cpu_reader()
    return read is None


_CPU = DefaultGenerator(torch.device("cpu"))
_cuda_generators: list[DefaultGenerator] = []


def _cuda_generator(index: int) -> DefaultGenerator:
    while len(_cuda_generators) <= index:
        _cuda_generators.append(DefaultGenerator(torch.device("cuda", len(_cuda_generators))))
    return _cuda_generators[index]


def _default_generators() -> list[DefaultGenerator]:
    # CUDA generators exist only once CUDA is initialized; never initialize it here.
    if torch.cuda.is_initialized() and torch.cuda.is_available():
        n = torch.cuda.device_count()
        return [_CPU, *(_cuda_generator(i) for i in range(n))]
    return [_CPU]


def unhooked_generators(state_hooks: tuple[Any, ...]) -> frozenset[str] | None:
    """The devices whose default generator a checkpoint with ``state_hooks`` leaves
    to the RNG guard: None for all of them, else a set naming those the stock hooks
    restore (``"cpu"``, ``"cuda:1"``), which the guard skips."""
    # Only the stock class: a subclass may snapshot something else.
    covered = frozenset(str(h.device) for h in state_hooks if type(h) is DeviceRNGStateHook)
    return covered or None


def fingerprints(skip: frozenset[str] | None = None) -> list[tuple[DefaultGenerator, Any]]:
    """``(generator, fingerprint)`` of every default generator not in ``skip``, now."""
    if skip is None:
        return [(g, g.fingerprint()) for g in _default_generators()]
    return [(g, g.fingerprint()) for g in _default_generators() if str(g.device) not in skip]


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
            "(apply_remat, enable_remat and the adapters attach the RNG hooks by "
            "default: leave RematConfig(rng_state_hooks=True) as it is). "
            "The caller's generator state is unchanged."
        )


def hook_fingerprint(hook: Any) -> Any:
    """Where the generator a ``DeviceRNGStateHook`` replays stands now."""
    fp = hook.generator.fingerprint()
    return hash(fp) if hook.device.type == "cpu" else fp


def position(hooks: tuple[Any, ...], indices: list[int]) -> list[Any]:
    """The fingerprints of the generators of ``hooks[i]`` for ``i`` in ``indices``."""
    return [hook_fingerprint(hooks[i]) for i in indices]


def check_position(checkpoint: str, hooks: tuple[Any, ...], indices: list[int], forward: list[Any],
                   where: str) -> None:
    """In the replay, at ``where``: raise if a generator is not where the forward's was."""
    for i, fp in zip(indices, forward):
        if hook_fingerprint(hooks[i]) != fp:
            name = hooks[i].generator.name
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


# ---------------------------------------------------------------- state hooks


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

    ``DeviceRNGStateHook("cpu")`` replays ``torch.default_generator`` (what dropout
    on CPU tensors draws from; each snapshot is a 5056-byte copy of the Mersenne
    Twister state, and snapshots that did not change since the previous one are
    shared, not stored again); ``DeviceRNGStateHook("cuda:1")`` replays the generator
    of CUDA device 1. Restores are absolute, so a snapshot can be restored any number
    of times. A checkpoint's RNG guard does not watch the generators its stock hooks
    restore.
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
            self.generator = _cuda_generator(device.index)
        elif device.type == "cpu":
            self.generator = _CPU
        else:
            raise ValueError(
                f"DeviceRNGStateHook: device type '{device.type}' is not supported; "
                "use 'cpu' or 'cuda[:N]', or write a RecomputeStateHook for it."
            )
        self.device = device

    def snapshot(self) -> torch.Tensor:
        return self.generator.get_state()

    def restore(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def __repr__(self) -> str:
        return f"DeviceRNGStateHook({str(self.device)!r})"


def CPURNGStateHook() -> DeviceRNGStateHook:  # noqa: N802 (named as the hook it returns)
    """``DeviceRNGStateHook("cpu")``, under the name earlier releases gave it: the
    hook for torch's default CPU generator."""
    return DeviceRNGStateHook("cpu")


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



# ------------------------------------------------ Python's random and NumPy's generator
#
# Model code also draws from Python's ``random`` (``h * (1 + 0.1 * random.random())``)
# and from NumPy's global generator (``np.random.rand()``). The replay must draw the
# same numbers, and must not move the caller's stream. Their public state getters are
# too slow to call around every checkpoint (``random.getstate()`` builds a tuple of 625
# ints, ``np.random.get_state()`` an array and a tuple: tens of microseconds each), so
# the raw Mersenne Twister state (2.5 KB each) is copied through a ctypes view of the memory
# where CPython and NumPy keep it, and compared. That layout is checked against
# the public getters once, and the public getters are used where it does not match.
# Only a replay of a forward that drew sets a state, through the public setters.


def _python_random_reader() -> tuple[Any, Any] | None:
    import random
    import struct

    inst = getattr(random, "_inst", None)  # what the module-level functions draw from
    if inst is None or getattr(random.random, "__self__", None) is not inst:
        return None

    def read_public() -> Any:
        return inst.getstate()

    def restore(state: Any) -> None:
        if type(state) is tuple and len(state) == 2 and type(state[0]) is bytes:
            raw, gauss = state
            words = struct.unpack_from("624I", raw, 4)
            index = struct.unpack_from("i", raw, 0)[0]
            inst.setstate((3, (*words, index), gauss))
        else:
            inst.setstate(state)

    # CPython's RandomObject: the object header, int index, uint32_t state[624]
    offset = object.__basicsize__
    address = id(inst) + offset
    try:
        raw = ctypes.string_at(address, 4 + 624 * 4)
        _, words, gauss = inst.getstate()
        if struct.unpack_from("624I", raw, 4) + struct.unpack_from("i", raw, 0) != words:
            return read_public, restore
    except Exception:
        return read_public, restore
    # a ctypes view of that memory: its ``raw`` copies it without a foreign call
    words_now = (ctypes.c_char * 2500).from_address(address)

    def read() -> Any:
        return words_now.raw, inst.gauss_next

    return read, restore


def _numpy_reader() -> tuple[Any, Any] | None:
    np = sys.modules.get("numpy")  # never imported here: only seen if the program uses it
    if np is None:
        return None
    try:
        state = np.random.mtrand._rand  # what np.random.rand() and friends draw from
        get_state, set_state = state.get_state, state.set_state
    except AttributeError:
        return None

    def read_public() -> Any:
        return _numpy_public_state(get_state())

    def restore(saved: Any) -> None:
        if type(saved) is tuple and len(saved) == 2 and type(saved[0]) is bytes:
            raw, aug = saved
            import struct

            key = np.frombuffer(raw, dtype=np.uint32, count=624).copy()
            pos = struct.unpack_from("i", raw, 2496)[0]
            has_gauss, gauss = struct.unpack_from("i4xd", aug, 0)
            set_state(("MT19937", key, pos, has_gauss, gauss))
        else:
            set_state(saved[1])

    located = _numpy_layout(np, type(state))
    if located is None:
        return read_public, restore
    state_at, aug_at = located
    bit_generator = state._bit_generator
    # ctypes views of the key and of the cached gaussian (see _python_random_reader)
    mt_now = (ctypes.c_char * 2500).from_address(bit_generator.ctypes.state_address)
    aug_now = (ctypes.c_char * 16).from_address(id(state) + aug_at)

    def read() -> Any:
        if state._bit_generator is not bit_generator:  # replaced: start over
            _host_readers.clear()
            return read_public()
        return mt_now.raw, aug_now.raw

    return read, restore


def _numpy_public_state(state: tuple) -> Any:
    # comparable with ==: the key array as bytes (three items: not a raw state)
    return (state[1].tobytes() + bytes(str(state[2:]), "ascii"), state, None)


def _numpy_layout(np: Any, cls: type) -> tuple[int, int] | None:
    """Where a RandomState keeps its bit generator and its cached gaussian
    (``has_gauss``, ``gauss``), checked on a scratch instance; None if not found."""
    import struct

    try:
        scratch = cls(1234)
        scratch.standard_normal()  # leaves a cached gaussian
        size = cls.__basicsize__
        base = id(scratch)
        raw = ctypes.string_at(base, size)
        mt = scratch._bit_generator.ctypes.state_address
        words = [struct.unpack_from("Q", raw, o)[0] for o in range(0, size - 7, 8)]
        bitgen_at = words.index(mt) * 8
        aug_at = words.index(base + bitgen_at) * 8 + 8
        for _ in range(3):
            _, key, pos, has_gauss, gauss = scratch.get_state()
            mt_raw = ctypes.string_at(mt, 2500)
            aug_raw = ctypes.string_at(base + aug_at, 16)
            if (
                mt_raw[:2496] != key.tobytes()
                or struct.unpack_from("i", mt_raw, 2496)[0] != pos
                or struct.unpack_from("i4xd", aug_raw, 0) != (has_gauss, gauss)
            ):
                return None
            scratch.standard_normal()
        return bitgen_at, aug_at
    except Exception:
        return None


# (read, restore) per generator, built at the first checkpoint; NumPy's once the
# program has imported it
_host_readers: list[tuple[Any, Any]] = []
_numpy_pending: list[bool] = []
# one function reading them all (host_rng_state runs at every SAVE region's return)
_read_all: list[Callable[[], tuple[Any, ...]]] = []


def _readers() -> list[tuple[Any, Any]]:
    changed = False
    if not _host_readers:
        _numpy_pending[:] = [True]
        reader = _python_random_reader()
        if reader is not None:
            _host_readers.append(reader)
        changed = True
    if _numpy_pending and "numpy" in sys.modules:
        _numpy_pending.clear()
        reader = _numpy_reader()
        if reader is not None:
            _host_readers.append(reader)
        changed = True
    if changed or not _read_all:
        _read_all[:] = [_read_each(tuple(read for read, _ in _host_readers))]
    return _host_readers


def _read_each(reads: tuple[Callable[[], Any], ...]) -> Callable[[], tuple[Any, ...]]:
    if len(reads) == 2:
        first, second = reads
        return lambda: (first(), second())
    if len(reads) == 1:
        (only,) = reads
        return lambda: (only(),)
    return lambda: tuple([read() for read in reads])


def host_rng_state() -> tuple[Any, ...]:
    """The states of Python's ``random`` and NumPy's global generator now: compare
    two with ``==`` to see whether a random number was drawn in between."""
    if _numpy_pending or not _host_readers:
        _readers()
    return _read_all[0]()


def restore_host_rng_state(state: tuple[Any, ...]) -> None:
    """Make ``state`` (from :func:`host_rng_state`) current again, setting only the
    generators that moved."""
    for (read, restore), saved in zip(_readers(), state):
        if read() != saved:
            restore(saved)


# ----------------------------------------- generator objects the model holds
#
# A generator a module keeps as an attribute, a closure variable or a module-level
# variable, and draws from, is not a default generator, so no state hook restores
# it: a ``torch.Generator`` passed to random ops (``torch.rand(...,
# generator=self.generator)``), a ``random.Random`` (``self.rng.random()``), a
# NumPy ``Generator`` (``np.random.default_rng(seed)``) or ``RandomState``. Each is
# forked as Python's global random is: its state at the checkpoint's entry and
# where each SAVE region returned is read, and a replay sets those states, then
# gives the caller's back.


def is_generator_type(cls: type) -> bool:
    """Whether values of ``cls`` are generator objects forked around a replay."""
    return _kind_of(cls) is not None


_HELD_KINDS: dict[type, str | None] = {}


def _kind_of(cls: type) -> str | None:
    """:func:`_held_kind`, once per class."""
    try:
        return _HELD_KINDS[cls]
    except KeyError:
        kind = _HELD_KINDS[cls] = _held_kind(cls)
        return kind


def _held_kind(cls: type) -> str | None:
    if cls is torch.Generator:
        return "torch"
    import array
    import random

    if issubclass(cls, array.array):
        return "array"
    if cls is types.GeneratorType or (
        cls.__module__ in ("itertools", "builtins") and hasattr(cls, "__next__")
    ):
        # a schedule the forward draws from (next(self.rates)): not forked (it
        # cannot be rewound), but a forward that advanced it is refused by the replay
        return "iterator"

    if issubclass(cls, random.Random):
        # SystemRandom draws from the operating system: no state to fork
        return None if issubclass(cls, random.SystemRandom) else "python"
    np = sys.modules.get("numpy")  # never imported here: only seen if the program uses it
    if np is not None:
        try:
            if issubclass(cls, np.random.Generator):
                return "numpy generator"
            if issubclass(cls, np.random.RandomState):
                return "numpy random state"
            if issubclass(cls, np.ndarray):
                return "numpy array"
        except AttributeError:
            return None
    return None


def _comparable(state: Any) -> Any:
    """``state`` with NumPy arrays as bytes, so two compare with ``==``."""
    if isinstance(state, dict):
        return tuple((k, _comparable(v)) for k, v in state.items())
    if isinstance(state, (tuple, list)):
        return tuple(_comparable(v) for v in state)
    tobytes = getattr(state, "tobytes", None)
    if tobytes is not None and hasattr(state, "dtype"):
        return (str(state.dtype), tobytes())
    return state


class _HostGeneratorState:
    """A Python or NumPy generator's state, equal to another by value."""

    __slots__ = ("key", "state")

    def __init__(self, state: Any) -> None:
        self.state = state
        self.key = _comparable(state)

    def __eq__(self, other: object) -> bool:
        return type(other) is _HostGeneratorState and self.key == other.key

    __hash__ = None  # type: ignore[assignment]


_POSITION_SCALARS = frozenset({int, float, bool, str, bytes, complex, type(None)})


def _iterator_position(x: Any, depth: int) -> Any:
    """A value that changes when the iterator ``x`` advances (compare two with
    ``==``): a generator's suspended instruction and locals, another iterator's
    pickled state (``__reduce__``), looked into a few levels; other objects by
    identity."""
    cls = type(x)
    if cls in _POSITION_SCALARS:
        return x
    if depth < 4:
        if cls is list or cls is tuple:
            return (len(x), tuple(_iterator_position(v, depth + 1) for v in x[:64]))
        if cls is types.GeneratorType:
            frame = x.gi_frame
            if frame is None:
                return "finished"
            return (frame.f_lasti, tuple((k, _iterator_position(v, depth + 1)) for k, v in frame.f_locals.items()))
        if _kind_of(cls) == "iterator":
            try:
                with warnings.catch_warnings():
                    # (itertools' pickling is deprecated from Python 3.12 on)
                    warnings.simplefilter("ignore", DeprecationWarning)
                    reduced = x.__reduce__()
            except Exception:  # (an iterator that cannot be pickled)
                return id(x)
            return _iterator_position(reduced, depth + 1)
    return id(x)


MAX_FORKED_ARRAY_BYTES = 1 << 16
"""A NumPy array or ``array.array`` the code holds is forked like a generator
(its bytes read at the checkpoint's entry and where each SAVE region returns, set
around the replay) up to this size; a larger or read-only one is not."""


def forked(g: Any) -> bool:
    """Whether the held state object ``g`` (see :func:`is_generator_type`) is forked
    around a replay: every generator; small writable arrays."""
    kind = _kind_of(type(g))
    if kind == "numpy array":
        return g.nbytes <= MAX_FORKED_ARRAY_BYTES and g.flags.writeable and g.dtype.hasobject is False
    if kind == "array":
        return len(g) * g.itemsize <= MAX_FORKED_ARRAY_BYTES
    return True


def drawn_iterator(held: tuple[Any, ...], before: tuple[Any, ...], after: tuple[Any, ...]) -> Any:
    """The first iterator among ``held`` whose position moved from ``before`` to
    ``after`` (their :func:`generator_states`), or None."""
    for g, a, b in zip(held, before, after):
        if _kind_of(type(g)) == "iterator" and a != b:
            return g
    return None


def holds_arrays(held: tuple[Any, ...]) -> bool:
    """Whether ``held`` (forked state objects) holds an array: read by the code
    without changing it, so its state is set around every replay."""
    return any(_kind_of(type(g)) in ("numpy array", "array") for g in held)


def _read_held(g: Any) -> Any:
    if type(g) is torch.Generator:
        state = g.get_state()  # a fresh contiguous uint8 tensor
        return ctypes.string_at(state.data_ptr(), state.nbytes)
    kind = _kind_of(type(g))
    if kind == "python":
        return g.getstate()  # a tuple of ints: compares by value
    if kind == "numpy array":
        return (g.dtype.str, g.shape, g.tobytes())
    if kind == "array":
        return g.tobytes()
    if kind == "iterator":
        return ("iterator", _iterator_position(g, 0))
    if kind == "numpy generator":
        return _HostGeneratorState(g.bit_generator.state)
    return _HostGeneratorState(g.get_state(legacy=False))


def _restore_held(g: Any, saved: Any) -> None:
    if type(g) is torch.Generator:
        with _compat.DisableTorchDispatch():  # the state tensor must be a real one
            g.set_state(torch.frombuffer(bytearray(saved), dtype=torch.uint8))
        return
    kind = _kind_of(type(g))
    if kind == "python":
        g.setstate(saved)
    elif kind == "numpy array":
        dtype, shape, data = saved
        if g.shape != shape or g.dtype.str != dtype:
            raise RecomputeMismatchError(
                f"torch_remat: a NumPy array the checkpointed code holds changed its shape or "
                f"dtype (from {shape} {dtype} to {g.shape} {g.dtype.str}) between the forward "
                "and the recompute: the recompute cannot read the values the forward read. "
                "Assign a new array instead of resizing it in place."
            )
        g[...] = sys.modules["numpy"].frombuffer(data, dtype=g.dtype).reshape(shape)
    elif kind == "array":
        g[:] = type(g)(g.typecode, saved)
    elif kind == "iterator":
        pass  # (cannot be set back: a forward that drew from one is refused, see drawn_iterator)
    elif kind == "numpy generator":
        g.bit_generator.state = saved.state
    else:
        g.set_state(saved.state)


def default_generators() -> set[int]:
    """ids of the generators forked otherwise: torch's default generators (the
    stock state hooks' business), Python's and NumPy's global ones (host_rng_state)."""
    ids = {id(torch.default_generator)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        ids.update(id(g) for g in torch.cuda.default_generators)
    import random

    ids.add(id(getattr(random, "_inst", None)))
    np = sys.modules.get("numpy")
    if np is not None:
        ids.add(id(getattr(getattr(np.random, "mtrand", None), "_rand", None)))
    return ids


def generator_states(generators: tuple[Any, ...]) -> tuple[Any, ...]:
    """The states of ``generators`` (see :func:`is_generator_type`) now, comparable
    with ``==``. A torch.Generator's are its bytes, read without an aten op
    (``get_state()`` dispatches nothing), so no dispatch mode (a forecast's fake
    tensors, a scope's recording) sees them."""
    return tuple(map(_read_held, generators))


def restore_generator_states(generators: tuple[Any, ...], states: tuple[Any, ...]) -> None:
    """Make ``states`` (from :func:`generator_states`) current again, setting only
    the generators that moved."""
    for g, saved, current in zip(generators, states, generator_states(generators)):
        if current != saved:
            _restore_held(g, saved)
