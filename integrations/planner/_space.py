"""What the planner may choose: the blocks, how identical blocks are grouped, the
candidate SAVE submodules of a block and the options they give.

Per block the options are: no checkpoint, or a checkpoint in which a subset of the
candidate units runs as SAVE regions (the empty subset is a full checkpoint). A unit
is one candidate submodule, or sibling projections that read the same input
(``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``), which are kept or
recomputed together. Subsets holding a unit and one of its descendants are left
out: the outermost SAVE region wins, so they equal the subset without the
descendant.

Blocks whose subsets number at most ``MAX_EXHAUSTIVE_OPTIONS`` have every subset
measured. Beyond that the planner measures the full checkpoint and each unit alone,
and then at most ``MAX_PREDICTED`` combinations: those that the sums of the
single-unit measurements place on the block's Pareto frontier (bytes against
recompute cost). The solver then picks among measured options only, so a plan's
bytes are still bytes that were seen; what the bound gives up is combinations the
additive prediction ranks as dominated.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._selection import module_matcher

Candidates = Sequence[type | str] | Callable[[str, nn.Module], bool] | None
"""Module classes and/or glob patterns of qualified names, or a predicate
``(path inside the block, module) -> bool``; None: the default candidates."""

BlockSelector = type | tuple | list | Callable[[nn.Module], bool] | None

MAX_EXHAUSTIVE_OPTIONS = 128
"""Blocks with at most this many checkpoint options have every one measured."""

MAX_PREDICTED = 16
"""Beyond that: the full checkpoint, each unit alone, and at most this many
combinations of units, so at most ``2 + units + MAX_PREDICTED`` options per
distinct block (no checkpoint included)."""

_CONTAINER_WORDS = ("attention", "attn", "mlp", "feedforward", "feed_forward", "ffn", "moe", "expert")
_BLOCK_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(frozen=True)
class Option:
    """One way to run a block: ``checkpoint`` off, or on with ``save`` as SAVE
    regions; ``offload``: what the checkpoint keeps moves to host memory (see
    ``_offload``)."""

    checkpoint: bool
    save: tuple[str, ...] = ()
    offload: bool = False

    def __post_init__(self) -> None:
        if self.offload and not self.checkpoint:
            raise ValueError("Option: only a checkpoint's kept tensors can be offloaded.")

    @property
    def label(self) -> str:
        if not self.checkpoint:
            return "no checkpoint"
        label = "checkpoint, save " + ", ".join(self.save) if self.save else "full checkpoint"
        return label + ", offloaded" if self.offload else label

    @property
    def resident(self) -> Option:
        """The same checkpoint with nothing offloaded."""
        return Option(self.checkpoint, self.save)

    def offloaded(self) -> Option:
        return Option(self.checkpoint, self.save, True)

    def to_json(self) -> dict:
        out = {"checkpoint": self.checkpoint, "save": list(self.save)}
        if self.offload:
            out["offload"] = True
        return out

    @staticmethod
    def from_json(data: dict) -> Option:
        return Option(bool(data["checkpoint"]), tuple(data["save"]), bool(data.get("offload", False)))


OFF = Option(False)


@dataclass(frozen=True)
class Group:
    """Blocks with the same structure (module classes, parameter and buffer shapes):
    they share candidates and measured options."""

    blocks: tuple[str, ...]
    candidates: tuple[str, ...]
    """Paths inside a block, in ``named_modules`` order."""
    kinds: tuple[str, ...] = ()
    """Per candidate its class name (``"Linear"`` for every ``nn.Linear``)."""
    units: tuple[tuple[str, ...], ...] = ()
    """The candidates as the planner chooses them: each unit is saved or recomputed
    whole (empty: one unit per candidate)."""

    def __post_init__(self) -> None:
        if not self.units:
            object.__setattr__(self, "units", tuple((c,) for c in self.candidates))

    def option(self, units: Sequence[int]) -> Option:
        """A checkpoint saving ``units`` (indices into :attr:`units`)."""
        chosen = {p for u in units for p in self.units[u]}
        return Option(True, tuple(c for c in self.candidates if c in chosen))

    def parents(self) -> list[int]:
        """Per unit, the index of the innermost unit holding it (-1: none)."""
        out = []
        for paths in self.units:
            holders = [
                j for j, outer in enumerate(self.units)
                if len(outer) == 1 and paths[0].startswith(outer[0] + ".")
            ]
            out.append(max(holders, key=lambda j: len(self.units[j][0])) if holders else -1)
        return out

    def count_options(self) -> int:
        """How many options :meth:`options` lists (no checkpoint included)."""
        parents = self.parents()

        def subsets(parent: int) -> int:
            n = 1
            for u, p in enumerate(parents):
                if p == parent:
                    n *= 1 + subsets(u)
            return n

        return 1 + subsets(-1)

    @property
    def exhaustive(self) -> bool:
        return self.count_options() <= MAX_EXHAUSTIVE_OPTIONS

    def options(self) -> list[Option]:
        """Every option: no checkpoint, then each subset of non-nested units."""
        subsets = [OFF]
        for r in range(len(self.units) + 1):
            for subset in itertools.combinations(range(len(self.units)), r):
                if not _nested([self.units[u][0] for u in subset]):
                    subsets.append(self.option(subset))
        return subsets

    def first_options(self) -> list[Option]:
        """What a pruned block measures first: the full checkpoint, each unit alone."""
        return [self.option(())] + [self.option((u,)) for u in range(len(self.units))]

    def predicted_options(self, single: Sequence[tuple[int, tuple[int, int]]],
                          full: tuple[int, tuple[int, int]]) -> list[Option]:
        """At most ``MAX_PREDICTED`` combinations of two or more units on the Pareto
        frontier of the additive prediction: ``single[u]`` is (bytes, cost) measured
        with unit ``u`` alone saved, ``full`` with none."""
        parents = self.parents()
        delta = [
            (b - full[0], (c[0] - full[1][0], c[1] - full[1][1])) for b, c in single
        ]

        def frontier_of(parent: int) -> list[tuple]:
            # Entries (bytes, cost, units): the best subsets of the units under
            # `parent` (none of them nested in another).
            current: list[tuple] = [(0, (0, 0), ())]
            for u, p in enumerate(parents):
                if p != parent:
                    continue
                inner = frontier_of(u)
                mine = _pareto(inner + [(delta[u][0], delta[u][1], (u,))])
                current = _pareto([
                    (a[0] + b[0], (a[1][0] + b[1][0], a[1][1] + b[1][1]), a[2] + b[2])
                    for a in current for b in mine
                ])
            return current

        combos = [e[2] for e in frontier_of(-1) if len(e[2]) > 1]
        if len(combos) > MAX_PREDICTED:
            step = (len(combos) - 1) / (MAX_PREDICTED - 1)
            combos = [combos[round(i * step)] for i in range(MAX_PREDICTED)]
        return [self.option(sorted(c)) for c in combos]


def _pareto(entries: list[tuple]) -> list[tuple]:
    """Entries ``(bytes, cost, ...)`` no other beats, by bytes ascending."""
    entries.sort(key=lambda e: (e[0], e[1]))
    kept: list[tuple] = []
    for e in entries:
        if not kept or e[1] < kept[-1][1]:
            kept.append(e)
    return kept


def _nested(paths: Sequence[str]) -> bool:
    return any(a != b and b.startswith(a + ".") for a in paths for b in paths)


def select_blocks(model: nn.Module, blocks: BlockSelector) -> list[str]:
    """Qualified names of the blocks: matches of ``blocks``, outermost only; by
    default :func:`default_blocks`."""
    if blocks is None:
        return default_blocks(model)
    # (qualified names are not selectors: the adapters' blocks= takes none either)
    match = module_matcher(blocks, "plan_remat: blocks")
    names: list[str] = []
    for name, module in model.named_modules():
        if module is model or not match(module):
            continue
        if any(name.startswith(outer + ".") for outer in names):
            continue
        names.append(name)
    if not names:
        raise ValueError(f"plan_remat: no module of the model matches blocks={blocks!r}.")
    return names


def _is_block(module: nn.Module) -> bool:
    """A module that can be a block: it has submodules and parameters."""
    return any(True for _ in module.children()) and any(True for _ in module.parameters())


def default_blocks(model: nn.Module) -> list[str]:
    """The blocks of a model by its layout: the children that have submodules and
    parameters of an ``nn.ModuleList``, ``nn.ModuleDict`` or ``nn.Sequential`` (the
    model itself included). The outermost such container with at least two wins
    (the layers, not the experts inside a layer), then the one with most; a
    container with one is taken only when none has two."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, _BLOCK_CONTAINERS):
            kids = [f"{name}.{k}" if name else k for k, c in module.named_children() if _is_block(c)]
            if kids:
                depth = name.count(".") + 1 if name else 0
                found.append((len(kids) < 2, depth, -len(kids), len(found), kids))
    if found:
        return min(found)[-1]
    listed = _block_classes(model)
    raise ValueError(
        "plan_remat: found no blocks: no nn.ModuleList, nn.ModuleDict or nn.Sequential "
        "of the model holds a module with submodules and parameters. Pass blocks= (a "
        "module class, a tuple of classes or a predicate); the model's modules that "
        "could be blocks are: " + (listed or "none (it has no module with submodules)") + "."
    )


