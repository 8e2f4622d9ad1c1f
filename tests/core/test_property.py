"""Property: for random programs of regions and bare ops (chains and DAGs, nested
regions, any SAVE/RECOMPUTE assignment), remat.checkpoint gives the gradients of
the plain program bit for bit — or, when a SAVE output that the replay reads was
not marked, a PlaceholderReadError. Never a wrong gradient."""

import contextlib
import os
import weakref

import torch
from helpers import UnseenLog, kept_bytes, recorded_replays
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import torch_remat as remat

UNARY = ("sin", "tanh", "exp_small", "mul_param", "matmul_param", "view_then_sin", "relu")


def apply_unary(op, t, w):
    if op == "sin":
        return t.sin()
    if op == "tanh":
        return t.tanh()
    if op == "exp_small":
        return (t * 0.1).exp()
    if op == "mul_param":
        return t * w[0]
    if op == "matmul_param":
        return t @ w
    if op == "view_then_sin":
        return t.reshape(4, 3).sin().reshape(3, 4)
    if op == "relu":
        return t.relu()
    raise AssertionError(op)


@st.composite
def steps(draw, depth=0, inside_save=False, max_steps=6):
    """A list of steps; each is ("op", op, arg_picks) or ("region", save, mark, body)."""
    out = []
    for _ in range(draw(st.integers(1, max_steps if depth == 0 else 2))):
        kind = draw(st.sampled_from(["op", "op", "add", "region"] if depth < 2 else ["op", "add"]))
        if kind == "op":
            out.append(("op", draw(st.sampled_from(UNARY)), draw(st.integers(0, 10**6))))
        elif kind == "add":
            out.append(("add", draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))))
        else:
            save = True if inside_save else draw(st.booleans())
            body = draw(steps(depth=depth + 1, inside_save=save))
            out.append(("region", save, draw(st.booleans()), body))
    return out


class Program:
    def __init__(self, plan, mark_all, params):
        self.plan = plan
        self.mark_all = mark_all
        self.params = params
        # Each region body run: (its qualified name, the region remat says is
        # running, whether it is a SAVE region, whether backward is replaying).
        self.runs = UnseenLog()
        self._names = []

    def unary(self, op, t, w):
        return apply_unary(op, t, w)

    def run_steps(self, plan, values):
        for index, step in enumerate(plan):
            if step[0] == "op":
                _, op, pick = step
                w = self.params[pick % len(self.params)]
                values.append(self.unary(op, values[pick % len(values)], w))
            elif step[0] == "add":
                _, a, b = step
                values.append(values[a % len(values)] + values[b % len(values)])
            elif step[0] != "region":
                self.extra_step(step, values)
            else:
                _, save, mark, body = step
                name = f"r{index}"  # nested regions are qualified: r2.r0
                start = len(values)

                def region_body(*vals, body=body, name=name, save=save):
                    self._names.append(name)
                    qualname = ".".join(self._names)
                    where = remat.active_checkpoint()
                    self.runs.append((qualname, where and where.region, save, remat.is_recomputing()))
                    try:
                        local = list(vals)
                        self.run_steps(body, local)
                        return local[-1]
                    finally:
                        self._names.pop()

                out = remat.region(region_body, name, recompute=not save)(*values[:start])
                if self.mark_all or mark:
                    remat.recompute_needs_tensor(out)
                values.append(out)
        return values

    def __call__(self, x, y):
        values = self.run_steps(self.plan, [x, y])
        return sum(((v * v).sum() for v in values[2:]), (x * y).sum())


