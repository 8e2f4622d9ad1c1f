"""A checkpointed module's state capture, reused by its next calls where nothing it
was built from changed (module_state._Reuse). Every change a walk would see makes
the call walk again, and each call, reused or not, replays exactly what its forward
read: compared with the same calls run without remat, with torch.equal."""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing

import pytest
import torch
from helpers import recorded_replays
from torch import nn
from torch.nn.utils import parametrize

import torch_remat as remat
from torch_remat.engine import module_state

D = torch.float64
SCALE = 1.0  # read by Block.forward: a module-level variable is state too


class Block(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = nn.Linear(5, 7, dtype=D)
        self.fc2 = nn.Linear(7, 5, dtype=D)
        self.norm = nn.BatchNorm1d(7, dtype=D)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, dtype=D, generator=g))
        self.temperature = 1.0
        self.tag = None

    def forward(self, x):
        h = self.norm(self.fc1(x)) / self.temperature
        return self.fc2(torch.tanh(h)) * SCALE


def _x(seed: int) -> torch.Tensor:
    return torch.randn(4, 5, dtype=D, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _walks(monkeypatch) -> list[int]:
    """Counts the full walks of the capture (each visits the module tree)."""
    walks: list[int] = []
    full = module_state._module_slots

    def counted(*args, **kwargs):
        walks.append(1)
        return full(*args, **kwargs)

    monkeypatch.setattr(module_state, "_module_slots", counted)
    return walks


def _step(model, x, between=None):
    """forward, ``between(model)``, backward: the gradients and the model's state."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = model(x)
    if between is not None:
        between(model)
    y.sum().backward()
    return [x.grad, *(p.grad for p in model.parameters())], [b.clone() for b in model.buffers()]


def _compare(changes, betweens=None, make=None):
    """Runs the steps with and without remat: ``changes[i](model)`` before step i,
    ``betweens[i](model)`` between its forward and its backward."""
    betweens = betweens or [None] * len(changes)
    plain, wrapped = (make or Block)(), (make or Block)()
    ckpt = remat.checkpoint(region_name="block")(wrapped)
    results = []
    for model, call in ((plain, plain), (wrapped, ckpt)):
        _set_scale(1.0)
        out = []
        for i, (change, between) in enumerate(zip(changes, betweens)):
            if change is not None:
                change(model)
            out.append(_step(_Call(model, call), _x(i), between and (lambda c, b=between: b(c.model))))
        results.append(out)
    for i, ((eg, eb), (gg, gb)) in enumerate(zip(*results)):
        for j, (e, g) in enumerate(zip(eg, gg)):
            assert (e is None) == (g is None) and (e is None or torch.equal(e, g)), f"step {i} grad {j}"
        for j, (e, g) in enumerate(zip(eb, gb)):
            assert torch.equal(e, g), f"step {i} buffer {j}"
    return wrapped, ckpt


class _Call(nn.Module):
    """Runs ``call`` (the model or its checkpoint) with the model's parameters."""

    def __init__(self, model, call):
        super().__init__()
        self.model = model
        self.call = call

    def forward(self, x):
        return self.call(x)


def test_the_second_call_reuses_the_capture_and_replays_exactly(monkeypatch):
    walks = _walks(monkeypatch)
    with recorded_replays() as replayed:
        _, ckpt = _compare([None, None, None])
    assert replayed == ["block"] * 3
    assert ckpt.capture_memo.reuse is not None
    # the first call walks (plus nothing else); the next two reuse
    assert len(walks) == 1


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda m: setattr(m, "temperature", 2.0), id="attribute-rebound"),
        pytest.param(
            lambda m: setattr(m.fc1, "weight", nn.Parameter(m.fc1.weight.detach() * 2)),
            id="parameter-replaced",
        ),
        pytest.param(lambda m: setattr(m, "fc2", _clone_linear(m.fc2, 3.0)), id="submodule-replaced"),
        pytest.param(lambda m: m.eval(), id="eval"),
        pytest.param(
            lambda m: m.fc1.register_forward_hook(lambda mod, args, out: out * 1.5),
            id="hook-added",
        ),
        pytest.param(
            lambda m: parametrize.register_parametrization(m.fc1, "weight", _Doubled()),
            id="class-changed-by-parametrize",
        ),
        pytest.param(lambda m: _rename(m, "tag", "label"), id="attribute-renamed-same-value"),
        pytest.param(lambda m: _set_scale(0.5), id="global-rebound"),
    ],
)
def test_a_change_between_calls_is_walked_again_and_replayed_exactly(monkeypatch, request, change):
    walks = _walks(monkeypatch)
    try:
        _compare([None, None, change, None])
    finally:
        _set_scale(1.0)
    # first call, then the changed one walk; the others reuse
    # (a module with forward hooks is walked at every call: the hooks are state)
    assert len(walks) == (3 if request.node.callspec.id == "hook-added" else 2)


