"""What the walk of a checkpointed module's Python state reaches: a user class its
forward names, a module-level helper behind a decorator, a method or a module-level
variable that appears after the first call, a buffer a plain module updates through
a kernel that leaves its version alone, and a module-level tensor. Each is changed
between a call's forward and its backward (or is updated by the forward itself);
the gradients and buffers must equal those of the same steps without remat, bit
for bit, over calls that reuse the checkpoint's capture."""

import array
import collections
import functools
import itertools
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import recorded_replays
from torch import nn

import torch_remat as remat

D = torch.float64


def _steps(make, between, *, calls=2, reset=lambda m: None, ckpt):
    """``calls`` steps of a fresh ``make()``; ``between(m)`` runs after each forward,
    before its backward. Returns every step's input gradient, parameter gradients
    and buffers."""
    torch.manual_seed(0)
    m = make()
    f = remat.checkpoint(region_name="blk")(m) if ckpt else m
    out = []
    for i in range(calls):
        reset(m)
        x = torch.randn(4, 8, dtype=D, generator=torch.Generator().manual_seed(i), requires_grad=True)
        y = f(x)
        between(m)
        m.zero_grad(set_to_none=True)
        (y * torch.linspace(-1, 1, y.numel(), dtype=D).view_as(y)).sum().backward()
        out.append([x.grad] + [p.grad for p in m.parameters()] + [b.clone() for b in m.buffers()])
    return out


def _same_as_without_remat(make, between, **kw):
    expected = _steps(make, between, ckpt=False, **kw)
    with recorded_replays() as replayed:
        got = _steps(make, between, ckpt=True, **kw)
    assert replayed == ["blk"] * len(got)
    for step, (e, g) in enumerate(zip(expected, got)):
        assert len(e) == len(g)
        for i, (a, b) in enumerate(zip(e, g)):
            assert torch.equal(a, b), f"step {step}: tensor {i} differs"


class Config:
    SCALE = 2.0


class NamesAClass(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)

    def forward(self, x):
        return torch.tanh(self.lin(x) * Config.SCALE)


def test_an_attribute_of_a_class_the_forward_names_is_replayed_as_the_forward_saw_it():
    def reset(m):
        Config.SCALE = 2.0

    def between(m):
        Config.SCALE = 5.0

    try:
        _same_as_without_remat(NamesAClass, between, reset=reset, calls=3)
    finally:
        Config.SCALE = 2.0


SCALE = 2.0


def _passes_through(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


@_passes_through
def _scaled_tanh(x):
    return torch.tanh(x * SCALE)


class CallsADecoratedHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)

    def forward(self, x):
        return _scaled_tanh(self.lin(x))


def _set_scale(value):
    globals()["SCALE"] = value


def test_a_module_level_variable_a_decorated_helper_reads_is_replayed_as_the_forward_saw_it():
    try:
        _same_as_without_remat(
            CallsADecoratedHelper, lambda m: _set_scale(5.0), reset=lambda m: _set_scale(2.0), calls=3
        )
    finally:
        _set_scale(2.0)