def _block_classes(model: nn.Module, shown: int = 4) -> str:
    by_class: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if name and _is_block(module):
            by_class.setdefault(type(module).__name__, []).append(name)
    return "; ".join(
        f"{cls}: {', '.join(names[:shown])}" + (f" (+{len(names) - shown} more)" if len(names) > shown else "")
        for cls, names in by_class.items()
    )


def _signature(block: nn.Module) -> tuple:
    return tuple(
        (
            name,
            type(m).__qualname__,
            tuple((n, tuple(p.shape), str(p.dtype)) for n, p in m.named_parameters(recurse=False)),
            tuple((n, tuple(b.shape), str(b.dtype)) for n, b in m.named_buffers(recurse=False)),
        )
        for name, m in block.named_modules()
    )


def _default_candidate(path: str, module: nn.Module) -> bool:
    """Leaves with parameters, and attention/MLP/MoE containers with parameters
    (a parameter-free attention backend computes from tensors a SAVE region of its
    caller would keep anyway)."""
    if not path or not any(True for _ in module.parameters()):
        return False
    lowered = type(module).__name__.lower()
    return not list(module.children()) or any(word in lowered for word in _CONTAINER_WORDS)


def _candidate_matcher(candidates: Candidates) -> Callable[[str, nn.Module, str], bool]:
    if candidates is None:
        return lambda path, module, _fqn: _default_candidate(path, module)
    if callable(candidates) and not isinstance(candidates, (list, tuple)):
        return lambda path, module, _fqn: bool(path) and bool(candidates(path, module))
    classes = tuple(c for c in candidates if isinstance(c, type))
    patterns = [c for c in candidates if isinstance(c, str)]
    if len(classes) + len(patterns) != len(candidates):
        raise TypeError(
            "plan_remat: candidates= holds module classes and glob patterns of qualified "
            f"names only, got {list(candidates)!r}."
        )

    def match(path: str, module: nn.Module, fqn: str) -> bool:
        if not path:
            return False
        if classes and isinstance(module, classes):
            return True
        return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(fqn, p) for p in patterns)

    return match