def _grads(fn, params, x, y, prog=None):
    """Gradients of params and x; with ``prog``, ``fn`` checkpoints it, and what
    remat kept and replayed is checked against the program's regions."""
    for t in [*params, x]:
        t.grad = None
    # x enters as a non-leaf (grad times 1.0: exact): a leaf that requires grad is
    # autograd's to hold, billed to no checkpoint, and the keep-or-replay check below
    # asks who holds the inputs
    if prog is None:
        fn(x * 1, y).backward()
    else:
        activations = saves_activations(prog, params, x, y)
        prog.runs.clear()
        with recorded_replays() as replayed:
            loss = fn(x * 1, y)
            kept = kept_bytes(loss).get("prog", {})
            loss.backward()
        # What the plain program saves beyond its inputs, the checkpoint either
        # keeps (a SAVE region's saves, the inputs its replay reads) or recreates.
        # (Unmarked SAVE outputs are placeholders in the replay: there the check is
        # the placeholder error or exact gradients, not who holds what.)
        if activations and prog.mark_all:
            assert kept or replayed == ["prog"], (kept, replayed)
        check_region_runs(prog, kept)
    return [t.grad.clone() if t.grad is not None else None for t in [*params, x]]


def saves_activations(prog, params, x, y):
    """Whether the plain program's backward holds a saved tensor other than its
    inputs and parameters (saves of branches the loss does not reach die with them)."""
    inputs = {t.untyped_storage().data_ptr() for t in [*params, x, y]}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = prog(x * 1, y)
    # A saved output packed as itself holds its own node, so the save of a branch the
    # loss does not reach (a region's unused tanh) stays alive: count only saves made
    # by nodes the loss's backward reaches (a saved output's node is its grad_fn).
    reachable, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in reachable:
            reachable.add(node)
            stack.extend(n for n, _ in node.next_functions)
    alive = any(
        (t := ref()) is not None and (t.grad_fn is None or t.grad_fn in reachable)
        for ref in saved
    )
    del loss
    return alive


def check_region_runs(prog, kept, reruns=False):
    """Each region body ran as that region; the replay never ran a SAVE body (with
    ``reruns``, only one whose output the program updates in place after it returned,
    as many times as in the forward, RegionRecord.rerun); the checkpoint kept nothing
    for a RECOMPUTE region (its inputs and the entry copies of buffers the forward
    updates are the checkpoint's own)."""
    for qualname, active, save, replaying in prog.runs:
        assert active == qualname, prog.runs
        assert reruns or not (save and replaying), prog.runs
    if reruns:
        for qualname in {q for q, _, save, replaying in prog.runs if save and replaying}:
            forward = [r for r in prog.runs if r[0] == qualname and not r[3]]
            replayed = [r for r in prog.runs if r[0] == qualname and r[3]]
            assert len(replayed) <= len(forward), prog.runs
    save_regions = {q for q, _, save, _ in prog.runs if save}
    assert set(kept) <= save_regions | {"(inputs)", "(state snapshots)"}, (kept, prog.runs)


