"""State a checkpointed function reads besides its arguments: the parameters,
buffers and other attributes of the modules behind it and the values in its closure.

The replay reads them again in backward, so it must see the tensors the forward
saw. When the checkpoint starts, every slot that holds such a tensor (an entry of a
module's ``_parameters`` or ``_buffers``, a closure cell) is recorded with the
tensor it holds and that tensor's version. Around the replay:

* a slot that holds another tensor now (``functional_call``, a stateless swap, a
  parameter replaced after the forward) gets the forward's tensor back for the
  replay, and the caller's afterwards;
* a tensor whose version moved since the forward (updated in place under
  ``no_grad``, an optimizer step) cannot be replayed: that raises
  :class:`SavedTensorModifiedError` naming it by its qualified name;
* every module's attributes (a shallow copy of its ``__dict__``: plain tensor
  attributes such as ``self.mask``, Python values such as a temperature or a
  counter, the ``training`` flag), its submodules, every closure value of the
  function, the module-level variables its code reads (the function's, each
  module class's ``forward``, the modules' forward hooks, and the plain functions
  they call, by name, and the functions behind a decorated one; modules aside, and
  torch's own code; a name defined only after a first call is read once it is),
  the attributes of the user's classes named there, those of the user's plain
  objects found in those and in turn in theirs (a
  config, a callable object: a shallow copy of their ``__dict__`` or
  ``__slots__``) and of the user's classes of the modules and objects are recorded
  too; generator objects among them (``torch.Generator``, ``random.Random``,
  NumPy's) are forked (rng.py). The replay runs with the values they had when the
  checkpoint started, and the caller's are back afterwards: one rebound, replaced
  or flipped (``model.eval()``) after the forward, one the forward itself rebinds
  from its own value (``self.center = 0.9 * self.center + ...``, ``self.calls +=
  1``), and one the forward added (absent in the replay). Values are compared by
  identity;
* the forward hooks of every module that has some (their dicts, with the kwargs
  and always-called flags) and the global forward hooks, if any: the replay runs
  with the hooks the forward ran, and those registered on other modules since are
  off while it runs (a hook that steered an activation for one forward and was
  removed before backward, one registered after the forward);
* the contents of every plain ``list``, ``dict`` and ``set`` (an ``OrderedDict``,
  a ``Counter``; those a ``UserDict``, ``UserList`` or ``ChainMap`` holds) in a
  module's attribute (a private one too, in a module of the user's), a closure
  cell, a plain object, another such container or (up to
  1,024 items) a module-level variable (a carried state ``self.state["h"] = h``,
  a history the forward reads ``self.hist[-1]`` and extends, a dict of counters)
  are recorded too (a shallow copy each; see :func:`_held_state`). The replay runs on the contents
  the forward started from. Afterwards each holds again what it held when the
  replay began, the caller's contents, whatever the replay added, changed or
  removed (:class:`_Contents`), as the replay's attribute writes are undone: a list
  the forward appends to holds the forward's entry once, a counter the forward
  increments in a dict counts once, and a key or member the caller removed before
  backward stays removed, as without remat. A tensor in such a container is
  version-checked like a tensor attribute (updated in place during the forward or
  before the replay, it is refused, named by its container and key), and where the
  replay skips a SAVE region's body, what the body did to a container (entries
  appended, keys set or removed, members added or removed) is done again there, for
  the replay's later code to read, and undone with the rest (:class:`_ContentsLeft`);
* a buffer the forward itself updated in place (BatchNorm's running statistics,
  spectral norm's power iteration) is copied when the checkpoint starts, and the
  replay runs on a fresh copy of that value, so it computes what the forward did
  and the module's buffer is updated once per step. Copies of buffers the forward
  did not update are dropped when the forward ends, and the checkpointed function
  remembers the module (:data:`BufferMemo`): its later calls copy that module's
  buffers no more. Should one of them write such a buffer after all, no copy of
  its starting value exists and the forward raises
  :class:`SavedTensorModifiedError` naming the buffer (the next call copies it
  again). Training-mode batch norm, whose kernels update the running statistics
  without a version bump, is always copied, and so, from then on, are the buffers
  of a module whose forward was seen to change a buffer's values without moving
  its version (a plain module calling ``F.batch_norm`` on buffers of its own: the
  copies are compared with the buffers when such a forward ends);
* a module-level tensor the code reads (a mask, a table) is checked like a
  closure tensor: updated in place after the forward, the replay refuses it by
  name; rebound, the replay gets the forward's tensor.

A checkpointed module called on tensors reuses its last call's capture where
nothing the walk read changed (:class:`_Reuse`: every ``__dict__``, parameter,
buffer and submodule dict of its modules holds the same keys and objects, their
classes and the user's class attributes are the same, no forward hook exists and
the module-level variables read are bound as before, and the containers in
private attributes hold the same objects); the tensors' versions,
``requires_grad`` and the buffer copies are taken anew at every call.

The modules behind a function: the function itself if it is an ``nn.Module``, the
object of a bound method, the callable and arguments of a ``functools.partial``,
what ``__wrapped__`` points to, modules in the closure, and the module named by a
``__remat_module__`` attribute (``(qualified_name, module)``; ``apply_remat``'s
forwards set it, so names are qualified in the whole model).
"""

from __future__ import annotations

import collections
import contextvars
import dis
import enum
import functools
import itertools
import operator
import sys
import sysconfig
import threading
import types
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import _compat
from .._compat import INFERENCE_VERSION, any_version, version_of
from .._errors import RecomputeMismatchError, modified_in_place
from .rng import default_generators, forked, generator_states, is_generator_type

PARAMETER = "parameter"
BUFFER = "buffer"
CLOSURE = "closure variable"
ATTRIBUTE = "tensor attribute"
GLOBAL = "module-level tensor"
CONTAINED = "tensor held in a container"

_MAX_DEPTH = 4
_MISSING = object()
_NOT_TENSORS = frozenset({dict, collections.OrderedDict, set, frozenset, bool, int, float, str, type(None), tuple, list})
# the value types seen in module __dict__s that are not tensors (grows as seen)
_non_tensor_types: set[type] = set(_NOT_TENSORS)
# the keys every nn.Module's __dict__ holds (torch's own state, all but "training"
# named with a leading underscore)
_MODULE_KEYS = frozenset(nn.Module().__dict__)
# the base containers whose contents are recorded
_CONTAINERS = frozenset({list, dict, set})
# the container types recorded: these three, a deque, and subclasses of them that
# keep their refill and read methods (an attribute dict, a defaultdict); joined as seen
_CONTAINER_TYPES: set[type] = set(_CONTAINERS)
_CONTAINER_CHECKED: dict[type, bool] = dict.fromkeys(_CONTAINERS, True)
# what a module attribute may hold that _held_state looks into: containers, tuples
# and named tuples (their types join as seen)
_HOLDERS: set[type] = set(_CONTAINERS) | {tuple}
# values of these types hold no state
_SCALARS = frozenset({bool, int, float, complex, str, bytes, type(None)})
# callables a module may hold and its forward call (self.act = lambda t: ...,
# obj.method, functools.partial): what they read is state too (visited like hooks)
_CALLABLES = frozenset({types.FunctionType, types.MethodType, functools.partial})
_NO_TYPES: frozenset[type] = frozenset()


def _dict_version_offset() -> int | None:
    """Where a ``dict`` keeps its version tag (PEP 509: a number that changes at
    every insertion, deletion or rebinding of a value), checked on dicts written
    every way a module's or an object's attributes are; None where this CPython
    has none (3.14 removed it) or keeps it elsewhere."""
    import ctypes
    import struct
    import sysconfig

    if sys.version_info >= (3, 14) or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None  # (a free-threaded build lays dicts out otherwise)
    offset = object.__basicsize__ + struct.calcsize("n")  # after ma_used

    def tag(d: dict) -> int:
        return ctypes.c_uint64.from_address(id(d) + offset).value

    class Probe:
        pass

    try:
        d: dict = {}
        m, obj = nn.Module(), Probe()
        md, od = m.__dict__, obj.__dict__
        writes = [
            (d, lambda: d.__setitem__("a", 1)),
            (d, lambda: d.__setitem__("a", 2)),
            (d, lambda: d.pop("a")),
            (md, lambda: setattr(m, "scale", 1.0)),
            (md, lambda: setattr(m, "scale", 2.0)),
            (md, lambda: delattr(m, "scale")),
            (md, lambda: m.train(False)),
            (m._buffers, lambda: m.register_buffer("b", None)),
            (m._buffers, lambda: setattr(m, "b", torch.zeros(1))),
        ]
        for i in range(16):  # (after the interpreter specializes the stores)
            writes.append((od, lambda i=i: setattr(obj, "n", i)))
        for target, write in writes:
            before = tag(target)
            if tag(target) != before:
                return None
            write()
            if tag(target) == before:
                return None
    except Exception:
        return None
    return offset


_DICT_VERSION_AT = _dict_version_offset()


def dict_version_views(dicts: Any) -> list[Any] | None:
    """A view of each dict's version tag (read its ``value``); None where this
    CPython has no tag (see _dict_version_offset)."""
    if _DICT_VERSION_AT is None:
        return None
    import ctypes

    at = _DICT_VERSION_AT
    from_address = ctypes.c_uint64.from_address
    return [from_address(id(d) + at) for d in dicts]


_tag_of = operator.attrgetter("value")

_CLASS_TAGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _class_tag(cls: type) -> Any:
    """A view of the version tag of the dict behind ``cls``'s attributes (see
    :func:`dict_version_views`), once per class; None where there is none."""
    try:
        return _CLASS_TAGS[cls]
    except KeyError:
        pass
    except TypeError:  # (a class that takes no weak reference)
        return None
    d = _class_dict_of(_class_dict(cls))
    views = dict_version_views([d]) if d is not None else None
    tag = _CLASS_TAGS[cls] = views[0] if views else None
    return tag


_NOT_PLAIN = (
    nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType,
    types.BuiltinFunctionType, functools.partial, BaseException, enum.Enum,
)
# where the objects are library state, not the user's (hooks, loggers, wrappers)
_LIBRARY_MODULES = frozenset({
    "torch", "torch_remat", "functorch", "torchvision", "torchaudio", "torchtext", "torchdata",
    "torchtitan", "torchtune", "torchao", "torchmetrics", "torchrec", "triton",
    "builtins", "numpy", "scipy", "logging", "threading", "weakref", "collections",
    "functools", "typing", "enum", "abc", "accelerate", "transformers", "peft", "lightning",
    "pytorch_lightning", "_pytest", "pytest", "_thread", "_contextvars",
})
# the standard library's containers that keep their contents in a container of
# their own (``data``, ``maps``): recorded as plain objects, through those
_STDLIB_PLAIN = frozenset({collections.UserDict, collections.UserList, collections.ChainMap})
_PLAIN: dict[type, bool] = {cls: True for cls in _STDLIB_PLAIN}


def _library_name(module: str) -> bool:
    """Whether ``module`` is one of :data:`_LIBRARY_MODULES` or inside one (a
    user's ``torch_blocks`` is not ``torch``), or this project's integrations."""
    if not isinstance(module, str):
        return False
    return module.partition(".")[0] in _LIBRARY_MODULES or module.startswith("integrations.")


def _from_library(cls: type) -> bool:
    module = getattr(cls, "__module__", None) or ""
    return not isinstance(module, str) or _library_name(module)


_USERS_MODULE_CLASS: dict[type, bool] = {}


def _users_module_class(cls: type) -> bool:
    """Whether ``cls`` is a module class of the user's, or one a library derived
    from one (FSDP2's ``fully_shard`` gives a module a class of its own, made in
    torch, with the user's class as a base)."""
    known = _USERS_MODULE_CLASS.get(cls)
    if known is None:
        known = _USERS_MODULE_CLASS[cls] = any(not _from_library(c) for c in cls.__mro__)
    return known


def _own_code(module: str) -> bool:
    """torch's or this package's functions: their globals are not the user's state."""
    if not isinstance(module, str):
        return False
    top = module.partition(".")[0]
    return top == "torch" or top == "torch_remat" or module.startswith("integrations.")


_KV_CACHE_MODULE = "transformers.cache_utils"


def _kv_cache_class(cls: type) -> bool:
    """Whether ``cls`` is one of transformers' key/value caches or their layers: a
    forward appends to them (a layer rebinds its ``keys``), which a replay must see
    as at the checkpoint's entry, and the caller as the forward left them."""
    found = any(getattr(c, "__module__", None) == _KV_CACHE_MODULE for c in cls.__mro__)
    if found:
        _KV_CACHE_NAMES.add(cls.__name__)
    return found


# the names of the key/value cache classes met (the walk's names for their attributes
# start with them): a cache written in place (StaticCache) is refused naming the fix
_KV_CACHE_NAMES: set[str] = set()


_MODEL_CONFIG_MODULE = "transformers.configuration_utils"
_MODEL_CONFIG: dict[type, bool] = {}


def _model_config_class(cls: type) -> bool:
    """Whether ``cls`` is a transformers model configuration (``PreTrainedConfig``):
    a layer reads its settings at every call (``config._attn_implementation`` picks
    the attention kernel), so a setting changed between a forward and its backward
    would send the replay down another path."""
    found = _MODEL_CONFIG.get(cls)
    if found is None:
        found = _MODEL_CONFIG[cls] = any(
            getattr(c, "__module__", None) == _MODEL_CONFIG_MODULE for c in cls.__mro__
        )
    return found


def _is_plain(cls: type) -> bool:
    """Whether values of ``cls`` are plain objects of the user's whose attributes
    the checkpointed code may read (a config, a callable object), in a ``__dict__``
    or in ``__slots__``."""
    plain = _PLAIN.get(cls)
    if plain is None:
        plain = cls is threading.local or cls is contextvars.ContextVar or (
            (getattr(cls, "__dictoffset__", 0) != 0 or bool(_slot_names(cls)))
            and not issubclass(cls, _NOT_PLAIN)
            and (not _from_library(cls) or _kv_cache_class(cls))
            and not is_generator_type(cls)  # forked whole (ModuleState.generators)
        )
        _PLAIN[cls] = plain
    return plain


class _AttributeView:
    """Attributes kept outside a plain ``__dict__``, through the ``dict`` protocol
    the attribute records use: reads from :meth:`_now`, writes through ``setattr``
    on ``target``."""

    __slots__ = ("target",)

    def __init__(self, target: Any) -> None:
        self.target = target

    def _now(self) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._now())

    def __iter__(self):
        return iter(self._now())

    def __contains__(self, key: Any) -> bool:
        return key in self._now()

    def __getitem__(self, key: str) -> Any:
        return self._now()[key]

    def keys(self):
        return self._now().keys()

    def values(self):
        return self._now().values()

    def items(self):
        return self._now().items()

    def get(self, key: str, default: Any = None) -> Any:
        return self._now().get(key, default)

    def copy(self) -> dict:
        return dict(self._now())

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self.target, key, value)

    def __delitem__(self, key: str) -> None:
        delattr(self.target, key)

    def pop(self, key: str) -> Any:
        value = self._now()[key]
        delattr(self.target, key)
        return value


_SLOT_NAMES: dict[type, tuple[str, ...]] = {}


