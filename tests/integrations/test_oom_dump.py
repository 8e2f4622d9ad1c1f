"""integrations.oom: the per-rank dump (guard and CUDA observer), its bounds, and
remat.active_checkpoint, which names the checkpoint and region in it."""

import gc
import json
import os
import socket
import threading
import time

import pytest
import torch
from helpers import UnseenLog

import torch_remat as remat
from torch_remat.diagnostics import ActiveCheckpoint
from torch_remat.integrations import _oom_bound, _oom_dump, oom

# The expanded matmul below materialises (2**44, 4, 4) float32: 1 PiB, more than a
# process can address, so the allocator fails whatever the kernel's overcommit policy.
CPU_REQUEST = 2**44 * 4 * 4 * 4


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    gc.collect()
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    yield
    oom.uninstall()


def impossible_allocation(h):
    """A real allocator failure (see CPU_REQUEST)."""
    return torch.randn(1, 4, 4).expand(2**44, 4, 4) @ torch.randn(4, 4) + h.sum()


def two_region_block(inner):
    lin = torch.nn.Linear(8, 8)

    def block(x):
        h = remat.region(lin, "proj", recompute=False)(x)
        return remat.region(inner, "attn", recompute=False)(h)

    return block


def read(path):
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------- active_checkpoint


def test_active_checkpoint_names_the_region_running_in_forward_and_recompute():
    seen = UnseenLog()

    def body(t):
        seen.append(remat.active_checkpoint())
        return t.sin()

    def block(x):
        return remat.region(body, "mlp", recompute=True)(x).cos()

    x = torch.randn(3, requires_grad=True)
    assert remat.active_checkpoint() is None
    y = remat.checkpoint(region_name="layers.2")(block)(x)
    y.sum().backward()
    assert seen == [
        ActiveCheckpoint("layers.2", "forward", "mlp"),
        ActiveCheckpoint("layers.2", "recompute", "mlp"),
    ]
    assert seen[1].format() == "checkpoint 'layers.2' (recompute), region 'mlp'"
    assert seen[0].to_dict() == {"checkpoint": "layers.2", "phase": "forward", "region": "mlp"}


def test_active_checkpoint_of_an_exception_names_where_it_was_raised_after_the_checkpoint_exited():
    def fail(t):
        if remat.is_recomputing():
            raise torch.OutOfMemoryError("in recompute")
        return t.sin()

    def inner(x):
        return remat.region(fail, "mlp", recompute=True)(x)

    def outer(x):
        h = remat.region(lambda t: t * 2, "attn", recompute=False)(x)
        return remat.checkpoint(region_name="layers.0.inner")(inner)(h).cos()

    y = remat.checkpoint(region_name="layers.0")(outer)(torch.randn(3, requires_grad=True))
    with pytest.raises(torch.OutOfMemoryError) as info:
        y.sum().backward()
    assert remat.active_checkpoint() is None
    assert remat.active_checkpoint(info.value) == ActiveCheckpoint(
        "layers.0.inner", "recompute", "mlp"
    )
    assert remat.active_checkpoint(ValueError("never raised")) is None


# ------------------------------------------------------------------ the guard


