"""Launch a checks module on N ranks once and hand its results to pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import plugin_env

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH_TIMEOUT_S = 600  # the 2-rank checks compile two blocks per rank


def launch(module_name: str, world_size: int, out_dir: str, config) -> list[dict]:
    """Run ``dist_worker.py`` for ``module_name`` and return each rank's results; the
    ranks run under the ``-p`` plugins of pytest's ``config`` (``helpers.plugin_env``)."""
    env = plugin_env(config)
    # the checks import from this folder and tests/ (helpers.py)
    env["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "dist_worker.py"),
            module_name,
            str(world_size),
            out_dir,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    results = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if not os.path.exists(path):
            raise RuntimeError(
                f"rank {rank} of {module_name} wrote no results (exit code {proc.returncode}).\n"
                f"stderr:\n{proc.stderr[-6000:]}"
            )
        with open(path) as f:
            results.append(json.load(f))
    return results


def check_names(module_name: str) -> list[str]:
    """Names of the checks in ``module_name`` (imported in this process)."""
    sys.path.insert(0, HERE)
    module = __import__(module_name)
    return [c.__name__ for c in module.CHECKS]


def assert_check_passed(results: list[dict], name: str) -> dict:
    """Fail with every rank's traceback unless ``name`` passed on all ranks; return
    rank 0's data."""
    errors = []
    for rank, per_rank in enumerate(results):
        result = per_rank.get(name)
        if result is None:
            errors.append(f"rank {rank}: check did not run (an earlier check hung or crashed)")
        elif not result["ok"]:
            errors.append(f"rank {rank}:\n{result['error']}")
    if errors:
        raise AssertionError(f"check {name} failed:\n" + "\n".join(errors))
    return results[0][name]["data"]