def _slot_names(cls: type) -> tuple[str, ...]:
    """The ``__slots__`` attributes of ``cls`` and its bases."""
    names = _SLOT_NAMES.get(cls)
    if names is None:
        found: dict[str, None] = {}
        for c in cls.__mro__:
            declared = c.__dict__.get("__slots__", ())
            if isinstance(declared, str):
                declared = (declared,)
            for n in declared:
                if n not in ("__dict__", "__weakref__"):
                    # a private name is stored mangled
                    found[f"_{c.__name__.lstrip('_')}{n}" if n.startswith("__") else n] = None
        names = _SLOT_NAMES[cls] = tuple(found)
    return names


class _SlotValues(_AttributeView):
    """An object's ``__slots__`` attributes (an unset slot is an absent key)."""

    __slots__ = ("names",)

    def __init__(self, obj: Any, names: tuple[str, ...]) -> None:
        super().__init__(obj)
        self.names = names

    def _now(self) -> dict:
        out = {}
        obj = self.target
        for n in self.names:
            try:
                value = getattr(obj, n, _MISSING)
            except Exception:  # a __getattr__ of the user's that raises otherwise
                continue
            if value is not _MISSING:
                out[n] = value
        return out


class _ThreadLocalValues(_AttributeView):
    """A ``threading.local``'s attributes as the thread asking sees them: a replay
    run by another thread than its forward (CUDA's backward runs on autograd's
    device threads) reads and sets them in its own thread's dict."""

    __slots__ = ()

    def _now(self) -> dict:
        return self.target.__dict__


class _ContextVarValue(_AttributeView):
    """A ``contextvars.ContextVar``'s value in the context asking, as a dict of one
    key, ``"value"`` (absent where the variable has none there): the replay sets the
    forward's value in the context that runs it, and the caller's back after."""

    __slots__ = ("tokens",)

    def __init__(self, var: contextvars.ContextVar) -> None:
        super().__init__(var)
        self.tokens: list[contextvars.Token] = []

    def _now(self) -> dict:
        value = self.target.get(_MISSING)
        return {} if value is _MISSING else {"value": value}

    def __setitem__(self, key: str, value: Any) -> None:
        tokens = self.tokens
        if tokens and tokens[-1].old_value is value:
            # putting back the value this view's last set replaced: reset it, so the
            # context ends exactly as it was (and no token is left behind)
            self.target.reset(tokens.pop())
        else:
            tokens.append(self.target.set(value))

    def __delitem__(self, key: str) -> None:
        if not self.tokens or self.tokens[-1].old_value is not contextvars.Token.MISSING:
            # The forward ran where the variable had no value, the replay where it
            # has one: a variable cannot be unset, so the replay cannot see what the
            # forward saw in this context (install: the replay runs again in a
            # context without it, see ContextVarUnset).
            raise ContextVarUnset(self.target,
                f"torch_remat: the checkpointed code reads the contextvars.ContextVar "
                f"'{self.target.name}', which had no value when its forward ran and has one "
                "when backward recomputes it; a replay cannot unset it. Set it before the "
                "forward (var.set(...)), or pass its value to the checkpointed function as "
                "an argument."
            )
        self.target.reset(self.tokens.pop())  # (the value it had before this replay set it)

    def pop(self, key: str) -> Any:
        value = self._now()[key]
        del self[key]
        return value


class ContextVarUnset(RecomputeMismatchError):
    """A context variable without a value where the forward started has one where
    the replay runs. Raised while the replay installs the forward's state, the
    replay runs again in a context without it (``CheckpointFrame.replay``);
    raised later (where a replay skips a SAVE region), it is the error."""

    def __init__(self, var: contextvars.ContextVar, message: str) -> None:
        super().__init__(message)
        self.var = var
        self.installing = False  # (raised by ModuleState.install)


def _attributes(obj: Any) -> list[Any]:
    """A plain object's attributes as ``dict``s: its ``__dict__``, its slots
    through :class:`_SlotValues`, a ``threading.local``'s through
    :class:`_ThreadLocalValues`, a ``ContextVar``'s value through
    :class:`_ContextVarValue`."""
    if type(obj) is contextvars.ContextVar:
        return [_ContextVarValue(obj)]
    names = _slot_names(type(obj))
    if isinstance(obj, threading.local):
        out: list[Any] = [_ThreadLocalValues(obj)]
        if names:
            out.append(_SlotValues(obj, names))
        return out
    try:
        d = getattr(obj, "__dict__", None)
    except Exception:  # a __getattr__ of the user's that raises otherwise
        d = None
    out = [d] if type(d) is dict else []
    if names:
        out.append(_SlotValues(obj, names))
    return out


_CLASS_INFO: dict[type, tuple[tuple[Any, ...], tuple[type, ...], tuple[Any, ...], list[Any]]] = {}
_METHOD_TYPES = (types.FunctionType, staticmethod, classmethod, property)


def _class_methods(users: tuple[type, ...]) -> list[Any]:
    """The functions, static and class methods and properties the classes define."""
    return [v for c in users for v in list(vars(c).values()) if isinstance(v, _METHOD_TYPES)]


def _defined_functions(values: Any) -> list[Any]:
    """The plain functions among a class's attributes: its methods, the functions of
    its static and class methods and properties, and those behind their decorators
    (``__wrapped__``)."""
    found: dict[int, Any] = {}
    for v in values:
        if not isinstance(v, _METHOD_TYPES):
            continue
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        for f in (v.fget, v.fset, v.fdel) if isinstance(v, property) else (v,):
            while type(f) is types.FunctionType and id(f) not in found:
                found[id(f)] = f
                f = f.__dict__.get("__wrapped__")
    return [f for f in found.values() if _written_by_the_user(f.__code__.co_filename)]


_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


@functools.cache
def _written_by_the_user(filename: str) -> bool:
    """Whether code from ``filename`` is the user's: not made by ``exec`` (a
    dataclass's or named tuple's generated methods) nor in the standard library
    or installed packages (the wrapper ``dataclasses`` puts around ``__repr__``)."""
    return not filename.startswith("<") and not filename.startswith(_LIBRARY_DIRS)


def _class_info(cls: type) -> tuple[tuple[Any, ...], tuple[type, ...]]:
    """The module-level variables of the user's state that the methods of ``cls``
    read (its ``forward`` and the helpers it calls: every plain function the user's
    classes in its method resolution order define, static and class methods and
    properties included), as :class:`_MergedReads`, one per module; and those
    classes. Looked at again when a method was defined, replaced or removed since
    (``Block.forward = patched``), or the method resolution order changed."""
    info = _CLASS_INFO.get(cls)
    if info is not None:
        reads, users, mro, defined = info
        if mro is cls.__mro__ or mro == cls.__mro__:
            now = _class_methods(users)
            if len(now) == len(defined) and all(map(operator.is_, now, defined)):
                return reads, users
    users = tuple(c for c in cls.__mro__ if c is not object and not _from_library(c))
    defined = _class_methods(users)
    methods: dict[int, Any] = {}
    for v in defined:
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        found = (v.fget, v.fset) if isinstance(v, property) else (v,)
        for f in found:
            # (and the method behind a decorator: @torch.no_grad(), functools.wraps)
            while type(f) is types.FunctionType and id(f) not in methods:
                if _global_names(f) or _module_attr_names(f):
                    methods[id(f)] = f
                f = f.__dict__.get("__wrapped__")
    # one merged read per module the methods live in (a class may define hundreds)
    by_module: dict[int, list[Any]] = {}
    for f in methods.values():
        by_module.setdefault(id(f.__globals__), []).append(f)
    reads = tuple(_MergedReads(fs[0].__globals__, fs) for fs in by_module.values())
    _CLASS_INFO[cls] = (reads, users, cls.__mro__, defined)
    return reads, users


def _class_dict_of(view: Any) -> dict | None:
    """The dict behind a class's attributes (its ``__dict__`` is a read-only proxy
    of it); None if not found."""
    import gc

    refs = gc.get_referents(view.target.__dict__)
    return refs[0] if len(refs) == 1 and type(refs[0]) is dict else None


class _ClassDict(_AttributeView):
    """A class's attributes (a class's ``__dict__`` is read-only)."""

    __slots__ = ()

    def _now(self) -> Any:
        return self.target.__dict__


_CLASS_DICTS: dict[type, _ClassDict] = {}


def _class_dict(cls: type) -> _ClassDict:
    d = _CLASS_DICTS.get(cls)
    if d is None:
        d = _CLASS_DICTS[cls] = _ClassDict(cls)
    return d


_GLOBAL_NAMES: dict[Any, tuple[str, ...]] = {}
"""Per code object, the module-level names it (and the code nested in it:
comprehensions, lambdas, inner functions) reads, modules and the library's classes
aside, and builtins its module does not shadow; a name its module does not define
yet is among them (read where it is defined by the time of a later call); empty for
torch's and torch_remat's own code."""

_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL"})


def _global_names(func: Any) -> tuple[str, ...]:
    code = getattr(func, "__code__", None)
    if code is None:
        return ()
    names = _GLOBAL_NAMES.get(code)
    if names is None:
        module = getattr(func, "__module__", None) or ""
        g = getattr(func, "__globals__", None)
        if _own_code(module) or type(g) is not dict:
            names = ()
        else:
            found: dict[str, None] = {}
            todo = [code]
            while todo:
                c = todo.pop()
                found.update((ins.argval, None) for ins in dis.get_instructions(c) if ins.opname in _GLOBAL_OPS)
                todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
            builtins = g.get("__builtins__", {})
            if isinstance(builtins, types.ModuleType):
                builtins = builtins.__dict__
            names = tuple(
                n for n in found
                if (n in g and not isinstance(g[n], types.ModuleType)
                    and not (isinstance(g[n], type) and _from_library(g[n])))
                or (n not in g and n not in builtins)
            )
        _GLOBAL_NAMES[code] = names
    return names


_MODULE_ATTRS: dict[Any, tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]] = {}


def _module_attr_names(func: Any) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """``(path, attribute names)`` of the user's modules ``func`` reads attributes
    of (``config.SCALE``, ``config.TABLE["k"]``, ``config.COUNT += 1``,
    ``pkg.sub.SCALE``): what ``import config`` makes a module-level variable of
    another module. ``path``: the global's name, then the submodules' names.
    Library and standard-library modules are left out."""
    code = getattr(func, "__code__", None)
    if code is None:
        return ()
    found = _MODULE_ATTRS.get(code)
    if found is None:
        g = getattr(func, "__globals__", None)
        module = getattr(func, "__module__", None) or ""
        if type(g) is not dict or _own_code(module):
            _MODULE_ATTRS[code] = ()
            return ()
        pairs: dict[tuple[str, ...], dict[str, None]] = {}
        todo = [code]
        while todo:
            c = todo.pop()
            todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
            chain: tuple[tuple[str, ...], Any] | None = None  # (path, the module it names)
            for ins in dis.get_instructions(c):
                op = ins.opname
                if op == "LOAD_GLOBAL":
                    value = g.get(ins.argval)
                    user = isinstance(value, types.ModuleType) and _user_module(value)
                    chain = ((ins.argval,), value) if user else None
                elif chain is not None and op in ("LOAD_ATTR", "LOAD_METHOD"):
                    path, module = chain
                    try:
                        value = getattr(module, ins.argval, None)
                    except Exception:  # a module-level __getattr__ that raises otherwise
                        value = None
                    if isinstance(value, types.ModuleType) and _user_module(value):
                        chain = ((*path, ins.argval), value)  # pkg.sub: a submodule
                    else:
                        pairs.setdefault(path, {})[ins.argval] = None
                        chain = None
                elif op not in ("COPY", "DUP_TOP", "CACHE", "EXTENDED_ARG"):
                    # (COPY: config.COUNT += 1 reads the module it then writes)
                    chain = None
        found = _MODULE_ATTRS[code] = tuple((m, tuple(a)) for m, a in pairs.items())
    return found


def _user_module(module: types.ModuleType) -> bool:
    return _user_module_name(getattr(module, "__name__", ""))


