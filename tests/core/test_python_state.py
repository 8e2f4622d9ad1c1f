"""State that lives in Python rather than in tensors, read by a checkpointed function:
tensor attributes the forward rebinds from their own value, plain Python attributes
and closure values changed between a forward and its backward, and draws from
Python's ``random`` and NumPy's global generator. The replay sees what the forward
saw, and the module, the closure and the generators end where they would without
remat."""

import collections
import contextvars
import functools
import random
import threading
import types

import numpy as np
import pytest
import python_state_config as config
import state_pkg
import torch
from helpers import UnseenLog, recorded_replays
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import torch_remat as remat
from torch_remat.integrations import apply_remat

D = torch.float64

# what ran while recomputing (an UnseenLog: what a replay appends to a list is undone)
REPLAYS = UnseenLog()


def _x(seed, requires_grad=True):
    x = torch.randn(3, 6, dtype=D, generator=torch.Generator().manual_seed(seed))
    return x.requires_grad_(requires_grad)


def _linear(seed):
    lin = nn.Linear(6, 6, dtype=D)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(6, 6, dtype=D, generator=g))
        lin.bias.copy_(torch.randn(6, dtype=D, generator=g))
    return lin


def _same(expected, got):
    assert len(expected) == len(got)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert torch.equal(e, g), f"gradient {i} differs"


# ---------------------------------------------------------------- a tensor attribute the forward updates


class Centered(nn.Module):
    """Keeps a running centre as a plain tensor attribute (not a buffer), updated
    from its own value in forward and used in the compute."""

    def __init__(self):
        super().__init__()
        self.lin = _linear(1)
        self.center = torch.zeros(6, dtype=D)

    def forward(self, x):
        if remat.is_recomputing():
            REPLAYS.append("centered")
        h = self.lin(x)
        self.center = 0.9 * self.center + 0.1 * h.detach().mean(0)
        return (h - self.center).sin() * h


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.blk = Centered()

    def forward(self, x):
        return self.blk(x)


def _centered_steps(how):
    model = Outer()
    if how == "checkpoint":
        model.blk.forward = remat.checkpoint(region_name="blk")(model.blk.forward)
    elif how == "apply_remat":
        apply_remat(model, check_fn=lambda m: isinstance(m, Centered))
    grads, centers = [], []
    for step in range(3):
        x = _x(step)
        model(x).sum().backward()
        grads += [x.grad, model.blk.lin.weight.grad.clone()]
        centers.append(model.blk.center)
    return grads, centers


@pytest.mark.parametrize("how", ["checkpoint", "apply_remat"])
def test_a_tensor_attribute_the_forward_updates_from_its_own_value_is_replayed_from_its_entry_value(how):
    expected, expected_centers = _centered_steps("none")
    REPLAYS.clear()
    got, centers = _centered_steps(how)
    assert REPLAYS == ["centered"] * 3  # one replay per step
    _same(expected, got)
    _same(expected_centers, centers)  # updated once per step, as without remat


# ---------------------------------------------------------------- Python attributes between forward and backward


class Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = _linear(2)
        self.temperature = 1.0
        self.calls = 0

    def forward(self, x):
        if remat.is_recomputing():
            REPLAYS.append("tempered")
        self.calls += 1  # a counter the forward updates from its own value
        return (self.lin(x) / self.temperature).sin() * self.calls


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.blk = Tempered()

    def forward(self, x):
        return self.blk(x) * 2


def _micro_batches(how):
    """Two micro-batch forwards, each with its own temperature, then both backwards."""
    model = Holder()
    if how == "apply_remat":
        apply_remat(model, check_fn=lambda m: isinstance(m, Tempered))
    elif how == "checkpoint":
        model.blk.forward = remat.checkpoint(region_name="blk")(model.blk.forward)
    outs, xs = [], []
    for i, t in enumerate((0.5, 3.0)):
        model.blk.temperature = t
        xs.append(_x(10 + i))
        outs.append(model(xs[-1]))
    for out in outs:
        out.sum().backward()
    return model, [x.grad for x in xs] + [model.blk.lin.weight.grad]


@pytest.mark.parametrize("how", ["checkpoint", "apply_remat"])
def test_python_attributes_changed_between_forward_and_backward_are_replayed_as_the_forward_saw_them(how):
    _, expected = _micro_batches("none")
    REPLAYS.clear()
    model, got = _micro_batches(how)
    assert REPLAYS == ["tempered"] * 2
    _same(expected, got)
    # the caller's values are back after the replays
    assert model.blk.temperature == 3.0 and model.blk.calls == 2


def test_an_attribute_the_forward_adds_is_absent_in_the_replay_and_kept_afterwards():
    class Lazy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = _linear(3)

        def forward(self, x):
            if not hasattr(self, "scale"):  # set on the first forward only
                self.scale = 2.0
                return (self.lin(x) * 3).sin()
            return (self.lin(x) * self.scale).sin()

    def run(ckpt):
        m = Lazy()
        fn = remat.checkpoint(region_name="lazy")(m) if ckpt else m
        x = _x(0)
        with recorded_replays() as replayed:
            fn(x).sum().backward()
        assert replayed == (["lazy"] if ckpt else [])
        return m, [x.grad, m.lin.weight.grad]

    _, expected = run(False)
    m, got = run(True)
    _same(expected, got)
    assert m.scale == 2.0


def _closure_block(ckpt):
    w = _linear(4).weight.detach().requires_grad_()
    scale = 0.5

    def set_scale(s):
        nonlocal scale
        scale = s

    def block(x):
        return ((x @ w) * scale).sin() * x

    fn = remat.checkpoint(region_name="closure")(block) if ckpt else block
    return fn, set_scale, w


def test_a_closure_value_changed_between_forward_and_backward_is_replayed_as_the_forward_saw_it():
    fn, set_scale, w = _closure_block(True)
    outs, xs = [], []
    with recorded_replays() as replayed:
        for i, s in enumerate((0.5, 4.0)):
            set_scale(s)
            xs.append(_x(20 + i))
            outs.append(fn(xs[-1]))
        for out in outs:
            out.sum().backward()
    assert replayed == ["closure", "closure"]
    got = [x.grad for x in xs] + [w.grad]
    ref, ref_set, ref_w = _closure_block(False)
    expected = []
    for i, s in enumerate((0.5, 4.0)):
        ref_set(s)
        x = _x(20 + i)
        ref(x).sum().backward()
        expected.append(x.grad)
    _same(expected, got[:2])
    assert torch.equal(ref_w.grad, w.grad)


# ---------------------------------------------------------------- module-level variables

SCALE = 1.0  # rebound per micro-batch by the tests below


def _scaled(h):
    return (h * SCALE).tanh()


class ReadsAGlobal(nn.Module):
    """Its forward reads SCALE itself and through a module-level helper."""

    def __init__(self):
        super().__init__()
        self.lin = _linear(7)

    def forward(self, x):
        h = self.lin(x)
        return _scaled(h) * h + SCALE


def _two_micro_batches(fn, params):
    """Forward two micro-batches with SCALE 0.5 and 4.0, then both backwards, SCALE
    set to 9.0 in between: the gradients of the inputs and of ``params``."""
    global SCALE
    outs, xs = [], []
    for i, s in enumerate((0.5, 4.0)):
        SCALE = s
        xs.append(_x(30 + i))
        outs.append(fn(xs[-1]))
    SCALE = 9.0
    for out in outs:
        out.sum().backward()
    return [x.grad for x in xs] + [p.grad for p in params]


MODEL: nn.Module | None = None  # a model kept in a module-level variable


def _reads_the_global_model(x):
    return MODEL(x).tanh()


def test_a_model_in_a_module_level_variable_has_its_buffers_replayed_and_updated_once():
    # The function reads MODEL, a module-level variable: its batch norm's running
    # statistics and spectral norm's power-iteration vectors are updated in the
    # forward. Before, the replay updated them again and read them updated:
    # gradients off by 0.03, every buffer moved twice.
    global MODEL

    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.utils.spectral_norm(nn.Linear(6, 6)), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6)
        ).double().train()

    def run(ckpt):
        global MODEL
        MODEL = build()
        x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(7), requires_grad=True)
        fn = remat.checkpoint(region_name="global_model")(_reads_the_global_model) if ckpt else _reads_the_global_model
        with recorded_replays() as replayed:
            fn(x).sum().backward()
        state = {k: v.clone() for k, v in MODEL.state_dict().items()}
        return [x.grad] + [p.grad for p in MODEL.parameters()], state, replayed

    expected, expected_state, _ = run(False)
    actual, state, replayed = run(True)
    MODEL = None
    assert replayed == ["global_model"]
    assert len(actual) == len(expected) and all(torch.equal(a, e) for a, e in zip(actual, expected))
    assert state.keys() == expected_state.keys()
    assert all(torch.equal(state[k], expected_state[k]) for k in state)