class Patched(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _scaled_forward(self, x):
    return torch.tanh(self.lin(x) * SCALE)


def test_a_forward_replaced_after_the_class_was_first_walked_is_walked_anew():
    # a first checkpointed call walks the class with its first forward
    warm = remat.checkpoint(region_name="warm")(Patched())
    warm(torch.randn(2, 8, dtype=D, requires_grad=True)).sum().backward()
    original = Patched.forward
    Patched.forward = _scaled_forward
    try:
        _same_as_without_remat(Patched, lambda m: _set_scale(5.0), reset=lambda m: _set_scale(2.0))
    finally:
        Patched.forward = original
        _set_scale(2.0)


class ReadsALaterVariable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self.use_extra = False

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        if self.use_extra:
            y = torch.tanh(y * EXTRA)  # noqa: F821 (defined by the test after the first call)
        return y


def test_a_module_level_variable_defined_after_the_first_call_is_replayed_as_the_forward_saw_it():
    m = ReadsALaterVariable()
    f = remat.checkpoint(region_name="first")(m)
    f(torch.randn(2, 8, dtype=D, requires_grad=True)).sum().backward()  # walks without EXTRA

    def make():
        m = ReadsALaterVariable()
        m.use_extra = True
        return m

    def set_extra(value):
        globals()["EXTRA"] = value

    try:
        _same_as_without_remat(make, lambda m: set_extra(5.0), reset=lambda m: set_extra(2.0), calls=3)
    finally:
        globals().pop("EXTRA", None)


class OwnBatchNorm(nn.Module):
    """Running statistics as buffers of a plain module, updated by ``F.batch_norm``
    (whose kernel writes them in place without bumping their versions)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self.register_buffer("running_mean", torch.zeros(8, dtype=D))
        self.register_buffer("running_var", torch.ones(8, dtype=D))

    def forward(self, x):
        return torch.tanh(F.batch_norm(self.lin(x), self.running_mean, self.running_var, training=True, momentum=0.1))


def test_buffers_a_kernel_updates_without_a_version_bump_are_updated_once_per_step():
    _same_as_without_remat(OwnBatchNorm, lambda m: None, calls=3)


BIAS = torch.zeros(8, dtype=D)


class ReadsAModuleLevelTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)

    def forward(self, x):
        return torch.tanh(self.lin(x) + BIAS)


def test_a_module_level_tensor_updated_in_place_after_the_forward_is_refused_by_name():
    m = ReadsAModuleLevelTensor()
    f = remat.checkpoint(region_name="blk")(m)
    for _ in range(2):  # the second call reuses the capture
        y = f(torch.randn(4, 8, dtype=D, requires_grad=True))
        with torch.no_grad():
            BIAS.add_(1.0)
        try:
            y.sum().backward()
        except remat.SavedTensorModifiedError as e:
            assert "BIAS" in str(e)
        else:
            raise AssertionError("the replay ran on a module-level tensor updated after the forward")
        finally:
            with torch.no_grad():
                BIAS.zero_()


def test_a_module_level_tensor_rebound_after_the_forward_is_replayed_as_the_forward_saw_it():
    def between(m):
        globals()["BIAS"] = torch.ones(8, dtype=D)

    def reset(m):
        globals()["BIAS"] = torch.zeros(8, dtype=D)

    try:
        _same_as_without_remat(ReadsAModuleLevelTensor, between, reset=reset, calls=3)
    finally:
        globals()["BIAS"] = torch.zeros(8, dtype=D)


# ------------------------------------------------ containers of more kinds


class ReadsAHolder(nn.Module):
    """Scales by a number it reads from a holder in attribute ``attr``."""

    def __init__(self, attr, make, read):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self.attr, self.read = attr, read
        setattr(self, attr, make())

    def forward(self, x):
        return torch.tanh(self.lin(x) * float(self.read(getattr(self, self.attr))))


_HOLDERS = {
    "OrderedDict": (lambda: collections.OrderedDict(k=2.0), lambda c: c["k"], lambda c: c.__setitem__("k", 5.0)),
    "Counter": (lambda: collections.Counter(k=2), lambda c: c["k"], lambda c: c.__setitem__("k", 5)),
    "UserDict": (lambda: collections.UserDict(k=2.0), lambda c: c["k"], lambda c: c.__setitem__("k", 5.0)),
    "UserList": (lambda: collections.UserList([2.0]), lambda c: c[0], lambda c: c.__setitem__(0, 5.0)),
    "ChainMap": (lambda: collections.ChainMap({"k": 2.0}), lambda c: c["k"], lambda c: c.__setitem__("k", 5.0)),
    "dict": (lambda: {"k": 2.0}, lambda c: c["k"], lambda c: c.__setitem__("k", 5.0)),
    "list of dicts": (lambda: [{"k": 2.0}], lambda c: c[0]["k"], lambda c: c[0].__setitem__("k", 5.0)),
    "deque": (lambda: collections.deque([2.0]), lambda c: c[0], lambda c: c.__setitem__(0, 5.0)),
}


@pytest.mark.parametrize("attr", ["cfg", "_cfg"])
@pytest.mark.parametrize("kind", sorted(_HOLDERS))
def test_a_value_in_a_container_changed_before_the_backward_is_replayed_as_the_forward_saw_it(kind, attr):
    # Before: the standard library's ordered dict, counter, UserDict, UserList and
    # ChainMap, and every container in a private attribute, were not recorded: the
    # replay read 5.0 where the forward had read 2.0 (a gradient off by up to 2.3)
    make, read, change = _HOLDERS[kind]

    def reset(m):
        setattr(m, attr, make())

    _same_as_without_remat(lambda: ReadsAHolder(attr, make, read), lambda m: change(getattr(m, attr)),
                           reset=reset, calls=3)


class CountsCalls(nn.Module):
    """Counts its calls in a Counter and logs each input's sum in an OrderedDict."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self.calls = collections.Counter()
        self._log = collections.OrderedDict()

    def forward(self, x):
        self.calls["forward"] += 1
        self._log[f"call {len(self._log)}"] = float(x.detach().sum())
        return torch.tanh(self.lin(x) * (1.0 + len(self._log)))


def test_counts_and_logs_the_forward_keeps_in_stdlib_containers_are_left_as_without_remat():
    # the replay runs on the contents the forward started from; afterwards each
    # holds what the forward left (a count once per step, an entry per step)
    got = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        m = CountsCalls()
        f = remat.checkpoint(region_name="blk")(m) if ckpt else m
        grads = []
        with recorded_replays() as replayed:
            for i in range(3):
                x = torch.randn(4, 8, dtype=D, generator=torch.Generator().manual_seed(i), requires_grad=True)
                f(x).sum().backward()
                grads.append(x.grad)
        assert replayed == (["blk"] * 3 if ckpt else [])  # (each replay counts and logs too)
        got[ckpt] = (grads, dict(m.calls), list(m._log.items()))
    assert got[True][1] == got[False][1] == {"forward": 3}
    assert got[True][2] == got[False][2]
    assert all(torch.equal(a, b) for a, b in zip(got[True][0], got[False][0]))


class KeepsPrivateTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self._table = {"scale": torch.tanh}

    def forward(self, x):
        return self._table["scale"](self.lin(x)) * 2


def test_a_private_container_keeps_the_capture_reused_while_it_holds_the_same_objects():
    m = KeepsPrivateTable()
    f = remat.checkpoint(region_name="blk")(m)
    x = torch.randn(4, 8, dtype=D, requires_grad=True)
    f(x).sum().backward()
    reuse = f.capture_memo.reuse
    assert reuse is not None and [c for c, _ in reuse.containers] == [m._table]
    f(x).sum().backward()
    assert f.capture_memo.reuse is reuse  # the same objects: reused
    m._table["scale"] = torch.sigmoid  # another function: walked again, and replayed as read
    y = f(x)
    assert f.capture_memo.reuse is not reuse
    m._table["scale"] = torch.tanh
    x.grad = None
    y.sum().backward()
    x2 = x.detach().requires_grad_()
    (torch.sigmoid(m.lin(x2)) * 2).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_private_containers_of_torch_modules_are_not_recorded():
    # nn.LSTM keeps its weights in private lists: torch's bookkeeping, not user state
    from torch_remat.engine.module_state import ModuleState

    lstm = nn.LSTM(4, 4)
    state = ModuleState.capture(lstm, {})
    assert state is not None and state.containers == []


class ScalesFromAPrivateDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self._scales = {"k": 2.0}

    def forward(self, x):
        return torch.tanh(self.lin(x) * self._scales["k"])


@pytest.mark.distributed
def test_a_private_container_of_a_module_fsdp2_shards_is_recorded_and_its_own_state_is_not():
    # fully_shard gives the module a class made in torch, with the user's as a base,
    # and adds dicts of its own state ("__composable_api_state_key_...")
    import torch.distributed as dist

    from torch_remat.engine.module_state import ModuleState
    from torch_remat.integrations import RematConfig, fully_shard_with_remat

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grads = []
        for enabled in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(ScalesFromAPrivateDict(), ScalesFromAPrivateDict())
            fully_shard_with_remat(model, ScalesFromAPrivateDict, remat=RematConfig(enabled=enabled))
            if enabled:
                state = ModuleState.capture(model[0], {})
                assert [c for c, _ in state.containers] == [model[0]._scales]
            x = torch.randn(4, 8, dtype=D, generator=torch.Generator().manual_seed(1), requires_grad=True)
            with recorded_replays() as replayed:
                y = model(x)
                for block in model:
                    block._scales["k"] = 5.0
                y.sum().backward()
            assert len(replayed) == (2 if enabled else 0)
            grads.append([x.grad] + [p.grad.full_tensor() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- reached through
# a plain list of blocks, a function argument, a function in a container, a tensor


W8 = torch.linspace(0.5, 1.5, 32, dtype=D).reshape(4, 8)


class _Counting(nn.Module):
    """Bumps a counter and reads a scale: the replay must see the forward's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self.n, self.k = 0, 2.0

    def forward(self, x):
        self.n += 1
        return (self.lin(x) * self.k * self.n).tanh()


def _segment_step(make_blocks, between, ckpt, hold=list):
    """One step of a segment running blocks it holds in ``hold(blocks)`` (a plain list,
    a dict, an object): not registered anywhere. Returns gradients, buffers and
    the blocks' counters."""
    torch.manual_seed(0)
    blocks = make_blocks()
    held = hold(blocks)

    def segment(x):
        # reads the container itself at each call, as the model's code would
        members = held.values() if isinstance(held, dict) else held.items if isinstance(held, _Holder) else held
        for b in members:
            x = b(x)
        return x

    x = torch.randn(4, 8, dtype=D, requires_grad=True)
    f = remat.checkpoint(region_name="seg")(segment) if ckpt else segment
    y = f(x)
    between(blocks)
    (y * W8).sum().backward()
    params = [p.grad for b in blocks for p in b.parameters()]
    buffers = [t.clone() for b in blocks for t in b.buffers()]
    return [x.grad, *params, *buffers], [getattr(b, "n", None) for b in blocks]


class _Holder:
    def __init__(self, blocks):
        self.items = list(blocks)


@pytest.mark.parametrize("hold", [list, lambda bs: dict(enumerate(bs)), _Holder], ids=["list", "dict", "object"])
@pytest.mark.parametrize("change", [False, True], ids=["untouched", "scale-changed-before-backward"])
def test_blocks_a_segment_holds_in_a_plain_container_are_replayed_as_the_forward_saw_them(hold, change):
    # Segment checkpointing over list(model.layers[i:j]): blocks with submodules held
    # in a list were not walked, so each counter was bumped twice and the scale
    # changed before the backward was read by the replay (wrong gradients, no error).
    def between(blocks):
        if change:
            for b in blocks:
                b.k = 5.0

    def make():
        return [_Counting(), _Counting()]

    expected, counts = _segment_step(make, between, False, hold)
    with recorded_replays() as replayed:
        got, got_counts = _segment_step(make, between, True, hold)
    assert replayed == ["seg"]
    assert got_counts == counts == [1, 1]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_batch_norm_blocks_in_a_plain_list_update_their_statistics_once():
    def make():
        return [nn.Sequential(nn.Linear(8, 8, dtype=D), nn.BatchNorm1d(8, dtype=D)) for _ in range(2)]

    expected, _ = _segment_step(make, lambda bs: None, False)
    with recorded_replays() as replayed:
        got, _ = _segment_step(make, lambda bs: None, True)
    assert replayed == ["seg"]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))  # running stats, num_batches_tracked


def test_dropout_blocks_in_a_plain_list_switched_to_eval_before_backward_replay_in_training_mode():
    def make():
        return [nn.Sequential(nn.Linear(8, 8, dtype=D), nn.Dropout(0.5)) for _ in range(2)]

    def to_eval(blocks):
        for b in blocks:
            b.eval()

    def step(ckpt):
        torch.manual_seed(0)
        blocks = make()

        def segment(x):
            for b in blocks:
                x = b(x).tanh()
            return x

        f = remat.checkpoint(region_name="seg", recompute_state_hooks=(remat.CPURNGStateHook(),))(segment) if ckpt else segment
        x = torch.randn(4, 8, dtype=D, requires_grad=True)
        y = f(x)
        to_eval(blocks)
        (y * W8).sum().backward()
        return [x.grad, *[p.grad for b in blocks for p in b.parameters()]]

    expected = step(False)
    with recorded_replays() as replayed:
        got = step(True)
    assert replayed == ["seg"]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


SCALE_READ_BY_ARGUMENT = 2.0


def _act_reading_a_global(t):
    return (t * SCALE_READ_BY_ARGUMENT).tanh()


class _Scaler:
    def __init__(self):
        self.k = 2.0

    def apply(self, t):
        return (t * self.k).tanh()


def _callable_cases():
    def counter():
        count = {"n": 0}

        def act(t):
            count["n"] += 1
            return (t * count["n"]).tanh()

        return act, lambda: None, lambda: count["n"]

    def global_read():
        global SCALE_READ_BY_ARGUMENT
        SCALE_READ_BY_ARGUMENT = 2.0

        def between():
            global SCALE_READ_BY_ARGUMENT
            SCALE_READ_BY_ARGUMENT = 5.0

        return _act_reading_a_global, between, lambda: SCALE_READ_BY_ARGUMENT

    def bound_method():
        s = _Scaler()
        return s.apply, lambda: setattr(s, "k", 5.0), lambda: s.k

    def partial():
        cfg = {"k": 2.0}
        return (functools.partial(lambda t, cfg: (t * cfg["k"]).tanh(), cfg=cfg),
                lambda: cfg.__setitem__("k", 5.0), lambda: cfg["k"])

    return {"closure-counter": counter, "global": global_read, "bound-method": bound_method, "partial": partial}


@pytest.mark.parametrize("how", ["argument", "closure-list", "closure-dict", "closure-tuple"])
@pytest.mark.parametrize("case", list(_callable_cases()))
def test_a_function_passed_in_or_held_in_a_container_is_replayed_as_the_forward_saw_it(case, how):
    # A function given as an argument, or kept in a list, dict or tuple the
    # checkpointed code closes over, was not walked: its counter was bumped twice
    # and what the caller changed before the backward was read by the replay.
    def step(ckpt):
        torch.manual_seed(0)
        lin = nn.Linear(8, 8, dtype=D)
        act, between, state = _callable_cases()[case]()
        held = {"closure-list": [act], "closure-dict": {"a": act}, "closure-tuple": (act,)}.get(how)

        def block(x, arg=None):
            f = arg if how == "argument" else (held["a"] if isinstance(held, dict) else held[0])
            return f(lin(x))

        x = torch.randn(4, 8, dtype=D, requires_grad=True)
        run = remat.checkpoint(region_name="blk")(block) if ckpt else block
        y = run(x, act) if how == "argument" else run(x)
        between()
        (y * W8).sum().backward()
        return [x.grad, lin.weight.grad, lin.bias.grad], state()

    expected, end = step(False)
    with recorded_replays() as replayed:
        got, got_end = step(True)
    assert replayed == ["blk"]
    assert got_end == end
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_python_attribute_of_an_input_tensor_is_there_in_the_replay():
    # x.scale = 2.0 read by the forward: the replay's copy of the input lacked it
    # (AttributeError in backward, where autograd and torch's checkpoint run).
    def step(ckpt):
        torch.manual_seed(0)
        lin = nn.Linear(8, 8, dtype=D)
        x = torch.randn(4, 8, dtype=D, requires_grad=True)
        x.scale = 2.0

        def block(h):
            return (lin(h) * h.scale).tanh()

        y = (remat.checkpoint(region_name="blk")(block) if ckpt else block)(x)
        (y * W8).sum().backward()
        return [x.grad, lin.weight.grad]

    expected = step(False)
    with recorded_replays() as replayed:
        got = step(True)
    assert replayed == ["blk"]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


class _ParameterAttributes(nn.Module):
    """Reads Python attributes of its weight (a muP-style gain) and of a buffer, and
    bumps a use counter on the weight."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self.register_buffer("shift", torch.full((8,), 0.5, dtype=D))
        self.lin.weight.gain, self.lin.weight.uses, self.shift.k = 2.0, 0, 3.0

    def forward(self, x):
        self.lin.weight.uses += 1
        return (self.lin(x) * self.lin.weight.gain * self.lin.weight.uses + self.shift * self.shift.k).tanh()


@pytest.mark.parametrize("change", [False, True], ids=["untouched", "changed-before-backward"])
def test_python_attributes_of_parameters_and_buffers_are_replayed_as_the_forward_saw_them(change):
    # The walk recorded a parameter by identity and version only: the counter was
    # bumped twice and a gain changed before the backward was read by the replay.
    def between(m):
        if change:
            m.lin.weight.gain, m.shift.k = 5.0, 7.0

    expected = _steps(_ParameterAttributes, between, ckpt=False)
    with recorded_replays() as replayed:
        got = _steps(_ParameterAttributes, between, ckpt=True)
    assert replayed == ["blk", "blk"]
    for e, g in zip(expected, got):
        assert all(torch.equal(a, b) for a, b in zip(e, g))
    # the counter ends where the forward alone leaves it
    torch.manual_seed(0)
    m = _ParameterAttributes()
    f = remat.checkpoint(region_name="blk")(m)
    f(torch.randn(4, 8, dtype=D, requires_grad=True)).sum().backward()
    assert m.lin.weight.uses == 1


class _EMABlock(nn.Module):
    """Updates a buffer in place in its forward (an EMA) and counts its calls."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self.register_buffer("ema", torch.zeros(8, dtype=D))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.lin(x))
        self.ema.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return x + h * (1 + 0.01 * self.calls) + self.ema


class _Registry(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.blocks = nn.ModuleList(_EMABlock() for _ in range(4))
        for i, b in enumerate(self.blocks):
            if how == "dict-of-blocks":
                b.registry = dict(enumerate(self.blocks))
            elif how == "next-block":
                b.next = [self.blocks[(i + 1) % 4]]
            elif how == "parent":
                b.parent = [self]
            elif how == "callback":
                b.callbacks = [self.note]

    def note(self):
        return None


@pytest.mark.parametrize("how", ["dict-of-blocks", "next-block", "parent", "callback"])
def test_blocks_that_hold_their_siblings_in_attribute_containers_are_checkpointed_one_by_one(how):
    # Each block checkpointed alone, holding the others in a list or dict attribute
    # (a registry, a link to the next block, its parent, a bound method of the
    # model): the walk of containers must not record the siblings, whose forwards
    # update their own buffers after this block's (a false SavedTensorModifiedError),
    # nor walk the whole model at every call.
    def step(ckpt):
        torch.manual_seed(0)
        m = _Registry(how)
        calls = [remat.checkpoint(region_name=f"b{i}")(b) if ckpt else b for i, b in enumerate(m.blocks)]
        out = []
        for i in range(2):
            x = torch.randn(4, 8, dtype=D, generator=torch.Generator().manual_seed(i), requires_grad=True)
            m.zero_grad(set_to_none=True)
            h = x
            for c in calls:
                h = c(h)
            (h * W8).sum().backward()
            out += [x.grad, *[p.grad for p in m.parameters()], *[b.clone() for b in m.buffers()]]
        return out, [b.calls for b in m.blocks]

    expected, counts = step(False)
    with recorded_replays() as replayed:
        got, got_counts = step(True)
    assert replayed == [f"b{i}" for i in (3, 2, 1, 0)] * 2
    assert got_counts == counts
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_tensor_attribute_of_an_input_updated_in_place_before_backward_is_refused_by_name():
    lin = nn.Linear(8, 8, dtype=D)
    x = torch.randn(4, 8, dtype=D, requires_grad=True)
    x.shift = torch.ones(8, dtype=D)
    y = remat.checkpoint(region_name="blk")(lambda h: torch.tanh(lin(h) + h.shift))(x)
    x.shift.add_(1)
    with pytest.raises(remat.SavedTensorModifiedError, match="tensor attribute 'shift' of checkpoint input 0 of checkpoint 'blk'"):
        y.sum().backward()


def test_a_python_attribute_of_a_parameter_given_as_input_is_there_in_the_replay():
    def step(ckpt):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(4, 8, dtype=D))
        p.scale = 2.0
        lin = nn.Linear(8, 8, dtype=D)

        def block(h):
            return (lin(h) * h.scale).tanh()

        y = (remat.checkpoint(region_name="blk")(block) if ckpt else block)(p)
        (y * W8).sum().backward()
        return [p.grad, lin.weight.grad]

    expected = step(False)
    with recorded_replays() as replayed:
        got = step(True)
    assert replayed == ["blk"]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


class _ShiftsInAList(nn.Module):
    """A shift kept in a list attribute, added (not saved for backward by the add)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self.shifts = [torch.ones(8, dtype=D)]

    def forward(self, x):
        return torch.tanh(self.lin(x) + self.shifts[0])


def _shift_in_closure_dict():
    lin = nn.Linear(8, 8, dtype=D)
    table = {"shift": torch.ones(8, dtype=D)}
    return (lambda h: torch.tanh(lin(h) + table["shift"])), table, "dict['shift']"


def _shift_in_closure_list():
    lin = nn.Linear(8, 8, dtype=D)
    held = [torch.ones(8, dtype=D)]
    return (lambda h: torch.tanh(lin(h) + held[0])), held, "list[0]"


def _shift_in_a_list_passed_in():
    lin = nn.Linear(8, 8, dtype=D)
    held = [torch.ones(8, dtype=D)]

    def block(h, shifts):
        return torch.tanh(lin(h) + shifts[0])

    return (lambda h: block(h, held)), held, "list[0]"


def _shift_in_a_module_attribute_list():
    m = _ShiftsInAList()
    return m, m.shifts, "list[0]"


@pytest.mark.parametrize(
    "make", [_shift_in_closure_dict, _shift_in_closure_list, _shift_in_a_list_passed_in, _shift_in_a_module_attribute_list]
)
def test_a_tensor_held_in_a_container_updated_in_place_before_backward_is_refused_by_name(make):
    # The replay would read the updated shift: tanh's saved output, recomputed from
    # it, gives another gradient with no error (the add saves nothing to check).
    fn, container, name = make()
    x = torch.randn(4, 8, dtype=D, requires_grad=True)
    y = remat.checkpoint(region_name="blk")(fn)(x)
    next(iter(container.values()) if isinstance(container, dict) else iter(container)).mul_(2)
    with pytest.raises(remat.SavedTensorModifiedError, match=rf"tensor held in a container '{re.escape(name)} \(shape \(8,\), float64\)' read by checkpoint 'blk' was modified in place after the forward"):
        y.sum().backward()


def test_a_tensor_held_in_a_container_the_forward_updates_in_place_is_refused_by_name():
    class Decays(_ShiftsInAList):
        def forward(self, x):
            self.shifts[0].mul_(0.5)  # the replay would halve it again
            return super().forward(x)

    f = remat.checkpoint(region_name="blk")(Decays())
    with pytest.raises(remat.SavedTensorModifiedError, match=r"tensor held in a container 'list\[0\] .*' read by checkpoint 'blk' was modified in place during the checkpoint's forward"):
        f(torch.randn(4, 8, dtype=D, requires_grad=True))


def test_a_tensor_in_a_container_rebound_before_backward_is_replayed_as_the_forward_saw_it():
    # rebinding (not writing) the entry is what the container record replays
    _same_as_without_remat(
        _ShiftsInAList, lambda m: m.shifts.__setitem__(0, torch.full((8,), 3.0, dtype=D)), calls=3
    )


def _shift_in_closure_tuple():
    lin = nn.Linear(8, 8, dtype=D)
    held = (torch.ones(8, dtype=D), 2)
    return (lambda h: torch.tanh(lin(h) + held[0])), held, "tuple[0]"


def _shift_as_a_default_argument():
    lin = nn.Linear(8, 8, dtype=D)
    shift = torch.ones(8, dtype=D)

    def block(h, shift=shift):
        return torch.tanh(lin(h) + shift)

    return block, (shift,), "tuple[0]"


def _shift_bound_by_a_partial():
    lin = nn.Linear(8, 8, dtype=D)
    shift = torch.ones(8, dtype=D)

    def block(s, h):
        return torch.tanh(lin(h) + s)

    return functools.partial(block, shift), (shift,), "tuple[0]"


class _ShiftsInATuple(_ShiftsInAList):
    def __init__(self):
        super().__init__()
        self.shifts = (torch.ones(8, dtype=D),)


def _shift_in_a_module_attribute_tuple():
    m = _ShiftsInATuple()
    return m, m.shifts, "tuple[0]"


@pytest.mark.parametrize(
    "make",
    [_shift_in_closure_tuple, _shift_as_a_default_argument, _shift_bound_by_a_partial, _shift_in_a_module_attribute_tuple],
)
def test_a_tensor_in_a_tuple_a_default_or_a_partial_updated_in_place_before_backward_is_refused_by_name(make):
    fn, held, name = make()
    x = torch.randn(4, 8, dtype=D, requires_grad=True)
    y = remat.checkpoint(region_name="blk")(fn)(x)
    held[0].mul_(2)
    with pytest.raises(remat.SavedTensorModifiedError, match=rf"tensor held in a container '{re.escape(name)} \(shape \(8,\), float64\)' read by checkpoint 'blk' was modified in place after the forward"):
        y.sum().backward()



class _ScaledByAnArray(nn.Module):
    """A scale kept in a NumPy array or an ``array.array``, read as a Python float."""

    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self.scale = np.array([2.0]) if kind == "numpy" else array.array("d", [2.0])

    def forward(self, x):
        return torch.tanh(self.lin(x) * float(self.scale[0]))


class _ArrayTheForwardUpdates(_ScaledByAnArray):
    def forward(self, x):
        self.scale[0] += 1.0  # the replay must start from the forward's value, once
        return super().forward(x)


@pytest.mark.parametrize("kind", ["numpy", "array"])
@pytest.mark.parametrize(
    "make, between",
    [
        (_ScaledByAnArray, lambda m: m.scale.__setitem__(0, 5.0)),  # written in place before backward
        (_ArrayTheForwardUpdates, lambda m: None),
    ],
    ids=["written before backward", "written by the forward"],
)
def test_a_small_array_the_code_holds_is_replayed_as_the_forward_saw_it(kind, make, between):
    # (its contents change in place: no identity moves, no version counter)
    _same_as_without_remat(lambda: make(kind), between, calls=3)


class _DrawsFromASchedule(nn.Module):
    def __init__(self, schedule):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self.rates = schedule

    def forward(self, x):
        return torch.tanh(self.lin(x) * next(self.rates))


def _generator_schedule():
    rate = 1.0
    while True:
        yield rate
        rate += 0.5


@pytest.mark.parametrize(
    "schedule",
    [_generator_schedule, lambda: itertools.cycle([1.0, 2.0]), lambda: itertools.count(1), lambda: iter([1.0, 2.0, 3.0])],
    ids=["generator", "cycle", "count", "list iterator"],
)
def test_an_iterator_the_forward_draws_from_is_refused_by_the_replay(schedule):
    # the replay would draw the next value (a silently different gradient), and
    # advance the schedule twice per step
    m = _DrawsFromASchedule(schedule())
    y = remat.checkpoint(region_name="blk")(m)(torch.randn(4, 8, dtype=D, requires_grad=True))
    with pytest.raises(remat.RecomputeMismatchError, match=r"forward of checkpoint 'blk' drew from a \w+ iterator the checkpointed code holds"):
        y.sum().backward()


def test_an_iterator_the_forward_does_not_draw_from_is_left_alone():
    class HoldsOne(_ScaledByAnArray):
        def __init__(self):
            super().__init__("numpy")
            self.rates = itertools.count(1)

    _same_as_without_remat(HoldsOne, lambda m: next(m.rates), calls=2)


class _RouterKeepsStats(nn.Module):
    """A SAVE region's body appends to a list and counts in a dict; the code after
    the region reads both (the replay skips the body)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 8, dtype=D)
        self.out = nn.Linear(8, 8, dtype=D)
        self.aux = [torch.tensor(0.5, dtype=D)]  # (the replay would read this one)
        self.counts = {"routed": 0}

    def route(self, x):
        h = self.gate(x)
        self.aux.append(h.detach().square().mean())
        self.counts["routed"] += 1
        return h

    def forward(self, x):
        h = remat.recompute_needs_tensor(remat.region(self.route, "router", recompute=False)(x))
        scale = self.aux[-1] * len(self.aux) + self.counts["routed"]
        return torch.tanh(self.out(torch.tanh(h) * scale))


