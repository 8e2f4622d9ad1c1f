"""Which modules the adapters touch: block selectors and the SAVE-region matches
inside a block."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn

ModuleSelector = type | tuple | list | set | frozenset | Callable[[nn.Module], bool]


def module_matcher(selector: ModuleSelector, what: str) -> Callable[[nn.Module], bool]:
    """``selector`` (a class, a collection of classes or a predicate) as a predicate;
    ``what`` names the argument in the error."""
    if isinstance(selector, type):
        return lambda m: isinstance(m, selector)
    if isinstance(selector, (tuple, list, set, frozenset)):
        classes = tuple(selector)
        if not all(isinstance(c, type) for c in classes):
            raise TypeError(f"{what} must hold module classes only, got {selector!r}.")
        return lambda m: isinstance(m, classes)
    if callable(selector):
        return selector
    raise TypeError(
        f"{what} must be a module class, a tuple of classes or a predicate "
        f"module -> bool, got {type(selector).__name__}."
    )


def select_modules(model: nn.Module, blocks: ModuleSelector) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` for every non-root module of ``model`` matched by
    ``blocks`` (a class, a tuple of classes, or a predicate), in ``named_modules`` order."""
    match = module_matcher(blocks, "blocks")
    return [(n, m) for n, m in model.named_modules() if m is not model and match(m)]


def qualified_names(model: nn.Module) -> dict[nn.Module, str]:
    """Each module of ``model`` and its first qualified name."""
    names: dict[nn.Module, str] = {}
    for name, module in model.named_modules():
        names.setdefault(module, name)
    return names


def save_modules_of(
    block: nn.Module, blocks: set[nn.Module], is_save: Callable[[nn.Module], bool]
) -> Iterator[tuple[str, nn.Module]]:
    """Outermost save-module matches inside ``block``, not inside a nested block, with
    their paths inside ``block``."""

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
        for name, child in module.named_children():
            if child in blocks:
                continue
            path = f"{prefix}{name}"
            if is_save(child):
                yield path, child
            else:
                yield from walk(child, path + ".")

    yield from walk(block, "")
