"""What the planner may choose: the blocks, how identical blocks are grouped, the
candidate SAVE submodules of a block and the options they give.

Per block the options are: no checkpoint, or a checkpoint in which a subset of the
candidate submodules runs as SAVE regions (the empty subset is a full checkpoint).
Subsets holding a candidate and one of its descendants are left out: the outermost
SAVE region wins, so they equal the subset without the descendant.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

Candidates = Sequence[type | str] | Callable[[str, nn.Module], bool] | None
"""Module classes and/or glob patterns of qualified names, or a predicate
``(path inside the block, module) -> bool``; None: the default candidates."""

BlockSelector = type | tuple | list | Callable[[nn.Module], bool] | None

MAX_CANDIDATES = 8
"""At most 2**8 + 1 measured options per distinct block."""

_CONTAINER_WORDS = ("attention", "attn", "mlp", "feedforward", "ffn")


@dataclass(frozen=True)
class Option:
    """One way to run a block: ``checkpoint`` off, or on with ``save`` as SAVE regions."""

    checkpoint: bool
    save: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        if not self.checkpoint:
            return "no checkpoint"
        return "checkpoint, save " + ", ".join(self.save) if self.save else "full checkpoint"

    def to_json(self) -> dict:
        return {"checkpoint": self.checkpoint, "save": list(self.save)}

    @staticmethod
    def from_json(data: dict) -> Option:
        return Option(bool(data["checkpoint"]), tuple(data["save"]))


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

    def options(self) -> list[Option]:
        subsets = [OFF]
        for r in range(len(self.candidates) + 1):
            for subset in itertools.combinations(self.candidates, r):
                if not _nested(subset):
                    subsets.append(Option(True, subset))
        return subsets


def _nested(paths: Sequence[str]) -> bool:
    return any(a != b and b.startswith(a + ".") for a in paths for b in paths)


def select_blocks(model: nn.Module, blocks: BlockSelector) -> list[str]:
    """Qualified names of the blocks: matches of ``blocks``, outermost only; by
    default the children of the largest ``nn.ModuleList`` (the layers)."""
    if blocks is None:
        lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        lists = [(n, m) for n, m in lists if len(m) > 0]
        if not lists:
            raise ValueError(
                "plan_remat: the model has no nn.ModuleList of layers to find its blocks "
                "in; pass blocks= (a module class, a tuple of classes or a predicate)."
            )
        name, layers = max(lists, key=lambda nm: len(nm[1]))
        return [f"{name}.{i}" if name else str(i) for i in range(len(layers))]
    if isinstance(blocks, type) or isinstance(blocks, (tuple, list)):
        classes = blocks if isinstance(blocks, type) else tuple(blocks)

        def match(m: nn.Module) -> bool:
            return isinstance(m, classes)

    elif callable(blocks):
        match = blocks
    else:
        raise TypeError(f"plan_remat: blocks must be a class, classes or a predicate, got {blocks!r}")
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
    if not path:
        return False
    leaf_with_params = not list(module.children()) and any(True for _ in module.parameters())
    lowered = type(module).__name__.lower()
    return leaf_with_params or any(word in lowered for word in _CONTAINER_WORDS)


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
    model: nn.Module, block_names: Sequence[str], candidates: Candidates
) -> list[Group]:
    """Groups of identical blocks, in the order of their first block."""
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
    groups = []
    for sig, names in by_signature.items():
        paths = paths_of[sig]
        if len(paths) > MAX_CANDIDATES:
            raise ValueError(
                f"plan_remat: block '{names[0]}' has {len(paths)} candidate submodules "
                f"({', '.join(paths)}); the planner measures every subset and takes at most "
                f"{MAX_CANDIDATES}. Pass candidates= (module classes or glob patterns such "
                "as 'attn', '*.fc1') to name fewer."
            )
        groups.append(Group(tuple(names), paths, kinds_of[sig]))
    return groups


def _inside_other_block(fqn: str, block: str, block_names: Sequence[str]) -> bool:
    return any(b != block and (fqn == b or fqn.startswith(b + ".")) for b in block_names)


def _kind(module: nn.Module) -> str:
    return "Linear" if isinstance(module, nn.Linear) else type(module).__name__