def test_a_change_between_forward_and_backward_of_a_reused_call_is_undone_for_the_replay(monkeypatch):
    # the reused state installs the forward's values like a walked one
    walks = _walks(monkeypatch)
    seen = []

    def swap(m):
        seen.append(len(walks))
        m.fc1.weight = nn.Parameter(m.fc1.weight.detach() + 1)
        m.temperature = 3.0

    with recorded_replays() as replayed:
        _compare([None, None], [None, swap])
    assert replayed == ["block"] * 2
    # at the swap: no walk yet in the run without remat; one (the first call's) with
    # remat, whose second call reused it
    assert seen == [0, 1]


def test_buffers_updated_in_forward_are_copied_at_every_reused_call():
    # BatchNorm in training mode: its running statistics replayed from a copy taken
    # at each call's start, so they advance once per step
    with recorded_replays() as replayed:
        _, ckpt = _compare([None] * 4)
    assert replayed == ["block"] * 4
    assert ckpt.capture_memo.reuse is not None  # (calls 2 to 4 reused the capture)


def test_a_module_among_the_arguments_is_walked_at_every_call(monkeypatch):
    walks = _walks(monkeypatch)
    block = Block()
    ckpt = remat.checkpoint(region_name="pair")(lambda m, x: m(x))
    for i in range(3):
        ckpt(block, _x(i)).sum().backward()
    assert len(walks) == 3


def _clone_linear(lin: nn.Linear, factor: float) -> nn.Linear:
    new = nn.Linear(lin.in_features, lin.out_features, dtype=D)
    with torch.no_grad():
        new.weight.copy_(lin.weight * factor)
        new.bias.copy_(lin.bias)
    return new


class _Doubled(nn.Module):
    def forward(self, w):
        return w * 2


def _rename(m, old, new):
    value = getattr(m, old)
    delattr(m, old)
    setattr(m, new, value)


def _set_scale(value):
    global SCALE
    SCALE = value


class Counting(nn.Module):
    """A SAVE region whose body rebinds module attributes (a counter, a tensor
    attribute, a renamed flag) that the code after it reads, on the calls whose
    input says so: the calls before one that rebinds leave the module as it was, so
    that call's capture is reused."""

    def __init__(self):
        super().__init__()
        self.inner = Block()
        self.calls = 0
        self.shift = torch.zeros(7, dtype=D)
        self.flag = None

    def _body(self, x):
        if float(x[0, 0].detach()) > 0:
            self.calls += 1
            self.shift = self.shift + 0.25
            if self.calls % 2:  # (renamed, same value: only the keys tell)
                del self.flag
                self.marker = None
            else:
                del self.marker
                self.flag = None
        return self.inner.fc1(x)

    def forward(self, x):
        h = remat.recompute_needs_tensor(remat.region(self._body, "body", recompute=False)(x))
        scale = (1.0 + self.calls) * (2.0 if hasattr(self, "marker") else 1.0)
        # (the replay recomputes tanh's output, saved for backward, from them)
        return self.inner.fc2(torch.tanh(h + self.shift * scale))


SIGNS = [-1, -1, 1, -1, -1, 1, 1]  # the calls whose body rebinds: 3rd, 6th, 7th


def _counting_steps(model, call):
    out = []
    for i, sign in enumerate(SIGNS):
        model.zero_grad(set_to_none=True)
        x = _x(i).detach()
        x[0, 0] = sign
        x.requires_grad_()
        call(x).sum().backward()
        out.append([x.grad, *(p.grad for p in model.parameters()), model.shift.clone()])
    return out, model.calls


def test_attributes_a_save_regions_body_rebinds_are_seen_in_reused_calls(monkeypatch):
    walks = _walks(monkeypatch)
    plain, wrapped = Counting(), Counting()
    expected, calls = _counting_steps(plain, plain)
    ckpt = remat.checkpoint(region_name="counting")(wrapped)
    with recorded_replays() as replayed:
        got, got_calls = _counting_steps(wrapped, ckpt)
    assert replayed == ["counting"] * len(SIGNS)
    assert got_calls == calls == 3
    for i, (e, g) in enumerate(zip(expected, got)):
        for j, (a, b) in enumerate(zip(e, g)):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"step {i} item {j}"
    # walked: the first call and each call after one that rebound (4th, 7th)
    assert len(walks) == 3


