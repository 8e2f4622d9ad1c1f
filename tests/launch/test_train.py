"""launch/train.py end to end: every --parallel mode on 2 ranks (gloo) without a
warning, identical losses across --remat policies, a falling loss, the memory report
in one process, and a resumed run after a crash (injected by tests/launch/example.py)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import set_plugin_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["--layers", "2", "--dim", "32", "--heads", "4", "--seq-len", "32", "--batch-size", "4"]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


# A device whose copies cost nothing next to its compute: offloading what a block keeps
# is predicted cheaper than recomputing it, whatever the machine's load (a calibrated
# profile of a shared CPU decides either way from run to run).
OFFLOAD_FAVOURED = {"name": "slow compute, free copies", "flops": {"float32": 1e8},
                    "memory_bandwidth": 1e9, "host_link_bandwidth": 1e13, "overlap_copies": True}


@pytest.fixture(autouse=True)
def _children_run_under_this_runs_plugins(pytestconfig, monkeypatch):
    set_plugin_env(pytestconfig, monkeypatch)


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    # launch/run.sh runs `torchrun` (and `python`) from PATH: this interpreter's.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.pop("WORLD_SIZE", None)
    return env


def run(cmd, env, timeout):
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def train(tmp_path, *args, nproc=None, max_restarts=0, timeout=240, faults=(), small=True):
    """Run launch/train.py (``nproc``: under torchrun; ``faults``: injected through
    tests/launch/example.py); returns its JSON log, its stdout and its stderr."""
    log = tmp_path / f"log{len(list(tmp_path.iterdir()))}.json"
    script = [str(ROOT / "launch" / "train.py")]
    if faults:
        script = [str(ROOT / "tests" / "launch" / "example.py"), "train", *faults]
    script += [*(SMALL if small else []), "--log-json", str(log), *args]
    if nproc is None:
        cmd = [sys.executable, *script]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), *script,
        ]
    proc = run(cmd, _env(), timeout)
    return json.loads(log.read_text()), proc.stdout, proc.stderr


def run_sh(*args, timeout=300):
    """``bash launch/run.sh ARGS`` as the README runs it (2 CPU ranks), on this .venv."""
    cmd = ["bash", str(ROOT / "launch" / "run.sh"), *args]
    return run(cmd, _env(TORCH_REMAT_NO_SETUP="1", NPROC="2"), timeout)


def losses(result):
    return [result["losses"][k] for k in sorted(result["losses"], key=int)]


def test_main_job_on_two_ranks_prints_what_the_readme_quotes(docs_check):
    proc = run_sh()  # the README's Quick start: FSDP2, selective remat, 40 steps, report
    assert "Warning" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    docs_check.check("readme-main-job", proc.stdout)


def test_losses_identical_across_remat_policies_under_ddp(tmp_path):
    runs = {r: losses(train(tmp_path, "--parallel", "ddp", "--steps", "3", "--remat", r, nproc=2)[0])
            for r in ("none", "full", "selective")}
    assert runs["none"] == runs["full"] == runs["selective"]


def test_losses_identical_across_remat_policies_single_process(tmp_path, docs_check):
    policies = ("none", "selective", "keep=up,down", "full")
    runs = {r: train(tmp_path, "--steps", "2", "--remat", r, small=False)[0] for r in policies}
    assert losses(runs["none"]) == losses(runs["full"]) == losses(runs["selective"])
    assert losses(runs["none"]) == losses(runs["keep=up,down"])
    saved = {r: runs[r]["saved_bytes"]["1"][0] for r in policies}
    rows = [f"| `{r}` | {saved[r] / 2**20:.2f} MiB | {saved[r] / saved['none']:.2f} |" for r in policies]
    docs_check.check("readme-remat-policies", "\n".join(
        ["| `--remat` | saved for backward | vs none |", "|---|---|---|", *rows]))


def test_report_in_one_process_prints_each_blocks_saved_bytes(tmp_path):
    _, out, _ = train(tmp_path, "--steps", "2", "--report")
    assert "saved for backward: " in out
    assert "x2: blocks.0-1" in out  # both blocks hold the same bytes


def test_remat_budget_plans_on_the_first_step_and_trains_like_no_remat(tmp_path):
    planned, out, err = train(tmp_path, "--steps", "3", "--remat", "budget=0.6")
    plain, _, _ = train(tmp_path, "--steps", "3", "--remat", "none")
    assert losses(planned) == losses(plain)
    assert "USDT" not in err and "profiler_start" not in err  # the measuring steps are quiet
    assert "remat plan for 2 blocks: budget" in out and "(equal)" in out
    assert "blocks.0" in out and "saved for backward r0=" in out


def test_forecast_prints_before_training_and_plans_the_offloads_the_first_step_measures(tmp_path):
    # --offload 0: every kept tensor may move; the forecast weighs the copies with the
    # device profile the plan on the first step uses (one where copies cost nothing next
    # to the compute, so offloading is the cheaper choice on any machine)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(OFFLOAD_FAVOURED))
    offloaded, out, err = train(tmp_path, "--steps", "2", "--remat", "budget=0.2", "--forecast",
                                "--offload", "0", "--device-profile", str(profile))
    plain, _, _ = train(tmp_path, "--steps", "2", "--remat", "none")
    assert losses(offloaded) == losses(plain)  # (calibrating draws no dropout mask)
    assert "USDT" not in err and "profiler_start" not in err  # the measuring steps are quiet
    # a line first, so that the wait for the fake runs is not silent; then the forecast
    # (its own plan table indented), then the plan measured on the first step, at the
    # start of a line
    assert out.startswith("torch_remat train: --forecast: running each option of a block once on fake tensors")
    forecast, plan = out.index("remat forecast for 2 blocks"), out.index("\nremat plan for 2 blocks")
    assert forecast < plan
    assert "device memory 80.00 GiB" in out and "largest micro-batch" in out  # --device-memory's default
    forecast_plan, first_step_plan = out[forecast:plan].split("remat plan for 2 blocks")[1], out[plan:]
    for text in (forecast_plan, first_step_plan):
        assert "offloaded to host: blocks.0" in text and "OFFLOAD: what it keeps" in text, out[-3000:]
    assert forecast_plan.split("measured ")[1].split(" B")[0] == first_step_plan.split("measured ")[1].split(" B")[0]
    assert "predicted added time (slow compute, free copies)" in out


@pytest.mark.parametrize("args", [["--remat", "selective", "--forecast"], ["--remat", "budget=0.6", "--forecast", "--device-memory", "80 gigs"]])
def test_forecast_usage_errors(args):
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), *args], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "train.py: error: --forecast" in proc.stderr, proc.stderr[-2000:]


def test_loss_falls_over_20_steps(tmp_path):
    curve = losses(train(tmp_path, "--steps", "20", "--remat", "selective", "--lr", "1e-2")[0])
    assert len(curve) == 20
    assert sum(curve[-3:]) / 3 < 0.85 * sum(curve[:3]) / 3


@pytest.fixture(scope="module")
def fsdp2_8_steps(tmp_path_factory):
    """The losses of 8 uninterrupted steps under FSDP2 on 2 ranks (steps 1-n of a
    longer run are those of an n-step run: no schedule depends on --steps)."""
    return losses(train(tmp_path_factory.mktemp("fsdp2"), "--parallel", "fsdp2", "--steps", "8",
                        nproc=2)[0])


def test_with_offload_the_plan_moves_kept_tensors_to_host_and_trains_as_without(tmp_path, fsdp2_8_steps):
    # --offload 0: every tensor may move (the launcher's model has none of 1 MiB). The
    # same model, seed and layout as fsdp2_8_steps, whose remat policy offloads nothing:
    # the losses of its first two steps are those of this run, bit for bit.
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(OFFLOAD_FAVOURED))
    result, out, err = train(tmp_path, "--parallel", "fsdp2", "--remat", "budget=0.15", "--steps", "2",
                             "--offload", "0", "--device-profile", str(profile), nproc=2)
    assert "Traceback" not in err, err[-3000:]
    assert "offloaded to host: blocks." in out and "OFFLOAD: what it keeps" in out, out[-3000:]
    assert "measured " in out and "(equal)" in out, out[-3000:]
    assert "nothing offloaded" not in out
    assert losses(result) == fsdp2_8_steps[:2]


@pytest.mark.slow
def test_crashed_rank_restarts_and_resumes_exactly_from_checkpoint(tmp_path, fsdp2_8_steps):
    ckpt = tmp_path / "ckpt"
    result, out, _ = train(
        tmp_path, "--parallel", "fsdp2", "--steps", "8", "--save-every", "4",
        "--checkpoint-dir", str(ckpt), nproc=2, max_restarts=1, faults=("--fail-at-step", "6"),
    )
    assert "(resumed at step 4)" in out
    # The log keeps the first attempt's steps 1-4; the dropout masks after the
    # resume are the uninterrupted run's (every rank's generators were saved).
    assert result["resumed_at"] == [4]
    assert losses(result) == fsdp2_8_steps  # bitwise: the same floats
    assert json.loads((ckpt / "latest.json").read_text()) == {"step": 8}
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest.json", "step4", "step8"]


@pytest.mark.slow
def test_a_checkpoint_saved_under_fsdp2_resumes_under_ddp_on_as_many_ranks_exactly(tmp_path, fsdp2_8_steps):
    # Before: the resume said each rank's batches differ from the saved run's; they do
    # not, and the resumed run is the uninterrupted one, bit for bit.
    ckpt = tmp_path / "ckpt"
    train(tmp_path, "--parallel", "fsdp2", "--steps", "4", "--checkpoint-dir", str(ckpt), nproc=2)
    resumed, out, _ = train(tmp_path, "--parallel", "ddp", "--steps", "6", "--checkpoint-dir", str(ckpt),
                            nproc=2)
    assert "(resumed at step 4)" in out
    assert (f"{ckpt / 'step4'} was saved with --parallel fsdp2 on 2 rank(s), and this run is --parallel "
            "ddp on 2: the model and optimizer states are resharded on loading; each rank trains on "
            "the batches, and draws the dropout masks, it would have in the run saved there") in out, out
    assert "differ" not in out
    assert losses(resumed) == fsdp2_8_steps[:6]  # bitwise: the same floats