def _user_module_name(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    # (the standard library and _LIBRARY_MODULES are not the user's state)
    return not (_library_name(name) or name.partition(".")[0] in sys.stdlib_module_names)


def _read_globals(func: Any, out: list[tuple[dict, str, Any]], seen: set[Any], depth: int) -> None:
    """``(globals, name, value)`` of the module-level variables ``func`` reads (a
    scale, a flag, a table), and of the plain functions it calls, ``depth`` deep
    (see :data:`_GLOBAL_NAMES`)."""
    if type(func) is _MergedReads:
        _read_names(func.globals, func.names, func.module_attrs, out, seen, depth)
        return
    names = _global_names(func)
    module_attrs = _module_attr_names(func)
    if names or module_attrs:
        _read_names(func.__globals__, names, module_attrs, out, seen, depth)


class _MergedReads:
    """The module-level variables several functions of one module read (the
    methods of a class), merged: read once per call, whatever their number."""

    __slots__ = ("globals", "names", "module_attrs")

    def __init__(self, g: dict, functions: list[Any]) -> None:
        self.globals = g
        self.names = tuple(dict.fromkeys(n for f in functions for n in _global_names(f)))
        attrs: dict[tuple[str, ...], dict[str, None]] = {}
        for f in functions:
            for path, names in _module_attr_names(f):
                attrs.setdefault(path, {}).update(dict.fromkeys(names))
        self.module_attrs = tuple((path, tuple(names)) for path, names in attrs.items())


# put in the ``seen`` set of a capture by _read_names: a name that was not there, and
# module attributes read (config.SCALE); then the capture is not reused (_Reuse)
_NAME_MISSED = object()
_MODULE_ATTRIBUTES_READ = object()


def _read_names(
    g: dict, names: tuple[str, ...], module_attrs: Any, out: list[tuple[dict, str, Any]],
    seen: set[Any], depth: int,
) -> None:
    gid = id(g)
    if module_attrs:
        seen.add(_MODULE_ATTRIBUTES_READ)
    for name in names:
        value = g.get(name, _MISSING)
        if value is _MISSING:
            seen.add(_NAME_MISSED)
            continue
        if (gid, name) in seen:
            continue
        seen.add((gid, name))  # (one entry per variable, however many functions read it)
        out.append((g, name, value))
        if type(value) is types.FunctionType and depth < _MAX_DEPTH and id(value) not in seen:
            seen.add(id(value))
            _read_globals(value, out, seen, depth + 1)
            _read_wrapped(value, out, seen, depth + 1)
    for path, attrs in module_attrs:
        module = g.get(path[0])
        for name in path[1:]:
            module = getattr(module, name, None)
        if not isinstance(module, types.ModuleType):
            continue
        md = module.__dict__
        mid = id(md)
        for name in attrs:
            value = md.get(name, _MISSING)
            if value is _MISSING or isinstance(value, types.ModuleType) or (mid, name) in seen:
                continue
            seen.add((mid, name))
            out.append((md, name, value))
            if type(value) is types.FunctionType and depth < _MAX_DEPTH and id(value) not in seen:
                seen.add(id(value))
                _read_globals(value, out, seen, depth + 1)
                _read_wrapped(value, out, seen, depth + 1)


def _read_wrapped(func: Any, out: list[tuple[dict, str, Any]], seen: set[Any], depth: int) -> None:
    """The functions behind a decorated one (``functools.wraps``' ``__wrapped__``,
    the functions in a wrapper's closure, as a decorator holds the one it wraps):
    their module-level variables are read too, the decorator's own code (torch's
    ``compiler.disable`` among them) aside or not."""
    behind: list[Any] = []
    wrapped = func.__dict__.get("__wrapped__") if hasattr(func, "__dict__") else None
    if type(wrapped) is types.FunctionType:
        behind.append(wrapped)
    for cell in func.__closure__ or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if type(v) is types.FunctionType:
            behind.append(v)
    for f in behind:
        if depth <= _MAX_DEPTH and id(f) not in seen:
            seen.add(id(f))
            _read_globals(f, out, seen, depth)
            _read_wrapped(f, out, seen, depth + 1)


def _wrapper_cells(fs: list[Any], cells: list[tuple[str, Any]], values: list[tuple[Any, Any]]) -> None:
    """Add to ``cells`` (those holding a tensor: ``(name, cell)``) and ``values``
    (``(cell, value)``) the closure cells of the functions ``fs`` and of the functions
    behind them (``__wrapped__``, the functions in their closures: what
    :func:`_read_wrapped` follows), torch's and this package's own cells aside, and
    none already there."""
    known = {id(c) for c, _ in values}
    known.update(id(c) for _, c in cells)
    seen: set[int] = set()
    stack = list(fs)
    while stack and len(seen) < _MAX_WRAPPED:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        wrapped = f.__dict__.get("__wrapped__")
        if type(wrapped) is types.FunctionType:
            stack.append(wrapped)
        closure = f.__closure__
        if not closure:
            continue
        own = _own_code(getattr(f, "__module__", None) or "")
        for name, cell in zip(f.__code__.co_freevars, closure):
            value = _cell_value(cell)
            if value is _MISSING or name == "__class__":  # (an empty cell; super()'s)
                continue
            if type(value) is types.FunctionType:
                stack.append(value)
            if own or id(cell) in known:
                continue
            known.add(id(cell))
            if isinstance(value, torch.Tensor):
                cells.append((name, cell))
            else:
                values.append((cell, value))


_MAX_WRAPPED = 256
"""How many functions behind the module-level functions a call reads
:func:`_wrapper_cells` looks at."""


_HELD_CALLABLES = (types.MethodType, functools.partial)
_SMALL = 64


def _held_callables(global_values: list[tuple[dict, str, Any]]) -> list[Any]:
    """The modules, bound methods and partials among module-level values, and the
    modules, functions, bound methods and partials in the small lists and dicts
    there (a table of ops): a model kept in a module-level variable
    (``MODEL = Net()``) has its parameters and buffers recorded as a closure's."""
    found = []
    for _, _, v in global_values:
        cls = type(v)
        if cls in _HELD_CALLABLES or isinstance(v, nn.Module):
            found.append(v)
        elif (cls is dict or cls is list) and len(v) <= _SMALL:
            for item in (v.values() if cls is dict else v):
                if type(item) in _CALLABLES or isinstance(item, nn.Module):
                    found.append(item)
    return found


# per base container, the methods a subclass must not override to be recorded
# (the standard library's ordered dict and counter first: refilled key by key
# through their own ``__setitem__``, see _fill)
_KEPT_METHODS = {
    collections.OrderedDict: ("clear", "keys", "items", "values", "__iter__", "__len__",
                              "__getitem__", "__setitem__"),
    collections.Counter: ("clear", "keys", "items", "values", "__iter__", "__len__",
                          "__getitem__", "__setitem__"),
    dict: ("clear", "update", "keys", "items", "values", "__iter__", "__len__", "__getitem__"),
    list: ("__setitem__", "__iter__", "__len__", "__getitem__"),
    set: ("clear", "update", "__iter__", "__len__"),
}


def _is_container(cls: type) -> bool:
    """Whether values of ``cls`` are containers whose contents are recorded."""
    known = _CONTAINER_CHECKED.get(cls)
    if known is None:
        known = cls is collections.deque
        for base, names in _KEPT_METHODS.items():
            if issubclass(cls, base):
                known = all(getattr(cls, n, None) is getattr(base, n) for n in names)
                break
        _CONTAINER_CHECKED[cls] = known
        if known:
            _CONTAINER_TYPES.add(cls)
            _HOLDERS.add(cls)
    return known


# (OrderedDict is among _NOT_TENSORS, so a module's attribute scan never asks)
_is_container(collections.OrderedDict)
_is_container(collections.Counter)


def _contents(container: Any) -> Any:
    """A shallow copy of a list, dict or set (a list of a deque's items), of the
    plain type."""
    cls = type(container)
    if cls is list:
        return list(container)
    if cls is dict or cls is set:
        return container.copy()
    if isinstance(container, dict):
        return dict(container)
    return set(container) if isinstance(container, set) else list(container)


def _contained_tensors(containers: list[tuple[Any, Any]]) -> list[tuple[torch.Tensor, int, Any, Any]]:
    """(tensor, its version now, container, key) of each tensor in the recorded
    contents of ``containers`` ((container, :func:`_contents`) pairs; a set's
    members have the key None)."""
    out = []
    for container, entry in containers:
        cls = type(entry)
        items = entry.items() if cls is dict else zip(itertools.repeat(None), entry) if cls is set else enumerate(entry)
        for key, t in items:
            if isinstance(t, torch.Tensor):
                out.append((t, any_version(t), container, key))
    return out


def _contained_name(container: Any, key: Any, t: torch.Tensor) -> str:
    """``list[0] (shape (4,), float32)``: a tensor in a container, for messages."""
    where = f"{type(container).__name__}[{key!r}]" if key is not None else f"a member of a {type(container).__name__}"
    return f"{where} (shape {tuple(t.shape)}, {str(t.dtype).removeprefix('torch.')})"


class _Contents:
    """Adapts a list, dict, set or deque to the ``dict`` protocol of the undo
    entries: ``restore`` gives it back the contents it held when the replay began
    (the caller's), whatever the replay added, changed or removed; one that holds
    them still is left alone (a dict's version tag does not move)."""

    __slots__ = ("container",)

    def __init__(self, container: Any) -> None:
        self.container = container

    def __setitem__(self, _key: Any, before: Any) -> None:
        if not _holds(self.container, before):
            _fill(self.container, before)


class _ContentsLeft:
    """A container a top-level SAVE region's body changed, as a change the replay
    makes where it skips that body (:meth:`ModuleState.skip_attributes`): the
    body's change (:func:`_change`) is made again to what the replay's container
    holds there, so the replay's later code reads it. :meth:`ModuleState.install`
    recorded the container's contents before the replay, which it gets back after."""

    __slots__ = ("container",)

    def __init__(self, container: Any) -> None:
        self.container = container

    def skip(self, change: tuple) -> None:
        container = self.container
        kind = change[0]
        if kind == "appended":
            container.extend(_alive(change[1]))
        elif kind == "keys":
            for key, ref in change[1].items():
                value = _deref(ref)
                if value is not _MISSING:
                    container[key] = value
            for key in change[2]:
                container.pop(key, None)
        elif kind == "members":
            container |= set(_alive(change[1]))
            container -= change[2]
        else:  # "contents": a list reordered or shortened
            _fill(container, change[1])


class _Strong:
    """A reference to a value that takes no weak reference (an int, a tuple)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _ref(value: Any) -> Any:
    """A weak reference to ``value`` where it takes one: what a SAVE region's body
    put in a container (an aux loss, a saved-tensor hook's box) is not kept alive for
    the replay by this record alone."""
    try:
        return weakref.ref(value)
    except TypeError:
        return _Strong(value)


def _deref(ref: Any) -> Any:
    """The value behind :func:`_ref`'s reference; ``_MISSING`` once it was freed."""
    if type(ref) is _Strong:
        return ref.value
    value = ref()
    return _MISSING if value is None else value


def _alive(refs: list[Any]) -> list[Any]:
    return [v for v in map(_deref, refs) if v is not _MISSING]


def _change(before: Any, after: Any) -> tuple:
    """What turned the contents ``before`` into ``after`` (both :func:`_contents`):
    items appended to a list, keys set or removed in a dict, members added or
    removed in a set (what was put in, by :func:`_ref`: one freed before the replay
    reaches the body, the forward's code dropped, and the replay's does too); else
    the new contents."""
    if type(before) is list:
        n = len(before)
        if len(after) >= n and all(map(operator.is_, after[:n], before)):
            return ("appended", [_ref(x) for x in after[n:]])
        return ("contents", after)
    if type(before) is dict:
        return (
            "keys",
            {k: _ref(v) for k, v in after.items() if before.get(k, _MISSING) is not v},
            [k for k in before if k not in after],
        )
    return ("members", [_ref(x) for x in after - before], before - after)


def _fill(container: Any, contents: Any) -> None:
    """Make ``container`` (a list, dict, set or deque) hold ``contents``."""
    if isinstance(container, list):
        container[:] = contents
    elif isinstance(container, collections.deque):
        container.clear()
        container.extend(contents)
    elif type(container).update is dict.update or not isinstance(container, dict):
        container.clear()
        container.update(contents)
    else:
        # an OrderedDict (its order: insertion), a Counter (whose update adds)
        container.clear()
        for key, value in contents.items():
            container[key] = value


def _holds(container: Any, entry: Any) -> bool:
    """Whether ``container`` holds what its recorded contents ``entry``
    (:func:`_contents`) hold: the same objects, in the same order."""
    if len(container) != len(entry):
        return False
    if type(entry) is dict:
        return all(map(operator.is_, container, entry)) and all(
            map(operator.is_, container.values(), entry.values())
        )
    if type(entry) is set:
        return container == entry
    return all(map(operator.is_, container, entry))


class _CellSlot:
    """Adapts a closure cell to the ``dict`` protocol used for module slots."""

    __slots__ = ("cell",)

    def __init__(self, cell: Any) -> None:
        self.cell = cell

    def get(self, _key: Any, default: Any = None) -> Any:
        try:
            return self.cell.cell_contents
        except ValueError:  # the variable was deleted
            return default

    def __setitem__(self, _key: Any, value: Any) -> None:
        self.cell.cell_contents = value

    def __delitem__(self, _key: Any) -> None:
        del self.cell.cell_contents


class _Slot:
    __slots__ = ("owner", "key", "tensor", "version", "prefix", "kind", "copy", "requires_grad")

    def __init__(self, owner, key, tensor, version, prefix, kind, copy=None) -> None:
        self.owner = owner
        self.key = key
        self.tensor = tensor
        self.version = version
        # at this call: a tensor switched to require grad (or not) before the replay
        # would make the replay's ops save other tensors
        self.requires_grad = tensor.requires_grad
        self.prefix = prefix  # the qualified name is prefix + key (closures: prefix only)
        self.kind = kind
        # buffers: the value at the checkpoint's start while the forward runs; kept
        # afterwards only if the forward updated the buffer in place
        self.copy: torch.Tensor | None = copy

    @property
    def name(self) -> str:
        return self.prefix if self.kind == CLOSURE else self.prefix + self.key


def _roots(
    *fns: Any,
) -> tuple[
    list[tuple[str, nn.Module]], list[tuple[str, Any]], list[tuple[Any, Any]], list[Any], list[Any]
]:
    modules: list[tuple[str, nn.Module]] = []
    cells: list[tuple[str, Any]] = []
    values: list[tuple[Any, Any]] = []  # (cell, value) of every other closure cell
    functions: list[Any] = []  # the plain functions visited (their globals)
    objects: list[Any] = []  # plain objects visited (a callable object)
    seen: set[int] = set()

    def visit(obj: Any, prefix: str, depth: int) -> None:
        if id(obj) in seen or depth > _MAX_DEPTH:
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            modules.append((prefix, obj))
            # a forward defined in a closure (a class built by a factory) reads its cells
            forward = getattr(type(obj), "forward", None)
            if getattr(forward, "__closure__", None):
                visit(forward, prefix, depth + 1)
            return
        named = getattr(obj, "__remat_module__", None)
        if isinstance(named, tuple) and len(named) == 2 and isinstance(named[1], nn.Module):
            visit(named[1], f"{named[0]}." if named[0] else "", depth + 1)
        if isinstance(obj, functools.partial):
            visit(obj.func, prefix, depth + 1)
            for a in (*obj.args, *obj.keywords.values()):
                visit(a, prefix, depth + 1)
            # its keywords (a dict the code may change) and the containers among
            # its arguments: recorded with the containers (_held_state)
            objects.append(obj.keywords)
            objects.extend(a for a in obj.args if _is_container(type(a)))
            objects.append(obj.args)  # (its tensors: version-checked)
            return
        owner = getattr(obj, "__self__", None)
        if owner is not None and (
            isinstance(owner, nn.Module) or hasattr(owner, "__remat_module__") or _is_plain(type(owner))
        ):
            visit(owner, prefix, depth + 1)  # (a bound method: the object it reads)
        func = getattr(obj, "__func__", None)
        if type(func) is types.FunctionType:
            functions.append(func)
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None:
            visit(wrapped, prefix, depth + 1)
        if type(obj) is types.FunctionType:
            functions.append(obj)
            if (obj.__defaults__ or obj.__kwdefaults__) and not _own_code(getattr(obj, "__module__", None) or ""):
                # default argument values (def f(x, shift=table)): read like closure
                # values, their tensors version-checked
                objects.extend(d for d in (obj.__defaults__, obj.__kwdefaults__) if d)
        elif _is_plain(type(obj)):
            # a callable object: its attributes, the modules among them, its __call__
            objects.append(obj)
            for d in _attributes(obj):
                for key, value in list(d.items()):
                    if isinstance(value, nn.Module) or callable(value):
                        visit(value, f"{key}.", depth + 1)
            call = next((c.__dict__["__call__"] for c in type(obj).__mro__ if "__call__" in c.__dict__), None)
            if type(call) is types.FunctionType:
                functions.append(call)
        closure = getattr(obj, "__closure__", None)
        if closure:
            # this package's functions (its wrappers, the planner's hooks) and torch's:
            # their closures lead to the user's modules and callables, their own
            # values are not the user's state
            own = _own_code(getattr(obj, "__module__", None) or "")
            for name, cell in zip(obj.__code__.co_freevars, closure):
                if id(cell) in seen:
                    continue
                seen.add(id(cell))
                try:
                    value = cell.cell_contents
                except ValueError:
                    value = _MISSING
                if isinstance(value, torch.Tensor):
                    cells.append((name, cell))
                    continue
                # any other value (a temperature, a flag, a submodule) may be rebound
                # between the forward and its backward: the replay gets the forward's
                if not own:
                    values.append((cell, value))
                if isinstance(value, nn.Module) or callable(value):
                    visit(value, f"{name}.", depth + 1)

    for fn in fns:
        visit(fn, "", 0)
    return modules, cells, values, functions, objects


_MAX_HELD = 4096
"""How many values inside plain objects and containers one call looks at beyond
the first level (an object's attributes, a container's items)."""
_MAX_TRACKED_ITEMS = 256
"""A container holding more items is not copied where each SAVE region's body
starts (:meth:`ModuleState.containers_now`): what such a body changes in it is not
done again where the replay skips the body."""

_MAX_GLOBAL_ITEMS = 1024
"""A list, dict or set in a module-level variable holding more items (a large
table) is not recorded: copying it at every call costs more than it is worth."""


def _held_state(
    held: list[Any],
    n_local: int,
    seen: set[int],
    slots: list[_Slot],
    others: list[tuple],
    containers: list[tuple[Any, Any]],
    generators: list[Any],
    user_classes: list[type],
    modules: list[nn.Module] | None = None,
    callables: list[Any] | None = None,
    reached: set[int] | None = None,
) -> None:
    """Record the state behind the values in ``held`` (the first ``n_local`` are
    closure values and containers in module attributes; then module-level
    variables and plain objects), and
    behind the values they hold in turn: generator objects (forked), plain objects
    (their attributes, the tensors among them version-checked), lists, dicts and
    sets (their contents). Modules found among them (a module kept in a list, not
    registered as a submodule) are added to ``modules``, functions, bound methods
    and partials (``ops = [act]``) to ``callables``.

    ``reached``: the ids of the values the checkpointed code holds itself (its
    closure values, its arguments), grown here by what their containers and plain
    objects hold. Only there are modules with submodules (the blocks of a segment,
    ``list(model.layers[i:j])``), torch's stateful modules and functions walked:
    a list or dict in a module's attribute that holds other modules or callables is
    more likely a registry of the model's blocks (``self.next = [block]``,
    ``self.registry``), whose state the block does not read and whose buffers other
    blocks' forwards update."""
    if reached is None:
        reached = set()
    budget = _MAX_HELD
    kinds = _HELD_KINDS
    i = 0
    while i < len(held):
        v = held[i]
        i += 1
        cls = type(v)
        try:
            kind = kinds.get(cls)
            if kind is None:
                kind = _held_kind(cls)
        except TypeError:  # a class whose metaclass makes it unhashable
            continue
        if kind == _SKIP:
            continue
        if kind == _HELD_CONTAINER:
            if id(v) in seen or (i > n_local and len(v) > _MAX_GLOBAL_ITEMS):
                continue
            seen.add(id(v))
            entry = _contents(v)
            containers.append((v, entry))
            if len(entry) <= budget:
                budget -= len(entry)
                items = entry.values() if type(entry) is dict else entry
                held.extend(items)
                if id(v) in reached:
                    reached.update(map(id, items))
        elif kind == _HELD_TUPLE:
            # a tuple or named tuple: not changed itself, what it holds may be
            if id(v) in seen or len(v) > _SMALL_TUPLE or len(v) > budget:
                continue
            seen.add(id(v))
            budget -= len(v)
            held.extend(v)
            if id(v) in reached:
                reached.update(map(id, v))
            for x in v:
                if isinstance(x, torch.Tensor):
                    # its tensors are version-checked like a container's (the
                    # tuple itself cannot change)
                    containers.append((v, v))
                    break
        elif kind == _HELD_GENERATOR:
            if id(v) not in seen:
                seen.add(id(v))
                generators.append(v)
        elif kind == _HELD_PLAIN:
            if id(v) in seen:
                continue
            seen.add(id(v))
            user_classes.extend(_class_info(cls)[1])
            for d in _attributes(v):
                entry = d.copy()
                others.append((d, entry, None, None))
                for k, t in entry.items():
                    if isinstance(t, torch.Tensor):
                        slots.append(_Slot(d, k, t, any_version(t), f"{cls.__name__}.", ATTRIBUTE))
                if len(entry) <= budget:
                    budget -= len(entry)
                    held.extend(entry.values())
                    if id(v) in reached:
                        reached.update(map(id, entry.values()))
        elif kind == _HELD_FUNCTION:
            # (not a SAVE region's wrapper, remat.region(m, ..., recompute=False) in
            # a list of layers: the replay skips its body, so what it wraps is not
            # read there, and SAVE outputs and saves carry their own checks)
            if (
                callables is not None and id(v) in reached and id(v) not in seen
                and not getattr(v, "__remat_save_region__", False)
            ):
                seen.add(id(v))
                callables.append(v)
        elif modules is not None and id(v) not in seen and _held_module_has_state(v, id(v) in reached):
            # _HELD_MODULE: a module kept in a list or an object, not registered (the
            # blocks of a segment, list(model.layers[i:j])); walked like a root
            modules.append(v)


def _public(attributes: dict[str, Any]) -> bool:
    """Whether a tensor's Python attributes include one not private (transformers
    marks every parameter ``_is_hf_initialized``: bookkeeping, not state)."""
    return any(k[0] != "_" for k in attributes)


def _held_module_has_state(module: nn.Module, reached: bool) -> bool:
    """Whether a module found in a list or an object is walked for its state. Held
    by the checkpointed code itself (``reached``, see :func:`_held_state`): unless it
    is a torch module without parameters, buffers or submodules whose forward
    ignores ``training`` (nn.Tanh in a list of layers). Held elsewhere (a module's
    attribute): only a module of the user's without submodules."""
    if not reached:
        return not module._modules and not _from_library(type(module))
    if module._modules or module._parameters or module._buffers:
        return True
    cls = type(module)
    stateless = _STATELESS.get(cls)
    if stateless is None:
        stateless = _STATELESS[cls] = _from_library(cls) and not issubclass(cls, _READS_TRAINING)
    return not stateless


_READS_TRAINING = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.RReLU,
)
"""Torch modules without parameters or buffers whose forward reads ``training``."""
_STATELESS: dict[type, bool] = {}
"""Per module class: a torch module whose forward reads no state of its own when it
has no parameters, buffers or submodules (``nn.Tanh``; not ``_READS_TRAINING``)."""


def _is_tuple_type(cls: type) -> bool:
    """A tuple or a named tuple (a subclass that keeps tuple's length and iteration)."""
    return cls is tuple or (
        issubclass(cls, tuple) and cls.__len__ is tuple.__len__ and cls.__iter__ is tuple.__iter__
    )


_SMALL_TUPLE = 64
"""Longer tuples (a schedule, a table of numbers) are not looked inside."""

# what _held_state does with a value, by its class (_held_kind)
_SKIP, _HELD_CONTAINER, _HELD_TUPLE, _HELD_GENERATOR, _HELD_PLAIN, _HELD_MODULE, _HELD_FUNCTION = range(7)
_HELD_KINDS: dict[type, int] = {}


def _held_kind(cls: type) -> int:
    if cls in _CALLABLES:
        kind = _HELD_FUNCTION
    elif _is_container(cls):
        kind = _HELD_CONTAINER
    elif _is_tuple_type(cls):
        kind = _HELD_TUPLE
    elif is_generator_type(cls):
        kind = _HELD_GENERATOR
    elif _is_plain(cls):
        kind = _HELD_PLAIN
    elif issubclass(cls, nn.Module):
        kind = _HELD_MODULE
    else:
        kind = _SKIP
    _HELD_KINDS[cls] = kind
    return kind


def _module_slots(
    prefix: str,
    root: nn.Module,
    params: list[tuple],
    slots: list[_Slot],
    buffer_groups: list[tuple[nn.Module, list[_Slot]]],
    seen: set[int],
    others: list[tuple],
    unwritten: BufferMemo,
    containers: list[Any],
    classes: dict[type, None],
    objects: list[Any],
    hooks: list[Any],
    visited: list[nn.Module] | None = None,
    private: list[Any] | None = None,
    configs: dict[int, Any] | None = None,
) -> None:
    # Runs at every checkpoint call: plain loops, names built only for messages.
    # Parameters, the most numerous, are plain tuples (ModuleState.params).
    stack = [(prefix, root)]
    pop, push = stack.pop, stack.append
    # FSDP2 swaps the parameters of a module it shards, and of its submodules, between
    # sharded and unsharded ones itself (unsharded before the replay, by its
    # pre-backward hook): those are its to set, not the replay's
    fsdp = _compat.fsdp_module_class()
    fsdp_managed: set[int] = set()
    while stack:
        p, m = pop()
        i = id(m)
        if i in seen:
            continue
        seen.add(i)
        managed = fsdp is not None and (i in fsdp_managed or isinstance(m, fsdp))
        classes[type(m)] = None
        if visited is not None:
            visited.append(m)
        d = m.__dict__
        # The attributes torch's Module sets (flags, hook dicts) hold no tensor,
        # generator or user container: only the others are looked at, their value
        # types first in C (most modules hold none of the three).
        extra = d.keys() - _MODULE_KEYS
        kinds = set(map(type, map(d.__getitem__, extra))) if extra else _NO_TYPES
        if not _non_tensor_types.issuperset(kinds):
            for k, t in d.items():
                if k not in extra:
                    continue
                if isinstance(t, torch.Tensor):
                    slots.append(_Slot(d, k, t, any_version(t), p, ATTRIBUTE))
                elif _is_plain(type(t)) or is_generator_type(type(t)):
                    objects.append(t)  # (never in _non_tensor_types: always looked at)
                elif configs is not None and _model_config_class(type(t)):
                    configs[id(t)] = t  # (never in _non_tensor_types: always looked at)
                else:
                    if isinstance(t, tuple) and _is_tuple_type(type(t)):
                        _HOLDERS.add(type(t))
                    else:
                        _is_container(type(t))  # (joins _HOLDERS if it is one)
                    _non_tensor_types.add(type(t))  # (Tensor's metaclass has no __instancecheck__)
        ps = m._parameters
        if ps and not managed:
            for k, t in ps.items():
                if t is not None:
                    params.append((ps, k, t, version_of(t), p, t.requires_grad))
                    attributes = t.__dict__
                    if attributes and _public(attributes):
                        # Python attributes on a parameter (weight.gain, a use
                        # counter): a dict recorded as the containers are
                        objects.append(attributes)
        buffers = m._buffers
        if buffers:
            group = []
            known = unwritten.get(i)
            copy_them = known is None or known() is not m or _updates_buffers_unseen(m)
            for k, t in buffers.items():
                if t is not None:
                    attributes = t.__dict__
                    if attributes and _public(attributes):
                        objects.append(attributes)
                    # a copy, not a node of the graph (buffers rarely require grad)
                    copy = None
                    if copy_them and not t.is_inference():  # (an inference tensor is never written)
                        copy = t.detach().clone() if t.requires_grad else t.clone()
                    group.append(_Slot(buffers, k, t, any_version(t), p, BUFFER, copy))
            slots.extend(group)
            buffer_groups.append((m, group))
        if m._forward_hooks or m._forward_pre_hooks:
            # hooks run inside the checkpoint: what they read is state too
            hooks.extend(m._forward_pre_hooks.values())
            hooks.extend(m._forward_hooks.values())
        if not _CALLABLES.isdisjoint(kinds):
            hooks.extend(v for v in map(d.__getitem__, extra) if type(v) in _CALLABLES)
        children = m._modules
        kids = tuple(children.items()) if children else None
        # the module's attributes (a shallow copy: a dict copy in C, cheaper than
        # picking out what might change) and submodules, as the forward starts
        others.append((d, d.copy(), children, kids))
        # the user's lists, dicts and sets (recorded by _held_state), and tuples
        # holding any (not a Conv's kernel size)
        if not _HOLDERS.isdisjoint(kinds):
            for k in extra:
                v = d[k]
                cls = type(v)
                if k[0] != "_":
                    if cls in _HOLDERS and (
                        cls in _CONTAINER_TYPES
                        or (len(v) <= _SMALL_TUPLE and not _SCALARS.issuperset(map(type, v)))
                    ):
                        containers.append(v)
                elif cls in _CONTAINER_TYPES and not k.startswith("__") and _users_module_class(type(m)):
                    # a private one of the user's module (self._cache): recorded too;
                    # torch's and libraries' own bookkeeping is not the user's state
                    # (nor the "__composable_api_state_key_..." dicts FSDP2 adds)
                    containers.append(v)
                    if private is not None:
                        private.append(v)
        if kids:
            for k, c in reversed(kids):  # named_modules order
                if c is not None:
                    if managed:
                        fsdp_managed.add(id(c))
                    push((p + k + ".", c))


_WRITES_UNSEEN: weakref.WeakSet = weakref.WeakSet()
"""Modules a forward was seen to update a buffer of without bumping its version (a
plain module calling ``F.batch_norm`` on buffers of its own): their buffers are
copied at every call."""


def _updates_buffers_unseen(m: nn.Module) -> bool:
    # The batch-norm kernels update running_mean/var in place without bumping their
    # versions; only num_batches_tracked (updated in Python) shows the update.
    return (
        isinstance(m, _compat.BatchNormBase)
        and m.training
        and m.track_running_stats
    ) or m in _WRITES_UNSEEN


def _written_unseen(group: list[_Slot]) -> bool:
    """A buffer of ``group`` holds other values than its copy at the start though its
    version did not move (written by a kernel that does not bump it). Compared on
    plain tensors with values only, outside the caller's dispatch and function modes
    (a forecast's fake mode, a FLOP counter: the engine's own comparison is none of
    theirs)."""
    compared = [
        s for s in group
        if s.copy is not None and type(s.tensor) is torch.Tensor and type(s.copy) is torch.Tensor
        and not s.tensor.is_meta
    ]
    if not compared:
        return False
    with _compat.outside_modes(), torch.no_grad():
        return any(not torch.equal(s.copy, s.tensor) for s in compared)


BufferMemo = dict
"""``id(module) -> weakref.ref(module)`` of the modules whose buffers earlier forwards
of one checkpointed function did not write (``CheckpointedFunction`` holds it)."""


class _Tagged:
    """A plain dict's contents (a copy) with its version tag then."""

    __slots__ = ("tag", "contents")

    def __init__(self, tag: int, contents: dict) -> None:
        self.tag = tag
        self.contents = contents


def _container_tag_views(containers: list[tuple[Any, Any]]) -> list[Any]:
    """A view of the version tag of each container that is a plain dict (see
    :func:`dict_version_views`), None for the others or where there are no tags.
    (The state holds the containers, so each view's dict lives while it does.)"""
    dicts = [c for c, _ in containers if type(c) is dict]
    views = iter(dict_version_views(dicts) or [None] * len(dicts))
    return [next(views) if type(c) is dict else None for c, _ in containers]


class CaptureMemo:
    """What a checkpointed function keeps of its last capture (``CheckpointedFunction``
    holds one): a :class:`_Reuse`, or None."""

    __slots__ = ("reuse", "views")

    def __init__(self) -> None:
        self.reuse: _Reuse | None = None
        # (the attribute dicts of the last walked capture, a view of each one's
        # version tag): a walk that finds the same dicts again reads its entry tags
        # through them (see ModuleState.note_entry_tags)
        self.views: tuple[list[dict], list[Any]] | None = None


_values = dict.values
_from_iterables = itertools.chain.from_iterable
_dict_of = operator.attrgetter("__dict__")


_IMMUTABLE_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})


