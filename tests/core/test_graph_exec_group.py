"""Refills made for the backwards of a torch.utils.checkpoint.GraphExecGroup are
shared by them and freed when the group object dies."""

import torch
from helpers import UnseenLog, recorded_replays
from torch.utils.checkpoint import GraphExecGroup

import torch_remat as remat
from torch_remat.engine.observers import CheckpointObserver, observe


def block(x):
    return (x.sin().exp() * 2).cos()


class Frames(CheckpointObserver):
    def __init__(self) -> None:
        self.frames = []

    def checkpoint_created(self, frame) -> None:
        self.frames.append(frame)

    def refilled(self) -> list:
        """Recreated tensors the frames still hold for some backward."""
        return [t for f in self.frames for store in f.recreated.values() for t in store.tensors.values()]


def test_refills_a_group_did_not_use_are_freed_when_the_group_dies():
    x = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    frames = Frames()
    with observe(frames), recorded_replays() as replayed:
        loss = remat.checkpoint(region_name="b")(lambda a, b: block(a) + block(b))(x, y).sum()
    with GraphExecGroup():
        (gx,) = torch.autograd.grad(loss, [x], retain_graph=True)
    assert len(frames.frames) == 1 and replayed == ["b"]
    # block(y)'s refills were made by the one replay but never unpacked
    assert frames.refilled() == []
    (ref,) = torch.autograd.grad((block(x) + block(y)).sum(), [x])
    assert torch.equal(gx, ref)


def test_the_backwards_of_one_group_share_one_replay():
    x = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    runs = UnseenLog()

    def fn(a, b):
        if remat.is_recomputing():
            runs.append(1)
        return block(a) + block(b)

    loss = remat.checkpoint(region_name="b", early_stop=False)(fn)(x, y).sum()
    with GraphExecGroup():
        (gx,) = torch.autograd.grad(loss, [x], retain_graph=True)
        (gy,) = torch.autograd.grad(loss, [y], retain_graph=True)
    assert len(runs) == 1
    rx, ry = torch.autograd.grad((block(x) + block(y)).sum(), [x, y])
    assert torch.equal(gx, rx) and torch.equal(gy, ry)


def test_a_scope_replays_once_for_a_group_and_its_recreated_tensors_die_with_the_group(monkeypatch):
    # The scope API keys what it recreates by the same backward key as checkpoints
    # (_autograd_hooks.graph_task_key): a group shares one replay, and what the
    # group's backwards did not unpack is freed when the group dies.
    import gc

    import torch_remat.scope.replay as scope_replay

    targets = []
    real = scope_replay.replay

    def spy(record, recipes, key):
        targets.extend(recipes)
        return real(record, recipes, key)

    monkeypatch.setattr(scope_replay, "replay", spy)
    x = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    z = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    with remat.gradient_checkpoint_scope():
        a, b, c = block(x), block(y), block(z)
    loss = a.sum() + b.sum() + c.sum()  # the backwards below overlap in no saved tensor
    group = GraphExecGroup()
    with group:
        (gx,) = torch.autograd.grad(loss, [x], retain_graph=True)
        n = len(targets)
        (gy,) = torch.autograd.grad(loss, [y], retain_graph=True)
    assert n > 0 and len(targets) == n  # the second backward of the group replayed nothing
    rx, ry = torch.autograd.grad((block(x) + block(y)).sum(), [x, y])
    assert torch.equal(gx, rx) and torch.equal(gy, ry)
    # block(z)'s tensors were recreated by that replay and never unpacked
    assert any(r.values for r in targets)
    del group
    gc.collect()
    assert not any(r.values for r in targets)
