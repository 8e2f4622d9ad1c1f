"""launch/train_accelerate.py end to end under torchrun on 2 CPU ranks."""

import os
import pathlib
import subprocess
import sys

import pytest
from helpers import plugin_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytest.importorskip("accelerate", reason="needs the 'accelerate' extra")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ARGS = ["--steps", "6", "--seq-len", "32", "--dim", "32", "--batch-size", "4"]


@pytest.fixture(scope="module")
def run(pytestconfig):
    env = plugin_env(pytestconfig, dict(os.environ, OMP_NUM_THREADS="1"))
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "launch" / "example.py"), "train_accelerate", *ARGS]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_every_rank_destroys_its_process_group_before_exit(run):
    assert run.stdout.count("process group initialized after main: False") == 2


def test_output_is_what_the_docs_quote(run, docs_check):
    # Both ranks print the line at exit, so their writes can interleave ("...False"
    # followed by the other rank's whole line and two newlines): drop every copy.
    out = run.stdout.replace("process group initialized after main: False", "")
    docs_check.check("train-accelerate", "".join(line + "\n" for line in out.splitlines() if line))