def test_what_a_save_body_puts_in_a_list_or_dict_is_there_where_the_replay_skips_it():
    def state(m):
        return [len(m.aux) - 1, m.counts["routed"]]

    expected = _steps(_RouterKeepsStats, lambda m: None, calls=3, ckpt=False)
    with recorded_replays() as replayed:
        got = _steps(_RouterKeepsStats, lambda m: None, calls=3, ckpt=True)
    assert replayed == ["blk"] * 3
    for e, g in zip(expected, got):
        assert all(torch.equal(a, b) for a, b in zip(e, g))
    # and the containers end as without remat: one entry and one count per step
    for ckpt in (False, True):
        torch.manual_seed(0)
        m = _RouterKeepsStats()
        f = remat.checkpoint(region_name="blk")(m) if ckpt else m
        for _ in range(2):
            f(torch.randn(4, 8, dtype=D, requires_grad=True)).sum().backward()
        assert state(m) == [2, 2]


def test_a_python_attribute_a_save_body_sets_on_its_output_is_there_in_the_replay():
    # (the replay skips the body: its output is the kept tensor, which must carry it)
    def step(ckpt):
        torch.manual_seed(0)
        lin = nn.Linear(8, 8, dtype=D)

        def body(h):
            out = lin(h)
            out.temperature = 3.0
            return out

        def block(h):
            out = remat.recompute_needs_tensor(remat.region(body, "proj", recompute=False)(h))
            return torch.tanh(out / out.temperature)

        x = torch.randn(4, 8, dtype=D, requires_grad=True)
        y = (remat.checkpoint(region_name="blk")(block) if ckpt else block)(x)
        (y * W8).sum().backward()
        return [x.grad, lin.weight.grad, lin.bias.grad]

    expected = step(False)
    with recorded_replays() as replayed:
        got = step(True)
    assert replayed == ["blk"]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_class_attribute_a_save_body_rebinds_is_rebound_where_the_replay_skips_it():
    def make():
        class Counted(nn.Module):
            calls = 0

            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8, dtype=D)

            def count(self, h):
                type(self).calls += 1
                return self.lin(h)

            def forward(self, x):
                h = remat.recompute_needs_tensor(remat.region(self.count, "proj", recompute=False)(x))
                return torch.tanh(h * type(self).calls)

        return Counted()

    _same_as_without_remat(make, lambda m: None, calls=3)


