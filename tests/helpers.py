"""Shared test helpers: gradient comparison and small models."""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import queue
import sys

import torch
import torch.nn.functional as F
from torch import nn

import torch_remat as remat
from torch_remat.engine.observers import CheckpointObserver, observe


class ReplayLog(CheckpointObserver):
    """The checkpoints backward replayed, by name, in order: an engine observer, as
    the diagnostics are, of the checkpoints created inside :func:`recorded_replays`."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def replay_started(self, frame) -> None:
        self.names.append(remat.active_checkpoint().checkpoint)


@contextlib.contextmanager
def recorded_replays():
    """``with recorded_replays() as replayed:`` lists, in ``replayed``, the name of each
    checkpoint replay that backward runs for the checkpoints called inside the block
    (the backward may run after it)."""
    log = ReplayLog()
    with observe(log):
        yield log.names


def kept_bytes(out):
    """What the checkpoints behind ``out`` keep for backward, as the saved-tensors
    report counts it: ``{checkpoint: {region: bytes}}``, with ``"(inputs)"`` for the
    inputs a checkpoint keeps for its replay. Remat doing nothing keeps no entry."""
    return {
        block["name"]: {r["region"]: r["bytes"] for r in block["regions"]}
        for block in remat.saved_tensors_report(out).to_dict()["checkpoints"]
    }


SCOPE_REPLAY = "(scope)"


@contextlib.contextmanager
def recorded_scope_replays():
    """``with recorded_scope_replays() as replayed:`` lists a :data:`SCOPE_REPLAY`
    in ``replayed`` for each replay of a ``gradient_checkpoint_scope`` inside the
    block, from the profiler range each replay opens."""
    replayed = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield replayed
    replayed.extend(SCOPE_REPLAY for e in prof.events() if e.name == "remat.scope.replay")


class GradResult(tuple):
    """``(loss, grads)`` as :func:`grads` returns it, with ``replays``: the names of
    the checkpoints its backward replayed (and, if asked, its scope replays)."""

    replays: list[str]


def grads(params, inputs, fn, *, seed=0, scope=False):
    """Run ``fn(*inputs)`` (a scalar loss) and return grads of params and inputs, as
    a ``(loss, grads)`` :class:`GradResult` that also says which checkpoints the
    backward replayed; with ``scope=True`` also each ``gradient_checkpoint_scope``
    replay (measured with the profiler, so only where a test asks)."""
    for p in params:
        p.grad = None
    for x in inputs:
        if x.requires_grad:
            x.grad = None
    torch.manual_seed(seed)
    scopes = recorded_scope_replays() if scope else contextlib.nullcontext([])
    with recorded_replays() as replayed, scopes as scope_replayed:
        loss = fn(*inputs)
        loss.backward()
    out = [p.grad.clone() if p.grad is not None else None for p in params]
    out += [x.grad.clone() if x.grad is not None else None for x in inputs if x.requires_grad]
    result = GradResult((loss.detach(), out))
    result.replays = replayed + scope_replayed
    return result


def assert_bitwise_equal(a, b, *, replays=None):
    """Losses and gradients of two :func:`grads` runs are equal bit for bit, and the
    runs replayed a checkpoint (or a scope, for ``grads(..., scope=True)``): an
    equality that remat doing nothing also gives proves nothing. ``replays=0`` for a
    comparison in which nothing replays (compiled code, whose backward re-runs no
    Python); an int ``n`` for exactly ``n`` replays in the two runs together."""
    ran = [*getattr(a, "replays", ()), *getattr(b, "replays", ())]
    if not isinstance(a, GradResult) and not isinstance(b, GradResult):
        assert replays == 0, "neither side comes from grads(): pass replays=0 or use grads()"
    elif replays is None:
        assert ran, "nothing was replayed in backward: remat did nothing here"
    else:
        assert len(ran) == replays, f"{len(ran)} replays ({ran}), expected {replays}"
    loss_a, grads_a = a
    loss_b, grads_b = b
    assert torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b)
    for i, (ga, gb) in enumerate(zip(grads_a, grads_b)):
        if ga is None or gb is None:
            assert ga is None and gb is None, f"gradient {i}: one is None"
        else:
            assert torch.equal(ga, gb), f"gradient {i} differs: max abs diff {(ga - gb).abs().max()}"


class SavedBytes:
    """Bytes of the distinct storages autograd saves while the block runs (an outer
    saved-tensor hook sees what the compiled forward hands its backward), not
    counting parameters, which are resident anyway."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.parameters:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class UnseenCounter:
    """An int counter kept in a ``ctypes`` integer: state remat does not record by
    itself (a plain object's attributes, the contents of a list, dict, set or
    deque, and small arrays, it does), so a replay sees the value the backward finds."""

    __slots__ = ("box",)

    def __init__(self) -> None:
        self.box = ctypes.c_longlong(0)

    @property
    def value(self) -> int:
        return self.box.value

    @value.setter
    def value(self, v: int) -> None:
        self.box.value = v