def _bitwise(a, b):
    """The same bytes (NaN included: ``torch.equal`` says a NaN differs from itself)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = (t.resolve_conj().resolve_neg().contiguous() for t in (a, b))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _same(a, b):
    return all((ga is None and gb is None) or (ga is not None and gb is not None and _bitwise(ga, gb)) for ga, gb in zip(a, b))


def _setup():
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 4, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3)]
    x = torch.randn(3, 4, dtype=torch.float64, generator=g).requires_grad_()
    y = torch.randn(3, 4, dtype=torch.float64, generator=g)  # an input without grad
    return params, x, y


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=steps())
# a SAVE region whose tanh branch the loss does not reach: nothing to keep or replay
@example(plan=[("region", False, False, [("op", "tanh", 0), ("op", "sin", 1)])])
def test_marked_programs_give_bitwise_equal_gradients(plan):
    params, x, y = _setup()
    prog = Program(plan, mark_all=True, params=params)
    expected = _grads(prog, params, x, y)
    actual = _grads(remat.checkpoint(region_name="prog")(prog), params, x, y, prog)
    assert _same(actual, expected)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=steps())
def test_unmarked_programs_are_exact_or_raise_placeholder_error(plan):
    params, x, y = _setup()
    prog = Program(plan, mark_all=False, params=params)
    expected = _grads(prog, params, x, y)
    try:
        actual = _grads(remat.checkpoint(region_name="prog")(prog), params, x, y, prog)
    except remat.PlaceholderReadError as e:
        assert "recompute_needs_tensor" in str(e)
        return
    assert _same(actual, expected)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=steps(), retain=st.booleans())
def test_second_backward_matches_first(plan, retain):
    params, x, y = _setup()
    prog = Program(plan, mark_all=True, params=params)
    activations = saves_activations(prog, params, x, y)
    prog.runs.clear()
    ckpt = remat.checkpoint(region_name="prog")(prog)
    for t in [*params, x]:
        t.grad = None
    with recorded_replays() as replayed:
        loss = ckpt(x, y)
    kept = kept_bytes(loss).get("prog", {})
    loss.backward(retain_graph=True)
    first = [t.grad.clone() if t.grad is not None else None for t in [*params, x]]
    for t in [*params, x]:
        t.grad = None
    loss.backward()
    second = [t.grad.clone() if t.grad is not None else None for t in [*params, x]]
    assert _same(first, second)
    if activations:
        assert kept or replayed == ["prog", "prog"], (kept, replayed)  # one per backward
    check_region_runs(prog, kept)


# --------------------------------------------------------------------------------
# Stateful programs: a module whose forward updates a buffer in place (in bare code
# or inside regions), writes in place inside regions, takes a repeated argument, and
# may run under torch.func.functional_call with swapped parameters. Exact gradients
# and buffers, or a RematError raised by remat (never a wrong gradient).

EXAMPLES = int(os.environ.get("REMAT_PROPERTY_EXAMPLES", "60"))
STATEFUL = ("op", "op", "add", "buffer", "inplace", "region")


@st.composite
def stateful_steps(draw, depth=0, inside_save=False, max_steps=6):
    out = []
    for _ in range(draw(st.integers(1, max_steps if depth == 0 else 3))):
        kind = draw(st.sampled_from(STATEFUL if depth < 2 else STATEFUL[:-1]))
        if kind == "op":
            out.append(("op", draw(st.sampled_from(UNARY)), draw(st.integers(0, 10**6))))
        elif kind == "add":
            out.append(("add", draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))))
        elif kind == "buffer":
            out.append(("buffer", draw(st.integers(0, 10**6))))
        elif kind == "inplace":
            out.append(("inplace", draw(st.integers(0, 10**6))))
        else:
            save = True if inside_save else draw(st.booleans())
            body = draw(stateful_steps(depth=depth + 1, inside_save=save))
            out.append(("region", save, True, body))
    return out


class StatefulProgram(torch.nn.Module, Program):
    def __init__(self, plan, checkpointed):
        torch.nn.Module.__init__(self)
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.ParameterList(
            [torch.randn(4, 4, dtype=torch.float64, generator=g) for _ in range(3)]
        )
        self.register_buffer("stat", torch.ones(4, dtype=torch.float64))
        Program.__init__(self, plan, True, list(self.w))
        self.checkpointed = checkpointed

    def extra_step(self, step, values):
        v = values[step[1] % len(values)]
        if step[0] == "buffer":
            # Updated under no_grad in forward and read (and saved) right after.
            with torch.no_grad():
                self.stat.mul_(0.5).add_(v.detach().mean(0))
            values.append(v * self.stat)
        elif v.grad_fn is not None:  # in place: never on a leaf or an input
            values.append(v.mul_(1.5))

    def body(self, x, y):
        self.params = list(self.w)  # under functional_call: the swapped tensors
        return Program.__call__(self, x, y)

    def forward(self, x, y):
        if self.checkpointed:
            return remat.checkpoint(region_name="prog")(self.body)(x, y)
        return self.body(x, y)


def _stateful_run(plan, checkpointed, repeated, swap):
    model = StatefulProgram(plan, checkpointed)
    _, x, y = _setup()
    y = x if repeated else y
    if swap:
        fast = {n: p * 1.5 for n, p in model.named_parameters()}
        loss = torch.func.functional_call(model, fast, (x, y))
    else:
        loss = model(x, y)
    kept = kept_bytes(loss).get("prog", {}) if checkpointed else None
    loss.backward()
    if checkpointed:
        # a SAVE output updated in place after its region returned: the replay runs
        # that region's body again
        check_region_runs(model, kept, reruns=_has(plan, "inplace"))
    return [p.grad for p in model.parameters()] + [x.grad, model.stat.clone()]


def _has(plan, kind):
    return any(s[0] == kind or (s[0] == "region" and _has(s[3], kind)) for s in plan)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=stateful_steps(), repeated=st.booleans(), swap=st.booleans())
# A SAVE output updated in place after its region returned: its body runs again in the
# replay, named as its region (remat.active_checkpoint().region)
@example(plan=[("region", True, True, [("op", "sin", 0)]), ("buffer", 0), ("inplace", 2)],
         repeated=False, swap=False)
@example(plan=[("region", True, True, [("region", True, True, [("op", "sin", 0)])]), ("inplace", 2)],
         repeated=False, swap=False)
# A later SAVE region writes an earlier SAVE region's output in place, and bare code
# reads it after: refused, naming both regions (was a message that did not say why).
@example(plan=[("region", True, True, [("buffer", 0)]), ("op", "sin", 0),
               ("region", True, True, [("op", "sin", 0), ("inplace", 5972)])],
         repeated=False, swap=False)
@example(plan=[("buffer", 0), ("region", True, True, [("op", "sin", 0)]), ("op", "sin", 0),
               ("op", "sin", 0), ("region", True, True, [("inplace", 12207)])],
         repeated=False, swap=False)
def test_stateful_programs_give_bitwise_gradients_and_buffers_or_raise(plan, repeated, swap):
    try:
        expected = _stateful_run(plan, False, repeated, swap)
    except RuntimeError:
        return  # the plain program is invalid (an in-place write autograd refuses)
    try:
        actual = _stateful_run(plan, True, repeated, swap)
    except remat.RematError as e:
        # Only an in-place write to a tensor the replay needs as it was (a kept SAVE
        # output updated after its region returned) is refused; a SAVE region writing
        # its argument is replayed exactly.
        assert _has(plan, "inplace") and "in place" in str(e), str(e)
        return
    assert _same(actual, expected)


# --------------------------------------------------------------------------------
# Complex programs: conjugate views of region arguments and of parameters (what
# rebuilt saves must not lose), run under saved-tensor hooks that pack and unpack
# (identity, copies, the offloader), with module state rebound between the forward
# and backward (a tensor attribute, a submodule, the training flag). Exact gradients.

from torch_remat.offload import ActivationOffloader  # noqa: E402

C128 = torch.complex128
COMPLEX_UNARY = ("sin", "conj_mul", "matmul_mH_param", "einsum_conj", "mul_mask", "proj", "train_branch",
                 "view_then_sin")
HOOKS = ("none", "identity", "clone", "offload", "offload-all-prefetch0")
REBIND = ("none", "mask", "proj", "eval")


@st.composite
def complex_steps(draw, depth=0, inside_save=False, max_steps=5):
    out = []
    for _ in range(draw(st.integers(1, max_steps if depth == 0 else 2))):
        kind = draw(st.sampled_from(["op", "op", "add", "region"] if depth < 2 else ["op", "add"]))
        if kind == "op":
            out.append(("op", draw(st.sampled_from(COMPLEX_UNARY)), draw(st.integers(0, 10**6))))
        elif kind == "add":
            out.append(("add", draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))))
        else:
            save = True if inside_save else draw(st.booleans())
            out.append(("region", save, True, draw(complex_steps(depth=depth + 1, inside_save=save))))
    return out


class ComplexProgram(torch.nn.Module, Program):
    def __init__(self, plan):
        torch.nn.Module.__init__(self)
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.ParameterList([torch.randn(4, 4, dtype=C128, generator=g) for _ in range(2)])
        self.proj = torch.nn.Linear(4, 4, bias=False, dtype=C128)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(4, 4, dtype=C128, generator=g))
        self.mask = torch.randn(4, dtype=C128, generator=g)  # a plain tensor attribute
        Program.__init__(self, plan, True, list(self.w))

    def unary(self, op, t, w):
        if op == "conj_mul":
            return t.conj() * t
        if op == "matmul_mH_param":
            return t @ w.mH
        if op == "einsum_conj":
            return torch.einsum("ij,jk->ik", t.conj(), w)
        if op == "mul_mask":
            return t * self.mask
        if op == "proj":
            return self.proj(t)
        if op == "train_branch":
            return t * 2 if self.training else t * 3
        return apply_unary(op, t, w)

    def forward(self, x, y):
        self.params = list(self.w)
        values = self.run_steps(self.plan, [x, y])
        total = (x * y).real.sum()
        for v in values[2:]:
            total = total + (v * v).real.sum() + (v.conj() * 0.5j).real.sum()
        return total


def _complex_hooks(kind):
    if kind == "identity":
        return remat.saved_tensors_hooks(lambda t: t, lambda t: t)
    if kind == "clone":
        return remat.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)
    if kind.startswith("offload"):
        prefetch, kinds = (0, list(remat.SavedTensorKind)) if kind.endswith("prefetch0") else (1, None)
        off = ActivationOffloader(1 << 20, min_bytes=0, prefetch=prefetch,
                                  **({"kinds": kinds} if kinds else {}))
        return remat.saved_tensors_hooks(off.pack_hook, off.unpack_hook)
    return contextlib.nullcontext()


def _complex_run(plan, checkpointed, hooks, rebind):
    model = ComplexProgram(plan)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, dtype=C128, generator=g).requires_grad_()
    y = torch.randn(3, 4, dtype=C128, generator=g)
    fn = remat.checkpoint(region_name="prog")(model) if checkpointed else model
    with _complex_hooks(hooks if checkpointed else "none"):
        loss = fn(x, y)
    params = [*model.w, model.proj.weight]
    if rebind == "mask":
        model.mask = torch.ones(4, dtype=C128)
    elif rebind == "proj":
        model.proj = torch.nn.Linear(4, 4, bias=False, dtype=C128)
    elif rebind == "eval":
        model.eval()
    kept = kept_bytes(loss).get("prog", {}) if checkpointed else None
    loss.backward()
    if checkpointed:
        check_region_runs(model, kept)
    return [p.grad for p in params] + [x.grad]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=complex_steps(), hooks=st.sampled_from(HOOKS), rebind=st.sampled_from(REBIND))
# gradients with a NaN at the same place on both sides (torch.equal calls them unequal)
@example(plan=[("region", False, True, [("region", False, True, [("op", "sin", 0), ("op", "sin", 2)]),
                                         ("op", "sin", 2)]), ("op", "sin", 2)], hooks="none", rebind="none")
def test_complex_programs_under_hooks_and_rebound_state_give_bitwise_gradients(plan, hooks, rebind):
    expected = _complex_run(plan, False, "none", rebind)
    actual = _complex_run(plan, True, hooks, rebind)
    assert _same(actual, expected)


# --------------------------------------------------------------------------------
# Python-level state: programs that read a module's Python attribute and a closure
# value (both set per micro-batch and changed again before the backwards), update a
# counter and a tensor attribute from their own values, and draw from Python's
# random and NumPy's global generator, in replayed code and inside SAVE regions.
# Two micro-batch forwards, then their backwards in either order: the gradients,
# the module's attributes and the callers' random streams are those without remat.

import random  # noqa: E402

import numpy as np  # noqa: E402

PY_UNARY = ("sin", "mul_param", "scale_attr", "scale_closure", "counter", "center", "random", "np_random")


@st.composite
def python_state_steps(draw, depth=0, inside_save=False, max_steps=5):
    out = []
    for _ in range(draw(st.integers(1, max_steps if depth == 0 else 2))):
        kind = draw(st.sampled_from(["op", "op", "add", "region"] if depth < 2 else ["op", "add"]))
        if kind == "op":
            out.append(("op", draw(st.sampled_from(PY_UNARY)), draw(st.integers(0, 10**6))))
        elif kind == "add":
            out.append(("add", draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))))
        else:
            save = True if inside_save else draw(st.booleans())
            out.append(("region", save, True, draw(python_state_steps(depth=depth + 1, inside_save=save))))
    return out


class PythonStateProgram(torch.nn.Module, Program):
    def __init__(self, plan, closure):
        torch.nn.Module.__init__(self)
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.ParameterList([torch.randn(4, 4, dtype=torch.float64, generator=g) for _ in range(2)])
        self.scale = 1.0
        self.calls = 0
        self.center = torch.zeros(4, dtype=torch.float64)
        self.closure = closure  # () -> the closure value the checkpointed function sees
        Program.__init__(self, plan, True, list(self.w))

    def unary(self, op, t, w):
        if op == "scale_attr":
            return t * self.scale
        if op == "scale_closure":
            return t * self.closure()
        if op == "counter":
            self.calls += 1
            return t * self.calls
        if op == "center":
            self.center = 0.5 * self.center + t.detach().mean(0)
            return t - self.center
        if op == "random":
            return t * (1 + 0.1 * random.random())
        if op == "np_random":
            return t * (1 + 0.1 * float(np.random.rand()))
        return apply_unary(op, t, w)

    def forward(self, x, y):
        self.params = list(self.w)
        return Program.__call__(self, x, y)


def _python_state_run(plan, checkpointed, order):
    closure_scale = 1.0

    def closure():
        return closure_scale

    model = PythonStateProgram(plan, closure)

    def body(x, y):
        return model(x, y) * closure_scale

    fn = remat.checkpoint(region_name="prog")(body) if checkpointed else body
    random.seed(3)
    np.random.seed(3)
    _, x0, y = _setup()
    xs, losses, kept = [], [], []
    with recorded_replays() as replayed:
        for i, s in enumerate((0.5, 2.0)):
            model.scale = s
            closure_scale = 1.5 - s / 2
            xs.append((x0 * (i + 1)).detach().requires_grad_())
            losses.append(fn(xs[-1], y))
            kept.append(kept_bytes(losses[-1]).get("prog", {}))
        model.scale, closure_scale = 7.0, 9.0  # changed again before the backwards
        for i in order:
            losses[i].backward()
    state = [torch.tensor([model.scale, model.calls, closure_scale, random.random(), float(np.random.rand())]),
             model.center]
    if checkpointed and _python_state_saves_activations(plan):
        # What the plain program saves, each call of the checkpoint kept (a SAVE
        # region's saves) or dropped and had backward replay.
        assert kept.count({}) <= len(replayed), (kept, replayed)
    return [p.grad for p in model.w] + [x.grad for x in xs] + state


def _python_state_saves_activations(plan):
    """Whether a fresh plain program of ``plan`` saves an activation for backward
    (a tensor other than its leaf input, ``y`` and its weights)."""
    model = PythonStateProgram(plan, lambda: 1.0)
    _, x, y = _setup()
    return saves_activations(lambda _, y: model(x, y), list(model.w), x, y)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=python_state_steps(), order=st.sampled_from([(0, 1), (1, 0)]))
def test_python_state_programs_give_bitwise_gradients_and_state(plan, order):
    expected = _python_state_run(plan, False, order)
    actual = _python_state_run(plan, True, order)
    assert _same(actual, expected)