def group_blocks(
    model: nn.Module,
    block_names: Sequence[str],
    candidates: Candidates,
    example_args: Sequence[Any] | None = None,
    forward: Callable[[], Any] | None = None,
) -> list[Group]:
    """Groups of identical blocks, in the order of their first block. Given
    ``example_args`` and the default candidates, one forward (no gradients) finds
    the sibling projections: leaves of one class under one parent called with the
    same input tensor become one unit. ``forward``: runs that forward (default:
    ``model(*example_args)`` without gradients, its state put back; a forecast
    passes its fake run)."""
    match = _candidate_matcher(candidates)
    by_signature: dict[tuple, list[str]] = {}
    paths_of: dict[tuple, tuple[str, ...]] = {}
    kinds_of: dict[tuple, tuple[str, ...]] = {}
    for name in block_names:
        block = model.get_submodule(name)
        sig = _signature(block)
        by_signature.setdefault(sig, []).append(name)
        if sig not in paths_of:
            paths_of[sig] = tuple(
                path
                for path, m in block.named_modules()
                if not _inside_other_block(f"{name}.{path}", name, block_names)
                and match(path, m, f"{name}.{path}")
            )
            kinds_of[sig] = tuple(_kind(block.get_submodule(p)) for p in paths_of[sig])
    inputs: dict[str, int] = {}
    if example_args is not None:
        leaves = {
            f"{names[0]}.{p}": model.get_submodule(f"{names[0]}.{p}")
            for sig, names in by_signature.items()
            for p in paths_of[sig]
        } if candidates is None else {}
        if leaves:
            inputs = _first_inputs(model, example_args, {
                n: m for n, m in leaves.items() if not any(True for _ in m.children())
            }, forward)
    groups = []
    for sig, names in by_signature.items():
        paths = paths_of[sig]
        units = _sibling_units(model, names[0], paths, inputs)
        groups.append(Group(tuple(names), paths, kinds_of[sig], units))
    return groups


