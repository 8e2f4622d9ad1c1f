"""forecast_remat(layout=...) against 2 gloo ranks under torchrun: each rank's
forecast (made on a fake process group before the real one starts) equals what
that rank measures after sharding the model for real, for FSDP2, tensor parallel
(sequence parallel) and DDP. One launch runs every check of forecast_checks.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from dist_harness import HERE, assert_check_passed
from helpers import plugin_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CHECK_NAMES = [
    "check_fsdp2_forecast_of_each_rank_equals_its_measurement",
    "check_tensor_parallel_forecast_of_each_rank_equals_its_measurement",
    "check_ddp_forecast_equals_the_replica",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory, pytestconfig):
    out_dir = str(tmp_path_factory.mktemp("forecast"))
    env = plugin_env(pytestconfig, dict(os.environ, OMP_NUM_THREADS="1", KINETO_LOG_LEVEL="6"))
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    env.pop("WORLD_SIZE", None)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2",
         os.path.join(HERE, "forecast_checks.py"), out_dir],
        env=env, capture_output=True, text=True, timeout=600,
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
def test_2_ranks_forecast_equals_measurement(results, check, record_property):
    data = assert_check_passed(results, check)
    for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "kept_bytes"):
        record_property(key, data[key])