def test_a_cpu_allocator_failure_in_a_region_writes_one_dump_and_is_reraised(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    dumps = oom.install(tmp_path / "oom")
    block = two_region_block(impossible_allocation)
    before = time.time()
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator: can't allocate memory"):
        with dumps.guard(step=12):
            remat.checkpoint(region_name="oomtest.layers.0")(block)(torch.randn(200, 8))
    after = time.time()
    [path] = dumps.written
    assert os.listdir(tmp_path / "oom") == [os.path.basename(path)]  # no temporary file left
    assert os.path.basename(path) == f"oom_job-7_rank0_{os.getpid()}_1.json"
    dump = read(path)
    assert {k: dump[k] for k in ("format", "version", "job_id", "attempt", "rank", "host", "pid",
                                 "step", "source", "device", "requested_bytes",
                                 "requested_bytes_exact", "location")} == {
        "format": "torch_remat.oom_dump", "version": 1, "job_id": "job-7", "attempt": 1,
        "rank": 0, "host": socket.gethostname(), "pid": os.getpid(), "step": 12,
        "source": "exception", "device": "cpu", "requested_bytes": CPU_REQUEST,
        "requested_bytes_exact": True,
        "location": {"checkpoint": "oomtest.layers.0", "phase": "forward", "region": "attn"},
    }
    assert before <= dump["time"] <= after
    assert dump["error"]["type"] == "RuntimeError"
    assert dump["site"].startswith("test_oom_dump.py:") and dump["site"].endswith(
        " impossible_allocation"
    )
    # what was held: proj's saved input, 200 x 8 float32. The output kept for the
    # replay is released when the failed forward unwinds, before the guard runs.
    assert {"name": "oomtest.layers.0", "bytes": 6400, "calls": 1} in dump["regions"]
    block_dict = next(b for b in dump["saved_tensors"]["checkpoints"] if b["name"] == "oomtest.layers.0")
    assert block_dict["bytes"] == 6400 and [r["region"] for r in block_dict["regions"]] == ["proj"]
    assert "oomtest.layers.0: 6.25 KiB resident in 1 storage(s)\n" in dump["saved_tensors_text"]
    assert dump["largest_tensors"][0]["bytes"] == 6400
    assert dump["allocator"]["process_resident_bytes"] > 0  # /proc on Linux
    assert dump["errors"] == [] and dump["truncated"] == []
    assert (
        f"torch_remat: rank 0 ran out of memory at step 12 in checkpoint 'oomtest.layers.0' "
        f"(forward), region 'attn'; dump written to {path}\n"
    ) in capfd.readouterr().err


def test_other_exceptions_pass_through_the_guard_without_a_dump(tmp_path):
    dumps = oom.install(tmp_path)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with dumps.guard(step=1):
            raise RuntimeError("shape mismatch")
    with pytest.raises(MemoryError):
        with dumps.guard(step=2):
            raise MemoryError()
    assert dumps.written == [] and os.listdir(tmp_path) == []


def test_guard_as_a_decorator_with_suppress_returns_after_dumping(tmp_path):
    dumps = oom.install(tmp_path, job_id="explicit", rank=5)

    @dumps.guard(suppress=True)
    def step():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 3 has a "
                                     "total capacity of 79.15 GiB of which 3.94 MiB is free.")

    assert step() is None
    assert step() is None  # a second failure, a second dump
    first, second = (read(p) for p in dumps.written)
    assert (first["job_id"], first["rank"], first["step"]) == ("explicit", 5, None)
    assert (first["device"], first["requested_bytes"], first["requested_bytes_exact"]) == (
        "cuda:3", 20 * 2**20, False)
    assert first["location"] is None
    assert [os.path.basename(p)[-7:] for p in dumps.written] == ["_1.json", "_2.json"]
    assert second["error"]["type"] == "OutOfMemoryError"


def test_allocator_messages_give_device_and_requested_bytes():
    cpu = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
           "memory: you tried to allocate 4398046511104 bytes. Error code 12 (Cannot allocate memory)")
    assert _oom_dump.requested_bytes(cpu) == (4398046511104, True)
    assert _oom_dump.device_of_error(cpu, "cuda:0") == "cpu"
    assert _oom_dump.is_out_of_memory(RuntimeError(cpu))
    assert not _oom_dump.is_out_of_memory(RuntimeError("CUDA error: an illegal memory access"))
    cuda = "CUDA out of memory. Tried to allocate 2.50 GiB. GPU 1 has a total capacity of 79.15 GiB"
    assert _oom_dump.requested_bytes(cuda) == (int(2.5 * 2**30), False)
    assert _oom_dump.device_of_error(cuda, "cpu") == "cuda:1"
    mps = "MPS backend out of memory (MPS allocated: 1.00 GiB). Tried to allocate 256.00 MiB on private pool."
    assert _oom_dump.requested_bytes(mps) == (256 * 2**20, False)
    assert _oom_dump.requested_bytes("Tried to allocate 512 bytes") == (512, True)
    assert _oom_dump.requested_bytes("out of memory") == (None, False)
    assert _oom_dump.device_of_error("out of memory", "cpu") == "cpu"


# -------------------------------------------------- the CUDA observer, synthetic