def test_a_reused_calls_replay_still_checks_what_no_dict_version_shows(monkeypatch):
    # an in-place update of a parameter (its version), a flipped requires_grad, a
    # rebound module-level variable and hooks registered between the forward and its
    # backward: each is seen by the replay of a call whose capture was reused
    def step(model, ckpt, between):
        model.zero_grad(set_to_none=True)
        y = ckpt(_x(0))
        between(model)
        y.sum().backward()

    def inplace(m):
        with torch.no_grad():
            m.fc1.weight.add_(1)

    model = Block()
    ckpt = remat.checkpoint(region_name="block")(model)
    step(model, ckpt, lambda m: None)
    with pytest.raises(remat.SavedTensorModifiedError, match="fc1.weight"):
        step(model, ckpt, inplace)
    assert ckpt.capture_memo.reuse is not None

    for between in (
        lambda m: m.fc2.weight.requires_grad_(False),
        lambda m: _set_scale(4.0),
        lambda m: m.fc1.register_forward_hook(lambda mod, args, out: out * 3),
        lambda m: nn.modules.module.register_module_forward_hook(lambda mod, args, out: out * 3),
    ):
        plain, wrapped = Block(), Block()
        ckpt = remat.checkpoint(region_name="block")(wrapped)
        handles = []
        try:
            results = []
            for model, call in ((plain, plain), (wrapped, ckpt)):
                _set_scale(1.0)
                for h in handles:
                    h.remove()
                handles.clear()
                grads = []
                for i in range(2):
                    model.zero_grad(set_to_none=True)
                    x = _x(i)
                    y = call(x)
                    if i == 1:
                        h = between(model)
                        if hasattr(h, "remove") and not isinstance(h, torch.Tensor):
                            handles.append(h)
                    y.sum().backward()
                    grads.append([x.grad, *(p.grad for p in model.parameters())])
                results.append(grads)
            assert ckpt.capture_memo.reuse is not None
            for e, g in zip(*results):
                for a, b in zip(e, g):
                    assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        finally:
            for h in handles:
                h.remove()
            _set_scale(1.0)


def test_attributes_rebound_in_later_save_regions_of_one_call_are_replayed():
    # a function (not a module: its capture is walked at every call) with three
    # SAVE regions; the first look compares every attribute, the later ones read the
    # dicts' version tags first
    def build():
        m = Block()
        m.shift = torch.zeros(7, dtype=D)

        def region_a(h):
            return m.fc1(h)

        def region_b(h):
            m.temperature = m.temperature + 1.0
            return h * 1.5

        def region_c(h):
            m.shift = m.shift + 0.5
            del m.tag
            m.label = None  # (renamed, same value)
            return h - 1.0

        def fn(x):
            h = remat.region(region_a, "a", recompute=False)(x)
            h = remat.recompute_needs_tensor(remat.region(region_b, "b", recompute=False)(h))
            g = torch.tanh(h / m.temperature)  # (tanh's output is saved: replayed)
            g = remat.recompute_needs_tensor(remat.region(region_c, "c", recompute=False)(g))
            k = 2.0 if hasattr(m, "label") else 1.0
            return m.fc2(torch.tanh(g + m.shift * k))

        return m, fn

    results = []
    for wrap in (False, True):
        m, fn = build()
        call = remat.checkpoint(region_name="fn")(fn) if wrap else fn
        x = _x(0)
        with recorded_replays() as replayed:
            call(x).sum().backward()
        assert replayed == (["fn"] if wrap else [])
        results.append([x.grad, *(p.grad for p in m.parameters()), m.shift, m.temperature])
    for a, b in zip(*results):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_dict_version_tags_are_read_on_this_python():
    # (CPython 3.10 to 3.12 bump PEP 509's tag at every write checked; 3.13 does not
    # for a stored attribute of an object whose __dict__ exists, 3.14 has no tag:
    # there every dict is compared)
    import sys

    if sys.version_info >= (3, 13):
        pytest.skip("the dict version tag is not used on CPython 3.13 and later")
    assert module_state._DICT_VERSION_AT is not None
    d = {"a": 1}
    (view,) = module_state.dict_version_views([d])
    before = view.value
    d["a"] = 1  # (the same object again: nothing rebound)
    assert view.value == before
    d["a"] = 2
    assert view.value != before
    block = Block()
    ckpt = remat.checkpoint(region_name="block")(block)
    for i in range(2):
        ckpt(_x(i)).sum().backward()
    reuse = ckpt.capture_memo.reuse
    assert reuse is not None and reuse.versions is not None


