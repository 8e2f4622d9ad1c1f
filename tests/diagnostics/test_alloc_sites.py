"""Allocation sites: CUDA snapshot lookup (on synthetic snapshots) and the CPU opt-in."""

import os

import torch

import torch_remat as remat
from torch_remat.diagnostics import alloc_sites as _alloc_sites
from torch_remat.diagnostics.alloc_sites import SnapshotIndex, choose_user_frame, cuda_site_lookup
from torch_remat.diagnostics.storage import StorageInfo

TORCH_FILE = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "linear.py")
REMAT_FILE = os.path.join(os.path.dirname(remat.__file__), "engine", "frame.py")
USER_FILE = "/home/me/project/model.py"


def frames(*specs):
    return [{"filename": f, "line": line, "name": name} for f, line, name in specs]


STACK = frames(
    ("??", 0, "c10::cuda::CUDACachingAllocator::malloc"),
    ("/opt/pytorch/c10/cuda/CUDACachingAllocator.cpp", 1200, "malloc"),
    (TORCH_FILE, 125, "forward"),
    (REMAT_FILE, 210, "run_region"),
    (USER_FILE, 42, "attention"),
    ("/home/me/project/train.py", 7, "main"),
)

SNAPSHOT = {
    "segments": [
        {
            "device": 0,
            "address": 0x1000,
            "total_size": 0x3000,
            "blocks": [
                {"address": 0x1000, "size": 0x800, "state": "active_allocated", "frames": STACK},
                {"address": 0x1800, "size": 0x800, "state": "inactive", "frames": STACK},
                {"address": 0x2000, "size": 0x2000, "state": "active_allocated", "frames": []},
            ],
        },
        {
            # older snapshots: blocks without "address", laid out from the segment's
            "device": 1,
            "address": 0x9000,
            "blocks": [
                {"size": 0x100, "state": "inactive"},
                {"size": 0x100, "state": "active_allocated", "frames": STACK[4:]},
            ],
        },
    ]
}


def test_frame_choice_is_the_innermost_user_frame():
    assert choose_user_frame(STACK) == "model.py:42 attention"
    assert choose_user_frame(STACK[:4]) is None
    assert choose_user_frame([]) is None


def test_pointer_to_block():
    index = SnapshotIndex(SNAPSHOT)
    assert index.site_of(0, 0x1000) == "model.py:42 attention"  # block start
    assert index.site_of(0, 0x17FF) == "model.py:42 attention"  # inside the block
    assert index.frames_at(0, 0x1800) is None  # an inactive (cached, free) block
    assert index.frames_at(0, 0x2100) == []  # active, recorded before history was on
    assert index.site_of(0, 0x2100) is None
    assert index.frames_at(0, 0x4000) is None  # past the segment
    assert index.frames_at(0, 0x0FFF) is None  # before it
    assert index.frames_at(1, 0x9100) is not None  # address from the running offset
    assert index.frames_at(1, 0x9000) is None
    assert index.frames_at(2, 0x1000) is None  # another device


def test_cuda_lookup_reads_the_allocator_snapshot(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: True, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: SNAPSHOT)
    on_cuda = StorageInfo(1, 0x800, 0x1000, torch.device("cuda", 0))
    on_cuda1 = StorageInfo(2, 0x100, 0x9100, torch.device("cuda", 1))
    on_cpu = StorageInfo(3, 16, 0x1000, torch.device("cpu"))
    lookup = cuda_site_lookup([on_cuda, on_cpu])
    assert lookup is not None
    assert lookup(on_cuda) == "model.py:42 attention"
    assert lookup(on_cuda1) == "model.py:42 attention"
    assert lookup(on_cpu) is None

    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: False, raising=False)
    assert cuda_site_lookup([on_cuda]) is None  # history off: no labels, no snapshot


def test_cuda_lookup_is_guarded():
    cpu = StorageInfo(1, 16, 0x10, torch.device("cpu"))
    assert cuda_site_lookup([cpu]) is None
    if not torch.cuda.is_available():
        assert cuda_site_lookup([StorageInfo(1, 16, 0x10, torch.device("cuda", 0))]) is None


def test_cuda_lookup_failure_is_swallowed(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("snapshot failed")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: True, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", broken)
    assert cuda_site_lookup([StorageInfo(1, 16, 0x10, torch.device("cuda", 0))]) is None


def test_current_user_site_skips_library_frames():
    line = current_line() + 1
    site = (lambda: _alloc_sites.current_user_site())()
    assert site == f"test_alloc_sites.py:{line} <lambda>"


def current_line():
    import sys

    return sys._getframe(1).f_lineno


def test_sites_are_recorded_only_inside_the_block_and_reach_the_saved_report():
    def block(x):
        line.append(current_line() + 1)
        return remat.region(torch.exp, "exp", recompute=False)(x)

    line = []
    x = torch.randn(4, requires_grad=True)
    with remat.record_save_sites():
        y = remat.checkpoint(region_name="sited")(block)(x)
    z = remat.checkpoint(region_name="plain")(block)(x)
    text = remat.format_saved_tensors_report([y, z])
    assert (
        "sited::exp: 16 B\n"
        "  16 B  saved.0 (output at idx 0)  (4,)  float32  "
        f"@ test_alloc_sites.py:{line[0]} block\n"
    ) in text
    assert text.endswith("plain::exp: 16 B\n  16 B  saved.0 (output at idx 0)  (4,)  float32")