@pytest.mark.parametrize("how", ["function", "module", "apply_remat"])
def test_a_module_level_variable_rebound_between_forward_and_backward_is_replayed_as_the_forward_saw_it(how):
    # Before, the replay read SCALE as the backward found it (9.0): wrong gradients,
    # silently (as under torch.utils.checkpoint).
    def build(ckpt):
        if how == "function":
            lin = _linear(7)

            def block(x):
                return _scaled(lin(x)) * SCALE

            fn = remat.checkpoint(region_name="global")(block) if ckpt else block
            return fn, list(lin.parameters())
        if how == "module":
            m = ReadsAGlobal()
            return (remat.checkpoint(region_name="global")(m) if ckpt else m), list(m.parameters())
        model = nn.Sequential(ReadsAGlobal())
        if ckpt:
            apply_remat(model, check_fn=lambda m: isinstance(m, ReadsAGlobal))
        return model, list(model.parameters())

    fn, params = build(True)
    with recorded_replays() as replayed:
        got = _two_micro_batches(fn, params)
    assert len(replayed) == 2
    assert SCALE == 9.0  # the caller's value, back after each replay
    ref, ref_params = build(False)
    _same(_two_micro_batches(ref, ref_params), got)


def _activation(h, scale=2.0):
    return (h * scale).tanh()


def _other_activation(h, scale=2.0):
    return (h * scale).sin()


class CallsAHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = _linear(11)

    def forward(self, x):
        return _activation(self.lin(x)) * x


def _other_method(self, h, scale=2.0):
    return (h * scale).sin()


def _forward_with_sin(self, x):
    return self.static_activation(self.activation(self.lin(x))).sin() * x


class CallsAMethod(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = _linear(11)

    def activation(self, h, scale=2.0):
        return (h * scale).tanh()

    @staticmethod
    def static_activation(h, scale=2.0):
        return (h * scale).tanh()

    def forward(self, x):
        return self.static_activation(self.activation(self.lin(x))) * x


class _Subclass(CallsAMethod):
    pass


@pytest.mark.parametrize(
    "how,what",
    [
        (how, what)
        for how in ["helper", "checkpointed function", "closure helper", "module", "apply_remat",
                    "method", "static method", "inherited method", "forward"]
        for what in ["code", "defaults"]
        if (how, what) != ("forward", "defaults")  # (a forward has no default that matters)
    ],
)
def test_a_function_given_another_body_or_defaults_before_backward_is_replayed_as_the_forward_ran_it(how, what):
    # A reloaded module (IPython's autoreload swaps __code__ in place) or a patched
    # helper between a forward and its backward: the replay ran the new body or
    # defaults, the gradients silently differed from the graph autograd recorded.
    # Now it runs the forward's, and the function ends as the caller left it.
    def change(f):
        if what == "code" and f in (CallsAMethod.forward, CallsAMethod.activation):
            f.__code__ = (_forward_with_sin if f is CallsAMethod.forward else _other_method).__code__
        elif what == "code":
            f.__code__ = _other_activation.__code__
        else:
            f.__defaults__ = (3.0,)

    def run(ckpt):
        lin = _linear(11)
        local = types.FunctionType(_activation.__code__, globals(), "local", _activation.__defaults__)
        params = list(lin.parameters())
        if how == "helper":
            target = _activation

            def fn(x):
                return _activation(lin(x)) * x
        elif how == "checkpointed function":
            fn = target = types.FunctionType(_activation.__code__, globals(), "block", _activation.__defaults__)
            params = []
        elif how == "closure helper":
            target = local

            def fn(x):
                return local(lin(x)) * x
        elif how in ("method", "static method", "forward", "inherited method"):
            # the class's function itself keeps its identity; its body is swapped
            cls = _Subclass if how == "inherited method" else CallsAMethod
            model = nn.Sequential(cls())
            target = {
                "static method": CallsAMethod.static_activation,
                "forward": CallsAMethod.forward,
            }.get(how, CallsAMethod.activation)
            params = list(model.parameters())
            fn = model
        else:
            model = CallsAHelper() if how == "module" else nn.Sequential(CallsAHelper())
            target, params = _activation, list(model.parameters())
            if ckpt and how == "apply_remat":
                apply_remat(model, check_fn=lambda m: isinstance(m, CallsAHelper))
            fn = model
        if ckpt and how != "apply_remat":
            fn = remat.checkpoint(region_name="helper")(fn)
        saved = target.__code__, target.__defaults__
        x = _x(41)
        try:
            with recorded_replays() as replayed:
                out = fn(x)
                change(target)
                out.sum().backward()
            after = target.__code__, target.__defaults__
        finally:
            target.__code__, target.__defaults__ = saved
        return [x.grad] + [p.grad for p in params], replayed, after

    expected, _, expected_after = run(False)
    got, replayed, after = run(True)
    assert replayed == ["helper" if how != "apply_remat" else "0"]
    assert after == expected_after  # as the caller left it
    _same(expected, got)


CALLS = 0  # counted in a SAVE region's body


def _count_and_project(lin, x):
    global CALLS
    CALLS += 1
    return lin(x)


def test_a_module_level_variable_a_save_regions_body_rebinds_is_replayed_as_the_body_left_it():
    # The replay skips the SAVE body; the code after it reads CALLS as the body left
    # it in the forward. Before, it read the entry value: 0 where the forward read 1.
    global CALLS
    lin = _linear(11)

    def block(x):
        h = remat.region(_count_and_project, "count", recompute=False)(lin, x)
        remat.recompute_needs_tensor(h)  # read again by the replayed product
        return (h * CALLS).tanh()

    def run(fn):
        global CALLS
        CALLS = 0
        x = _x(60)
        fn(x).sum().backward()
        return [x.grad, *(p.grad for p in lin.parameters())]

    expected = run(block)
    lin.zero_grad()
    with recorded_replays() as replayed:
        got = run(remat.checkpoint(region_name="counts")(block))
    assert replayed == ["counts"]
    assert CALLS == 1  # once: the replay skips the body
    _same(expected, got)


class Settings:
    """A plain object of the user's (a config) the model reads its scale from."""

    def __init__(self):
        self.scale = 1.0


class ReadsAnObject(nn.Module):
    """Reads a scale from a config object it holds and one from its class."""

    factor = 1.0

    def __init__(self, settings):
        super().__init__()
        self.lin = _linear(9)
        self.settings = settings

    def forward(self, x):
        h = self.lin(x)
        return (h * self.settings.scale).tanh() * (h * self.factor).sin()


class ScaledCall:
    """A callable object (not a module) holding a module and a scale."""

    def __init__(self):
        self.lin = _linear(10)
        self.scale = 1.0

    def __call__(self, x):
        return (self.lin(x) * self.scale).tanh()


@pytest.mark.parametrize("where", ["config object", "class attribute", "callable object"])
def test_an_attribute_of_an_object_or_class_rebound_between_forward_and_backward_is_replayed_as_the_forward_saw_it(
    where,
):
    # Before, the replay read the value the backward found: wrong gradients,
    # silently (as under torch.utils.checkpoint).
    def build(ckpt):
        if where == "callable object":
            obj = ScaledCall()

            def set_to(v):
                obj.scale = v

            fn, params = obj, list(obj.lin.parameters())
        else:
            m = ReadsAnObject(Settings())

            def set_to(v):
                if where == "config object":
                    m.settings.scale = v
                else:
                    ReadsAnObject.factor = v

            fn, params = m, list(m.parameters())
        return (remat.checkpoint(region_name="object")(fn) if ckpt else fn), params, set_to

    def run(ckpt):
        fn, params, set_to = build(ckpt)
        outs, xs = [], []
        for i, s in enumerate((0.5, 4.0)):
            set_to(s)
            xs.append(_x(50 + i))
            outs.append(fn(xs[-1]))
        set_to(9.0)
        for out in outs:
            out.sum().backward()
        return [x.grad for x in xs] + [p.grad for p in params]

    try:
        with recorded_replays() as replayed:
            got = run(True)
        assert len(replayed) == 2
        assert ReadsAnObject.factor == (9.0 if where == "class attribute" else 1.0)
        _same(run(False), got)
    finally:
        ReadsAnObject.factor = 1.0


NOISE = torch.Generator().manual_seed(3)  # a module-level generator the code draws from


def test_a_module_level_generator_is_forked_around_the_replay():
    # Before, the replay drew again from NOISE: other noise than the forward's,
    # wrong gradients, and the generator one draw further than without remat.
    lin = _linear(8)

    def block(x):
        h = lin(x)
        return h * torch.rand(h.shape, dtype=D, generator=NOISE)

    def step(fn):
        NOISE.manual_seed(3)
        x = _x(40)
        fn(x).sum().backward()
        return [x.grad, *(p.grad for p in lin.parameters())], NOISE.get_state()

    expected, state = step(block)
    lin.zero_grad()
    with recorded_replays() as replayed:
        got, got_state = step(remat.checkpoint(region_name="noise")(block))
    assert replayed == ["noise"]
    _same(expected, got)
    assert torch.equal(state, got_state)


# ---------------------------------------------------------------- Python's random and NumPy's generator


class Jittered(nn.Module):
    def __init__(self, draw):
        super().__init__()
        self.lin = _linear(5)
        self.draw = draw

    def forward(self, x):
        if remat.is_recomputing():
            REPLAYS.append("jittered")
        h = self.lin(x)
        return (h * (1 + 0.1 * self.draw())).sin() * h


DRAWS = {
    "random.random": random.random,
    "random.gauss": lambda: random.gauss(0.0, 1.0),  # caches every other value (gauss_next)
    "np.random.rand": lambda: float(np.random.rand()),
    "np.random.randn": lambda: float(np.random.randn()),  # NumPy's cached gaussian
}


def _seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)