def test_a_module_given_a_new_dict_object_is_walked_again():
    # the walk reads the module's __dict__ as it is now: a new dict object with the
    # same contents is state the reused capture never saw
    def step(m, call, between):
        m.zero_grad(set_to_none=True)
        x = _x(1)
        y = call(x)
        between(m)
        y.sum().backward()
        return [x.grad, *(p.grad for p in m.parameters())]

    results = []
    for wrap in (False, True):
        m = Block()
        call = remat.checkpoint(region_name="block")(m) if wrap else m
        call(_x(0)).sum().backward()
        m.__dict__ = dict(m.__dict__)
        with recorded_replays() as replayed:
            results.append(step(m, call, lambda m: setattr(m, "temperature", 2.0)))
        assert replayed == (["block"] if wrap else [])  # (replayed at the forward's temperature)
    for a, b in zip(*results):
        assert torch.equal(a, b)


# A layer whose forward a decorator wraps, as transformers wraps its layers' forwards
# (deprecate_kwarg, can_return_tuple): the walk reads the decorator's closure (flags,
# names, the wrapped function). Such a capture is reused while every closure cell
# holds the same object, every function read has the same code, defaults and
# __wrapped__, and the class's forward is the same function.

OFFSET = 0.0  # read by _offset_forward, the code swapped into a decorated forward


def _scaled_by(factor):
    def decorate(f):
        @functools.wraps(f)
        def wrapper(self, x):
            return f(self, x * factor)

        return wrapper

    return decorate


def _decorated_class(library: bool = False):
    """A fresh module class whose forward ``_scaled_by(1.0)`` wraps; ``library``: named
    as a library's class (transformers'), whose attributes the walk does not copy."""

    class Decorated(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.fc1 = nn.Linear(5, 7, dtype=D)
            self.fc2 = nn.Linear(7, 5, dtype=D)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, dtype=D, generator=g))

        @_scaled_by(1.0)
        def forward(self, x):
            # (tanh saves its output: the replay recomputes it from the factor)
            return self.fc2(torch.tanh(self.fc1(x)))

    if library:
        Decorated.__module__ = "transformers.models.decorated"
    return Decorated


def _offset_forward(self, x):
    return self.fc2(torch.tanh(self.fc1(x) + OFFSET))


def _cell(fn, name):
    return fn.__closure__[fn.__code__.co_freevars.index(name)]


def _run_decorated(cls, changes, betweens, monkeypatch):
    """Steps of ``cls()`` with and without remat (``changes[i](cls)`` before step i,
    ``betweens[i](cls)`` between its forward and backward), compared with torch.equal;
    returns the walks and replays of the run with remat."""
    results, walks, replayed = [], None, None
    for wrap in (False, True):
        model = cls()
        call = remat.checkpoint(region_name="decorated")(model) if wrap else model
        saved = [(c, c.cell_contents) for c in cls.forward.__closure__]
        inner = cls.forward.__wrapped__
        code = inner.__code__
        forward = cls.forward
        if wrap:
            walks = _walks(monkeypatch)
        out = []
        try:
            with recorded_replays() as names:
                for i, (change, between) in enumerate(zip(changes, betweens)):
                    if change is not None:
                        change(cls)
                    out.append(_step(_Call(model, call), _x(i), between and (lambda _, b=between: b(cls)))[0])
        finally:
            for c, v in saved:
                c.cell_contents = v
            inner.__code__ = code
            cls.forward = forward
            _set_offset(0.0)
        results.append(out)
        if wrap:
            replayed = list(names)
    for i, (e, g) in enumerate(zip(*results)):
        for j, (a, b) in enumerate(zip(e, g)):
            assert torch.equal(a, b), f"step {i} grad {j}"
    return walks, replayed


def _set_offset(value):
    global OFFSET
    OFFSET = value


def _rebind_factor(value):
    return lambda cls: setattr(_cell(cls.forward, "factor"), "cell_contents", value)