@pytest.fixture
def fake_cuda(monkeypatch):
    """Make this CPU build look like one with CUDA: what the observer path reads."""
    stats = {"allocated_bytes.all.current": 70 * 2**30, "reserved_bytes.all.current": 78 * 2**30,
             "num_ooms": 1, "num_alloc_retries": 2, "some.other.counter": 9}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    return stats


def test_observer_dump_has_the_exact_request_allocator_counters_and_the_region(tmp_path, fake_cuda):
    dumps = oom.install(tmp_path, cuda_observer=False)

    def attn(h):
        # what the CUDA caching allocator calls when a 3 GiB request fails
        dumps.observe(0, 3 * 2**30, 80 * 2**30, 512 * 2**20)
        return h * 2

    remat.checkpoint(region_name="oomtest.layers.4")(two_region_block(attn))(torch.randn(4, 8))
    [path] = dumps.written
    dump = read(path)
    assert (dump["source"], dump["device"], dump["requested_bytes"], dump["requested_bytes_exact"]) == (
        "cuda_observer", "cuda:0", 3 * 2**30, True)
    assert dump["error"] is None
    assert dump["location"] == {"checkpoint": "oomtest.layers.4", "phase": "forward", "region": "attn"}
    assert dump["site"].endswith(" attn")
    allocator = dump["allocator"]
    assert {k: allocator[k] for k in ("allocated_bytes.all.current", "reserved_bytes.all.current",
                                      "num_ooms", "num_alloc_retries", "device_usable_bytes",
                                      "device_free_bytes")} == {
        "allocated_bytes.all.current": 70 * 2**30, "reserved_bytes.all.current": 78 * 2**30,
        "num_ooms": 1, "num_alloc_retries": 2, "device_usable_bytes": 80 * 2**30,
        "device_free_bytes": 512 * 2**20}
    assert "some.other.counter" not in allocator
    assert {"name": "oomtest.layers.4", "bytes": 256, "calls": 1} in dump["regions"]


def test_the_guard_adds_the_exception_to_the_observer_dump_instead_of_writing_a_second(tmp_path, fake_cuda):
    dumps = oom.install(tmp_path, cuda_observer=False)

    def attn(h):
        dumps.observe(0, 3 * 2**30, 80 * 2**30, 2**20)  # the allocator, then it raises:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 ...")

    with pytest.raises(torch.OutOfMemoryError):
        with dumps.guard(step=5):
            remat.checkpoint(region_name="oomtest.layers.1")(two_region_block(attn))(torch.randn(4, 8))
    [path] = dumps.written
    assert os.listdir(tmp_path) == [os.path.basename(path)]
    dump = read(path)
    assert (dump["source"], dump["step"], dump["requested_bytes"]) == ("cuda_observer", 5, 3 * 2**30)
    assert dump["error"]["type"] == "OutOfMemoryError"
    assert dump["error"]["message"].startswith("CUDA out of memory. Tried to allocate 3.00 GiB.")
    assert dump["location"]["region"] == "attn"


def test_an_error_the_observer_did_not_see_gets_its_own_dump_not_an_earlier_observer_dump(tmp_path):
    # The observer runs for every failed CUDA request, also ones torch recovers from;
    # a later, different out-of-memory error in the same guarded step is not that one.
    dumps = oom.install(tmp_path, cuda_observer=False)
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
        with dumps.guard(step=3):
            dumps.observe(0, 2**20, 80 * 2**30, 2**30)  # recovered: no exception follows
            remat.checkpoint(region_name="oomtest.layers.9")(two_region_block(impossible_allocation))(
                torch.randn(4, 8))
    observed, caught = (read(p) for p in dumps.written)
    assert (observed["source"], observed["device"], observed["requested_bytes"], observed["error"]) == (
        "cuda_observer", "cuda:0", 2**20, None)
    assert (caught["source"], caught["device"], caught["requested_bytes"], caught["step"]) == (
        "exception", "cpu", CPU_REQUEST, 3)
    assert caught["location"] == {"checkpoint": "oomtest.layers.9", "phase": "forward", "region": "attn"}
    assert caught["error"]["type"] == "RuntimeError"