def _jittered_steps(draw, how, gauss_first):
    model = nn.Sequential(Jittered(DRAWS[draw]), Jittered(DRAWS[draw]))
    if how == "apply_remat":
        apply_remat(model, check_fn=lambda m: isinstance(m, Jittered))
    _seed_all(0)
    if gauss_first:  # leave a cached gaussian in both generators
        random.gauss(0.0, 1.0)
        np.random.randn()
    grads = []
    for step in range(2):
        x = _x(30 + step)
        model(x).sum().backward()
        grads += [x.grad, model[0].lin.weight.grad.clone(), model[1].lin.weight.grad.clone()]
    # where the caller's streams stand
    return grads, (random.random(), random.gauss(0.0, 1.0), float(np.random.rand()), float(np.random.randn()))


@pytest.mark.parametrize("gauss_first", [False, True])
@pytest.mark.parametrize("draw", sorted(DRAWS))
def test_python_and_numpy_random_draws_in_forward_are_replayed_exactly_with_fork_semantics(draw, gauss_first):
    expected, expected_streams = _jittered_steps(draw, "none", gauss_first)
    REPLAYS.clear()
    got, streams = _jittered_steps(draw, "apply_remat", gauss_first)
    assert REPLAYS == ["jittered"] * 4
    _same(expected, got)
    assert streams == expected_streams  # the replay did not move the caller's streams


def test_a_draw_inside_a_save_region_is_not_replayed_and_later_draws_are():
    def body(x):
        a = remat.region(lambda t: t * random.random(), "jitter", recompute=False)(x)
        a = remat.recompute_needs_tensor(a)
        return (a * random.random()).sin() * x

    def run(ckpt):
        random.seed(7)
        x = _x(40)
        fn = remat.checkpoint(region_name="blk")(body) if ckpt else body
        with recorded_replays() as replayed:
            fn(x).sum().backward()
        assert replayed == (["blk"] if ckpt else [])  # the later draw was replayed
        return x.grad, random.random()

    expected, after = run(False)
    got, got_after = run(True)
    assert torch.equal(expected, got)
    assert after == got_after


def test_a_closure_value_of_a_checkpointed_modules_forward_is_replayed_as_the_forward_saw_it():
    def make():
        scale = 0.5

        class Scaled(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = _linear(6)

            def forward(self, x):
                return (self.lin(x) * scale).sin() * x

        def set_scale(s):
            nonlocal scale
            scale = s

        return Scaled(), set_scale

    def run(ckpt):
        m, set_scale = make()
        fn = remat.checkpoint(region_name="scaled")(m) if ckpt else m
        outs, xs = [], []
        with recorded_replays() as replayed:
            for i, s in enumerate((0.5, 4.0)):
                set_scale(s)
                xs.append(_x(50 + i))
                outs.append(fn(xs[-1]))
            for out in outs:
                out.sum().backward()
        assert replayed == (["scaled", "scaled"] if ckpt else [])
        return [x.grad for x in xs] + [m.lin.weight.grad]

    _same(run(False), run(True))


def test_an_attribute_a_save_region_rebinds_is_read_after_it_as_the_body_left_it():
    # The replay skips the SAVE region's body: the code after it must still read the
    # counter as the body left it (2, not 1), and the module ends as without remat.
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0
            self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))

        def count(self, t):
            self.calls += 1
            return t * self.calls

        def forward(self, x):
            a = remat.region(lambda t: self.count(t * self.w).sin(), "counted", recompute=False)(x)
            remat.recompute_needs_tensor(a)
            return self.count(a).sin().sum()

    results = []
    for checkpointed in (False, True):
        m = Counting()
        x = torch.arange(3.0, dtype=torch.float64).requires_grad_()
        f = remat.checkpoint(region_name="p")(m) if checkpointed else m
        with recorded_replays() as replayed:
            f(x).backward()
        results.append((x.grad, m.w.grad, m.calls, replayed))
    (gx, gw, calls, _), (cx, cw, ccalls, creplayed) = results
    assert creplayed == ["p"]
    assert torch.equal(cx, gx) and torch.equal(cw, gw)
    assert ccalls == calls == 2


@pytest.mark.parametrize("where", ["module attribute", "module-level variable", "closure value"])
def test_a_value_the_code_before_a_save_region_set_and_its_body_set_back_is_replayed(where):
    # Before: the look where a SAVE body returns compared with the last look (the
    # checkpoint's entry or the previous region's return), where the value was the
    # same: nothing recorded, and the replay, skipping the body, read the value the
    # code before it set (silently different gradients).
    def run(ckpt):
        global SET_BEFORE_SCALE
        one = float("1")  # the value at entry, which the body sets back (the same object)
        SET_BEFORE_SCALE = one
        lin = _linear(93)
        holder = nn.Module()
        holder.scale = one
        scale = one

        def set_scale(value):
            nonlocal scale
            global SET_BEFORE_SCALE
            if where == "module attribute":
                holder.scale = value
            elif where == "module-level variable":
                SET_BEFORE_SCALE = value
            else:
                scale = value

        def block(x):
            nonlocal scale
            set_scale(2.0)

            def body(t):
                set_scale(one)  # back to the value at the checkpoint's entry
                return lin(t)

            h = remat.recompute_needs_tensor(remat.region(body, "body", recompute=False)(x))
            now = {"module attribute": holder.scale, "module-level variable": SET_BEFORE_SCALE,
                   "closure value": scale}[where]
            return (h * now).sin()

        fn = remat.checkpoint(region_name="toggling")(block) if ckpt else block
        x = _x(94)
        fn(x).sum().backward()
        return [x.grad, *(p.grad for p in lin.parameters())]

    expected = run(False)
    with recorded_replays() as replayed:
        got = run(True)
    assert replayed == ["toggling"]
    _same(expected, got)


SET_BEFORE_SCALE = 1.0


@pytest.mark.parametrize("case", ["caller resets the counter before backward", "body sets back a value"])
def test_what_the_replay_writes_is_undone_where_the_caller_holds_the_entry_value(case):
    # Before: the replay's writes were undone only where the caller's value differed
    # from the one at the checkpoint's entry; a counter the caller reset to that
    # value read 1 after backward (and the next step's forward read it).
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.lin = _linear(95), _linear(96)
            self.calls = 0
            self.scale = 1.0

        def forward(self, x):
            self.calls = self.calls + 1
            h = self.pre(x).tanh() * self.calls * self.scale
            old = self.scale
            if case.startswith("body"):
                self.scale = 2.0

            def body(t):
                self.scale = old
                return self.lin(t).tanh()

            return remat.region(body, "lin", recompute=False)(h)

    def run(ckpt):
        m = Counting()
        fn = remat.checkpoint(region_name="counting")(m) if ckpt else m
        out = []
        for step in range(2):
            x = _x(97 + step)
            loss = fn(x).sin().sum()
            if case.startswith("caller"):
                m.calls = 0
            loss.backward()
            out.extend([x.grad, *(p.grad.clone() for p in m.parameters())])
            m.zero_grad()
            assert (m.calls, m.scale) == ((0 if case.startswith("caller") else step + 1), 1.0)
        return out

    expected = run(False)
    with recorded_replays() as replayed:
        got = run(True)
    assert replayed == ["counting"] * 2
    _same(expected, got)


# ---------------------------------------------------------------- tensors in dict attributes


class _Carry(nn.Module):
    """A block that carries a hidden state between calls in a dict slot: each
    forward reads the slot and puts its own state there."""

    def __init__(self):
        super().__init__()
        self.lin = _linear(5)
        self.state = {"h": torch.zeros(3, 6, dtype=D)}

    def forward(self, x):
        h = (self.lin(x) + self.state["h"]).tanh()
        self.state["h"] = h.detach() * 0.5
        return self.lin(h).sin()


def _two_steps(make, ckpt, seed):
    """Two calls of a fresh ``make()`` module, each with its backward (the second
    reads what the first left): the module and the gradients."""
    m = make()
    fn = remat.checkpoint(region_name="stateful")(m) if ckpt else m
    grads = []
    with recorded_replays() as replayed:
        for i in range(2):
            x = _x(seed + i)
            fn(x).sum().backward()
            grads.append(x.grad)
    assert replayed == (["stateful", "stateful"] if ckpt else [])
    return m, grads + [m.lin.weight.grad]


def test_a_tensor_in_a_dict_attribute_the_forward_replaces_is_the_entry_one_in_the_replay():
    # Before, the replay read the state its own forward had put in the slot:
    # silently wrong gradients (as with torch.utils.checkpoint).
    plain, expected = _two_steps(_Carry, False, 30)
    m, got = _two_steps(_Carry, True, 30)
    _same(expected, got)
    # the caller's state is back after each replay
    assert torch.equal(m.state["h"], plain.state["h"])


def test_a_tensor_the_caller_puts_in_a_dict_attribute_after_the_forward_is_back_after_the_replay():
    m = _Carry()
    entry = m.state["h"]
    mine = torch.ones(3, 6, dtype=D)
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="carry")(m)(_x(40))
        m.state["h"] = mine
        m.state["new"] = mine
        out.sum().backward()
    assert replayed == ["carry"]
    assert m.state["h"] is mine and m.state["new"] is mine and entry is not mine


# ---------------------------------------------------------------- lists, dicts and sets changed in place


class _History(nn.Module):
    """Reads the last state of a list attribute and appends its own; counts its
    calls in a dict and records the calls it saw in a set."""

    def __init__(self):
        super().__init__()
        self.lin = _linear(7)
        self.hist = [torch.zeros(3, 6, dtype=D)]
        self.counts = {"calls": 0}
        self.steps = set()

    def forward(self, x):
        self.counts["calls"] += 1
        self.steps.add(self.counts["calls"])
        h = (self.lin(x) + self.hist[-1] * self.counts["calls"]).tanh()
        self.hist.append(h.detach())
        return self.lin(h).sin()


