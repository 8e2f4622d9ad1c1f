"""The merge command of integrations.oom on synthetic dump folders: ordering,
per-region bytes across ranks, largest tensors, corrupt and foreign files, jobs."""

import json
import os
import pickle
import subprocess
import sys
import tracemalloc

import pytest

from torch_remat.integrations import _oom_merge, _oom_read, oom

T0 = 1_750_000_000.0


def dump(rank, seconds, *, job="job-a", step=7, regions=(), tensors=(), world_size=4, **extra):
    """A dump as integrations.oom writes it (the fields the merge reads)."""
    d = {
        "format": "torch_remat.oom_dump", "version": 1, "job_id": job, "attempt": 0,
        "rank": rank, "world_size": world_size, "local_rank": rank, "host": f"node{rank // 2}",
        "pid": 100 + rank, "time": T0 + seconds, "time_utc": f"2025-06-15T15:06:{40 + seconds:06.3f}Z",
        "step": step, "source": "exception", "device": "cpu", "requested_bytes": 2**30,
        "requested_bytes_exact": True,
        "error": {"type": "RuntimeError", "message": "DefaultCPUAllocator: can't allocate memory\nmore"},
        "site": "model.py:40 attention",
        "location": {"checkpoint": "layers.1", "phase": "forward", "region": "attn"},
        "allocator": {"process_resident_bytes": 3 * 2**20},
        "regions": [{"name": n, "bytes": b, "calls": 1} for n, b in regions],
        "largest_tensors": [
            {"bytes": b, "region": r, "tensor": t, "shape": [b // 4], "dtype": "float32", "site": s}
            for b, r, t, s in tensors
        ],
        "saved_tensors_text": f"saved for backward: report of rank {rank}",
        "errors": [], "truncated": [],
    }
    d.update(extra)
    return d


def write(folder, name, content):
    path = folder / name
    if isinstance(content, (bytes, str)):
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    else:
        path.write_text(json.dumps(content))
    return path


@pytest.fixture
def cluster(tmp_path):
    """Ranks 2 and 1 of a 4-rank job ran out (2 first); 0 and 3 did not."""
    write(tmp_path, "oom_job-a_rank1_101_1.json", dump(
        1, 0.5, regions=[("layers.0", 4096), ("layers.1", 2048), ("(outside regions)", 16)],
        tensors=[(2048, "layers.0::attn", "saved.0", "model.py:41 attention"),
                 (1024, "layers.1::attn", "saved.0", None)],
        location={"checkpoint": "layers.0", "phase": "recompute", "region": "mlp"},
        requested_bytes=2 * 2**30 + 5, requested_bytes_exact=False))
    write(tmp_path, "oom_job-a_rank2_102_1.json", dump(
        2, 0.0, regions=[("layers.0", 8192), ("layers.1", 1024), ("(outside regions)", 16)],
        tensors=[(4096, "layers.0::attn", "saved.0", "model.py:41 attention"),
                 (512, "(outside regions)", "DivBackward0 (x4)", None)]))
    return tmp_path


def test_merge_names_the_ranks_in_the_order_they_ran_out_and_compares_regions(cluster):
    text = _oom_merge.merge_dumps(str(cluster)).format()
    assert text == f"""\
torch_remat OOM dumps in {cluster}: 2 dump(s) of 1 job(s), 0 file(s) skipped

job 'job-a': 2 of 4 rank(s) ran out of memory; no dump from rank(s) 0, 3

ran out of memory, earliest first:
  #  rank  step  time (UTC)                   after  device  requested  where                                            site
  1     2     7  2025-06-15T15:06:40.000Z            cpu      1.00 GiB  checkpoint 'layers.1' (forward), region 'attn'   model.py:40 attention
  2     1     7  2025-06-15T15:06:40.500Z  +0.500 s  cpu     ~2.00 GiB  checkpoint 'layers.0' (recompute), region 'mlp'  model.py:40 attention

first: rank 2 (node1, oom_job-a_rank2_102_1.json)
  RuntimeError: DefaultCPUAllocator: can't allocate memory

saved for backward when each rank ran out (its first dump):
  region                  min  on              max  on
  layers.0           4.00 KiB  rank 1     8.00 KiB  rank 2
  layers.1           1.00 KiB  rank 2     2.00 KiB  rank 1
  (outside regions)      16 B  all ranks      16 B  all ranks

largest tensors held for backward:
     bytes  rank  region             tensor             shape    dtype    site
  4.00 KiB     2  layers.0::attn     saved.0            (1024,)  float32  model.py:41 attention
  2.00 KiB     1  layers.0::attn     saved.0            (512,)   float32  model.py:41 attention
  1.00 KiB     1  layers.1::attn     saved.0            (256,)   float32
     512 B     2  (outside regions)  DivBackward0 (x4)  (128,)   float32"""


def test_json_output_has_the_same_view_for_machines(cluster, capsys):
    assert oom.main([str(cluster), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    [job] = out["jobs"]
    assert (job["job_id"], job["world_size"], job["ranks_with_dump"], job["ranks_without_dump"]) == (
        "job-a", 4, [1, 2], [0, 3])
    assert [(r["order"], r["rank"], r["seconds_after_first"]) for r in job["ran_out"]] == [
        (1, 2, 0.0), (2, 1, 0.5)]
    assert job["ran_out"][1]["location"] == {"checkpoint": "layers.0", "phase": "recompute", "region": "mlp"}
    assert job["regions"][0] == {
        "name": "layers.0", "ranks": [2, 1], "bytes_per_rank": [8192, 4096], "calls_per_rank": [1, 1],
        "min": 4096, "min_rank": 1, "max": 8192, "max_rank": 2, "ranks_left_out": []}
    assert [(t["bytes"], t["rank"], t["site"]) for t in job["largest_tensors"]][:2] == [
        (4096, 2, "model.py:41 attention"), (2048, 1, "model.py:41 attention")]
    assert out["skipped"] == []


def test_corrupt_half_written_and_foreign_files_are_reported_and_skipped(cluster):
    good = json.dumps(dump(3, 1.0, regions=[("layers.0", 1)]))
    write(cluster, "cut.json", good[: len(good) // 2])
    write(cluster, "garbage.json", '{"format": "torch_remat.oom_dump", oops}')
    write(cluster, "empty.json", "")
    write(cluster, "binary.json", pickle.dumps({"rank": 3}))
    write(cluster, "list.json", [1, 2])
    write(cluster, "config.json", {"lr": 0.1})
    write(cluster, "newer.json", dump(3, 1.0, version=2))
    write(cluster, "badrank.json", {**dump(3, 1.0), "rank": "3"})
    write(cluster, "badregions.json", {**dump(3, 1.0), "regions": [{"name": "layers.0"}]})
    write(cluster, ".oom_job-a_rank3_103_1.json.103.tmp", good[:10])
    write(cluster, "model.pt", b"\x80\x04not read at all")
    merge = _oom_merge.merge_dumps(str(cluster))
    assert [d.rank for d in merge.jobs[0].dumps] == [2, 1]
    assert {os.path.basename(s.path): s.reason for s in merge.skipped} == {
        ".oom_job-a_rank3_103_1.json.103.tmp": "half-written: its writer stopped before renaming it into place",
        "badrank.json": "malformed dump: rank is not a non-negative integer",
        "badregions.json": "malformed dump: regions is not a list of {name, bytes}",
        "binary.json": "not UTF-8 text (binary data; dumps are JSON)",
        "config.json": 'not a torch_remat OOM dump (no "format": "torch_remat.oom_dump")',
        "cut.json": "cut off: the JSON ends early (a truncated or half-written file)",
        "empty.json": "empty: a writer that stopped before writing, or not a dump",
        "garbage.json": "not valid JSON (Expecting property name enclosed in double quotes at line 1 column 36)",
        "list.json": 'not a torch_remat OOM dump (no "format": "torch_remat.oom_dump")',
        "newer.json": "written by a newer torch_remat (dump version 2; this reads 1)",
    }
    text = merge.format()
    assert "10 file(s) skipped" in text
    assert "\nskipped:\n  .oom_job-a_rank3_103_1.json.103.tmp: half-written" in text


def test_dumps_are_read_as_json_only(cluster, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the merge must never unpickle")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    write(cluster, "evil.json", pickle.dumps(dump(3, 1.0)))
    merge = _oom_merge.merge_dumps(str(cluster))
    assert len(merge.jobs[0].dumps) == 2 and len(merge.skipped) == 1


def test_a_file_larger_than_the_read_limit_is_not_read(cluster, monkeypatch):
    monkeypatch.setattr(_oom_read, "READ_LIMIT_BYTES", 100)
    merge = _oom_merge.merge_dumps(str(cluster))
    assert merge.jobs == []
    assert {s.reason for s in merge.skipped} == {"larger than 100 B; not read"}


def test_dumps_of_different_jobs_are_kept_apart(cluster, capsys):
    write(cluster, "oom_job-b_rank0_200_1.json", dump(
        0, -60.0, job="job-b", world_size=2, regions=[("layers.0", 999_999)]))
    write(cluster, "oom_nojob_rank0_300_1.json", dump(0, 30.0, job=None, world_size=None))
    merge = _oom_merge.merge_dumps(str(cluster))
    assert [(j.job_id, [d.rank for d in j.dumps]) for j in merge.jobs] == [
        ("job-b", [0]), ("job-a", [2, 1]), (None, [0])]
    job_a = merge.jobs[1]
    assert [r.name for r in job_a.regions()[1]][0] == "layers.0"
    assert job_a.regions()[1][0].max_bytes == 8192  # job-b's 999,999 B stay in job-b
    text = merge.format()
    assert "dumps of different jobs are shown apart; --job ID shows one" in text
    assert "\njob 'job-b': 1 of 2 rank(s) ran out of memory; no dump from rank(s) 1\n" in text
    assert "\n(no job id): 1 rank(s) ran out of memory\n" in text
    assert oom.main([str(cluster), "--job", "job-b", "--json"]) == 0
    assert [j["job_id"] for j in json.loads(capsys.readouterr().out)["jobs"]] == ["job-b"]
    assert oom.main([str(cluster), "--job", "job-z"]) == 1
    assert "no usable OOM dump of job 'job-z'" in capsys.readouterr().err


def test_a_rank_that_ran_out_twice_is_listed_twice_and_compared_by_its_first_dump(cluster):
    write(cluster, "oom_job-a_rank2_102_2.json", dump(2, 9.0, step=8, regions=[("layers.0", 1)]))
    job = _oom_merge.merge_dumps(str(cluster)).jobs[0]
    assert [(d.rank, d.data["step"]) for d in job.dumps] == [(2, 7), (1, 7), (2, 8)]
    assert job.regions()[1][0].bytes_per_rank == [8192, 4096]
    assert "1 later dump(s) of ranks that had already run out are not in the tables" in job.format()


def test_a_dump_without_report_is_named_in_the_notes(tmp_path):
    write(tmp_path, "a.json", dump(0, 0.0, regions=[], errors=["saved-tensors report: not ready"]))
    text = _oom_merge.merge_dumps(str(tmp_path)).format()
    assert "rank 0's dump has no saved-tensors report (saved-tensors report: not ready)" in text
    assert "saved for backward when each rank ran out" not in text


def test_show_prints_one_ranks_full_report(cluster, capsys):
    assert oom.main([str(cluster), "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert out.endswith(
        "rank 1, oom_job-a_rank1_101_1.json\n"
        "RuntimeError: DefaultCPUAllocator: can't allocate memory\n"
        "where: checkpoint 'layers.0' (recompute), region 'mlp'\n"
        "allocator:\n"
        "  process_resident_bytes: 3.00 MiB\n"
        "\n"
        "saved for backward: report of rank 1\n"
    )


def test_empty_and_missing_folders(tmp_path, capsys):
    assert oom.main([str(tmp_path)]) == 1
    assert "no usable OOM dump in" in capsys.readouterr().err
    assert oom.main([str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err


@pytest.mark.slow
def test_module_runs_with_python_dash_m(cluster):
    proc = subprocess.run(
        [sys.executable, "-m", "torch_remat.integrations.oom", str(cluster), "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # runpy warns when the module was imported before it ran
    assert [r["rank"] for r in json.loads(proc.stdout)["jobs"][0]["ran_out"]] == [2, 1]


def test_reading_small_dumps_allocates_far_less_than_the_read_limit(cluster):
    # f.read(limit) allocates the whole limit (64 MiB) before reading a 2 KB file
    tracemalloc.start()
    try:
        _oom_merge.merge_dumps(str(cluster))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_merge_of_64_dumps_lists_ten_and_groups_every_dump_by_step_and_place(tmp_path):
    for rank in range(64):
        early = rank == 40  # ran out a step earlier, in the recompute of layers.0
        write(tmp_path, f"oom_job-a_rank{rank}_{100 + rank}_1.json", dump(
            rank, -1.0 if early else rank / 100, world_size=64, step=6 if early else 7,
            regions=[("layers.0", 16384 if early else 8192)],
            **({"location": {"checkpoint": "layers.0", "phase": "recompute", "region": "mlp"}} if early else {})))
    merge = _oom_merge.merge_dumps(str(tmp_path))
    lines = merge.format().splitlines()
    assert lines[2] == "job 'job-a': 64 of 64 rank(s) ran out of memory"
    assert lines[6].split()[:3] == ["1", "40", "6"]
    assert lines[15].split()[:3] == ["10", "8", "7"]
    assert lines[16:19] == [
        "  ... 54 more dump(s), the last +1.630 s after the first (--json lists every dump); "
        "all dumps by step and place:",
        "    step 6, checkpoint 'layers.0' (recompute), region 'mlp': rank 40",
        "    step 7, checkpoint 'layers.1' (forward), region 'attn': ranks 0-39, 41-63 (63 ranks)",
    ]
    regions = lines[lines.index("saved for backward when each rank ran out (its first dump):") + 1:][:2]
    assert regions == [
        "  region         min  on                                  max  on",
        "  layers.0  8.00 KiB  ranks 0-39, 41-63 (63 ranks)  16.00 KiB  rank 40",
    ]
    assert len(lines) < 40
    assert len(merge.to_dict()["jobs"][0]["ran_out"]) == 64


def test_a_region_a_trimmed_dump_left_out_is_unknown_on_that_rank_not_zero(tmp_path, capsys):
    # rank 0's dump was trimmed to its size bound: layers.32 (32 B) is in its
    # regions_left_out, so rank 0's bytes there are unknown, not 0
    write(tmp_path, "oom_job-a_rank0_100_1.json", dump(
        0, 0.0, regions=[("layers.0", 8192), ("(outside regions)", 16)],
        regions_left_out={"count": 1, "bytes": 32}))
    write(tmp_path, "oom_job-a_rank1_101_1.json", dump(
        1, 0.5, regions=[("layers.0", 4096), ("layers.32", 32), ("(outside regions)", 16)]))
    text = _oom_merge.merge_dumps(str(tmp_path)).format()
    table = text[text.index("saved for backward"):].splitlines()[1:5]
    assert table == [
        "  region                  min  on              max  on         not in the dump of",
        "  layers.0           4.00 KiB  rank 1     8.00 KiB  rank 0",
        "  (outside regions)      16 B  all ranks      16 B  all ranks",
        "  layers.32              32 B  rank 1         32 B  rank 1     rank 0 (left out)",
    ]
    assert ("rank 0's dump left out 1 smaller regions (32 B) to stay within its size bound; "
            "the regions it does not list are unknown on rank 0 and not in their min / max") in text
    assert oom.main([str(tmp_path), "--json"]) == 0
    regions = {r["name"]: r for r in json.loads(capsys.readouterr().out)["jobs"][0]["regions"]}
    assert regions["layers.32"] == {
        "name": "layers.32", "ranks": [0, 1], "bytes_per_rank": [None, 32], "calls_per_rank": [None, 1],
        "min": 32, "min_rank": 1, "max": 32, "max_rank": 1, "ranks_left_out": [0]}
    assert regions["layers.0"]["ranks_left_out"] == []
    assert (regions["layers.0"]["min_rank"], regions["layers.0"]["max_rank"]) == (1, 0)


MALFORMED = {
    "calls_not_an_int": (lambda d: d["regions"][0].update(calls="x"),
                         "malformed dump: regions[0].calls is not a non-negative integer"),
    "left_out_bytes_not_an_int": (lambda d: d.update(regions_left_out={"count": 1, "bytes": "x"}),
                                  "malformed dump: regions_left_out is not {count, bytes} "
                                  "(non-negative integers)"),
    "shape_not_a_list": (lambda d: d["largest_tensors"][0].update(shape=5),
                         "malformed dump: largest_tensors[0].shape is not a list"),
    "largest_tensors_not_a_list": (lambda d: d.update(largest_tensors=5),
                                   "malformed dump: largest_tensors is not a list"),
    "tensor_bytes_negative": (lambda d: d["largest_tensors"][0].update(bytes=-5),
                              "malformed dump: largest_tensors[0].bytes is not a non-negative integer"),
    "errors_not_a_list": (lambda d: d.update(errors=5), "malformed dump: errors is not a list"),
    "step_not_an_int": (lambda d: d.update(step=[1]), "malformed dump: step is not an integer or a string"),
    "location_not_an_object": (lambda d: d.update(location="blocks.1"),
                               "malformed dump: location is not {checkpoint, phase, region}"),
    "error_not_an_object": (lambda d: d.update(error="boom"),
                            "malformed dump: error is not {type, message}"),
    "requested_bytes_negative": (lambda d: d.update(requested_bytes=-1),
                                 "malformed dump: requested_bytes is not a non-negative integer"),
    "allocator_not_an_object": (lambda d: d.update(allocator=[1]),
                                "malformed dump: allocator is not an object"),
    "world_size_not_an_int": (lambda d: d.update(world_size="4"),
                              "malformed dump: world_size is not an integer"),
    "world_size_below_rank": (lambda d: d.update(world_size=1),
                              "malformed dump: world_size 1 does not include its rank 1"),
    "world_size_absurd": (lambda d: d.update(world_size=10**12),
                          "malformed dump: world_size 1000000000000 is more ranks than the "
                          "merge accepts (at most 1048576)"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_dump_is_skipped_with_the_reason_and_the_others_merged(tmp_path, capsys, name):
    change, reason = MALFORMED[name]
    write(tmp_path, "oom_job-a_rank0_100_1.json", dump(
        0, 0.0, regions=[("layers.0", 64)], tensors=[(64, "layers.0::attn", "saved.0", None)]))
    bad = dump(1, 0.5, regions=[("layers.0", 64)], tensors=[(64, "layers.0::attn", "saved.0", None)])
    change(bad)
    write(tmp_path, "oom_job-a_rank1_101_1.json", bad)
    assert oom.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 dump(s) of 1 job(s), 1 file(s) skipped" in out
    assert out.endswith(f"\nskipped:\n  oom_job-a_rank1_101_1.json: {reason}\n")
    assert oom.main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == [
        {"file": "oom_job-a_rank1_101_1.json", "reason": reason}]


def test_ranks_without_a_dump_are_listed_as_ranges_at_the_largest_world_size(tmp_path):
    # a larger world_size is refused as malformed (see MALFORMED["world_size_absurd"])
    write(tmp_path, "a.json", dump(5, 0.0, world_size=2**20))
    write(tmp_path, "b.json", dump(9, 0.1, world_size=2**20))
    job = _oom_merge.merge_dumps(str(tmp_path)).jobs[0]
    assert len(job.ranks_without_dump) == 2**20 - 2
    assert job.format().splitlines()[0] == (
        "job 'job-a': 2 of 1048576 rank(s) ran out of memory; "
        "no dump from rank(s) 0-4, 6-8, 10-1048575")


def test_top_must_not_be_negative_and_zero_leaves_the_tensors_out(cluster, capsys):
    with pytest.raises(SystemExit) as exit_:
        oom.main([str(cluster), "--top", "-3"])
    assert exit_.value.code == 2
    assert "argument --top: must be 0 or more (0 leaves the largest tensors out), got -3" in (
        capsys.readouterr().err)
    assert oom.main([str(cluster), "--top", "0"]) == 0
    out = capsys.readouterr().out
    assert "largest tensors held for backward" not in out
    assert "largest tensors: left out (--top 0)" in out


def test_show_with_json_is_refused_with_a_message(cluster, capsys):
    with pytest.raises(SystemExit) as exit_:
        oom.main([str(cluster), "--json", "--show", "1"])
    assert exit_.value.code == 2
    assert ("--show prints one rank's text report and cannot be combined with --json; "
            "run it without --json") in capsys.readouterr().err


def test_job_empty_selects_the_dumps_without_a_job_id_and_an_unknown_job_names_the_others(
    cluster, capsys
):
    write(cluster, "oom_nojob_rank0_300_1.json", dump(0, 30.0, job=None, world_size=None))
    assert oom.main([str(cluster), "--job", "", "--json"]) == 0
    [job] = json.loads(capsys.readouterr().out)["jobs"]
    assert (job["job_id"], job["ranks_with_dump"]) == (None, [0])
    assert oom.main([str(cluster), "--job", "nope"]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == (
        f"torch_remat OOM dumps in {cluster}: no dump of job 'nope'; the folder holds 3 dump(s) "
        "of job 'job-a' and (no job id), 0 file(s) skipped")
    assert captured.err == (
        f"torch-remat-oom: no usable OOM dump of job 'nope' in {cluster}; it holds dumps of job "
        "'job-a' and (no job id): pass one of them to --job (--job '' for dumps without a job id)\n")
