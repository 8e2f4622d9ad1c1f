"""launch/train.py --oom-dump-dir under torchrun: the last of 2 ranks runs out of
memory inside the last block (tests/launch/example.py --oom-at-step: a 1 PiB request
its allocator refuses),
writes its dump and fails the job; the merge command names it and the block."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import plugin_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["--layers", "2", "--dim", "32", "--heads", "4", "--seq-len", "32", "--batch-size", "4"]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_train_with_oom_dump_dir_writes_the_failing_ranks_dump(tmp_path, docs_check, pytestconfig):
    folder = tmp_path / "oom"
    env = plugin_env(pytestconfig, dict(os.environ, OMP_NUM_THREADS="1"))
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tests" / "launch" / "example.py"), "train", "--oom-at-step", "3",
         *SMALL, "--parallel", "ddp", "--steps", "4", "--oom-dump-dir", str(folder)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode != 0  # the error still fails the job
    assert "DefaultCPUAllocator: can't allocate memory" in proc.stderr
    [name] = os.listdir(folder)
    with open(folder / name) as f:
        dump = json.load(f)
    assert (dump["rank"], dump["world_size"], dump["step"], dump["requested_bytes"]) == (1, 2, 3, 2**50)
    assert dump["location"] == {"checkpoint": "blocks.1", "phase": "forward", "region": None}
    assert dump["job_id"] and name.startswith(f"oom_{dump['job_id']}_rank1_")  # torchrun's run id
    assert "rank 1 ran out of memory at step 3 in checkpoint 'blocks.1' (forward)" in proc.stderr
    # blocks.0 had finished its forward: its SAVE regions (the Linears) hold memory
    assert {r["name"] for r in dump["regions"]} == {"blocks.0", "blocks.1", "(outside regions)"}
    # docs/distributed.md quotes this run and its merge, with the folder as /tmp/oom
    train_command, = docs_check.quoted_commands("distributed-oom-train")
    assert train_command.split() == [
        "torchrun", "--standalone", "--nproc-per-node", "2", "tests/launch/example.py", "train",
        "--oom-at-step", "3", *SMALL, "--parallel", "ddp", "--steps", "4", "--oom-dump-dir", "/tmp/oom"]
    assert docs_check.quoted_commands("distributed-oom-merge") == ["torch-remat-oom /tmp/oom"]
    docs_check.check("distributed-oom-train", (proc.stdout + proc.stderr).replace(str(folder), "/tmp/oom"))

    merged = subprocess.run(
        [sys.executable, "-m", "torch_remat.integrations.oom", str(folder)],
        capture_output=True, text=True, timeout=120,
    )
    assert merged.returncode == 0, merged.stderr
    docs_check.check("distributed-oom-merge", merged.stdout.replace(str(folder), "/tmp/oom"))
    lines = merged.stdout.splitlines()
    assert lines[2] == f"job '{dump['job_id']}': 1 of 2 rank(s) ran out of memory; no dump from rank(s) 0"
    assert lines[6].split()[:3] == ["1", "1", "3"]
    assert "checkpoint 'blocks.1' (forward)" in lines[6]
