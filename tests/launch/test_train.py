"""launch/train.py end to end: every --parallel mode on 2 ranks (gloo), identical
losses across --remat policies, a falling loss, and a resumed run after a crash."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["--layers", "2", "--dim", "32", "--heads", "4", "--seq-len", "32", "--batch-size", "4"]
pytestmark = pytest.mark.distributed


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("WORLD_SIZE", None)
    return env


def train(tmp_path, *args, nproc=None, max_restarts=0, timeout=240):
    log = tmp_path / f"log{len(list(tmp_path.iterdir()))}.json"
    script = [str(ROOT / "launch" / "train.py"), *SMALL, "--log-json", str(log), *args]
    if nproc is None:
        cmd = [sys.executable, *script]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), *script,
        ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(log.read_text()), proc.stdout


def losses(result):
    return [result["losses"][k] for k in sorted(result["losses"], key=int)]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2", "tp", "fsdp2+tp"])
def test_parallel_mode_runs_on_two_ranks(tmp_path, parallel):
    result, out = train(tmp_path, "--parallel", parallel, "--steps", "3", nproc=2)
    assert result["world"] == 2
    assert len(result["losses"]) == 3
    assert f"parallel={parallel} remat=selective ranks=2" in out
    assert "activations r0=" in out and " r1=" in out


def test_losses_identical_across_remat_policies_under_ddp(tmp_path):
    runs = {r: losses(train(tmp_path, "--parallel", "ddp", "--steps", "3", "--remat", r, nproc=2)[0])
            for r in ("none", "full", "selective")}
    assert runs["none"] == runs["full"] == runs["selective"]


def test_losses_identical_across_remat_policies_single_process(tmp_path):
    runs = {r: losses(train(tmp_path, "--steps", "4", "--remat", r)[0]) for r in ("none", "full", "selective")}
    assert runs["none"] == runs["full"] == runs["selective"]


def test_remat_budget_plans_on_the_first_step_and_trains_like_no_remat(tmp_path):
    planned, out = train(tmp_path, "--steps", "3", "--remat", "budget=0.6")
    plain, _ = train(tmp_path, "--steps", "3", "--remat", "none")
    assert losses(planned) == losses(plain)
    assert "remat plan for 2 blocks: budget" in out and "(equal)" in out
    assert "blocks.0" in out and "activations r0=" in out


def test_loss_falls_over_20_steps(tmp_path):
    curve = losses(train(tmp_path, "--steps", "20", "--remat", "selective", "--lr", "1e-2")[0])
    assert len(curve) == 20
    assert sum(curve[-3:]) / 3 < 0.85 * sum(curve[:3]) / 3


def test_crashed_rank_restarts_and_resumes_from_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    result, out = train(
        tmp_path, "--parallel", "fsdp2", "--steps", "8", "--save-every", "4",
        "--fail-at-step", "6", "--checkpoint-dir", str(ckpt), nproc=2, max_restarts=1,
    )
    assert "(resumed at step 4)" in out
    assert sorted(int(k) for k in result["losses"]) == [5, 6, 7, 8]
    assert json.loads((ckpt / "latest.json").read_text()) == {"step": 8}