def test_a_list_a_dict_and_a_set_the_forward_changes_are_replayed_from_their_entry_contents():
    # Before, the replay read the state its own forward had appended and the count
    # it had raised: silently wrong gradients (as with torch.utils.checkpoint).
    plain, expected = _two_steps(_History, False, 70)
    m, got = _two_steps(_History, True, 70)
    _same(expected, got)
    # a counter counts once per call, a set holds what the forward added and a list
    # the forward's entries: what the replay changed is undone, as without remat
    assert m.counts == plain.counts == {"calls": 2}
    assert m.steps == plain.steps == {1, 2}
    assert len(plain.hist) == len(m.hist) == 3
    assert all(torch.equal(a, b) for a, b in zip(plain.hist, m.hist))


def test_a_closure_list_the_forward_reads_and_extends_is_replayed_from_its_entry_contents():
    def run(ckpt):
        lin, seen = _linear(8), []

        def block(x):
            seen.append(remat.is_recomputing())
            return (lin(x) * len(seen)).sin()

        fn = remat.checkpoint(region_name="closure_list")(block) if ckpt else block
        x = _x(80)
        with recorded_replays() as replayed:
            fn(x).sum().backward()
        assert replayed == (["closure_list"] if ckpt else [])
        return seen, [x.grad, lin.weight.grad]

    expected_seen, expected = run(False)
    seen, got = run(True)
    _same(expected, got)
    assert seen == expected_seen == [False]  # the replay's entry is undone


def test_contents_the_caller_changes_after_the_forward_are_kept_through_the_replay():
    m = _History()
    entry = m.hist[0]
    mine = torch.ones(3, 6, dtype=D)
    with recorded_replays() as replayed:
        out = remat.checkpoint(region_name="hist")(m)(_x(90))
        m.hist[:] = [mine]
        m.counts["calls"] = 10
        m.counts["logged"] = True
        out.sum().backward()
    assert replayed == ["hist"]
    # the replay read the entry contents; what it appended is undone and the
    # caller's values are where the caller put them
    assert len(m.hist) == 1 and m.hist[0] is mine and entry is not mine
    assert m.counts == {"calls": 10, "logged": True}


# ------------------------------------- containers end as the caller left them when backward starts
#
# Without remat, backward changes no container: each holds what the caller left in
# it. The replay's changes (the forward's code run again on the entry contents, a
# SAVE body's changes done again where the replay skips it) are undone as its
# attribute writes are. Before, they were merged into the caller's contents: a key
# or member the caller removed before backward was back, an entry a SAVE body
# appended was there twice, and the next step read it (silently different gradients).

# (where a SAVE region's body appends to the list, and what the code around it does)
BODY_CASES = ("body appends, the code after it rebinds that entry", "body sets an entry back and appends",
              "body appends and is run again by the replay")
CALLER_CASES = ("caller pops the key the forward set", "caller discards the member the forward added",
                "caller appends to the list", "caller clears the dict")


class _Kept(nn.Module):
    """Reads and changes a dict, a set and a list it holds, around a SAVE region."""

    def __init__(self, case):
        super().__init__()
        self.case = case
        self.pre, self.r0 = _linear(31), _linear(32)
        self.cache = {"k": 1.0}
        self.flags = {"base"}
        self.aux = [1.0]

    def forward(self, x):
        case = self.case
        scale = (len(self.aux) + self.aux[-1] + self.cache.get("bias", 0.5) + len(self.cache)
                 + (2.0 if "warm" in self.flags else 0.5))
        h = self.pre(x).tanh() * scale
        self.cache["bias"] = 2.0
        self.flags.add("warm")
        if case not in BODY_CASES:
            self.aux.append(float(len(self.aux)))
        gen = torch.Generator().manual_seed(3)
        old = self.aux[-1]
        if case == "body sets an entry back and appends":
            self.aux[-1] = 0.5

        def body(t):
            if case == "body sets an entry back and appends":
                self.aux[-1] = old
            if case == "body appends and is run again by the replay":
                # (a draw from a generator the forward made: the replay runs the body)
                t = t * torch.rand((), dtype=D, generator=gen)
            if case in BODY_CASES:
                self.aux.append(2.0)
            return self.r0(t).tanh()

        out = remat.recompute_needs_tensor(remat.region(body, "r0", recompute=False)(h))
        if case == "body appends, the code after it rebinds that entry":
            self.aux[-1] = self.aux[-1] * 3.0
        return (out * 1.5).sin()  # (saves a dropped tensor: the replay runs past the region)


def _caller_changes(m, case):
    """What the caller does between the forward and backward."""
    if case == "caller pops the key the forward set":
        m.cache.pop("bias", None)
    elif case == "caller discards the member the forward added":
        m.flags.discard("warm")
    elif case == "caller appends to the list":
        m.aux.append(-1.0)
    elif case == "caller clears the dict":
        m.cache.clear()


def _contents_of(m):
    return dict(m.cache), set(m.flags), list(m.aux)


def _kept_steps(case, ckpt, steps=2):
    """``steps`` forwards and backwards of a fresh :class:`_Kept`: per step the loss,
    the gradients and the containers' contents after backward."""
    m = _Kept(case)
    fn = remat.checkpoint(region_name="kept")(m) if ckpt else m
    out = []
    with recorded_replays() as replayed:
        for step in range(steps):
            x = _x(33 + step)
            m.zero_grad(set_to_none=True)
            loss = fn(x).sum()
            _caller_changes(m, case)
            loss.backward()
            out.append((loss.detach(), [x.grad, *(p.grad for p in m.parameters())], _contents_of(m)))
    assert replayed == (["kept"] * steps if ckpt else [])
    return out


def _same_steps(expected, got):
    assert len(expected) == len(got)
    for step, ((loss_e, grads_e, contents_e), (loss_g, grads_g, contents_g)) in enumerate(zip(expected, got)):
        assert contents_g == contents_e, f"step {step}: the containers differ"
        assert torch.equal(loss_e, loss_g), f"step {step}: the loss differs"
        _same(grads_e, grads_g)


@pytest.mark.parametrize("case", CALLER_CASES + BODY_CASES)
def test_containers_end_as_the_caller_left_them_when_backward_started(case):
    _same_steps(_kept_steps(case, False), _kept_steps(case, True))


@pytest.mark.parametrize("backward", ["twice, retaining the graph", "on another thread"])
def test_containers_the_caller_changes_before_each_backward_end_as_the_caller_left_them(backward):
    def run(ckpt):
        m = _Kept("caller appends to the list")
        fn = remat.checkpoint(region_name="kept")(m) if ckpt else m
        x = _x(35)
        loss = fn(x).sum()
        m.cache.pop("bias")
        m.aux.append(-1.0)
        seen = []
        if backward.startswith("twice"):
            loss.backward(retain_graph=True)
            seen.append(_contents_of(m))
            m.flags.discard("warm")
            m.aux.append(-2.0)
            loss.backward()
        else:
            _backward_on("another thread", loss)
        seen.append(_contents_of(m))
        return seen, [x.grad, *(p.grad for p in m.parameters())]

    expected_contents, expected = run(False)
    with recorded_replays() as replayed:
        got_contents, got = run(True)
    assert replayed == ["kept"] * (2 if backward.startswith("twice") else 1)
    assert got_contents == expected_contents
    _same(expected, got)


# (an op on one of the containers: a list, a dict or a set)
_CONTAINER_OPS = st.sampled_from((
    "list append", "list pop", "list set last", "list clear", "list extend",
    "dict set", "dict pop", "dict clear", "set add", "set discard",
))


def _container_op(m, op, n):
    """Do ``op`` with the number ``n`` (a key, a value) to ``m``'s containers."""
    aux, cache, flags = m.aux, m.cache, m.flags
    if op == "list append":
        aux.append(float(n))
    elif op == "list pop":
        if aux:
            aux.pop()
    elif op == "list set last":
        if aux:
            aux[-1] = float(n)
    elif op == "list clear":
        aux.clear()
    elif op == "list extend":
        aux.extend([float(n), float(n + 1)])
    elif op == "dict set":
        cache[n % 3] = float(n)
    elif op == "dict pop":
        cache.pop(n % 3, None)
    elif op == "dict clear":
        cache.clear()
    elif op == "set add":
        flags.add(n % 4)
    else:
        flags.discard(n % 4)


