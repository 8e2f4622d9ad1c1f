"""Cluster OOM diagnosis on 3 real gloo ranks: one launch runs every check of
checks_oom_3rank.py (one rank runs out, its dump is written, the others keep
their state); the tests below assert each check and merge the dump folder with the
command a user runs, ``python -m torch_remat.integrations.oom DIR``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from checks_oom_3rank import JOB, OTHER_JOB
from dist_harness import assert_check_passed, check_names, launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def launched(tmp_path_factory, pytestconfig):
    out_dir = str(tmp_path_factory.mktemp("oom3"))
    return launch("checks_oom_3rank", 3, out_dir, pytestconfig), os.path.join(out_dir, "scratch", "oom")


def merge(folder, *args):
    proc = subprocess.run(
        [sys.executable, "-m", "torch_remat.integrations.oom", folder, *args],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("check", check_names("checks_oom_3rank"))
def test_3_ranks(launched, check):
    assert_check_passed(launched[0], check)


def test_merge_names_the_rank_that_ran_out_first_and_its_region(launched):
    _, folder = launched
    out = json.loads(merge(folder, "--json"))
    jobs = {j["job_id"]: j for j in out["jobs"]}
    assert set(jobs) == {JOB, OTHER_JOB} and out["skipped"] == []
    job = jobs[JOB]
    assert (job["world_size"], job["ranks_with_dump"], job["ranks_without_dump"]) == (3, [1, 2], [0])
    first, second = job["ran_out"]
    assert (first["rank"], first["step"], first["location"]) == (
        1, 2, {"checkpoint": "layers.1", "phase": "forward", "region": "attn"})
    assert (second["rank"], second["step"], second["location"]) == (
        2, 3, {"checkpoint": "layers.0", "phase": "recompute", "region": "mlp"})
    assert second["seconds_after_first"] > 0
    regions = {r["name"]: r for r in job["regions"]}
    assert regions["layers.0"]["ranks"] == [1, 2]
    assert {r["rank"] for r in job["largest_tensors"]} == {1, 2}
    # the other job's dump stays in its own job
    assert [r["rank"] for r in jobs[OTHER_JOB]["ran_out"]] == [0]


def test_merge_text_for_one_job(launched):
    _, folder = launched
    text = merge(folder, "--job", JOB)
    lines = text.splitlines()
    assert lines[2] == f"job '{JOB}': 2 of 3 rank(s) ran out of memory; no dump from rank(s) 0"
    row1, row2 = lines[6], lines[7]
    assert row1.split()[:3] == ["1", "1", "2"]
    assert "checkpoint 'layers.1' (forward), region 'attn'" in row1
    assert row2.split()[:3] == ["2", "2", "3"]
    assert "checkpoint 'layers.0' (recompute), region 'mlp'" in row2
    assert "largest tensors held for backward:" in text
    print(text)


# docs/distributed.md quotes both merges with the folder as /tmp/oom3/scratch/oom
DOCS_FOLDER = "/tmp/oom3/scratch/oom"


@pytest.mark.slow
def test_the_docs_quote_the_merge_of_the_two_jobs(launched, docs_check):
    _, folder = launched
    assert docs_check.quoted_commands("distributed-oom-3-ranks") == [f"torch-remat-oom {DOCS_FOLDER}"]
    docs_check.check("distributed-oom-3-ranks", merge(folder).replace(folder, DOCS_FOLDER))


@pytest.mark.slow
def test_the_docs_quote_what_the_merge_says_of_unusable_files(launched, docs_check, tmp_path):
    _, folder = launched
    copy = tmp_path / "oom"
    shutil.copytree(folder, copy)
    dump = sorted(copy.glob("oom_*.json"))[0].read_text()
    (copy / "oom_cut.json").write_text(dump[: len(dump) // 2])
    (copy / ".oom_copy_rank0_1234_1.json.1234.tmp").write_text(dump[:100])
    (copy / "config.json").write_text('{"lr": 0.1}')
    text = merge(str(copy))
    docs_check.check("distributed-oom-skipped", text[text.index("skipped:") :])