def _fixed_value(v: Any) -> bool:
    """Whether a closure value or a default the walk met is one a reused capture
    need only compare by identity: an immutable atom, a tuple of fixed values, a
    plain function (its code, defaults and ``__wrapped__``: :attr:`_Reuse.functions`;
    what it holds and reads is among what the walk found), or a class (the
    ``__class__`` cell of a forward that calls ``super()``; a class of the user's
    has its attributes recorded and compared as the modules' classes' are)."""
    cls = type(v)
    return cls in _IMMUTABLE_ATOMS or cls is types.FunctionType or (
        cls is tuple and all(map(_fixed_value, v))
    ) or isinstance(v, type)


_SETTING_ATOMS = _IMMUTABLE_ATOMS | {torch.dtype, torch.device}


def _setting(v: Any) -> bool:
    """Whether an attribute of a plain object is a setting a reused capture need only
    compare by identity: an immutable atom, a dtype or device, or a tuple of them."""
    cls = type(v)
    return cls in _SETTING_ATOMS or (cls is tuple and all(map(_setting, v)))


def _settings_object(obj: Any, d: dict | None) -> bool:
    """Whether ``obj`` is a plain object of the user's holding only settings in its
    ``__dict__`` (``d``: the copy the walk took), no slots: a config a module keeps
    (``self.config = config``), which a reused capture compares like the modules'
    attributes."""
    cls = type(obj)
    return (
        type(d) is dict and _dict_of(obj) is d and cls is not threading.local
        and cls not in _STDLIB_PLAIN and not _slot_names(cls) and all(map(_setting, d.values()))
    )