class _RandomlyKept(nn.Module):
    """Reads its containers and changes them with ``ops``: before a SAVE region, in
    its body (``rerun``: one the replay runs again) and after it."""

    def __init__(self, ops, rerun):
        super().__init__()
        self.ops, self.rerun = ops, rerun
        self.pre, self.r0 = _linear(36), _linear(37)
        self.aux, self.cache, self.flags = [1.0], {0: 1.0}, {0}

    def _read(self):
        return 1.0 + 0.1 * (len(self.aux) + sum(self.aux) + sum(self.cache.values()) + sum(self.flags))

    def _do(self, where):
        for op, n in self.ops[where]:
            _container_op(self, op, n)

    def forward(self, x):
        h = self.pre(x).tanh() * self._read()
        self._do("before")
        gen = torch.Generator().manual_seed(5)

        def body(t):
            if self.rerun:
                t = t * torch.rand((), dtype=D, generator=gen)
            t = t * self._read()
            self._do("body")
            return self.r0(t).tanh()

        out = remat.recompute_needs_tensor(remat.region(body, "r0", recompute=False)(h))
        out = out * self._read()
        self._do("after")
        return (out * self._read()).sin()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.fixed_dictionaries({
        where: st.lists(st.tuples(_CONTAINER_OPS, st.integers(0, 5)), max_size=4)
        for where in ("before", "body", "after", "caller")
    }),
    rerun=st.booleans(),
    twice=st.booleans(),
)
def test_random_container_changes_end_as_without_remat(ops, rerun, twice):
    def run(ckpt):
        m = _RandomlyKept(ops, rerun)
        fn = remat.checkpoint(region_name="random_kept")(m) if ckpt else m
        out = []
        for step in range(2):
            x = _x(38 + step)
            m.zero_grad(set_to_none=True)
            loss = fn(x).sum()
            for op, n in ops["caller"]:
                _container_op(m, op, n + step)
            if twice:
                loss.backward(retain_graph=True)
                out.append((loss.detach(), [], _contents_of(m)))
                _container_op(m, "list append", 9)
            loss.backward()
            out.append((loss.detach(), [x.grad, *(p.grad for p in m.parameters())], _contents_of(m)))
        return out

    expected = run(False)
    with recorded_replays() as replayed:
        got = run(True)
    assert len(replayed) == (4 if twice else 2)
    _same_steps(expected, got)


# ------------------------------------------- generator objects, nested and slotted state, hooks
#
# Each case: two micro-batches whose forwards see different state (changed after
# each forward), then both backwards; gradients and the state where the step ends
# must equal those without remat. Before, each gave wrong gradients, silently (as
# under torch.utils.checkpoint), and the generator cases left the generator one
# draw further than without remat.

HOOK_SCALE = {"scale": 1.0}  # a module-level dict a forward hook reads
PRE_HOOK_SCALE = 1.0  # a module-level number a forward pre-hook reads


class _Slotted:
    __slots__ = ("scale",)

    def __init__(self):
        self.scale = 1.0


class _Draws(random.Random):
    """A user's subclass of Python's generator."""


class _Scaler:
    def __init__(self):
        self.scale = 1.0

    def apply(self, t):
        return t * self.scale


class _ClassTable(nn.Module):
    """A class attribute holding a list (a table shared by the class's instances)."""

    scales = [1.0]


class StateCase(nn.Module):
    """A block whose forward multiplies by a value read from the state ``kind``
    names, then applies sin (so the replay's saved tensors depend on it)."""

    def __init__(self, kind):
        super().__init__()
        global PRE_HOOK_SCALE
        self.kind = kind
        self.lin = _linear(21)
        if kind == "random.Random attribute":
            self.rng = random.Random(5)
        elif kind == "random.Random subclass, gauss":
            self.rng = _Draws(5)
        elif kind == "numpy Generator attribute":
            self.rng = np.random.default_rng(5)
        elif kind == "numpy RandomState attribute":
            self.rng = np.random.RandomState(5)
        elif kind == "generator in a config object":
            self.cfg = types.SimpleNamespace(rng=random.Random(5))
        elif kind == "object two attributes away":
            self.cfg = types.SimpleNamespace(inner=types.SimpleNamespace(scale=1.0))
        elif kind == "slotted object":
            self.cfg = _Slotted()
        elif kind == "list in a dict attribute":
            self.cfg = {"scales": [1.0]}
        elif kind == "forward hook reading a module-level dict":
            HOOK_SCALE["scale"] = 1.0
            self.lin.register_forward_hook(lambda mod, args, out: out * HOOK_SCALE["scale"])
        elif kind == "forward pre-hook reading a module-level number":
            PRE_HOOK_SCALE = 1.0
            self.lin.register_forward_pre_hook(lambda mod, args: (args[0] * PRE_HOOK_SCALE,))
        elif kind == "forward hook reading its closure":
            box = types.SimpleNamespace(scale=1.0)
            self.set_box = lambda v: setattr(box, "scale", v)
            self.lin.register_forward_hook(lambda mod, args, out: out * box.scale)
        elif kind == "lambda attribute reading its closure's dict":
            table = {"scale": 1.0}
            self.table = None
            self.scaled = lambda t: t * table["scale"]
            self.set_table = lambda v: table.__setitem__("scale", v)
        elif kind == "bound method of an object":
            self.scaled = _Scaler().apply
        elif kind == "functools.partial keyword":
            self.scaled = functools.partial(torch.mul, other=1.0)
        elif kind == "class attribute list":
            _ClassTable.scales[0] = 1.0
            self.table = _ClassTable()

    def value(self):
        k = self.kind
        if k in ("random.Random attribute", "numpy Generator attribute"):
            return float(self.rng.random())
        if k == "random.Random subclass, gauss":
            return self.rng.gauss(0.0, 1.0)
        if k == "numpy RandomState attribute":
            return float(self.rng.rand())
        if k == "generator in a config object":
            return self.cfg.rng.random()
        if k == "object two attributes away":
            return self.cfg.inner.scale
        if k == "slotted object":
            return self.cfg.scale
        if k == "list in a dict attribute":
            return self.cfg["scales"][0]
        if k == "class attribute list":
            return self.table.scales[0]
        return 1.0

    def change(self, i):
        """Between the micro-batches (the generators move by themselves)."""
        global PRE_HOOK_SCALE
        v = 3.0 + i
        k = self.kind
        if k == "object two attributes away":
            self.cfg.inner.scale = v
        elif k == "slotted object":
            self.cfg.scale = v
        elif k == "list in a dict attribute":
            self.cfg["scales"][0] = v
        elif k == "forward hook reading a module-level dict":
            HOOK_SCALE["scale"] = v
        elif k == "forward pre-hook reading a module-level number":
            PRE_HOOK_SCALE = v
        elif k == "forward hook reading its closure":
            self.set_box(v)
        elif k == "lambda attribute reading its closure's dict":
            self.set_table(v)
        elif k == "bound method of an object":
            self.scaled.__self__.scale = v
        elif k == "functools.partial keyword":
            self.scaled.keywords["other"] = v
        elif k == "class attribute list":
            _ClassTable.scales[0] = v

    def generator_state(self):
        rng = getattr(self, "rng", None) or getattr(getattr(self, "cfg", None), "rng", None)
        if rng is None:
            return None
        if isinstance(rng, random.Random):
            return rng.getstate()
        if isinstance(rng, np.random.Generator):
            return str(rng.bit_generator.state)
        return rng.get_state()[1].tobytes()

    def forward(self, x):
        h = self.lin(x)
        scaled = getattr(self, "scaled", None)
        if scaled is not None:
            h = scaled(h)
        return (h * (1 + self.value())).sin()


STATE_CASES = [
    "random.Random attribute", "random.Random subclass, gauss", "numpy Generator attribute",
    "numpy RandomState attribute", "generator in a config object", "object two attributes away",
    "slotted object", "list in a dict attribute", "forward hook reading a module-level dict",
    "forward pre-hook reading a module-level number", "forward hook reading its closure",
    "lambda attribute reading its closure's dict", "bound method of an object",
    "functools.partial keyword", "class attribute list",
]


@pytest.mark.parametrize("kind", STATE_CASES)
def test_state_behind_generators_nested_objects_slots_and_hooks_is_replayed_as_the_forward_saw_it(kind):
    def run(ckpt):
        m = StateCase(kind)
        fn = remat.checkpoint(region_name="state")(m) if ckpt else m
        xs = [_x(60 + i) for i in range(2)]
        outs = []
        for i, x in enumerate(xs):
            outs.append(fn(x))
            m.change(i)
        sum(o.sum() for o in outs).backward()
        return [x.grad for x in xs] + [p.grad for p in m.parameters()], m.generator_state()

    expected, expected_state = run(False)
    with recorded_replays() as replayed:
        got, got_state = run(True)
    assert replayed == ["state", "state"]
    _same(expected, got)
    if isinstance(expected_state, bytes):
        assert got_state == expected_state
    else:
        assert got_state == expected_state, "the generator does not end where it would without remat"


GLOBAL_TABLE = {"scale": 1.0}  # a small module-level dict the function reads


def test_the_contents_of_a_small_module_level_dict_are_replayed_as_the_forward_saw_them():
    lin = _linear(22)

    def block(x):
        return (lin(x) * GLOBAL_TABLE["scale"]).sin()

    def run(fn):
        GLOBAL_TABLE["scale"] = 1.0
        xs = [_x(70 + i) for i in range(2)]
        outs = []
        for i, x in enumerate(xs):
            outs.append(fn(x))
            GLOBAL_TABLE["scale"] = 2.0 + i
        sum(o.sum() for o in outs).backward()
        grads = [x.grad for x in xs] + [p.grad.clone() for p in lin.parameters()]
        lin.zero_grad()
        return grads

    expected = run(block)
    with recorded_replays() as replayed:
        got = run(remat.checkpoint(region_name="table")(block))
    assert replayed == ["table", "table"]
    _same(expected, got)
    assert GLOBAL_TABLE == {"scale": 3.0}  # the caller's contents after the replays


