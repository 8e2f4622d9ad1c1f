"""accelerate: remat in place of torch's checkpoint wrapper, on 2 gloo ranks under torchrun.

One ``torchrun --standalone --nproc-per-node 2`` launch runs every check of
accelerate_checks.py in order; each test below asserts that one check passed on
both ranks.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from dist_harness import HERE, assert_check_passed
from helpers import plugin_env

pytest.importorskip("accelerate", reason="needs the 'accelerate' extra")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CHECK_NAMES = [
    "check_accelerate_drops_the_fsdp_plugin_on_cpu",
    "check_example_losses_equal_with_and_without_remat",
    "check_ddp_gradients_equal_with_and_without_remat",
    "check_fsdp2_plugin_checkpointing_is_replaced_by_remat",
    "check_fsdp2_plugin_offload_runs_remat_under_save_on_cpu",
    "check_dynamo_backend_traces_the_checkpoints_with_the_gradients_of_eager_remat",
]
LAUNCH_TIMEOUT_S = 600  # one check compiles the model


@pytest.fixture(scope="module")
def results(tmp_path_factory, pytestconfig):
    out_dir = str(tmp_path_factory.mktemp("accelerate"))
    env = plugin_env(pytestconfig, dict(os.environ, OMP_NUM_THREADS="1"))
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            os.path.join(HERE, "accelerate_checks.py"),
            out_dir,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    paths = [os.path.join(out_dir, f"rank{rank}.json") for rank in range(2)]
    missing = [path for path in paths if not os.path.exists(path)]
    if missing:
        raise RuntimeError(
            f"no results in {missing} (torchrun exit code {proc.returncode}).\n"
            f"stderr:\n{proc.stderr[-6000:]}"
        )
    return [json.loads(pathlib.Path(path).read_text()) for path in paths]


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_2_ranks_under_torchrun(results, check, record_property):
    data = assert_check_passed(results, check)
    for key, value in data.items():
        record_property(key, value)
