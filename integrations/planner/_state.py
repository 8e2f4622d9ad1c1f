"""The Python state a forward may change, put back after planning.

The planners run the model many times; training must then start where it would
have started without them. Parameters, buffers, gradients and the default RNG
states are put back by the measurements themselves. This module covers what lives
in Python objects: each module's attributes (a ``self.steps += 1`` counter, a list
it appends to, a tensor it caches), the state of its hooks (an object's attributes,
a closure's variables) and ``torch.Generator`` objects the model holds.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

# Modules whose slots the measurements restore themselves, or that the planners
# add and remove around each run.
_MANAGED = frozenset({"_parameters", "_buffers", "_modules"})
_HOOK_TABLES = (
    "_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
# Wrappers whose own attributes are the state of a process group's protocol (DDP's
# lazy initialisation and bucket rebuilding): theirs are left alone.
_PROTOCOL_MODULES = ("torch.nn.parallel", "torch.distributed")


class _Namespace:
    """One object's attributes as found: rebound ones are bound back, added ones
    deleted, and a list, dict or set mutated in place gets its items back."""

    def __init__(self, target: dict[str, Any], skip: frozenset[str] = frozenset()) -> None:
        self.target = target
        self.values = {k: v for k, v in target.items() if k not in skip}
        self.skip = skip
        self.items = {k: _items(v) for k, v in self.values.items() if _items(v) is not None}
        self.generators = {
            k: v.get_state() for k, v in self.values.items()
            if isinstance(v, torch.Generator) and v.device.type == "cpu"
        }

    def restore(self) -> None:
        for k in [k for k in self.target if k not in self.values and k not in self.skip]:
            del self.target[k]
        for k, v in self.values.items():
            if self.target.get(k, _MISSING) is not v:
                self.target[k] = v
        for k, items in self.items.items():
            _put_items(self.values[k], items)
        for k, state in self.generators.items():
            if not torch.equal(self.values[k].get_state(), state):
                self.values[k].set_state(state)


_MISSING = object()


def _items(value: Any) -> Any:
    """A shallow copy of a builtin container (None: not one). An ordered dict too:
    a module's hook tables are ordered dicts, and a library that registers hooks at
    a model's first call (transformers' output capturing) would otherwise leave a
    second set behind after planning, with its flag put back."""
    if type(value) is list:
        return list(value)
    if type(value) is dict or type(value) is collections.OrderedDict:
        return dict(value)
    if type(value) is set:
        return set(value)
    return None


def _put_items(container: Any, items: Any) -> None:
    if isinstance(container, list):
        if len(container) != len(items) or any(a is not b for a, b in zip(container, items)):
            container[:] = items
    elif isinstance(container, dict):
        if container.keys() != items.keys() or any(container[k] is not v for k, v in items.items()):
            container.clear()
            container.update(items)
    elif container != items:
        container.clear()
        container.update(items)


class _Cells:
    """A closure's variables (``nonlocal`` counters of a hook function)."""

    def __init__(self, fn: Any) -> None:
        self.cells = []
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self.cells.append((cell, value, _items(value)))

    def restore(self) -> None:
        for cell, value, items in self.cells:
            if cell.cell_contents is not value:
                cell.cell_contents = value
            if items is not None:
                _put_items(value, items)


def _hook_state(hook: Any) -> list[Any]:
    """A hook's state: its closure's variables, and the attributes of the object it
    is a method of, or that it is (a callable object). Hooks of torch and of this
    package are left alone: the planner's own hooks carry what it measures out of
    the run, and torch's (FSDP2's) state is the protocol's."""
    inner = hook.func if isinstance(hook, functools.partial) else hook
    if getattr(getattr(inner, "__func__", inner), "__module__", None) is None:
        where = type(inner).__module__
    else:
        where = getattr(inner, "__func__", inner).__module__
    if where == "torch" or where.startswith(("torch.", "torch_remat")):
        return []
    owner = getattr(hook, "__self__", None)
    fn = getattr(hook, "__func__", hook)
    holder = owner if owner is not None else (
        None if isinstance(hook, types.FunctionType) else hook
    )
    out: list[Any] = [_Cells(fn)]
    if holder is not None and not isinstance(holder, nn.Module) and hasattr(holder, "__dict__"):
        out.append(_Namespace(vars(holder)))
    return out


@contextlib.contextmanager
def preserved_python_state(model: nn.Module) -> Iterator[None]:
    """Put back, on exit, every module's attributes, its hooks' state and the CPU
    generators it holds, as they were on entry (see the module's docstring)."""
    saved: list[Any] = []
    for module in model.modules():
        if type(module).__module__.startswith(_PROTOCOL_MODULES):
            continue
        saved.append(_Namespace(vars(module), _MANAGED))
        for table in _HOOK_TABLES:
            hooks = vars(module).get(table)
            if isinstance(hooks, dict):
                for hook in list(hooks.values()):
                    hook = hook[0] if isinstance(hook, tuple) else hook
                    saved.extend(_hook_state(hook))
    try:
        yield
    finally:
        for state in saved:
            state.restore()