@pytest.mark.parametrize("kind", ["random.Random", "numpy Generator"])
def test_a_generator_objects_draw_inside_a_save_region_is_not_replayed_and_later_draws_are(kind):
    # The replay skips the SAVE body and starts the draw after it from where the
    # body left the generator.
    lin = _linear(23)

    def make():
        return random.Random(7) if kind == "random.Random" else np.random.default_rng(7)

    def run(ckpt):
        rng = make()

        def body(x):
            a = remat.region(lambda t: lin(t) * float(rng.random()), "jitter", recompute=False)(x)
            a = remat.recompute_needs_tensor(a)
            return (a * float(rng.random())).sin() * x

        x = _x(41)
        fn = remat.checkpoint(region_name="blk")(body) if ckpt else body
        with recorded_replays() as replayed:
            fn(x).sum().backward()
        assert replayed == (["blk"] if ckpt else [])
        grads = [x.grad] + [p.grad.clone() for p in lin.parameters()]
        lin.zero_grad()
        return grads, float(rng.random())

    expected, after = run(False)
    got, got_after = run(True)
    _same(expected, got)
    assert after == got_after  # the generator ends where it would without remat


# ------------------------------------------- arguments, imported modules, classes named in code
#
# State the function reaches other than through its modules and closure: an
# attribute of a module it imported (a config module), a plain object passed as an
# argument, a class attribute read through the class's name (a classmethod), a
# module-level dict read by a custom autograd Function's forward. Each gave wrong
# gradients, silently, before.


class _Config:
    def __init__(self):
        self.scale = 1.0


class _ClassScale:
    scale = 1.0

    @classmethod
    def apply(cls, t):
        return t * cls.scale


FUNCTION_TABLE = {"k": 1.0}


class _TableMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        ctx.k = FUNCTION_TABLE["k"]
        return t * FUNCTION_TABLE["k"]

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k


REACHED_CASES = [
    "attribute of an imported module", "dict in an imported module", "plain object argument",
    "class attribute through a classmethod", "dict read by an autograd.Function",
]


@pytest.mark.parametrize("kind", REACHED_CASES)
def test_state_reached_through_arguments_imported_modules_and_named_classes_is_replayed(kind):
    lin = _linear(23)

    def scale(h, c):
        if kind == "attribute of an imported module":
            return h * config.SCALE
        if kind == "dict in an imported module":
            return h * config.TABLE["k"]
        if kind == "class attribute through a classmethod":
            return _ClassScale.apply(h)
        if kind == "dict read by an autograd.Function":
            return _TableMul.apply(h)
        return h * c.scale  # (the object reaches the function only as an argument)

    def block(x, c):
        return scale(lin(x), c).sin()

    def change(v):
        config.SCALE = config.TABLE["k"] = _ClassScale.scale = FUNCTION_TABLE["k"] = v
        for c in configs:
            c.scale = v

    configs = []

    def run(fn):
        configs[:] = [_Config()]
        change(1.0)
        lin.zero_grad()
        xs = [_x(80 + i) for i in range(2)]
        outs = []
        for i, x in enumerate(xs):
            outs.append(fn(x, configs[0]))
            change(3.0 + i)
        sum(o.sum() for o in outs).backward()
        return [x.grad for x in xs] + [p.grad.clone() for p in lin.parameters()]

    try:
        expected = run(block)
        with recorded_replays() as replayed:
            got = run(remat.checkpoint(region_name="reached")(block))
    finally:
        change(1.0)
    assert replayed == ["reached", "reached"]
    _same(expected, got)


# ------------------------------------------- state held in tuples, arguments, defaults, helpers
#
# Each case: a function whose forward advances a counter (or draws from a
# generator) that its output depends on, run for two steps (forward, then
# backward); gradients and the state where the steps end must equal those without
# remat. Each gave wrong gradients, silently, before: the state sat in a named
# tuple, an argument that is a generator or a set, a default value, a class held
# in a closure, a closure variable a SAVE body rebinds, a module kept in a list, a
# bound method, partial or table of functions in a module-level variable, a method
# of a plain object or a helper method of the module, or a user module whose name
# starts with "torch".

_Holder = collections.namedtuple("_Holder", "counts")


class _Counter(nn.Module):  # kept in a plain list: not a registered submodule
    def __init__(self):
        super().__init__()
        self.n = 0

    def forward(self, t):
        self.n += 1
        return t * (1.0 + 0.25 * self.n)


class _Stepper:
    def __init__(self):
        self.n = 0

    def bump(self):
        self.n += 1
        return 1.0 + 0.25 * self.n


HELD_COUNT = {"n": 0}


def _bump_held_count():
    HELD_COUNT["n"] += 1
    return 1.0 + 0.25 * HELD_COUNT["n"]


def _scale_by_keyword(box):
    box["n"] += 1
    return 1.0 + 0.25 * box["n"]


HELD_STEPPER = _Stepper()
HELD_METHOD = HELD_STEPPER.bump
HELD_PARTIAL_BOX = {"n": 0}
HELD_PARTIAL = functools.partial(_scale_by_keyword, box=HELD_PARTIAL_BOX)
HELD_OPS = {"scale": _bump_held_count}


class _GlobalScaler:
    def scale(self):
        return _bump_held_count()


class _HelperBlock(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def scale(self):  # reads a module-level variable; forward does not name it
        return _bump_held_count()

    def forward(self, x):
        return (self.lin(x) * self.scale()).sin()


HELD_CASES = [
    "list in a named tuple attribute", "torch.Generator argument", "random.Random argument",
    "set argument", "mutable default value", "class held in a closure",
    "closure variable rebound in a SAVE body", "module kept in a list",
    "bound method in a module-level variable", "partial in a module-level variable",
    "function in a module-level table", "method of a plain object reading a global",
    "helper method of the module reading a global", "class of a user module named torch_*",
    "dict subclass with attribute access", "defaultdict counter",
    "counter in a submodule of an imported package",
]


class _AttrDict(dict):
    __getattr__ = dict.__getitem__


def _held_case(kind, lin):
    """``(function, extra arguments, state reader)`` for one case."""
    import torch_user_blocks

    HELD_COUNT["n"] = HELD_STEPPER.n = HELD_PARTIAL_BOX["n"] = 0
    torch_user_blocks.Counted.calls = 0
    if kind == "list in a named tuple attribute":
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = lin
                self.state = _Holder([0])

            def forward(self, x):
                self.state.counts[0] += 1
                return (self.lin(x) * (1.0 + 0.25 * self.state.counts[0])).sin()

        m = Block()
        return m, (), lambda: list(m.state.counts)
    if kind in ("torch.Generator argument", "random.Random argument"):
        torch_gen = kind.startswith("torch")
        g = torch.Generator().manual_seed(5) if torch_gen else random.Random(5)

        def drawn(x, g):
            if torch_gen:
                return (lin(x) * torch.rand(6, dtype=D, generator=g)).sin()
            return (lin(x) * (1.0 + g.random())).sin()

        return drawn, (g,), lambda: g.get_state().tolist() if torch_gen else g.getstate()
    if kind == "set argument":
        seen = set()

        def with_set(x, s):
            s.add(len(s))
            return (lin(x) * (1.0 + 0.25 * len(s))).sin()

        return with_set, (seen,), lambda: sorted(seen)
    if kind == "mutable default value":
        def with_default(x, state={"n": 0}):  # noqa: B006 (the case under test)
            state["n"] += 1
            return (lin(x) * (1.0 + 0.25 * state["n"])).sin()

        return with_default, (), lambda: dict(with_default.__defaults__[0])
    if kind == "class held in a closure":
        class Scale:
            calls = 0

        def with_class(x):
            Scale.calls += 1
            return (lin(x) * (1.0 + 0.25 * Scale.calls)).sin()

        return with_class, (), lambda: Scale.calls
    if kind == "closure variable rebound in a SAVE body":
        n = 0

        def count(t):
            nonlocal n
            n += 1
            return t * 2.0

        def with_cell(x):
            h = remat.recompute_needs_tensor(remat.region(count, "count", recompute=False)(lin(x)))
            return (h * (1.0 + 0.25 * n)).sin()

        return with_cell, (), lambda: n
    if kind == "module kept in a list":
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = lin
                self.helpers = [_Counter()]

            def forward(self, x):
                return self.helpers[0](self.lin(x)).sin()

        m = Block()
        return m, (), lambda: m.helpers[0].n
    if kind == "helper method of the module reading a global":
        return _HelperBlock(lin), (), lambda: HELD_COUNT["n"]
    if kind == "class of a user module named torch_*":
        counted = torch_user_blocks.Counted()
        return (lambda x: counted.apply(lin(x)).sin()), (), lambda: torch_user_blocks.Counted.calls
    if kind == "counter in a submodule of an imported package":
        state_pkg.sub.COUNT = 0

        def with_package(x):
            state_pkg.sub.COUNT += 1
            return (lin(x) * (1.0 + 0.25 * state_pkg.sub.COUNT)).sin()

        return with_package, (), lambda: state_pkg.sub.COUNT
    if kind in ("dict subclass with attribute access", "defaultdict counter"):
        counts = _AttrDict(n=0) if kind.startswith("dict") else collections.defaultdict(int)

        def with_counts(x):
            counts["n"] += 1
            return (lin(x) * (1.0 + 0.25 * counts["n"])).sin()

        return with_counts, (), lambda: dict(counts)
    if kind == "method of a plain object reading a global":
        scaler = _GlobalScaler()
        return (lambda x: (lin(x) * scaler.scale()).sin()), (), lambda: HELD_COUNT["n"]
    read = {
        "bound method in a module-level variable": (lambda: HELD_METHOD(), lambda: HELD_STEPPER.n),
        "partial in a module-level variable": (lambda: HELD_PARTIAL(), lambda: HELD_PARTIAL_BOX["n"]),
        "function in a module-level table": (lambda: HELD_OPS["scale"](), lambda: HELD_COUNT["n"]),
    }
    scale, state = read[kind]
    return (lambda x: (lin(x) * scale()).sin()), (), state


@pytest.mark.parametrize("kind", HELD_CASES)
def test_state_held_in_tuples_arguments_defaults_and_helpers_is_replayed(kind):
    def run(ckpt):
        lin = _linear(31)
        fn, extra, state = _held_case(kind, lin)
        if ckpt:
            fn = remat.checkpoint(region_name="held")(fn)
        grads, states = [], []
        with recorded_replays() as replayed:
            for i in range(2):
                x = _x(90 + i)
                fn(x, *extra).sum().backward()
                grads += [x.grad] + [p.grad.clone() for p in lin.parameters()]
                lin.zero_grad()
                states.append(state())
        assert replayed == (["held", "held"] if ckpt else [])
        return grads, states

    expected, expected_states = run(False)
    got, got_states = run(True)
    _same(expected, got)
    assert got_states == expected_states


# ------------------------------------------- unusual user objects the capture meets


class _RaisingTuple(tuple):
    def __len__(self):
        raise RuntimeError("len")

    def __iter__(self):
        raise RuntimeError("iter")


class _EqualityMeta(type):  # __eq__ without __hash__: its classes are unhashable
    def __eq__(cls, other):
        return cls is other


class _UnhashableConfig(metaclass=_EqualityMeta):
    k = 2.0


class _SlotsWithGetattr:
    __slots__ = ("a", "b")  # b is never set

    def __getattr__(self, name):
        raise KeyError(name)


RAISING_TUPLE = _RaisingTuple((1, 2))
LAZY_CONFIG = types.ModuleType("lazy_user_config")  # a module-level __getattr__ that raises
exec("def __getattr__(name):\n    raise KeyError(name)\nSCALE = 2.0", LAZY_CONFIG.__dict__)


def test_unusual_user_objects_are_read_without_errors_and_replayed_exactly():
    # A tuple subclass whose length raises, a class with an unhashable metaclass, a
    # module whose __getattr__ raises KeyError (read in a branch not taken), a slotted
    # object with an unset slot and a raising __getattr__: the capture met each while
    # looking for state, and raised.
    lin = _linear(41)
    slotted = _SlotsWithGetattr()
    slotted.a = 1.5

    def body(x, cfg, debug=False):
        scale = LAZY_CONFIG.DEBUG_ONLY if debug else LAZY_CONFIG.SCALE
        h = lin(x) * (scale * _UnhashableConfig.k * cfg.a)
        return (h * (RAISING_TUPLE is not None)).sin()

    def run(fn):
        x = _x(120)
        fn(x, slotted).sum().backward()
        grads = [x.grad] + [p.grad.clone() for p in lin.parameters()]
        lin.zero_grad()
        return grads

    expected = run(body)
    with recorded_replays() as replayed:
        got = run(remat.checkpoint(region_name="unusual")(body))
    assert replayed == ["unusual"]
    _same(expected, got)


def test_a_window_deque_holds_the_callers_entries_after_the_replay():
    # deque(maxlen=3): the replay's append, kept after the caller's entries, pushed
    # the oldest one out, and the next step read another sum
    def run(ckpt):
        lin = _linear(43)
        window = collections.deque([0.0], maxlen=3)

        def body(x):
            window.append(float(x.detach().sum()))
            return (lin(x) * sum(window)).sin()

        fn = remat.checkpoint(region_name="window")(body) if ckpt else body
        grads = []
        with recorded_replays() as replayed:
            for i in range(3):
                x = _x(130 + i)
                fn(x).sum().backward()
                grads.append(x.grad)
        assert replayed == (["window"] * 3 if ckpt else [])  # (the replay appends too)
        return grads, list(window)

    (expected, expected_window), (got, got_window) = run(False), run(True)
    _same(expected, got)
    assert got_window == expected_window and len(got_window) == 3


class _Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).sin()