def _first_inputs(
    model: nn.Module,
    args: Sequence[Any],
    leaves: dict[str, nn.Module],
    forward: Callable[[], Any] | None = None,
) -> dict[str, int]:
    """Per leaf, an id of the tensor its first call took first (leaves called more
    than once, or with no tensor, are left out)."""
    from ._measure import preserved_state

    seen: dict[str, list[Any]] = {}
    handles = []
    for name, leaf in leaves.items():
        def pre(_m: nn.Module, a: tuple, _name: str = name) -> None:
            seen.setdefault(_name, []).append(a[0] if a and isinstance(a[0], torch.Tensor) else None)

        handles.append(leaf.register_forward_pre_hook(pre))
    try:
        if forward is not None:
            forward()
        else:
            with preserved_state(model, args), torch.no_grad():
                model(*args)
    finally:
        for h in handles:
            h.remove()
    # The tensors are alive in `seen` until here, so their ids are distinct.
    return {n: id(t[0]) for n, t in seen.items() if len(t) == 1 and t[0] is not None}


def _sibling_units(
    model: nn.Module, block: str, paths: Sequence[str], inputs: dict[str, int]
) -> tuple[tuple[str, ...], ...]:
    units: list[list[str]] = []
    key_of: dict[tuple, int] = {}
    for path in paths:
        source = inputs.get(f"{block}.{path}")
        if source is None:
            units.append([path])
            continue
        parent = path.rpartition(".")[0]
        key = (parent, type(model.get_submodule(f"{block}.{path}")), source)
        if key in key_of:
            units[key_of[key]].append(path)
        else:
            key_of[key] = len(units)
            units.append([path])
    return tuple(tuple(u) for u in units)


def _inside_other_block(fqn: str, block: str, block_names: Sequence[str]) -> bool:
    return any(b != block and (fqn == b or fqn.startswith(b + ".")) for b in block_names)


def _kind(module: nn.Module) -> str:
    return "Linear" if isinstance(module, nn.Linear) else type(module).__name__