class UnseenLog:
    """A list of entries kept in a ``queue.SimpleQueue``: state remat does not record
    (the contents of a list, dict or set the checkpointed code holds, it does, and
    sets them around the replay), so the log holds what the forward and the replay
    logged, in the order they ran. Compares equal to a list of the same entries."""

    __slots__ = ("_queue",)
    __hash__ = None

    def __init__(self, entries=()) -> None:
        self._queue = queue.SimpleQueue()
        self.extend(entries)

    def append(self, entry) -> None:
        self._queue.put(entry)

    def extend(self, entries) -> None:
        for entry in entries:
            self._queue.put(entry)

    def clear(self) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()

    def pop(self):
        """Remove and return the last entry."""
        entries = self._entries()
        self.clear()
        self.extend(entries[:-1])
        return entries[-1]

    def _entries(self) -> list:
        entries = []
        while not self._queue.empty():
            entries.append(self._queue.get_nowait())
        self.extend(entries)
        return entries

    def __iter__(self):
        return iter(self._entries())

    def __len__(self) -> int:
        return self._queue.qsize()

    def __getitem__(self, index):
        return self._entries()[index]

    def __eq__(self, other) -> bool:
        if isinstance(other, UnseenLog):
            other = other._entries()
        return isinstance(other, list) and self._entries() == other

    def __repr__(self) -> str:
        return f"UnseenLog({self._entries()!r})"


class CounterHook:
    """A user RecomputeStateHook for state other than RNG (an int counter)."""

    def __init__(self) -> None:
        self.value = 0

    def snapshot(self):
        return self.value

    def restore(self, state):
        self.value = state


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """``save_on_cpu`` that records the shapes it offloads (the replay's too)."""

    def __init__(self):
        super().__init__()
        self.offloaded = UnseenLog()
        pack = self.pack_hook

        def counting_pack(t):
            self.offloaded.append(tuple(t.shape))
            return pack(t)

        self.pack_hook = counting_pack


def _logged(fn, runs):
    def body(*args):
        where = remat.active_checkpoint()
        runs.append((where and where.region, remat.is_recomputing()))
        return fn(*args)

    return body


BLOCK_REGIONS = ("attn_norm", "qkv", "attention", "out_proj", "mlp_norm", "mlp")


class Block(nn.Module):
    """A pre-norm transformer block with every piece in its own region."""

    def __init__(self, dim=16, heads=2, dropout=0.1, dtype=torch.float64):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(dim, dtype=dtype)
        self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype)
        self.out_proj = nn.Linear(dim, dim, dtype=dtype)
        self.mlp_norm = nn.LayerNorm(dim, dtype=dtype)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim, dtype=dtype), nn.GELU(), nn.Linear(4 * dim, dim, dtype=dtype)
        )
        self.dropout = dropout
        self.save = {name: False for name in BLOCK_REGIONS}
        # An UnseenLog to log region bodies into: (the region remat says is running,
        # whether backward is replaying) per body run. None: no logging.
        self.runs = None

    def attention(self, qkv):
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        probs = F.dropout(probs, self.dropout, self.training)
        return (probs @ v).transpose(1, 2).reshape(b, s, -1)

    def _r(self, fn, name):
        if self.runs is not None:
            fn = _logged(fn, self.runs)
        return remat.region(fn, name, recompute=not self.save[name])

    def forward(self, x):
        h = self._r(self.attn_norm, "attn_norm")(x)
        qkv = self._r(self.qkv, "qkv")(h)
        a = self._r(self.attention, "attention")(qkv)
        a = self._r(self.out_proj, "out_proj")(a)
        remat.recompute_needs_tensor(a)
        x = x + F.dropout(a, self.dropout, self.training)
        h = self._r(self.mlp_norm, "mlp_norm")(x)
        m = self._r(self.mlp, "mlp")(h)
        remat.recompute_needs_tensor(m)
        return x + m


PLUGINS_ENV = "TORCH_REMAT_TEST_PLUGINS"


def plugin_env(config, env=None) -> dict:
    """``env`` (default: this process's) for a Python child that runs remat code, made
    to run under the plugins this pytest run was given with ``-p NAME``: pytest loads
    them in its own process only, so a change one makes to torch_remat would not reach
    the child's checks. Names them in :data:`PLUGINS_ENV`, puts their folders on
    ``PYTHONPATH`` and, first, ``tests/child_site``, whose ``sitecustomize`` imports
    each at the child's start and calls its ``pytest_configure(None)`` (a child started
    with ``-S`` or ``-I`` runs without them). Without ``-p`` plugins: ``env`` as given."""
    env = dict(os.environ if env is None else env)
    names = [p for p in config.option.plugins or () if not p.startswith("no:")]
    if not names:
        return env
    folders = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_site")]
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            folders.append(os.path.dirname(os.path.abspath(file)))
    env[PLUGINS_ENV] = ",".join(names)
    env["PYTHONPATH"] = os.pathsep.join([*folders, *filter(None, [env.get("PYTHONPATH")])])
    return env


def set_plugin_env(config, monkeypatch) -> None:
    """Set :func:`plugin_env`'s variables in this process's environment for one test
    (``monkeypatch``), for the children it starts with a copy of ``os.environ``."""
    for key, value in plugin_env(config).items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)


def second_step_peak(model: nn.Module, x: torch.Tensor) -> int:
    """The peak of a model's second step (``model(x).sum()`` and its backward),
    counted by the tests' own ``MemoryProbe`` (the profiler's flat memory records,
    not the planner's event tree). After a first step an offloader's pool reuses
    the host buffers it made then and allocates nothing, so what the probe sees is
    the step's own device memory."""
    from conftest import MemoryProbe

    for step in range(2):
        model.zero_grad(set_to_none=True)
        x.grad = None
        if step == 0:
            model(x).sum().backward()
            continue
        with MemoryProbe() as probe:
            loss = model(x).sum()
            loss.backward()
            del loss
    return probe.peak