# A module-level helper a decorator wraps, whose decorator holds a value in its
# closure (a scale) and the function it wraps: the replay runs with the closure
# values the forward read, and a capture reused by the next call sees a closure
# cell pointed at another function (which reads another module-level variable).


def _scaled_by(scale):
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(x):
            return fn(x) * scale

        return wrapper

    return decorate


@_scaled_by(1.0)
def _scaled_helper(x):
    return torch.tanh(x)


OTHER_SCALE = 1.0


def _other_helper(x):
    # (sigmoid saves its output: the replay recomputes it from OTHER_SCALE)
    return torch.sigmoid(x * OTHER_SCALE)


def _helper_cell(name):
    return _scaled_helper.__closure__[_scaled_helper.__code__.co_freevars.index(name)]


class CallsAScaledHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self.out = nn.Linear(8, 8, dtype=D)

    def forward(self, x):
        # (the product feeds a Linear, which saves it: the replay recomputes it)
        return self.out(_scaled_helper(self.lin(x)))


def _reset_helper():
    _helper_cell("scale").cell_contents = 1.0
    _helper_cell("fn").cell_contents = _scaled_helper.__wrapped__
    globals()["OTHER_SCALE"] = 1.0


def test_a_closure_value_of_a_decorated_module_level_helper_is_replayed_as_the_forward_saw_it():
    def between(m):
        _helper_cell("scale").cell_contents = 7.0

    try:
        _same_as_without_remat(CallsAScaledHelper, between, reset=lambda m: _reset_helper(), calls=3)
    finally:
        _reset_helper()


