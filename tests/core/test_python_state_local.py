"""Python state local to one forward that a SAVE region's body changes: a dict, a
list, a counter rebound with ``nonlocal``, an object, a NumPy array or a generator
the checkpointed function creates and hands to the body (in its closure or as an
argument), then reads after it. The replay creates them anew and would skip the
body: where the body changed any, the replay runs the body again instead, so the
code after it reads what the forward read. Compared with the same steps without
remat, with torch.equal; a body that changes none is skipped as before."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch
from helpers import recorded_replays
from torch import nn

import torch_remat as remat
from torch_remat.engine.replay import ReplayPass

D = torch.float64


class Layers(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.l1 = nn.Linear(8, 8, dtype=D)
        self.l2 = nn.Linear(8, 8, dtype=D)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, dtype=D, generator=g))


def _forward(kind: str, m: Layers):
    """The checkpointed function: ``kind`` names the local state its SAVE body
    changes."""

    def fn(x):
        h = m.l1(x)
        region = lambda body, *extra: remat.region(body, "body", recompute=False)(h, *extra)  # noqa: E731
        if kind == "dict":
            st = {"scale": 1.0}

            def body(t):
                st["scale"] = float(t.detach().abs().max())
                return m.l2(t)

            o = region(body)
            scale = st["scale"]
        elif kind == "nonlocal":
            n = 0

            def body(t):
                nonlocal n
                n += 2
                return m.l2(t)

            o = region(body)
            scale = float(n)
        elif kind == "object argument":
            config = types.SimpleNamespace(k=1.0)

            def body(t, c):
                c.k = 2.5
                return m.l2(t)

            o = region(body, config)
            scale = config.k
        elif kind == "list argument":
            aux: list[float] = []

            def body(t, losses):
                losses.append(float(t.detach().pow(2).mean()))
                return m.l2(t)

            o = region(body, aux)
            scale = aux[0]
        elif kind == "numpy array":
            arr = np.ones(1)

            def body(t):
                arr[0] = 4.0
                return m.l2(t)

            o = region(body)
            scale = float(arr[0])
        elif kind == "torch generator":
            g = torch.Generator().manual_seed(5)

            def body(t):
                return m.l2(t) + torch.rand(t.shape, dtype=D, generator=g)

            o = region(body)
            scale = float(torch.rand((), dtype=D, generator=g))  # (the draw after the body's)
        elif kind == "python random":
            rng = random.Random(3)

            def body(t):
                return m.l2(t) * rng.random()

            o = region(body)
            scale = rng.random()
        elif kind == "unchanged":
            st = {"scale": 1.5}

            def body(t):
                return m.l2(t) * st["scale"]

            o = region(body)
            scale = st["scale"]
        else:
            raise AssertionError(kind)
        remat.recompute_needs_tensor(o)
        # (tanh saves its output: the replay recomputes it from the scale)
        return torch.tanh(o * scale)

    return fn


def _steps(kind: str, ckpt: bool):
    m = Layers()
    fn = _forward(kind, m)
    call = remat.checkpoint(region_name="blk")(fn) if ckpt else fn
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    out = []
    for i in range(2):
        x = torch.randn(4, 8, dtype=D, generator=torch.Generator().manual_seed(i), requires_grad=True)
        call(x).pow(2).sum().backward()
        out.append([x.grad, *(p.grad.clone() for p in m.parameters())])
        opt.step()
        opt.zero_grad()
    return out


KINDS = ["dict", "nonlocal", "object argument", "list argument", "numpy array", "torch generator", "python random"]


def _reruns(monkeypatch) -> list[str]:
    """The SAVE bodies the replays run again, by name."""
    ran: list[str] = []
    rerun = ReplayPass._rerun_body

    def counted(self, fn, pos, record, args, kwargs):
        ran.append(record.qualname)
        return rerun(self, fn, pos, record, args, kwargs)

    monkeypatch.setattr(ReplayPass, "_rerun_body", counted)
    return ran


def _assert_equal(expected, got):
    for i, (a, b) in enumerate(zip(expected, got)):
        for j, (u, v) in enumerate(zip(a, b)):
            assert torch.equal(u, v), f"step {i} grad {j}"


@pytest.mark.parametrize("kind", KINDS)
def test_local_state_a_save_body_changes_is_there_for_the_code_after_it_in_the_replay(kind, monkeypatch):
    expected = _steps(kind, ckpt=False)
    reruns = _reruns(monkeypatch)
    with recorded_replays() as replayed:
        got = _steps(kind, ckpt=True)
    assert replayed == ["blk"] * 2
    _assert_equal(expected, got)
    assert reruns == ["body"] * 2  # (the replay ran the body again)


def test_a_save_body_that_changes_no_local_state_is_skipped_by_the_replay(monkeypatch):
    expected = _steps("unchanged", ckpt=False)
    reruns = _reruns(monkeypatch)
    with recorded_replays() as replayed:
        got = _steps("unchanged", ckpt=True)
    assert replayed == ["blk"] * 2
    _assert_equal(expected, got)
    assert reruns == []


def test_an_attribute_a_save_body_adds_and_the_code_after_it_deletes():
    # the replay sets it where it skips the body, the code deletes it again, and the
    # caller's module is left without it
    def run(ckpt):
        m = Layers()

        def fn(x):
            h = m.l1(x)

            def body(t):
                m.__dict__["peak"] = float(t.detach().abs().max())
                return m.l2(t)

            o = remat.recompute_needs_tensor(remat.region(body, "body", recompute=False)(h))
            peak = m.peak
            del m.peak
            return torch.tanh(o * peak)

        call = remat.checkpoint(region_name="blk")(fn) if ckpt else fn
        x = torch.randn(4, 8, dtype=D, generator=torch.Generator().manual_seed(0), requires_grad=True)
        call(x).sum().backward()
        assert "peak" not in m.__dict__
        return [x.grad, *(p.grad for p in m.parameters())]

    with recorded_replays() as replayed:
        got = run(True)
    assert replayed == ["blk"]
    for u, v in zip(run(False), got):
        assert torch.equal(u, v)


class LazyNoise(nn.Module):
    """Makes its noise generator on its first forward, inside the checkpoint; a SAVE
    region's body (a lambda over ``self``) draws from it, and so does the code after."""

    def __init__(self):
        super().__init__()
        self.layers = Layers()

    def forward(self, x):
        if not hasattr(self, "gen"):
            self.gen = torch.Generator().manual_seed(5)
        h = self.layers.l1(x)
        o = remat.region(
            lambda t: self.layers.l2(t) * torch.rand(t.shape, dtype=D, generator=self.gen),
            "noisy", recompute=False,
        )(h)
        remat.recompute_needs_tensor(o)
        return torch.tanh(o * torch.rand(o.shape, dtype=D, generator=self.gen))


@pytest.mark.parametrize("how", ["module", "function over the module"])
def test_a_generator_a_module_makes_in_its_first_forward_and_a_save_body_draws_from(monkeypatch, how):
    # the first replay starts from the module as the call found it (no generator),
    # makes one anew and runs the body again; the module keeps the forward's
    # generator, drawn as often as without remat
    def run(ckpt):
        m = LazyNoise()
        fn = m if how == "module" else (lambda x: m(x))
        call = remat.checkpoint(region_name="blk")(fn) if ckpt else fn
        out = []
        for i in range(2):
            x = torch.randn(4, 8, dtype=D, generator=torch.Generator().manual_seed(i), requires_grad=True)
            call(x).pow(2).sum().backward()
            out.append([x.grad, *(p.grad.clone() for p in m.parameters()), m.gen.get_state()])
            m.zero_grad()
        return out

    expected = run(False)
    reruns = _reruns(monkeypatch)
    with recorded_replays() as replayed:
        got = run(True)
    assert replayed == ["blk"] * 2
    _assert_equal(expected, got)
    # (the second call finds the generator at its start: the module state forks it,
    # and the replay skips the body as usual)
    assert reruns == ["noisy"]