def _function_parts(f: Any) -> tuple[Any, ...]:
    """What a walk reads of a plain function besides its closure's cells (compared
    one by one) and its globals (the variables it reads are compared by name)."""
    return (f.__code__, f.__defaults__, f.__kwdefaults__, f.__dict__.get("__wrapped__"))


def _parts_of_functions(
    functions: Any, global_values: list[tuple[dict, str, Any]], cell_values: list[tuple[Any, Any]]
) -> list[tuple[Any, tuple[Any, ...]]]:
    """``(function, _function_parts(function))`` of the plain functions among
    ``functions``, the module-level variables read and the closure values read."""
    found = [
        *(f for f in functions if type(f) is types.FunctionType),
        *(v for _, _, v in global_values if type(v) is types.FunctionType),
        *(v for _, v in cell_values if type(v) is types.FunctionType),
    ]
    return [(f, _function_parts(f)) for f in dict.fromkeys(found)]


class _FunctionSlot:
    """Adapts a function to the ``dict`` protocol of the replay's undo list: its
    ``__code__``, ``__defaults__`` and ``__kwdefaults__`` by name."""

    __slots__ = ("function",)

    def __init__(self, function: Any) -> None:
        self.function = function

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self.function, key, value)


_FUNCTION_ATTRIBUTES = ("__code__", "__defaults__", "__kwdefaults__")


def _named_module(fn: Any, module: nn.Module) -> tuple[str, nn.Module] | None:
    """``fn.__remat_module__`` where ``fn`` is this package's forward of ``module``
    (``apply_remat``'s): a callable the walk reads as the module alone."""
    if not _own_code(type(fn).__module__):
        return None
    named = getattr(fn, "__remat_module__", None)
    if type(named) is tuple and len(named) == 2 and named[1] is module:
        return named
    return None


def _called_module(fn: Any, module: nn.Module) -> bool:
    """Whether calling ``fn`` calls ``module`` and reads nothing else: the module
    itself, a method bound to it (``layer.forward``: its function is read with the
    class's, see :attr:`_Reuse.functions`) or ``apply_remat``'s forward of it."""
    return (
        fn is module
        or (type(fn) is types.MethodType and fn.__self__ is module)
        or _named_module(fn, module) is not None
    )


class _Reuse:
    """A capture of a module called on tensors, for the calls after it: where every
    dict the walk read (each module's ``__dict__``, ``_parameters``, ``_buffers`` and
    ``_modules``, the user's classes' attributes) holds the same keys and the same
    objects, every module still has that ``__dict__`` and is of the same class, its forward hook dicts are still
    empty, no global forward hook is registered and the module-level variables read
    are bound as they were, the closure cells read (the module class's forward's,
    a decorator's) hold the same objects and the plain functions read have the same
    code, defaults and ``__wrapped__``, a walk would find what this one found. Then the
    attribute copies, module-level variables and class copies are shared with the
    new state (none of them is changed after the capture) and only the tensors'
    versions, ``requires_grad`` and the buffer copies are taken anew.

    Only captures made from the modules alone are reused (the module called, or
    ``apply_remat``'s forward of it): no closure value other than immutable atoms,
    tuples of them, classes and plain functions (``transformers``' decorators around a
    layer's ``forward``), no plain object other than one holding settings alone
    (a config: its ``__dict__`` compared as the modules' are), no container,
    generator, forward hook or callable in a module-level variable among what was read, and no
    module-level variable missing or read through another module. The containers in
    the modules' private attributes are the exception when nothing they hold is
    walked in turn (a table of functions): the capture is reused while each holds
    the same objects, its recorded contents with it."""

    __slots__ = (
        "fn", "modules", "types", "dicts", "keys", "values", "hook_dicts", "class_dicts",
        "params", "slots", "groups", "others", "global_values", "class_values", "versions",
        "containers", "tags_valid", "container_views", "named", "cells", "functions",
        "forwards", "configs", "objects", "object_dicts",
    )

    def __init__(
        self, fn: Any, modules: list[nn.Module], state: ModuleState,
        roots: list[nn.Module] = (), objects: list[Any] = (),
    ) -> None:
        # (holds the objects it compares by identity: none of them can be freed and
        # its id reused while the comparison stands)
        self.fn = fn
        # apply_remat's forward: the (name, module) it named at the capture
        self.named = _named_module(fn, roots[0]) if roots else None
        # (cell, value) of the closure cells read, compared by identity
        self.cells = state.cell_values
        # the plain functions walked, with their code and defaults (the capture's,
        # _parts_of_functions: those among the module-level variables read, a helper
        # the code calls, and in the closure cells read, the function a decorator
        # wraps: the walk followed their reads)
        self.functions = state.function_parts
        # the root module's class's forward, whose closure the walk read (_roots)
        self.forwards = [(type(m), getattr(type(m), "forward", None)) for m in roots]
        self.modules = tuple(modules)
        self.types = tuple(map(type, modules))
        dicts: list[Any] = []
        hook_dicts: list[dict] = []
        for m in modules:
            dicts.extend((m.__dict__, m._parameters, m._buffers, m._modules))
            hook_dicts.extend((m._forward_hooks, m._forward_pre_hooks))
        self.dicts = tuple(dicts)
        # the plain objects holding settings (a config) and their __dict__s, whose
        # entries follow the modules' in ``others``
        self.objects = tuple(objects)
        self.object_dicts = tuple(map(_dict_of, objects))
        # (the classes' attributes, read through their mappingproxy)
        self.class_dicts = tuple(d.target.__dict__ for d, _ in state.class_values)
        self.keys = self._keys_now()
        self.values = self._values_now()
        self.hook_dicts = tuple(hook_dicts)
        # what a call's state is built from: the slots without their versions and copies
        self.params = [(ps, k, t, p) for ps, k, t, _, p, _ in state.params]
        in_groups = {id(s) for _, group in state.buffer_groups for s in group}
        # (owner, key, tensor, prefix, kind), None for a buffer (taken from groups)
        self.slots = [
            None if id(s) in in_groups else (s.owner, s.key, s.tensor, s.prefix, s.kind)
            for s in state.slots
        ]
        self.groups = [
            (m, [(s.owner, s.key, s.tensor, s.prefix) for s in group])
            for m, group in state.buffer_groups
        ]
        self.others = state.others
        # the model configurations' attribute dicts: copied at every call (they are
        # held by the modules' attributes, compared above, but are not walked)
        self.configs = [d for d, _ in state.configs]
        self.global_values = state.global_values
        self.class_values = state.class_values
        # (container, its contents) of the private containers of the modules (their
        # items walked no further): reused while each holds the same objects
        self.containers = state.containers
        self.container_views: list[Any] | None = None  # (see ModuleState.containers_now)
        # the version tags of every dict compared, modules' attributes first (one per
        # module, in ``others`` order), then their parameters', buffers' and
        # submodules', then the classes' (kept alive by ``dicts`` and ``class_values``)
        class_dicts = [_class_dict_of(d) for d, _ in state.class_values]
        self.versions = None if None in class_dicts else dict_version_views(
            [*self.dicts[0::4], *self.object_dicts, *(d for i, d in enumerate(self.dicts) if i % 4),
             *self.hook_dicts, *class_dicts]
        )
        # the dicts' version tags when their contents were last found as walked:
        # every change to a dict gives it a new tag, so equal tags need no comparison
        self.tags_valid = None if self.versions is None else list(map(_tag_of, self.versions))

    def _values_now(self) -> list[Any]:
        now = list(_from_iterables(map(_values, self.dicts)))
        for d in self.object_dicts:
            now.extend(d.values())
        for d in self.class_dicts:
            now.extend(d.values())
        return now

    def _keys_now(self) -> list[Any]:
        now = list(_from_iterables(self.dicts))
        for d in self.object_dicts:
            now.extend(d)
        for d in self.class_dicts:
            now.extend(d)
        return now

    def state_now(self, leaves: Any, unwritten: BufferMemo) -> ModuleState | None:
        """The capture of this call, or None where it must be walked again."""
        for x in leaves:
            if not isinstance(x, torch.Tensor) and (
                isinstance(x, nn.Module) or type(x) is set or type(x) not in _non_tensor_types
            ):
                return None  # (what capture looks at among the arguments)
        tags = None if self.versions is None else list(map(_tag_of, self.versions))
        if tags is None or tags != self.tags_valid:
            values = self.values
            now = self._values_now()
            if (
                len(now) != len(values) or not all(map(operator.is_, now, values))
                or self._keys_now() != self.keys or any(self.hook_dicts)
            ):
                return None
            self.tags_valid = tags
        if (
            not all(map(operator.is_, map(type, self.modules), self.types))
            # (a module given a new __dict__ object: the walk would read that one)
            or not all(map(operator.is_, map(_dict_of, self.modules), self.dicts[0::4]))
            or not all(map(operator.is_, map(_dict_of, self.objects), self.object_dicts))
            or any(_GLOBAL_HOOKS)
        ):
            return None
        named = self.named
        if named is not None:
            now = self.fn.__remat_module__
            if now[1] is not named[1] or now[0] != named[0]:
                return None
        for cls, forward in self.forwards:
            if getattr(cls, "forward", None) is not forward:
                return None
        for cell, value in self.cells:
            try:
                if cell.cell_contents is not value:
                    return None
            except ValueError:  # (emptied)
                return None
        for f, parts in self.functions:
            if not all(map(operator.is_, _function_parts(f), parts)):
                return None
        for g, name, value in self.global_values:
            if g.get(name, _MISSING) is not value:
                return None
        for container, entry in self.containers:
            if not _holds(container, entry):
                return None
        params = [(ps, k, t, version_of(t), p, t.requires_grad) for ps, k, t, p in self.params]
        groups: list[tuple[nn.Module, list[_Slot]]] = []
        buffers: list[_Slot] = []
        for m, group in self.groups:
            known = unwritten.get(id(m))
            copy_them = known is None or known() is not m or _updates_buffers_unseen(m)
            fresh = []
            for owner, key, t, prefix in group:
                copy = None
                if copy_them and not t.is_inference():
                    copy = t.detach().clone() if t.requires_grad else t.clone()
                fresh.append(_Slot(owner, key, t, any_version(t), prefix, BUFFER, copy))
            groups.append((m, fresh))
            buffers.extend(fresh)
        # the tensor attributes and the buffers, in the walk's order
        next_buffer = iter(buffers).__next__
        slots = [
            next_buffer() if spec is None else _Slot(*spec[:3], any_version(spec[2]), *spec[3:])
            for spec in self.slots
        ]
        state = ModuleState(params, slots, groups, self.others, self.cells)
        state.global_values = self.global_values
        state.function_parts = self.functions  # (each as compared above)
        state.class_values = self.class_values
        if self.configs:
            state.configs = [(d, d.copy()) for d in self.configs]
        state.containers = self.containers
        state.contained = _contained_tensors(self.containers)
        if self.containers:
            # (the same containers: their tag views are shared)
            if self.container_views is None:
                self.container_views = _container_tag_views(self.containers)
            state.container_views = self.container_views
            state.containers_tagged = [None] * len(self.containers)
        if tags is not None:
            state.versions = self.versions
            state.versions_at_entry = tags
            n = len(self.others)
            state.attr_versions = self.versions[:n]
            state.versions_seen = state.versions_at_entry[:n]
            k = len(self.class_values)
            if k:
                # the classes' dicts hold what they held at the capture (checked
                # above): their entry copies and tags are those of this call
                state.classes_seen = [entry for _, entry in self.class_values]
                state.class_tags = self.versions[-k:]
                state.class_tags_seen = tags[-k:]
        return state