@pytest.mark.parametrize("frozen_in_forward", [False, True])
def test_a_parameter_frozen_or_unfrozen_between_forward_and_backward_replays_as_in_forward(frozen_in_forward):
    # the replay's ops would save other tensors for a weight that does not require
    # grad (it raised, blaming an in-place change)
    def run(use_remat):
        torch.manual_seed(0)
        block = _Frozen()
        x = torch.randn(2, 4, requires_grad=True)
        block.a.weight.requires_grad_(not frozen_in_forward)
        f = remat.checkpoint(region_name="b")(block) if use_remat else block
        with recorded_replays() as replayed:
            out = f(x)
            block.a.weight.requires_grad_(frozen_in_forward)
            out.square().sum().backward()
        grads = [p.grad for p in block.parameters()] + [x.grad]
        return grads, block.a.weight.requires_grad, replayed

    expected, flag, _ = run(False)
    actual, actual_flag, replayed = run(True)
    assert replayed == ["b"]
    assert actual_flag == flag == frozen_in_forward  # the caller's flag is back
    for e, a in zip(expected, actual):
        assert (e is None and a is None) or torch.equal(e, a)


@pytest.mark.parametrize("where", ["closure", "attribute", "module-level"])
@pytest.mark.parametrize("switch_to", [True, False])
def test_a_tensor_switched_to_require_grad_or_not_before_backward_is_replayed_as_the_forward_saw_it(where, switch_to):
    # A plain tensor the function reads (not a parameter) switched to require grad,
    # or not, between the forward and backward: the replay's ops saved other tensors
    # (more of the same shapes: gradients off by 0.8; fewer: a count error).
    global _SCALE
    lin = _linear(4)
    holder = nn.Module()

    def run(ckpt):
        global _SCALE
        scale = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        scale.requires_grad_(not switch_to)
        holder.scale = scale
        _SCALE = scale
        read = {
            "closure": lambda: scale,
            "attribute": lambda: holder.scale,
            "module-level": lambda: _SCALE,
        }[where]

        def block(x):
            h = lin(x).sin()
            return (h * read()).tanh() * (h * 2).exp()

        fn = remat.checkpoint(region_name="flip")(block) if ckpt else block
        x = _x(11)
        for p in lin.parameters():
            p.grad = None
        with recorded_replays() as replayed:
            out = fn(x).pow(2).sum()
            scale.requires_grad_(switch_to)
            out.backward()
        return [x.grad, lin.weight.grad, scale.grad], replayed

    expected, _ = run(False)
    actual, replayed = run(True)
    assert replayed == ["flip"]
    assert all((a is None and e is None) or torch.equal(a, e) for a, e in zip(actual, expected))


_SCALE = None


def _backward_on(where: str, out: torch.Tensor) -> None:
    """``out.sum().backward()`` on this thread or on another one (as CUDA's backward
    runs on autograd's device threads); an error there is raised here."""
    errors = []

    def backward():
        try:
            out.sum().backward()
        except Exception as e:  # noqa: BLE001 (raised below)
            errors.append(e)

    if where == "same thread":
        backward()
    else:
        worker = threading.Thread(target=backward)
        worker.start()
        worker.join()
    assert not errors, errors


class _LocalConfig(threading.local):
    """A subclass of threading.local: each thread its own attributes."""


THREAD_LOCAL = threading.local()  # a module-level one the function reads


@pytest.mark.parametrize("backward_on", ["same thread", "another thread"])
@pytest.mark.parametrize("kind", ["threading.local attribute", "threading.local subclass", "module-level threading.local"])
def test_thread_local_state_is_replayed_as_the_forward_saw_it_on_any_thread(kind, backward_on):
    # Before: a threading.local's attribute, changed between the forward and backward,
    # was read anew by the replay (silently different gradients); a backward on
    # another thread (CUDA's runs on autograd's device threads) raised
    # AttributeError there, where the thread's own dict lacks the attribute.
    local = THREAD_LOCAL if kind.startswith("module-level") else (
        _LocalConfig() if "subclass" in kind else threading.local()
    )
    lin = _linear(80)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin
            if not kind.startswith("module-level"):
                self.local = local

        def forward(self, x):
            scale = THREAD_LOCAL.scale if kind.startswith("module-level") else self.local.scale
            return (self.lin(x) * scale).sin()

    def run(ckpt):
        m = Block()
        fn = remat.checkpoint(region_name="local")(m) if ckpt else m
        local.scale = 2.0
        x = _x(81)
        out = fn(x)
        local.scale = 3.0  # set for the next step before this one's backward
        _backward_on(backward_on, out)
        grads = [x.grad] + [p.grad.clone() for p in lin.parameters()]
        lin.zero_grad()
        return grads

    expected = run(False)
    with recorded_replays() as replayed:
        got = run(True)
    assert replayed == ["local"]
    _same(expected, got)
    assert local.scale == 3.0  # the caller's value after the replay


SCALE_VAR = contextvars.ContextVar("scale")  # module-level, read by the forward
SCALE_VAR_WITH_DEFAULT = contextvars.ContextVar("scale_with_default", default=1.5)