def test_a_decorated_helper_pointed_at_another_function_between_calls_is_walked_again():
    # from the second call on, the forward runs _other_helper, which reads
    # OTHER_SCALE: a capture reused from the first call would not know it, and the
    # replay would read the value set before the backward
    calls: dict[int, int] = {}  # (per module; an attribute would be module state)

    def reset(m):
        n = calls[id(m)] = calls.get(id(m), 0) + 1
        _reset_helper()
        if n > 1:
            _helper_cell("fn").cell_contents = _other_helper

    def between(m):
        globals()["OTHER_SCALE"] = 3.0

    try:
        _same_as_without_remat(CallsAScaledHelper, between, reset=reset, calls=3)
    finally:
        _reset_helper()


PROJECTION = None
NORM = None


class CallsModuleLevelModules(nn.Module):
    """Calls a Linear and a BatchNorm held in module-level variables."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)
        self.out = nn.Linear(8, 8, dtype=D)

    def forward(self, x):
        return self.out(torch.tanh(PROJECTION(NORM(self.lin(x)))))


def _module_level_modules():
    torch.manual_seed(1)
    globals()["PROJECTION"] = nn.Linear(8, 8, dtype=D)
    globals()["NORM"] = nn.BatchNorm1d(8, dtype=D)
    return CallsModuleLevelModules()


def test_modules_a_forward_reads_from_module_level_variables_are_replayed_as_the_forward_saw_them():
    # the BatchNorm's running statistics advance once per step, and a weight replaced
    # before the backward is not the one the replay uses
    def between(m):
        PROJECTION.weight = nn.Parameter(PROJECTION.weight.detach() * 2)

    results = []
    for ckpt in (False, True):
        steps = _steps(_module_level_modules, between, calls=3, ckpt=ckpt)
        results.append([*steps, [NORM.num_batches_tracked.clone(), NORM.running_mean.clone()]])
    for i, (a, b) in enumerate(zip(*results)):
        for j, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {i} item {j}"