class ModuleState:
    """The tensors behind one checkpoint call (see the module docstring)."""

    __slots__ = (
        "params", "slots", "buffer_groups", "others", "cell_values", "seen", "generators",
        "containers", "global_values", "class_values", "globals_seen", "cells_seen",
        "hooks_at_entry", "versions", "versions_at_entry", "attr_versions", "versions_seen",
        "contained", "classes_seen", "class_tags", "class_tags_seen", "container_views",
        "containers_tagged", "configs", "context_vars", "function_parts", "functions_only",
    )

    def __init__(
        self,
        params: list[tuple],
        slots: list[_Slot],
        buffer_groups: list[tuple[nn.Module, list[_Slot]]],
        others: list[tuple] | None = None,
        cell_values: list[tuple[Any, Any]] | None = None,
    ) -> None:
        # parameters: (module._parameters, key, tensor, version, name prefix,
        # requires_grad)
        self.params = params
        self.slots = slots  # buffers and closure cells
        # (module, its buffer slots): a module that updated one buffer in forward
        # may have updated the others in place unseen, so all are replayed from copies
        self.buffer_groups = buffer_groups
        # per module: (its __dict__, a copy of it, its _modules, their items)
        self.others = others or []
        # (cell, value) of the closure cells that hold no tensor
        self.cell_values = cell_values or []
        # per module in ``others``: its attributes as the last SAVE region left them
        # (the entry copy until one rebinds any)
        self.seen: list[dict] | None = None
        # generator objects (torch's, Python's, NumPy's; not the default or global
        # ones) the code reaches: forked around the replay like Python's random (rng.py)
        self.generators: tuple[Any, ...] = ()
        # (list, dict or set, its contents when the checkpoint started)
        self.containers: list[tuple[Any, Any]] = []
        # per container: a view of a plain dict's version tag, else None (built at
        # the first SAVE region), and the _Tagged contents of that dict at the last
        # region's start (containers_now)
        self.container_views: list[Any] | None = None
        self.containers_tagged: list[_Tagged | None] = []
        # (tensor, its version, container, key) of the tensors those contents hold
        # (_contained_tensors): refused by the replay if updated in place since
        self.contained: list[tuple[torch.Tensor, int, Any, Any]] = []
        # (module globals, name, value) of the module-level variables the code reads
        self.global_values: list[tuple[dict, str, Any]] = []
        # (function, its code, defaults and keyword defaults) of the plain functions
        # the code runs, as the forward ran them (_function_parts)
        self.function_parts: list[tuple[Any, tuple[Any, ...]]] = []
        # nothing else recorded: the replay installs nothing unless one was changed
        self.functions_only = False
        # their values as the last SAVE region left them (see attributes_rebound)
        self.globals_seen: list[Any] | None = None
        # the closure values (cell_values) as the last SAVE region left them
        self.cells_seen: list[Any] | None = None
        # the class attributes (class_values) as the last SAVE region left them, and
        # the class dicts' version tags then (None: no tags)
        self.classes_seen: list[dict] | None = None
        self.class_tags: list[Any] | None = None
        self.class_tags_seen: list[int] | None = None
        # (hook dict, its contents) of the modules that had forward hooks when the
        # checkpoint started, and of the global forward hooks if there were any
        # (see _hooks_at_entry): the replay runs with those hooks, no others
        self.hooks_at_entry: list[tuple[dict, dict]] = []
        # (a user class's attributes, a copy of them) of the modules' and the objects'
        # classes (not looked at where a SAVE region returns: rebound in the forward
        # itself, a class attribute is replayed from its entry value)
        self.class_values: list[tuple[_ClassDict, dict]] = []
        # (a model configuration's __dict__, a copy of it) of the configurations the
        # modules hold (transformers' PreTrainedConfig): set as the forward started
        # them around the replay; their attributes' values are not looked into
        self.configs: list[tuple[dict, dict]] = []
        # the views of the context variables among ``others``: each replay runs in a
        # context of its own, so the tokens a view holds are dropped as one starts
        self.context_vars: list[_ContextVarValue] = []
        # a reused capture's (_Reuse) views of the version tags of the dicts it
        # compared, modules' attributes first, and their values at entry and at the
        # last look (attributes_rebound); None where unknown (then every dict is
        # compared entry by entry)
        self.versions: list[Any] | None = None
        self.versions_at_entry: list[int] = []
        # views of the version tags of the dicts in ``others`` alone (any capture
        # whose ``others`` are all dicts), their values at the last look
        self.attr_versions: list[Any] | None = None
        self.versions_seen: list[int] | None = None

    @staticmethod
    def capture(
        fn: Any, unwritten: BufferMemo, leaves: Any = (), memo: CaptureMemo | None = None
    ) -> ModuleState | None:
        """Record the slots when the checkpoint starts; None if there are none.
        Buffers of the modules in ``unwritten`` are not copied. ``leaves``: the
        call's flattened arguments, whose plain objects (a config) are state too.
        ``memo``: the checkpointed function's, whose last capture is reused where
        everything it was built from is as it was (:class:`_Reuse`)."""
        if memo is not None:
            reuse = memo.reuse
            if reuse is not None and reuse.fn is fn:
                state = reuse.state_now(leaves, unwritten)
                if state is not None:
                    return state
                memo.reuse = None
        # the modules and functions among the arguments are read like the function's own
        in_args = [x for x in leaves if isinstance(x, nn.Module) or type(x) in _CALLABLES] if leaves else ()
        modules, cells, values, functions, objects = _roots(fn, *in_args)
        for x in leaves:
            # plain objects (a config), generator objects (forked) and sets (lists,
            # dicts and tuples are flattened into leaves)
            cls = type(x)
            if cls is set or (
                cls not in _non_tensor_types and not isinstance(x, torch.Tensor)
                and (_is_plain(cls) or is_generator_type(cls))
            ):
                objects.append(x)
        params: list[tuple] = []
        slots: list[_Slot] = []
        groups: list[tuple[nn.Module, list[_Slot]]] = []
        seen: set[int] = set()  # a module shared by two roots is recorded once
        others: list[tuple] = []
        in_modules: list[Any] = []  # the lists, dicts and sets in module attributes
        classes: dict[type, None] = {}
        hooks: list[Any] = []
        visited: list[nn.Module] = []
        private: list[Any] = []  # those of in_modules in private attributes
        configs: dict[int, Any] = {}  # the model configurations the modules hold
        # what the checkpointed code holds itself: its closure values, its arguments
        # (see _held_state)
        reached = {id(v) for _, v in values}
        reached.update(map(id, objects))
        for prefix, module in modules:
            _module_slots(
                prefix, module, params, slots, groups, seen, others, unwritten, in_modules,
                classes, objects, hooks, visited, private, configs,
            )
        # what the modules alone gave (see _Reuse)
        plain_call = (
            memo is not None and len(modules) == 1
            and _called_module(fn, modules[0][1])
            and not cells and len(in_modules) == len(private) and not hooks and not in_args
        )
        n_others, n_slots = len(others), len(slots)
        # module-level variables the code reads: the functions', each module class's
        # forward's (and the plain functions they call)
        global_values: list[tuple[dict, str, Any]] = []
        read: set[Any] = set()  # functions read (ids) and variables recorded

        def read_globals(fs: Any) -> None:
            for f in fs:
                if id(f) not in read:
                    read.add(id(f))
                    _read_globals(f, global_values, read, 0)

        def visit_callables(found: list[Any]) -> None:
            # callables reached another way than from the function: visited like it
            nonlocal cells, values, functions, objects
            more = _roots(*found)
            for prefix, module in more[0]:
                _module_slots(
                    prefix, module, params, slots, groups, seen, others, unwritten, in_modules,
                    classes, objects, [], configs=configs,
                )
            cells, values = cells + more[1], values + more[2]
            functions, objects = functions + more[3], objects + more[4]
            read_globals(more[3])

        if hooks:
            visit_callables(hooks)  # the modules' forward hooks
        read_globals(functions)
        callables = _held_callables(global_values)
        if callables:
            # bound methods, partials and functions in module-level variables and in
            # the small containers there (OPS["act"])
            visit_callables(callables)
        for v in [v for _, _, v in global_values] + [v for _, v in values]:
            # a class of the user's the code names (Config.k in a classmethod), or holds
            # in a closure (a class defined in the enclosing function)
            if isinstance(v, type) and _user_module_name(v.__module__):
                try:
                    classes.setdefault(v, None)
                except TypeError:  # a metaclass with __eq__ and no __hash__
                    continue
        for f in functions:
            # mutable default values of the user's functions (def f(x, state={"n": 0}))
            if not _user_module_name(f.__module__):
                continue
            if f.__defaults__:
                objects.extend(f.__defaults__)
            if f.__kwdefaults__:
                objects.extend(f.__kwdefaults__.values())
        user_classes: list[type] = []

        def named_classes(entries: list[tuple[dict, str, Any]]) -> list[type]:
            # the user's classes that the methods read name (Config.SCALE in a
            # forward): their attributes are state, and their methods are read in
            # turn (the loop below)
            named = []
            for _, _, v in entries:
                if isinstance(v, type) and _user_module_name(v.__module__):
                    try:
                        if v not in classes:
                            named.extend(_class_info(v)[1])
                    except TypeError:  # a metaclass with __eq__ and no __hash__
                        continue
            return named

        start = len(global_values)
        for cls in classes:
            reads, users = _class_info(cls)
            read_globals(reads)
            if users:
                user_classes.extend(users)
        named = named_classes(global_values[start:])
        # the modules, bound methods and partials among the variables the classes'
        # methods read (a module-level BatchNorm a forward calls): walked like those
        # a function reads
        callables = _held_callables(global_values[start:])
        if callables:
            visit_callables(callables)
        # the closure values of the decorated module-level functions read, and of the
        # functions behind them: the replay runs with the forward's, as with the
        # checkpointed function's own closure
        n_values = len(values)
        _wrapper_cells([v for _, _, v in global_values if type(v) is types.FunctionType], cells, values)
        reached.update(id(v) for _, v in values[n_values:])
        # values that hold further state: generator objects (forked), plain objects
        # (their attributes), lists, dicts and sets (their contents)
        held: list[Any] = [v for _, v in values]
        held.extend(in_modules)
        n_local = len(held)  # recorded whatever their size
        held.extend(v for _, _, v in global_values)
        held.extend(objects)
        containers: list[tuple[Any, Any]] = []
        generators: list[Any] = []
        found: list[nn.Module] = []
        found_callables: list[Any] = []
        done = set(classes)  # the classes whose methods' module-level variables were read
        done.update(user_classes)
        user_classes.extend(named)
        _held_state(
            held, n_local, seen, slots, others, containers, generators, user_classes, found,
            found_callables, reached,
        )
        for _ in range(_MAX_DEPTH):
            # the classes of the plain objects found (a method of a config reading a
            # module-level variable), modules held in a list or a plain object, not
            # registered as submodules, and functions held so (ops = [act])
            new = [c for c in user_classes if c not in done]
            if not found and not new and not found_callables:
                break
            more_held: list[Any] = []
            more_objects: list[Any] = []
            if found_callables:
                n_values, n_objects, start = len(values), len(objects), len(global_values)
                visit_callables(found_callables)
                more_held.extend(v for _, v in values[n_values:])
                more_held.extend(objects[n_objects:])
                # (what the functions hold in their closures: held by the code too)
                reached.update(id(v) for _, v in values[n_values:])
                reached.update(map(id, objects[n_objects:]))
                more_held.extend(v for _, _, v in global_values[start:])
                found_callables = []
            more_classes: dict[type, None] = dict.fromkeys(new)
            for m in found:
                _module_slots(
                    f"{type(m).__name__}.", m, params, slots, groups, seen, others, unwritten,
                    more_held, more_classes, more_objects, [], configs=configs,
                )
            n_more = len(more_held)
            start = len(global_values)
            for cls in more_classes:
                if cls in done:
                    continue
                done.add(cls)
                reads, users = _class_info(cls)
                read_globals(reads)
                user_classes.extend(users)
                done.update(users)
            user_classes.extend(named_classes(global_values[start:]))
            more_held.extend(v for _, _, v in global_values[start:])
            more_held.extend(more_objects)
            found = []
            _held_state(
                more_held, n_more, seen, slots, others, containers, generators, user_classes, found,
                found_callables, reached,
            )
            # (modules and callables in the variables those classes' methods read:
            # visited in the next round)
            found_callables.extend(_held_callables(global_values[start:]))
        class_values: list[tuple[_ClassDict, dict]] = []
        in_classes: list[Any] = []  # the lists, dicts and sets class attributes hold
        methods: list[Any] = []  # (their bodies and defaults: _parts_of_functions)
        for c in user_classes:
            if id(c) not in seen:
                seen.add(id(c))
                d = _class_dict(c)
                entry = d.copy()
                class_values.append((d, entry))
                checked = _CONTAINER_CHECKED
                # (the private attributes and generated methods of a class another
                # metaclass makes, an enum's member tables, or of a named tuple are
                # their machinery)
                plain_class = type(c) is type and not issubclass(c, tuple)
                if plain_class:
                    methods.extend(_defined_functions(entry.values()))
                for k, v in entry.items():
                    if k[0] != "_" or (plain_class and k[1:2] != "_"):
                        cls = type(v)
                        known = checked.get(cls)
                        if known or (known is None and (_is_container(cls) or _is_plain(cls))):
                            in_classes.append(v)
        if methods:
            # the closures of the classes' methods (a class built in a function,
            # its methods reading the function's variables)
            _wrapper_cells(methods, cells, values)
        if in_classes:
            _held_state(in_classes, 0, seen, slots, others, containers, generators, [])
        for name, cell in cells:
            t = cell.cell_contents
            slots.append(_Slot(_CellSlot(cell), None, t, any_version(t), name, CLOSURE))
        for g, name, v in global_values:
            # a module-level tensor (a mask, a table): refused if updated in place
            # before the replay, as the forward's value if rebound
            if isinstance(v, torch.Tensor):
                slots.append(_Slot(g, name, v, any_version(v), "", GLOBAL))
        state = None
        # (a function alone, reading no state, still runs in the replay as the
        # forward ran it: its code and defaults are state)
        function_parts = _parts_of_functions([*functions, *methods], global_values, values)
        has_state = bool(params or slots or others or values or global_values or class_values)
        if has_state or function_parts:
            state = ModuleState(params, slots, groups, others, values)
            state.functions_only = not has_state
            state.hooks_at_entry = _hooks_at_entry(others)
            state.containers = containers
            state.contained = _contained_tensors(containers)
            state.global_values = global_values
            state.function_parts = function_parts
            state.class_values = class_values
            state.configs = [(c.__dict__, c.__dict__.copy()) for c in configs.values()]
            state.context_vars = [d for d, *_ in others if type(d) is _ContextVarValue]
            if generators:
                defaults = default_generators()
                state.generators = tuple(
                    {id(g): g for g in generators if id(g) not in defaults and forked(g)}.values()
                )
        if state is not None and (others or class_values):
            state.note_entry_tags(memo)
        if memo is not None:
            memo.reuse = None
            held_objects = [o for o in objects if not _fixed_value(o)]
            if (
                plain_call and state is not None and not state.hooks_at_entry
                # (private containers holding nothing that is walked in turn)
                and len(containers) == len(private) and not generators and not found
                and len(slots) == n_slots and _NAME_MISSED not in read
                and _MODULE_ATTRIBUTES_READ not in read
                and not _held_callables(global_values)
                # (the lists as the walk left them: visit_callables extends them)
                and not cells and all(_fixed_value(v) for _, v in values)
                # plain objects only where each holds settings alone (a config),
                # whose __dict__ is compared as the modules' are
                and len(others) - n_others == len(held_objects)
                and all(map(_settings_object, held_objects, [o[0] for o in others[n_others:]]))
            ):
                memo.reuse = _Reuse(fn, visited, state, [m for _, m in modules], held_objects)
        return state

    def finish(self, checkpoint: str, unwritten: BufferMemo) -> None:
        """End of the forward: keep copies of the buffers it updated, drop the rest
        (and remember their modules in ``unwritten``); refuse parameters and closure
        tensors it updated in place, and buffers it updated without a copy."""
        for module, group in self.buffer_groups:
            if (
                any(any_version(s.tensor) != s.version for s in group) or _updates_buffers_unseen(module)
                or (_written_unseen(group) and _WRITES_UNSEEN.add(module) is None)
            ):
                unwritten.pop(id(module), None)
                # (an inference tensor has no copy: nothing writes it outside inference mode)
                if any(s.copy is None and s.version != INFERENCE_VERSION for s in group):
                    changed = [s for s in group if any_version(s.tensor) != s.version] or group
                    s = changed[0]
                    raise _written_without_copy(s.name, checkpoint, s.version, s.tensor)
                for s in group:
                    if s.copy is not None:
                        _compat.set_version_counters((s.copy,), (s.version,))
            else:
                for s in group:
                    s.copy = None
                unwritten[id(module)] = weakref.ref(module)
        for owner, key, t, version, prefix, _ in self.params:
            if version_of(t) != version:
                raise _modified_in_forward(
                    PARAMETER, prefix + key, checkpoint, version, t, _renorms(self.others, owner, key)
                )
        for s in self.slots:
            t = s.tensor
            if s.kind is ATTRIBUTE and s.owner.get(s.key) is not t:
                # The forward rebinds it (self.center = 0.9 * self.center + ...): the
                # replay starts from the tensor it held at entry, kept here.
                continue
            if any_version(t) != s.version and s.kind != BUFFER:
                raise _modified_in_forward(s.kind, s.name, checkpoint, s.version, t)
        for t, version, container, key in self.contained:
            if any_version(t) != version:
                raise _modified_in_forward(CONTAINED, _contained_name(container, key, t), checkpoint, version, t)

    def buffers_now(self) -> list[tuple[Any, int]]:
        """Before a SAVE region: the tensor in every buffer slot and its version."""
        out = []
        for _, group in self.buffer_groups:
            for s in group:
                t = s.owner.get(s.key)
                out.append((t, -1 if t is None else any_version(t)))
        return out

    def updated_in_region(self, before: list[tuple[Any, int]]) -> list[tuple[_Slot, Any, int]]:
        """After a SAVE region: copies of the buffers of every module the region
        updated (the replay skips the region and installs these instead)."""
        out: list[tuple[_Slot, Any, int]] = []
        i = 0
        for _, group in self.buffer_groups:  # runs after every SAVE region: plain loops
            changed = False
            now = []
            for s in group:
                t0, v = before[i]
                i += 1
                t = s.owner.get(s.key)
                now.append(t)
                if t is not t0 or (t is not None and any_version(t) != v):
                    changed = True
            if not changed:
                continue
            with torch.no_grad():
                for s, t in zip(group, now):
                    out.append((s, None if t is None else t.detach().clone(), 0 if t is None else any_version(t)))
        return out

    @staticmethod
    def skip_region(updated: list[tuple[_Slot, Any, int]]) -> None:
        """In the replay, at a skipped SAVE region: its buffer updates, from copies."""
        for s, value, version in updated:
            if value is not None:
                with torch.no_grad():
                    value = value.clone()
                _compat.set_version_counters((value,), (version,))
            s.owner[s.key] = value

    def note_entry_tags(self, memo: CaptureMemo | None) -> None:
        """Right after a walk: the version tags of the attribute dicts it copied
        (``others``) and of the user's classes' dicts, so that the first SAVE
        region's return compares tags rather than every dict with its copy
        (:meth:`attributes_rebound`). The views come
        from ``memo`` where the walk found the same dicts as the last one (they are
        held there, so none of them is freed while its view stands)."""
        if _DICT_VERSION_AT is None:
            return
        if self.class_values:
            # (the same for the user's classes' attributes: _classes_rebound)
            tags = [_class_tag(d.target) for d, _ in self.class_values]
            if all(t is not None for t in tags):
                self.classes_seen = [entry for _, entry in self.class_values]
                self.class_tags = tags
                self.class_tags_seen = list(map(_tag_of, tags))
        dicts = [o[0] for o in self.others]
        if not dicts or not all(type(d) is dict for d in dicts):
            return
        known = memo.views if memo is not None else None
        if known is not None and len(known[0]) == len(dicts) and all(map(operator.is_, known[0], dicts)):
            views = known[1]
        else:
            views = dict_version_views(dicts)
            if memo is not None:
                memo.views = (dicts, views)
        self.attr_versions = views
        self.versions_seen = list(map(_tag_of, views))

    def attributes_rebound(self) -> list[tuple[dict, Any, Any]] | None:
        """In the forward, where a SAVE region returns: the module attributes rebound
        (or added, or deleted) since the last look (the engine looks where a top-level
        SAVE region's body starts too, so that only the body's changes are returned),
        as ``(__dict__, key, value)``. The
        replay skips the region's body and sets them (:meth:`skip_attributes`), so the
        code after it reads what the body left (``self.calls += 1`` in the body).
        None when nothing changed: one identity comparison per module in C."""
        changes = None
        versions = self.attr_versions
        if versions is not None:
            # a module whose attributes' dict kept its version tag rebound nothing
            now = list(map(_tag_of, versions))
            last_versions = self.versions_seen
            if now == last_versions:
                check = ()
            else:
                check = [i for i, (a, b) in enumerate(zip(now, last_versions)) if a != b]
            self.versions_seen = now
        else:
            check = range(len(self.others))
            others = self.others
            if others and _DICT_VERSION_AT is not None and all(type(o[0]) is dict for o in others):
                # from the next SAVE region on, the version tags tell which to compare
                # (read now: the loop below writes nothing)
                self.attr_versions = dict_version_views([o[0] for o in others])
                self.versions_seen = list(map(_tag_of, self.attr_versions))
        others = self.others
        if check and self.seen is None:
            self.seen = [entry for _, entry, _, _ in others]
        for i in check:
            d = others[i][0]
            found = _rebound_since(d, d, self.seen[i])
            if found:
                changes = (changes or []) + found
                self.seen[i] = dict(d)
        if self.global_values:
            # module-level variables, as the last SAVE region left them
            if self.globals_seen is None:
                self.globals_seen = [value for _, _, value in self.global_values]
            last_values = self.globals_seen
            for i, (g, name, _) in enumerate(self.global_values):
                value = g.get(name, _MISSING)
                if value is not last_values[i]:
                    changes = changes or []
                    changes.append((g, name, value))
                    last_values[i] = value
        if self.cell_values:
            # closure variables (nonlocal n; n += 1 in the body)
            if self.cells_seen is None:
                self.cells_seen = [value for _, value in self.cell_values]
            last_values = self.cells_seen
            for i, (cell, _) in enumerate(self.cell_values):
                value = _cell_contents(cell)
                if value is not last_values[i]:
                    changes = changes or []
                    changes.append((_CellSlot(cell), None, value))
                    last_values[i] = value
        if self.class_values:
            changes = self._classes_rebound(changes)
        return changes

    def _classes_rebound(self, changes: list[tuple[Any, Any, Any]] | None) -> list[tuple[Any, Any, Any]] | None:
        """:meth:`attributes_rebound` for the user's classes' attributes (``Block.calls
        += 1`` in a SAVE region's body): added to ``changes``."""
        class_values = self.class_values
        if self.classes_seen is None:
            self.classes_seen = [entry for _, entry in class_values]
            tags = [_class_tag(d.target) for d, _ in class_values]
            if all(t is not None for t in tags):
                self.class_tags = tags
                self.class_tags_seen = list(map(_tag_of, tags))
            check: Any = range(len(class_values))
        elif self.class_tags is not None:
            # a class whose dict kept its version tag rebound nothing
            now = list(map(_tag_of, self.class_tags))
            last = self.class_tags_seen
            check = () if now == last else [i for i, (a, b) in enumerate(zip(now, last)) if a != b]
            self.class_tags_seen = now
        else:
            check = range(len(class_values))
        for i in check:
            d = class_values[i][0]
            current = d._now()
            found = _rebound_since(d, current, self.classes_seen[i])
            if found:
                changes = (changes or []) + found
                self.classes_seen[i] = dict(current)
        return changes

    def containers_now(self) -> list[Any]:
        """Where a top-level SAVE region's body starts: the contents of the
        containers (see :meth:`containers_changed`). A plain dict's contents come
        with its version tag (:class:`_Tagged`), and are copied again only where
        the tag moved since the last region's start."""
        views = self.container_views
        if views is None:
            views = self.container_views = _container_tag_views(self.containers)
            self.containers_tagged = [None] * len(views)
        out: list[Any] = []
        for i, ((container, entry), view) in enumerate(zip(self.containers, views)):
            if container is entry or len(container) > _MAX_TRACKED_ITEMS:
                out.append(None)
            elif view is not None:
                tag = view.value
                last = self.containers_tagged[i]
                if last is None or last.tag != tag:
                    last = self.containers_tagged[i] = _Tagged(tag, container.copy())
                out.append(last)
            else:
                out.append(container.copy() if type(container) in _CONTAINERS else _contents(container))
        return out

    def containers_changed(self, before: list[Any]) -> list[tuple[Any, Any, Any]] | None:
        """Where that body returned: what it changed in each container
        (``before``: :meth:`containers_now`), as changes the replay makes where it
        skips the body (:meth:`skip_attributes`): a list the body appended an aux
        loss to, a dict of counters it incremented. None when it changed none."""
        changes = None
        is_ = operator.is_
        for (container, _), was, view in zip(self.containers, before, self.container_views):
            if was is None:
                continue
            if type(was) is _Tagged:
                if view.value == was.tag:  # (a dict whose tag did not move changed nothing)
                    continue
                was = was.contents
            if type(was) is list:  # (_holds, inlined: this runs at every SAVE region)
                if len(container) == len(was) and all(map(is_, container, was)):
                    continue
            elif _holds(container, was):
                continue
            changes = changes or []
            changes.append((_ContentsLeft(container), None, _change(was, _contents(container))))
        return changes

    def hooks_added_since(self, start: int) -> list[tuple[dict, int, Any]]:
        """The module hooks registered since the hook-handle counter read ``start``
        (by a SAVE region's body) on the modules walked and the global ones, as
        ``(hook dict, handle id, hook)``: the replay adds them where it skips the body
        (:meth:`skip_attributes`)."""
        return [(h, k, v) for h in _module_hook_dicts(self.others) if h for k, v in h.items()
                if type(k) is int and k >= start]

    @staticmethod
    def skip_attributes(changes: list[tuple[dict, Any, Any]], undo: list[tuple[Any, Any, Any]]) -> None:
        """In the replay, at a skipped SAVE region: the attributes its body rebound, as
        it left them, and the changes it made to containers; ``undo`` (from
        :meth:`install`, which holds every container's contents already) gets the
        attributes' values to put back."""
        for d, key, value in changes:
            if type(d) is _ContentsLeft:
                d.skip(value)
                continue
            current = d.get(key, _MISSING)
            if current is value:
                continue
            if type(d) is not _ContextVarValue:  # (the replay's context is dropped)
                undo.append((d, key, current))
            if value is _MISSING:
                del d[key]
            else:
                d[key] = value

    def install(self, checkpoint: str) -> list[tuple[Any, Any, Any]]:
        """Before the replay: put the forward's tensors back where the caller swapped
        them, fresh copies of updated buffers in place of the buffers. Returns what
        :meth:`restore` puts back."""
        undo: list[tuple[Any, Any, Any]] = []
        for view in self.context_vars:
            view.tokens = []  # (an earlier replay's, made in its own context)
        # a reused capture whose dicts all kept their version tags since the forward
        # started, with no global forward hook: every attribute, submodule, parameter
        # slot, hook dict and class attribute is as it was (the versions of the
        # tensors, their requires_grad and the module-level variables are checked)
        versions = self.versions
        unchanged = (
            versions is not None and list(map(_tag_of, versions)) == self.versions_at_entry
            and not any(_GLOBAL_HOOKS)
        )
        try:
            for d, entry, children, kids in () if unchanged else self.others:
                # attributes rebound since the forward started, by the forward itself
                # (self.calls += 1) or by the caller (model.eval(), a temperature set
                # per micro-batch), and attributes added since: as at entry
                if _rebound(d, entry):
                    # (a context variable's value is set in the replay's own context,
                    # dropped with it: nothing to put back)
                    _install_attributes(d, entry, undo if type(d) is not _ContextVarValue else [])
                if kids:
                    for key, child in kids:
                        current = children[key] if key in children else _MISSING
                        if current is not child:  # a replaced submodule
                            undo.append((children, key, current))
                            children[key] = child
            if not unchanged:
                _install_hooks(self.others, self.hooks_at_entry, undo)
            for cell, value in self.cell_values:
                current = _cell_contents(cell)
                if current is not value:
                    slot = _CellSlot(cell)
                    undo.append((slot, None, current))
                    if value is _MISSING:
                        del slot[None]
                    else:
                        slot[None] = value
            for d, entry in () if unchanged else self.class_values:
                if _rebound(d, entry):
                    _install_attributes(d, entry, undo)
            for d, entry in self.configs:
                # a setting changed since the forward started (the attention kernel)
                if _rebound(d, entry):
                    _install_attributes(d, entry, undo)
            for g, name, value in self.global_values:
                # a module-level variable rebound since (a scale set per step)
                current = g.get(name, _MISSING)
                if current is not value:
                    undo.append((g, name, current))
                    g[name] = value
            for f, parts in self.function_parts:
                # a function given another body or defaults since (a reloaded module,
                # a patched helper): run as the forward ran it
                for key, value in zip(_FUNCTION_ATTRIBUTES, parts):
                    current = getattr(f, key)
                    if current is not value:
                        undo.append((_FunctionSlot(f), key, current))
                        setattr(f, key, value)
            for t, version, container, key in self.contained:
                # (a scale kept in a list, a dict of masks: what the replay reads)
                if any_version(t) != version:
                    raise _modified_before_replay(
                        CONTAINED, _contained_name(container, key, t), checkpoint, version, t
                    )
            for container, entry in self.containers:
                # the contents the forward started from; afterwards, the caller's,
                # whatever the replay (or a skipped SAVE body's change done again)
                # put in or took out
                if container is entry:  # (a tuple: its tensors are checked above)
                    continue
                if _holds(container, entry):
                    undo.append((_Contents(container), None, entry))
                else:
                    undo.append((_Contents(container), None, _contents(container)))
                    _fill(container, entry)
            for owner, key, t, version, prefix, requires_grad in self.params:
                if version_of(t) != version:
                    raise _modified_before_replay(PARAMETER, prefix + key, checkpoint, version, t)
                current = owner.get(key)
                if current is not t:
                    undo.append((owner, key, current))
                    owner[key] = t
                if t.requires_grad is not requires_grad:
                    # frozen or unfrozen since the forward: the replay's ops would
                    # save other tensors (none for a weight's gradient)
                    undo.append((_RequiresGrad(t), None, not requires_grad))
                    t.requires_grad_(requires_grad)
            for s in self.slots:
                current = s.owner.get(s.key)
                if s.copy is not None:
                    with torch.no_grad():
                        replayed = s.copy.clone()
                    _compat.set_version_counters((replayed,), (s.version,))
                    undo.append((s.owner, s.key, current))
                    s.owner[s.key] = replayed
                    continue
                t = s.tensor
                if any_version(t) != s.version:
                    raise _modified_before_replay(s.kind, s.name, checkpoint, s.version, t)
                if current is not t:
                    undo.append((s.owner, s.key, current))
                    s.owner[s.key] = t
                if t.requires_grad is not s.requires_grad and t.is_leaf:
                    # (a leaf: one with history requires grad whatever is set)
                    undo.append((_RequiresGrad(t), None, not s.requires_grad))
                    t.requires_grad_(s.requires_grad)
            # hooks the replay registers on tensors it did not create (a parameter's
            # register_hook inside the forward) are removed when it ends: the
            # forward's registration is the one backward runs
            undo.append((_ReplayHooks(self), None, None))
            # (restore applies it first: see _ReplayWrites)
            undo.append((_ReplayWrites(self, list(map(_tag_of, versions)) if versions is not None else None), None, None))
        except BaseException as e:
            if type(e) is ContextVarUnset:
                e.installing = True
            restore(undo)
            raise
        return undo