@pytest.mark.parametrize("device, alloc, matches", [
    (0, 3 * 2**30 + 12345, True),   # the message rounds the request to two decimals
    (0, 2**20, False),              # another request
    (1, 3 * 2**30, False),          # another device
])
def test_a_cuda_error_is_added_only_to_the_observer_dump_of_the_same_request(
    tmp_path, device, alloc, matches
):
    # observer calls made by hand, as the allocator makes them (no GPU needed)
    dumps = oom.install(tmp_path, cuda_observer=False)
    with pytest.raises(torch.OutOfMemoryError):
        with dumps.guard(step=4):
            dumps.observe(0, 5 * 2**20, 80 * 2**30, 2**30)  # an earlier, recovered request
            dumps.observe(device, alloc, 80 * 2**30, 2**30)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a "
                                         "total capacity of 79.15 GiB of which 1.00 GiB is free.")
    written = [read(p) for p in dumps.written]
    assert [d["error"] is None for d in written] == ([True, False] if matches else [True, True, False])
    assert written[-1]["error"]["type"] == "OutOfMemoryError"
    assert (written[-1]["source"], written[-1]["device"]) == (
        ("cuda_observer", "cuda:0") if matches else ("exception", "cuda:0"))
    assert written[-1]["requested_bytes"] == (alloc if matches else 3 * 2**30)


def test_installing_twice_into_one_folder_keeps_every_dump(tmp_path):
    first = oom.install(tmp_path, job_id="job").dump_exception(torch.OutOfMemoryError("first"))
    second = oom.install(tmp_path, job_id="job").dump_exception(torch.OutOfMemoryError("second"))
    assert first != second
    assert [read(p)["error"]["message"] for p in (first, second)] == ["first", "second"]
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (first, second))


def test_a_dump_name_already_in_the_folder_is_not_overwritten(tmp_path):
    # e.g. a restarted worker whose pid is that of the previous attempt's worker
    taken = tmp_path / f"oom_job_rank0_{os.getpid()}_1.json"
    taken.write_text("earlier dump")
    path = oom.install(tmp_path, job_id="job").dump_exception(torch.OutOfMemoryError("x"))
    assert os.path.basename(path) == f"oom_job_rank0_{os.getpid()}_2.json"
    assert taken.read_text() == "earlier dump"


def test_install_attaches_the_observer_once_through_torch_and_it_writes_to_the_latest_folder(
    tmp_path, fake_cuda, monkeypatch
):
    attached = []
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", attached.append, raising=False)
    monkeypatch.setattr(oom, "_observer_attached", False)
    oom.install(tmp_path / "first")
    second = oom.install(tmp_path / "second")
    assert len(attached) == 1 and oom.installed() is second
    attached[0](2, 4096, 2**30, 0)
    assert [read(p)["device"] for p in second.written] == ["cuda:2"]
    assert os.listdir(tmp_path / "first") == []
    oom.uninstall()
    attached[0](2, 4096, 2**30, 0)  # attached but idle
    assert len(second.written) == 1


# ------------------------------------------------------- never raises, bounded


def test_a_failing_report_still_gives_a_dump_that_says_so(tmp_path, monkeypatch):
    def broken(roots=None):
        raise RuntimeError("graph walk exploded")

    monkeypatch.setattr(remat, "saved_tensors_report", broken)
    dumps = oom.install(tmp_path)
    with pytest.raises(torch.OutOfMemoryError):
        with dumps.guard(step=3):
            raise torch.OutOfMemoryError("out of memory")
    dump = read(dumps.written[0])
    assert dump["errors"] == ["saved-tensors report: RuntimeError: graph walk exploded"]
    assert dump["regions"] == [] and dump["saved_tensors"] is None


def test_the_observer_never_raises_even_when_nothing_can_be_written(tmp_path, capfd):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    dumps = oom.install(tmp_path / "dumps")
    dumps.dump_dir = str(blocker / "dumps")  # the folder became impossible to create
    assert dumps.observe(0, 1024, 0, 0) is None
    with pytest.raises(torch.OutOfMemoryError, match="the original error"):
        with dumps.guard(step=1):
            raise torch.OutOfMemoryError("the original error")
    assert dumps.written == []
    err = capfd.readouterr().err
    assert err.count("torch_remat: could not write the OOM dump oom_nojob_rank0_") == 2
    assert "NotADirectoryError" in err


