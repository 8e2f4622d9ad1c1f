"""The first unpack of a dropped tensor (the one that replays the function) stays in
few engine files: the unpack hook (``_autograd_hooks.py``), the holder and the store
of recreated tensors (``records.py``), the frame that starts the replay
(``frame.py``) and the replay pass (``replay.py``). Each feature a block uses adds
its own module and nothing else: its SAVE regions ``api.py`` (the ``remat.region``
calls the block makes) and ``rebuild.py``, its module state ``module_state.py``,
its state hooks ``rng.py``."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from torch import nn

import torch_remat as remat
from torch_remat.engine import records

PACKAGE = Path(remat.__file__).parent
CORE = {"_autograd_hooks.py", "engine/records.py", "engine/frame.py", "engine/replay.py"}


def first_replaying_unpack(loss: torch.Tensor) -> dict[str, set[str]]:
    """The torch_remat functions the first replaying unpack of ``loss``'s backward
    runs, by file (relative to the package)."""
    calls: list[tuple[str, str]] = []
    done = []
    root = str(PACKAGE) + "/"

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            calls.append((frame.f_code.co_filename[len(root):], frame.f_code.co_name))

    real = records.Holder.unpack

    def unpack(self):
        if done:
            return real(self)
        calls.clear()
        sys.setprofile(profile)
        try:
            return real(self)
        finally:
            sys.setprofile(None)
            if any(name == "replay" for _, name in calls):
                done.append(True)

    records.Holder.unpack = unpack
    try:
        loss.backward()
    finally:
        records.Holder.unpack = real
    assert done, "no unpack replayed"
    by_file = collections.defaultdict(set)
    for file, name in calls:
        by_file[file].add(name)
    return dict(by_file)


def test_the_first_unpack_of_a_plain_function_runs_in_four_files():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    # its tensors are arguments (a closure tensor is module state: module_state.py)
    loss = remat.checkpoint(region_name="p")(lambda t, v: torch.tanh(t @ v).sin().sum())(x, w)
    trip = first_replaying_unpack(loss)
    assert set(trip) <= CORE, sorted(set(trip) - CORE)
    assert sum(map(len, trip.values())) <= 20, trip


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = remat.region(self.b, "b", recompute=False)(h)
        return (torch.tanh(h) * h).sum()


def test_each_feature_of_a_block_adds_only_its_own_module_to_the_trip():
    x = torch.randn(4, 8, requires_grad=True)
    features = {"engine/api.py", "engine/context.py", "engine/rebuild.py", "engine/module_state.py"}
    loss = remat.checkpoint(region_name="m")(_Block())(x)
    trip = first_replaying_unpack(loss)
    assert set(trip) <= CORE | features, sorted(set(trip) - CORE - features)
    # the block's own remat.region call is all that reaches api.py and context.py
    assert trip.get("engine/context.py", set()) <= {"current_pass", "current_prefixes"}
    loss = remat.checkpoint(region_name="m", recompute_state_hooks=[remat.CPURNGStateHook()])(_Block())(x)
    trip = first_replaying_unpack(loss)
    assert set(trip) <= CORE | features | {"engine/rng.py"}, sorted(set(trip) - CORE - features)