@pytest.mark.parametrize("backward_on", ["same thread", "another thread"])
@pytest.mark.parametrize("how", ["set, then set again before backward", "set in a scope around the forward"])
@pytest.mark.parametrize("kind", ["module-level ContextVar", "ContextVar with a default, as an attribute"])
def test_a_context_variable_is_replayed_with_the_value_the_forward_read(kind, how, backward_on):
    # Before: the replay read the variable's value at backward time (silently
    # different gradients after the caller set another value, or once a scope set
    # around the forward alone had ended); a backward on another thread, whose
    # context lacks the value, raised LookupError.
    var = SCALE_VAR if kind.startswith("module-level") else SCALE_VAR_WITH_DEFAULT
    lin = _linear(82)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin
            if not kind.startswith("module-level"):
                self.var = var

        def forward(self, x):
            scale = SCALE_VAR.get() if kind.startswith("module-level") else self.var.get()
            return (self.lin(x) * scale).sin()

    def run(ckpt):
        m = Block()
        fn = remat.checkpoint(region_name="context")(m) if ckpt else m
        x = _x(83)
        if how.startswith("set, then"):
            var.set(2.0)
            out = fn(x)
            var.set(3.0)
        else:
            token = var.set(2.5)
            out = fn(x)
            var.reset(token)
        caller = var.get(None)
        _backward_on(backward_on, out)
        assert var.get(None) == caller  # the caller's value after the replay
        grads = [x.grad] + [p.grad.clone() for p in lin.parameters()]
        lin.zero_grad()
        return grads

    expected = run(False)
    with recorded_replays() as replayed:
        got = run(True)
    assert replayed == ["context"]
    _same(expected, got)


def test_a_context_variable_without_a_value_in_the_forward_and_one_in_backward_is_replayed_unset():
    # Before: refused (a variable cannot be unset in a context). The replay runs in a
    # context of its own, built without that variable, the others as the caller has them.
    var = contextvars.ContextVar("unset_in_forward")
    other = contextvars.ContextVar("set_throughout")

    def run(ckpt):
        lin = _linear(84)

        def block(x):
            return (lin(x) * var.get(1.0) * other.get()).sin()

        fn = remat.checkpoint(region_name="unset")(block) if ckpt else block
        x = _x(85)
        other.set(0.5)
        out = fn(x)
        var.set(4.0)  # the replay would read 4.0, where the forward read the default 1.0
        out.sum().backward()
        assert var.get() == 4.0 and other.get() == 0.5  # the caller's values stand
        return [x.grad, *(p.grad for p in lin.parameters())]

    expected = contextvars.Context().run(run, False)
    with recorded_replays() as replayed:
        got = contextvars.Context().run(run, True)
    assert replayed == ["unset"]
    _same(expected, got)


def test_a_context_variable_unset_where_a_save_region_returns_and_set_in_backward_is_refused_by_name():
    # (the replay cannot unset it midway: the code before the region set it)
    var = contextvars.ContextVar("unset_midway")
    lin = _linear(88)

    def body(x):
        var.reset(token[0])
        return lin(x)

    def block(x):
        token[0] = var.set(2.0)
        h = remat.recompute_needs_tensor(remat.region(body, "body", recompute=False)(x))
        return (h * var.get(1.0)).sin()

    token = [None]

    def forward_then_backward():
        out = remat.checkpoint(region_name="midway")(block)(_x(89))
        out.sum().backward()

    with pytest.raises(remat.RecomputeMismatchError, match="ContextVar 'unset_midway', which had no value"):
        contextvars.Context().run(forward_then_backward)


TOGGLED_VAR = contextvars.ContextVar("toggled", default=1.0)


class _TogglesAroundRegions(nn.Module):
    """Sets a context variable before each SAVE region (once with a token reset
    after it), each body setting it back to the value the code before it replaced."""

    def __init__(self):
        super().__init__()
        self.r0, self.r1, self.tail = _linear(98), _linear(99), _linear(100)

    def forward(self, x):
        old0 = TOGGLED_VAR.get()
        TOGGLED_VAR.set(0.5)
        token = TOGGLED_VAR.set(0.5)

        def body0(t):
            TOGGLED_VAR.set(old0)
            return self.r0(t).tanh()

        h = remat.recompute_needs_tensor(remat.region(body0, "r0", recompute=False)(x.sin()))
        TOGGLED_VAR.reset(token)
        old1 = TOGGLED_VAR.get()
        TOGGLED_VAR.set(2.0)

        def body1(t):
            TOGGLED_VAR.set(old1)
            return self.r1(t).tanh()

        h = remat.recompute_needs_tensor(remat.region(body1, "r1", recompute=False)(h))
        TOGGLED_VAR.set(TOGGLED_VAR.get() + 1.0)
        return self.tail(h) * TOGGLED_VAR.get()


@pytest.mark.parametrize("backward", ["twice, retaining the graph", "on another thread"])
def test_a_context_variable_toggled_around_save_regions_replays_in_any_context(backward):
    # Before: the tokens a replay made in its own context were used by the next
    # replay (ValueError: created in a different Context), and putting the caller's
    # value back after a replay on a thread whose context lacks the variable was
    # refused as if the forward had had none.
    def run(ckpt):
        TOGGLED_VAR.set(1.5)  # the caller's value when the forward starts
        m = _TogglesAroundRegions()
        fn = remat.checkpoint(region_name="toggled")(m) if ckpt else m
        x = _x(101)
        loss = fn(x).sum()
        if backward.startswith("twice"):
            loss.backward(retain_graph=True)
            loss.backward()
        else:
            _backward_on("another thread", loss)
        assert TOGGLED_VAR.get() == 1.5  # as the forward left it (0.5 + 1)
        return [x.grad, *(p.grad for p in m.parameters())]

    expected = contextvars.copy_context().run(run, False)
    with recorded_replays() as replayed:
        got = contextvars.copy_context().run(run, True)
    assert replayed == ["toggled"] * (2 if backward.startswith("twice") else 1)
    _same(expected, got)


@pytest.mark.parametrize("kind", ["ContextVar", "threading.local"])
def test_context_and_thread_local_values_changed_before_each_backward_are_replayed_every_step(kind):
    # (the later steps reuse the first step's capture of the module's state)
    var, local = contextvars.ContextVar("step_scale"), threading.local()
    lin = _linear(86)

    def block(x):
        return (lin(x) * (var.get() if kind == "ContextVar" else local.scale)).sin()

    def set_scale(value):
        if kind == "ContextVar":
            var.set(value)
        else:
            local.scale = value

    def run(fn):
        grads = []
        for step in range(4):
            set_scale(1.0 + step)
            out = fn(_x(87 + step))
            set_scale(10.0 + step)
            out.sum().backward()
            grads.extend(p.grad.clone() for p in lin.parameters())
            lin.zero_grad()
        return grads

    expected = run(block)
    with recorded_replays() as replayed:
        got = run(remat.checkpoint(region_name="steps")(block))
    assert replayed == ["steps"] * 4
    _same(expected, got)


def _factory(kind):
    """Classes built inside a function whose methods read its variables (a model
    factory), and a class with state in a private or plain-object class attribute."""
    k = 2.0
    n = 0

    def set_k(v):
        nonlocal k
        k = v

    class Sub(nn.Module):
        def forward(self, h):
            return h * k

    class Act:
        def __call__(self, h):
            return (h * k).sin()

    class Cfg:
        def __init__(self):
            self.t, self.n = 2.0, 0

    class Built(nn.Module):
        _table = {"k": 2.0}
        cfg = Cfg()

        def __init__(self):
            super().__init__()
            self.lin = _linear(13)
            self.sub, self.act = Sub(), Act()

        def helper(self, h):
            return (h * k).sin()

        def count(self):
            nonlocal n
            n += 1
            return n

        def forward(self, x):
            h = self.lin(x)
            if kind == "helper method":
                return self.helper(h) * x
            if kind == "submodule forward":
                return self.sub(h).sin() * x
            if kind == "callable object":
                return self.act(h) * x
            if kind == "nonlocal counter":
                return (h * self.count()).sin() * x
            if kind == "private class dict":
                return (h * self._table["k"]).sin() * x
            if kind == "plain object in a class attribute":
                return (h * self.cfg.t).sin() * x
            self.cfg.n += 1  # a counter on it
            return (h * self.cfg.n).sin() * x

    def change():
        set_k(5.0)
        Built._table["k"] = 5.0
        Built.cfg.t = 5.0

    return Built(), change, lambda: (n, Built.cfg.n)


@pytest.mark.parametrize(
    "kind",
    ["helper method", "submodule forward", "callable object", "nonlocal counter", "private class dict",
     "plain object in a class attribute", "counter on a class attribute's object"],
)
def test_state_of_a_class_built_in_a_function_or_held_by_its_class_is_replayed_as_the_forward_saw_it(kind):
    # A variable of the enclosing function read by a method other than the root
    # module's forward, a submodule's forward or a callable object's __call__; a dict
    # in a private class attribute; a plain object in a class attribute. Changed
    # before backward (or advanced by the forward itself: a counter), the replay read
    # the new value: gradients silently wrong, counters advanced twice.
    def run(ckpt):
        model, change, counters = _factory(kind)
        fn = remat.checkpoint(region_name="built")(model) if ckpt else model
        x = _x(71)
        with recorded_replays() as replayed:
            out = fn(x)
            change()
            out.sum().backward()
        return [x.grad, *(p.grad for p in model.parameters())], replayed, counters()

    expected, _, expected_counters = run(False)
    got, replayed, counters = run(True)
    assert replayed == ["built"]
    assert counters == expected_counters
    _same(expected, got)