def test_a_forward_a_decorator_wraps_reuses_its_capture(monkeypatch):
    walks, replayed = _run_decorated(_decorated_class(), [None] * 3, [None] * 3, monkeypatch)
    assert replayed == ["decorated"] * 3
    assert len(walks) == 1


@pytest.mark.parametrize("library", [False, True], ids=["user-class", "library-class"])
def test_a_decorators_closure_value_rebound_between_calls_is_walked_again(monkeypatch, library):
    # the forward then scales by 2.0; a reused capture would replay at 1.0
    walks, replayed = _run_decorated(
        _decorated_class(library), [None, None, _rebind_factor(2.0), None], [None] * 4, monkeypatch
    )
    assert replayed == ["decorated"] * 4
    assert len(walks) == 2


@pytest.mark.parametrize("library", [False, True], ids=["user-class", "library-class"])
def test_a_decorators_closure_value_rebound_before_a_reused_calls_backward_is_undone(monkeypatch, library):
    walks, replayed = _run_decorated(
        _decorated_class(library), [None, None], [None, _rebind_factor(3.0)], monkeypatch
    )
    assert replayed == ["decorated"] * 2
    assert len(walks) == 1  # (the second call reused the capture, then replayed at 1.0)


def test_code_swapped_into_a_decorated_forward_is_walked_again(monkeypatch):
    # the new code reads OFFSET, a module-level variable the first walk never saw: the
    # replay of the last call must use the forward's value, not the one set before
    # its backward
    def swap(cls):
        cls.forward.__wrapped__.__code__ = _offset_forward.__code__

    walks, replayed = _run_decorated(
        _decorated_class(), [None, None, swap, None], [None, None, None, lambda cls: _set_offset(0.5)],
        monkeypatch,
    )
    assert replayed == ["decorated"] * 4
    assert len(walks) == 2


def test_a_library_classs_forward_replaced_between_calls_is_walked_again(monkeypatch):
    # (as a kernel library patches a transformers class's forward): the new
    # decorator's closure is read by a new walk, so the replay of the last call sets
    # its value back to the forward's
    replacement = _scaled_by(1.0)(_decorated_class().forward.__wrapped__)

    def patch(cls):
        _cell(replacement, "factor").cell_contents = 1.0  # (each run rebinds it)
        cls.forward = replacement

    def rebind(cls):
        _cell(cls.forward, "factor").cell_contents = 4.0

    try:
        walks, replayed = _run_decorated(
            _decorated_class(library=True), [None, None, patch, None], [None, None, None, rebind],
            monkeypatch,
        )
    finally:
        _cell(replacement, "factor").cell_contents = 1.0
    assert replayed == ["decorated"] * 4
    assert len(walks) == 2


@pytest.mark.parametrize("how", ["checkpoint", "apply_remat"])
def test_a_transformers_layer_reuses_its_capture(monkeypatch, how):
    # transformers wraps LlamaDecoderLayer.forward in decorators whose closures hold
    # flags, names and the wrapped function: the capture is walked once, reused by
    # the later calls, and every step is exact
    transformers = pytest.importorskip("transformers")
    from torch_remat.integrations import apply_remat

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, use_cache=False, attn_implementation="eager",
    )
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config)
    wrapped = transformers.LlamaForCausalLM(config)
    wrapped.load_state_dict(plain.state_dict())
    if how == "apply_remat":
        apply_remat(wrapped, check_fn=lambda m: type(m).__name__ == "LlamaDecoderLayer")
    else:
        for i, layer in enumerate(wrapped.model.layers):
            wrapped.model.layers[i].forward = remat.checkpoint(region_name=f"layers.{i}")(layer.forward)
    walks = _walks(monkeypatch)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with recorded_replays() as replayed:
        for _ in range(3):
            for model in (plain, wrapped):
                model.zero_grad(set_to_none=True)
                model(ids).logits.sum().backward()
            for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
                assert torch.equal(a.grad, b.grad), name
    assert len(replayed) == 6
    assert len(walks) == 2  # (one per layer: the first call of each)


# ------------------------------------------------- a plain object holding settings


class Settings:
    """A config of the user's that a module keeps (``self.settings = settings``)."""

    def __init__(self, scale: float = 1.0, dtype: torch.dtype = D, shape: tuple = (4, 5)):
        self.scale = scale
        self.dtype = dtype
        self.shape = shape