def test_a_report_that_is_not_ready_within_the_time_budget_is_left_out(tmp_path, monkeypatch):
    release = threading.Event()

    def slow(roots=None):
        release.wait()
        raise RuntimeError("too late")

    monkeypatch.setattr(remat, "saved_tensors_report", slow)
    dumps = oom.install(tmp_path, time_budget_s=0.2)
    with pytest.raises(torch.OutOfMemoryError):
        with dumps.guard(step=1):
            raise torch.OutOfMemoryError("out of memory")
    still_running = not release.is_set()
    release.set()
    dump = read(dumps.written[0])
    assert still_running  # the dump was written while the report was still blocked
    assert dump["errors"] == [
        "saved-tensors report: not ready within the time budget (0.2 s); left out"
    ]


def test_dumps_stay_within_max_dump_bytes_and_keep_exact_region_totals(tmp_path):
    def block(x):
        for i in range(6):
            x = remat.region(torch.sin, f"r{i}", recompute=False)(x)  # keeps its input
        return x

    x = torch.randn(16, requires_grad=True)
    outputs = [remat.checkpoint(region_name=f"oomtest.big.{i}")(block)(x) for i in range(60)]
    full = read(oom.install(tmp_path / "full").dump_exception(torch.OutOfMemoryError("x")))
    for limit in (16384, 4096):
        path = oom.install(tmp_path / str(limit), max_dump_bytes=limit).dump_exception(
            torch.OutOfMemoryError("x" * 10000)
        )
        size = os.path.getsize(path)
        dump = read(path)
        assert size <= limit
        assert dump["truncated"], dump
        assert (dump["rank"], dump["format"]) == (0, "torch_remat.oom_dump")
    # at 16 KiB the per-region totals survive the trimming (regions over 32 are summed)
    bounded = read(os.path.join(tmp_path / "16384", os.listdir(tmp_path / "16384")[0]))
    total = sum(r["bytes"] for r in bounded["regions"]) + bounded.get("regions_left_out", {}).get("bytes", 0)
    assert total == sum(r["bytes"] for r in full["regions"])
    assert full["truncated"] == []
    del outputs


def test_too_small_a_bound_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_dump_bytes=1000 is too small"):
        oom.install(tmp_path, max_dump_bytes=1000)


def test_a_write_that_fails_midway_leaves_no_dump_and_no_temporary_file(tmp_path, monkeypatch):
    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        _oom_dump.write_atomically(str(tmp_path), "oom_x.json", b"{}")
    assert os.listdir(tmp_path) == []


def test_record_sites_labels_saved_tensors_in_guarded_steps(tmp_path):
    dumps = oom.install(tmp_path, record_sites=True)
    block = two_region_block(impossible_allocation)
    with pytest.raises(RuntimeError):
        with dumps.guard(step=1):
            remat.checkpoint(region_name="oomtest.sites")(block)(torch.randn(4, 8))
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if 'remat.region(lin, "proj"' in text)
    rows = [t for t in read(dumps.written[0])["largest_tensors"] if t["region"] == "oomtest.sites::proj"]
    assert [(t["tensor"], t["site"]) for t in rows] == [
        ("saved.0", f"test_oom_dump.py:{line} block")]


def test_the_size_bound_holds_for_any_content():
    snow = "\u2603" * 5000  # JSON writes each as six bytes
    dump = {"format": "torch_remat.oom_dump", "version": 1, "rank": 3, "time": 1.0, "job_id": snow,
            "host": snow, "device": snow, "error": {"type": snow, "message": snow},
            "location": {"checkpoint": snow, "phase": "forward", "region": snow},
            "regions": [{"name": f"{snow}{i}", "bytes": i} for i in range(50)],
            "largest_tensors": [{"bytes": 1, "tensor": snow}] * 50, "errors": [snow] * 50,
            "saved_tensors": {"checkpoints": [{"name": snow, "bytes": 1, "regions": []}] * 200},
            "saved_tensors_text": snow * 10}
    payload = _oom_bound.encode_bounded(dump, 4096)
    small = json.loads(payload)
    assert len(payload) <= 4096
    assert (small["format"], small["rank"], small["time"]) == ("torch_remat.oom_dump", 3, 1.0)
    assert small["truncated"] == ["everything but what identifies the event: the dump exceeded 4096 bytes"]