# A module's forward hook dicts (the hooks, their kwargs and always-called flags):
# hooks registered or removed between the forward and backward (a hook that steers
# an activation, registered for one forward and removed before backward) would make
# the replay compute other values. Empty ones are not recorded: the replay clears
# those that hold hooks since.
_HOOK_KEYS = tuple(
    k for k in (
        "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
        "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    ) if k in _MODULE_KEYS
)
_GLOBAL_HOOKS = _compat.global_forward_hook_dicts()


def _hooks_at_entry(others: list[tuple]) -> list[tuple[dict, dict]]:
    """(hook dict, a copy of it) of the modules in ``others`` that have forward
    hooks now, and of the global forward hooks if any are registered."""
    out: list[tuple[dict, dict]] = []
    for d, _, _, _ in others:
        if d.get("_forward_hooks") or d.get("_forward_pre_hooks"):
            for k in _HOOK_KEYS:
                h = d.get(k)
                if h is not None:
                    out.append((h, h.copy()))
    if any(_GLOBAL_HOOKS):
        out.extend((h, h.copy()) for h in _GLOBAL_HOOKS)
    return out


class _RequiresGrad:
    """An undo entry that sets a parameter's ``requires_grad`` back."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __setitem__(self, _key: Any, before: bool) -> None:
        self.tensor.requires_grad_(before)


class _ReplayWrites:
    """An undo entry, the first :func:`restore` applies: what the replay wrote to the
    attributes, class attributes, configurations, module-level variables and closure
    values the state records is set back to their entry values; the undo entries
    :meth:`ModuleState.install` made before it then give the caller's values back
    where they differed. Where the caller's value was the entry's (a counter the
    caller reset before backward, a value a SAVE body set back), install changed
    nothing, and only this undoes the replay's write (``self.calls += 1`` again).
    ``tags``: the version tags of the reused capture's dicts when install ended;
    equal after the replay, it wrote none of them."""

    __slots__ = ("state", "tags")

    def __init__(self, state: ModuleState, tags: list[int] | None) -> None:
        self.state = state
        self.tags = tags

    def __setitem__(self, _key: Any, _before: Any) -> None:
        state = self.state
        tags = self.tags
        if tags is None or list(map(_tag_of, state.versions)) != tags:
            for d, entry, _, _ in state.others:
                # (a context variable: the replay's context is dropped with it)
                if type(d) is not _ContextVarValue and _rebound(d, entry):
                    _install_attributes(d, entry, [])
            for d, entry in state.class_values:
                if _rebound(d, entry):
                    _install_attributes(d, entry, [])
        for d, entry in state.configs:
            if _rebound(d, entry):
                _install_attributes(d, entry, [])
        for g, name, value in state.global_values:
            if g.get(name, _MISSING) is not value:
                if value is _MISSING:
                    g.pop(name, None)
                else:
                    g[name] = value
        for cell, value in state.cell_values:
            if _cell_contents(cell) is not value:
                slot = _CellSlot(cell)
                if value is _MISSING:
                    del slot[None]
                else:
                    slot[None] = value


# every hook dict of a module (forward, backward, state_dict, load_state_dict...) and
# the global module hooks: all keyed by their handle's id
_MODULE_HOOK_KEYS = tuple(k for k, v in sorted(vars(nn.Module()).items()) if "hook" in k and isinstance(v, dict))


def _module_hook_dicts(others: list[tuple]) -> list[Any]:
    """Every hook dict of the modules among ``others`` (attribute dicts the capture
    recorded) and the global module hook dicts: all keyed by handle id."""
    dicts = [d.get(k) for d, _, _, _ in others if d.get("_forward_hooks") is not None for k in _MODULE_HOOK_KEYS]
    dicts.extend(_compat.global_module_hook_dicts())
    return dicts


class _ReplayHooks:
    """An undo entry that removes the hooks registered during the replay: tensor
    hooks (``register_hook``, ``register_post_accumulate_grad_hook``) on the
    parameters and the tensors the module state holds, and module hooks on the
    modules it walked and the global ones (a forward that registers a hook for one
    call and removes it at its end: the replay may stop early, before the removal).
    Hooks are keyed by their handle's id, which a class counter hands out in order:
    the replay's are those from the counter's value at its start on, and where the
    counter did not move (no hook of any kind registered: the common case) nothing
    is looked at."""

    __slots__ = ("state", "start")

    def __init__(self, state: ModuleState) -> None:
        self.state = state
        self.start = RemovableHandle.next_id

    def __setitem__(self, _key: Any, _before: Any) -> None:
        start = self.start
        if RemovableHandle.next_id == start:
            return
        state = self.state
        tensors = [p[2] for p in state.params]
        tensors.extend(s.tensor for s in state.slots if s.copy is None)
        dicts = [hooks for t in tensors for hooks in _compat.tensor_hook_dicts(t)]
        dicts.extend(_module_hook_dicts(state.others))
        for hooks in dicts:
            if hooks:
                for k in [k for k in hooks if type(k) is int and k >= start]:
                    del hooks[k]


class _Refill:
    """An undo entry that gives a hook dict back the contents it held."""

    __slots__ = ("container",)

    def __init__(self, container: dict) -> None:
        self.container = container

    def __setitem__(self, _key: Any, before: dict) -> None:
        _fill(self.container, before)


def _install_hooks(others: list[tuple], entries: list[tuple[dict, dict]], undo: list) -> None:
    """Before the replay: the forward hooks as the forward had them (``entries``:
    :func:`_hooks_at_entry`); the caller's go in ``undo``."""
    recorded = {id(h) for h, _ in entries} if entries else ()
    for h, entry in entries:
        if len(h) != len(entry) or not all(map(operator.is_, h.values(), entry.values())) or h.keys() != entry.keys():
            undo.append((_Refill(h), None, h.copy()))
            _fill(h, entry)
    for d, _, _, _ in others:
        for k in ("_forward_hooks", "_forward_pre_hooks"):
            h = d.get(k)
            if h and id(h) not in recorded:  # hooks registered since the forward
                undo.append((_Refill(h), None, h.copy()))
                h.clear()
    if _GLOBAL_HOOKS and id(_GLOBAL_HOOKS[0]) not in recorded:
        for h in _GLOBAL_HOOKS[:2]:
            if h:
                undo.append((_Refill(h), None, h.copy()))
                h.clear()


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # deleted
        return _MISSING


def _rebound_since(d: Any, now: Any, last: dict) -> list[tuple[Any, Any, Any]] | None:
    """``(d, key, value)`` for each attribute of ``now`` (what ``d`` holds now)
    rebound or added since ``last``, ``(d, key, _MISSING)`` for each deleted; None
    where none was."""
    if len(now) == len(last) and all(map(operator.is_, now.values(), last.values())) and now.keys() == last.keys():
        return None
    found = [(d, key, value) for key, value in now.items() if last.get(key, _MISSING) is not value]
    found.extend((d, key, _MISSING) for key in last if key not in now)
    return found


def _rebound(d: Any, entry: dict) -> bool:
    """Whether the attributes ``d`` differ from their copy ``entry`` (a value rebound,
    added or deleted): one identity comparison per value, in C."""
    return len(d) != len(entry) or not all(map(operator.is_, d.values(), entry.values()))


def _install_attributes(d: dict, entry: dict, undo: list[tuple[Any, Any, Any]]) -> None:
    """Give a module's ``__dict__`` its entry values for the replay, noting the
    caller's in ``undo``."""
    for key, value in entry.items():
        current = d.get(key, _MISSING)
        if current is not value:
            undo.append((d, key, current))
            d[key] = value
    if len(d) != len(entry):
        for key in [k for k in d if k not in entry]:
            undo.append((d, key, d.pop(key)))


def _renorms(others: list[tuple], owner: dict, key: str) -> bool:
    """Whether ``owner[key]`` is the weight of an ``nn.Embedding`` or
    ``nn.EmbeddingBag`` with ``max_norm``, which renormalizes the rows it looks up
    in place in every forward (``torch.embedding_renorm_``)."""
    if key != "weight":
        return False
    for d, *_ in others:
        if type(d) is dict and d.get("_parameters") is owner:
            return d.get("max_norm") is not None and "num_embeddings" in d
    return False


def _modified_in_forward(
    kind: str, name: str, checkpoint: str, version: int, t, renormed: bool = False
) -> Exception:
    advice = (
        "The recompute in backward would read the updated value. Update "
        "it outside the checkpoint, or register it as a buffer of the "
        "checkpointed module (buffers updated in forward are replayed "
        "from a copy)."
    )
    owner = name.partition(".")[0]
    if owner in _KV_CACHE_NAMES:
        advice = (
            f"It belongs to a transformers key/value cache ({owner}) that the forward writes in "
            "place (a StaticCache, the state of a linear-attention or state-space "
            "layer): a replay cannot see the cache as the forward did. Pass "
            "use_cache=False, or run a forward that needs no backward under "
            "torch.no_grad(); a cache that only appends (a DynamicCache of attention "
            "layers) is replayed as at the checkpoint's entry."
        )
    elif renormed:
        advice = (
            "It is the weight of an nn.Embedding or nn.EmbeddingBag with max_norm, "
            "which renormalizes the rows it looks up in place in every forward: the "
            "recompute in backward would read and renormalize the updated weight. "
            "Renormalize before the checkpoint and look up without max_norm inside "
            "it (with torch.no_grad(): torch.embedding_renorm_(emb.weight, ids, "
            "emb.max_norm, emb.norm_type); then emb.max_norm = None), or keep the "
            "embedding outside the checkpoint."
        )
    elif kind == PARAMETER:
        # a lazy module (nn.LazyLinear) fills its parameters in its first forward
        advice += (
            " A lazy module (nn.LazyLinear, nn.LazyConv2d) materializes its parameters "
            "in its first forward: run one forward before checkpointing it."
        )
    return modified_in_place(
        f"the {kind} '{name}' read by checkpoint '{checkpoint}'",
        "during the checkpoint's forward",
        advice,
        (version, any_version(t)),
    )


def _written_without_copy(name: str, checkpoint: str, version: int, t) -> Exception:
    return modified_in_place(
        f"the buffer '{name}' read by checkpoint '{checkpoint}'",
        "during the checkpoint's forward, which earlier forwards of this checkpoint "
        "did not do (so its starting value was not copied for the recompute)",
        "This step cannot be replayed exactly; the next call copies the buffer again. "
        "If the forward updates it only on some steps, assign the new value instead "
        "(self.buf = new, which needs no copy) or update it outside the checkpoint.",
        (version, any_version(t)),
    )


def _modified_before_replay(kind: str, name: str, checkpoint: str, version: int, t) -> Exception:
    return modified_in_place(
        f"the {kind} '{name}' read by checkpoint '{checkpoint}'",
        "after the forward, before backward recomputed the checkpoint "
        "(an in-place update under no_grad, an optimizer step)",
        "The recompute would read the new value and the gradients "
        "would be wrong. Run backward before updating it (e.g. "
        "optimizer.step() after loss.backward()), or update a clone.",
        (version, any_version(t)),
    )


def restore(undo: list[tuple[Any, Any, Any]]) -> None:
    """After the replay: give every slot :meth:`ModuleState.install` changed its
    caller's tensor back."""
    for owner, key, value in reversed(undo):
        if value is _MISSING:
            try:
                del owner[key]
            except KeyError:  # (the replayed code deleted it already: del self.cache)
                pass
        else:
            owner[key] = value


# ------------------------------------------------- state local to one forward

# (run eagerly where torch.compile is active around the eager engine)
@_compat.disable_dynamo
def entry_known(state: ModuleState | None) -> set[int]:
    """The ids of the closure cells, containers, attribute dicts, generators and
    values the checkpoint's module state recorded when it started: the engine sets
    those where the replay skips a SAVE body (:meth:`ModuleState.attributes_rebound`,
    :meth:`ModuleState.containers_changed`), so :func:`local_watch` leaves them out."""
    if state is None:
        return set()
    known = {id(c) for c, _ in state.cell_values}
    known.update(id(v) for _, v in state.cell_values)
    known.update(id(s.owner.cell) for s in state.slots if type(s.owner) is _CellSlot)
    known.update(id(s.tensor) for s in state.slots)  # (version-checked there)
    known.update(id(c) for c, _ in state.containers)
    known.update(id(d) for d, *_ in state.others)
    known.update(id(v) for _, _, v in state.global_values)
    known.update(map(id, state.generators))
    return known


# (run eagerly where torch.compile is active around the eager engine)
@_compat.disable_dynamo
def local_watch(fn: Any, arguments: Any, known: set[int]) -> list[tuple[int, Any, Any]] | None:
    """What the body ``fn`` of a top-level SAVE region may change that the replay
    cannot set where it skips the body: the closure cells of the body (and of the
    functions it holds there), which hold the checkpointed function's locals (a
    counter it rebinds with ``nonlocal``, a dict, a list an aux loss is appended to, a
    generator made in this forward), and the values the cells hold and the
    ``arguments`` (as passed, not flattened) that are not tensors, which the engine
    tracks otherwise (an object, a container, a generator, a NumPy array). Their state as the body starts, for
    :func:`local_changed`; None where there is nothing to compare.

    One level deep: a container's items are compared by identity, an object's
    attributes likewise, a tensor by its version. Of a module there (``self`` in a
    lambda), the values in its public attributes; not what the module state
    recorded at the checkpoint's start (``known``: :func:`entry_known`), which the
    engine sets where the replay skips the body."""
    cells: list[Any] = []
    values: list[Any] = []
    seen: set[int] = set()
    stack = [fn]
    while stack:
        f = stack.pop()
        if id(f) in seen or isinstance(f, nn.Module):
            continue
        seen.add(id(f))
        cls = type(f)
        if cls is types.FunctionType:
            wrapped = f.__dict__.get("__wrapped__")
            if wrapped is not None and _own_code(f.__module__ or ""):
                stack.append(wrapped)  # (remat.name_scope's wrapper of the body)
            for cell in f.__closure__ or ():
                if id(cell) in known:
                    continue
                cells.append(cell)
                v = _cell_value(cell)
                if v is _MISSING:
                    continue
                if type(v) is types.FunctionType or type(v) is functools.partial:
                    stack.append(v)
                else:
                    values.append(v)
        elif cls is types.MethodType:
            stack.append(f.__func__)
            values.append(f.__self__)
        elif cls is functools.partial:
            stack.append(f.func)
            values.extend(f.args)
            values.extend(f.keywords.values())
        elif _is_plain(cls):
            values.append(f)  # a callable object: its attributes
    values.extend(x for x in arguments if not isinstance(x, torch.Tensor))
    watch: list[tuple[int, Any, Any]] = [(_CELL, c, _cell_value(c)) for c in cells]
    done: set[int] = set()
    i = 0
    while i < len(values):
        v = values[i]
        i += 1
        if id(v) in done:
            continue
        done.add(id(v))
        if isinstance(v, nn.Module):
            # (the body's module, `self` in a lambda, known or not: a generator this
            # forward put in its public attributes, made on the first call; one there
            # at the start is the module state's, forked, so known)
            for k, x in v.__dict__.items():
                if k[0] != "_" and id(x) not in known and is_generator_type(type(x)):
                    entry = _watched(x)
                    if entry is not None:
                        watch.append(entry)
            continue
        if id(v) in known:
            continue
        entry = _watched_unless(v, known)
        if entry is not None:
            watch.append(entry)
    return watch or None


# (run eagerly where torch.compile is active around the eager engine)
@_compat.disable_dynamo
def local_changed(watch: list[tuple[int, Any, Any]]) -> bool:
    """Whether anything :func:`local_watch` noted differs now."""
    for kind, obj, before in watch:
        if kind == _CELL:
            if _cell_value(obj) is not before:
                return True
        elif not _same_now(kind, obj, before):
            return True
    return False


_CELL, _TENSOR, _CONTENTS, _BYTES, _STATE = range(5)


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _MISSING


def _watched(v: Any) -> tuple[int, Any, Any] | None:
    """``(kind, what is compared, its state now)`` for ``v``; None: nothing to compare.
    A container's items and an object's attributes are compared as the module
    state compares its containers (:func:`_contents`, :func:`_holds`)."""
    cls = type(v)
    if isinstance(v, torch.Tensor):
        return (_TENSOR, v, any_version(v))
    if isinstance(v, nn.Module) or cls in _IMMUTABLE_ATOMS or cls is tuple or cls is frozenset:
        return None
    if isinstance(v, (list, collections.deque, dict, set)):
        return (_CONTENTS, v, _contents(v))
    if cls is bytearray:
        return (_BYTES, v, bytes(v))
    if is_generator_type(cls):
        # generators and small arrays, read as a forked one is (a larger array: not
        # compared, as it is not forked)
        return (_STATE, v, generator_states((v,))) if forked(v) else None
    if _is_plain(cls) and hasattr(v, "__dict__"):
        d = vars(v)
        return (_CONTENTS, d, dict(d))
    return None


def _watched_unless(v: Any, known: set[int]) -> tuple[int, Any, Any] | None:
    entry = _watched(v)
    if entry is not None and entry[1] is not v and id(entry[1]) in known:
        return None  # (an object whose attributes are the module state's)
    return entry


def _same_now(kind: int, v: Any, before: Any) -> bool:
    if kind == _TENSOR:
        return any_version(v) == before
    if kind == _CONTENTS:
        return _holds(v, before)
    if kind == _BYTES:
        return bytes(v) == before
    return generator_states((v,)) == before  # (_STATE)