class Configured(Block):
    def __init__(self, settings: Settings | None = None):
        super().__init__()
        self.settings = settings or Settings()

    def forward(self, x):
        return super().forward(x).to(self.settings.dtype) * self.settings.scale


def test_a_module_keeping_a_settings_object_reuses_its_capture(monkeypatch):
    walks = _walks(monkeypatch)
    with recorded_replays() as replayed:
        _, ckpt = _compare([None, None, None], make=Configured)
    assert replayed == ["block"] * 3
    assert ckpt.capture_memo.reuse is not None
    assert len(walks) == 1


@pytest.mark.parametrize(
    "change, walked",
    [
        pytest.param(lambda m: setattr(m.settings, "scale", 2.0), 2, id="setting-rebound"),
        pytest.param(lambda m: setattr(m, "settings", Settings(3.0)), 2, id="settings-replaced"),
        pytest.param(lambda m: setattr(m.settings, "extra", 1), 2, id="setting-added"),
        # not settings alone any more: walked at every call from then on
        pytest.param(lambda m: setattr(m.settings, "table", [1.0]), 3, id="list-added"),
        pytest.param(
            lambda m: setattr(m.settings, "offset", torch.zeros(1, dtype=D)), 3, id="tensor-added"
        ),
    ],
)
def test_a_settings_change_between_calls_is_walked_again_and_replayed_exactly(monkeypatch, change, walked):
    walks = _walks(monkeypatch)
    _compare([None, None, change, None], make=Configured)
    assert len(walks) == walked


def test_a_setting_changed_before_a_reused_calls_backward_is_undone_for_the_replay(monkeypatch):
    walks = _walks(monkeypatch)
    seen = []

    def swap(m):
        seen.append(len(walks))
        m.settings.scale = 5.0

    with recorded_replays() as replayed:
        _, ckpt = _compare([None, None, None], [None, swap, None], make=Configured)
    assert replayed == ["block"] * 3
    assert seen == [0, 1]  # (the second call reused the first one's capture)
    assert ckpt.__wrapped__.settings.scale == 5.0  # the caller's value after backward


class SettingInSave(nn.Module):
    """A SAVE region's body that rebinds a setting the code after it reads."""

    def __init__(self):
        super().__init__()
        self.inner = Block()
        self.settings = Settings()

    def _body(self, x):
        self.settings.scale = self.settings.scale + 0.5
        return self.inner.fc1(x)

    def forward(self, x):
        h = remat.recompute_needs_tensor(remat.region(self._body, "body", recompute=False)(x))
        return self.inner.fc2(torch.tanh(h)) * self.settings.scale


def test_a_setting_a_save_regions_body_rebinds_is_seen_by_the_replay():
    plain, wrapped = SettingInSave(), SettingInSave()
    ckpt = remat.checkpoint(region_name="s")(wrapped)
    with recorded_replays() as replayed:
        for i in range(3):
            expected = _step(plain, _x(i))
            got = _step(_Call(wrapped, ckpt), _x(i))
            for e, g in zip(expected[0], got[0]):
                assert (e is None) == (g is None) and (e is None or torch.equal(e, g)), i
    assert replayed == ["s"] * 3
    assert wrapped.settings.scale == plain.settings.scale == 2.5


class _Mode(enum.Enum):
    SIN = 1
    TANH = 2


class _Pair(typing.NamedTuple):
    scale: float = 1.5
    shift: float = 0.25


@dataclasses.dataclass
class _Settings:
    power: float = 2.0


class _ReadsAnEnumAndANamedTuple(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(5, 5, dtype=D)
        self.mode = _Mode.TANH
        self.pair = _Pair()
        self.settings = _Settings()

    def forward(self, x):
        h = self.fc(x) * self.pair.scale + _Pair._field_defaults["shift"]
        h = h.pow(self.settings.power)
        return h.tanh() if self.mode is _Mode.TANH else h.sin()


def test_a_forward_reading_an_enum_a_named_tuple_and_a_dataclass_reuses_its_capture(monkeypatch):
    # The private attributes and generated methods of those classes (an enum's
    # member tables, a named tuple's field defaults, the set in the closure of a
    # dataclass's __repr__) are their machinery, not state the checkpoint must
    # record: recorded, every call walked again.
    walks = _walks(monkeypatch)
    with recorded_replays() as replayed:
        _, ckpt = _compare([None, None, None], make=_ReadsAnEnumAndANamedTuple)
    assert replayed == ["block"] * 3
    assert len(walks) == 1
