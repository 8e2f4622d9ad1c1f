"""launch/ as an operator uses it: checkpoints that survive a crash, a bad disk and a
re-run, usage errors without tracebacks, one process for --parallel none, and a
setup that runs only when needed, in a venv per torch version."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from checkpoint_damage import flip_a_byte_of_tensor_data
from helpers import set_plugin_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["--layers", "2", "--dim", "32", "--heads", "4", "--seq-len", "32", "--batch-size", "4"]
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _children_run_under_this_runs_plugins(pytestconfig, monkeypatch):
    set_plugin_env(pytestconfig, monkeypatch)


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env.pop("WORLD_SIZE", None)
    return env


def train(*args, expect=0, timeout=240):
    """``python launch/train.py SMALL ARGS`` in one process."""
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), *SMALL, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def run_sh(*args, expect=0, timeout=300):
    cmd = ["bash", str(ROOT / "launch" / "run.sh"), *SMALL, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(TORCH_REMAT_NO_SETUP="1", NPROC="2"),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(log: pathlib.Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads(log.read_text())["losses"].items()}


@pytest.fixture(scope="module")
def uninterrupted_run_sh(tmp_path_factory):
    """``uninterrupted_run_sh(n)``: the losses of steps 1-n of ``run.sh SMALL`` without
    interruption (FSDP2 on 2 ranks), from one run of at least 8 steps shared by the
    tests (steps 1-n of a longer run are those of an n-step run: no schedule depends
    on --steps)."""
    runs: dict[int, dict[int, float]] = {}

    def losses_to(n: int) -> dict[int, float]:
        longest = max(runs, default=0)
        if n > longest:
            log = tmp_path_factory.mktemp("uninterrupted") / "log.json"
            run_sh("--no-report", "--steps", str(max(n, 8)), "--log-json", str(log))
            longest = max(n, 8)
            runs[longest] = losses(log)
        return {k: v for k, v in runs[longest].items() if k <= n}

    return losses_to


def test_checkpoints_keep_k_refuse_a_rerun_and_skip_corrupt_ones(tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    uninterrupted = tmp_path / "uninterrupted.json"
    train("--steps", "8", "--log-json", str(uninterrupted))

    common = ["--save-every", "2", "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    train("--steps", "6", "--keep-checkpoints", "2", *common)
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest.json", "step4", "step6"]

    again = train("--steps", "6", *common)
    assert "holds step 6 and --steps is 6: this run is finished" in again.stdout
    assert "step    1/6" not in again.stdout

    # A corrupt latest.json and newest checkpoint, and an unfinished save: the run
    # says so and resumes from step 4, exactly where the uninterrupted run was.
    (ckpt / "latest.json").write_text("{")
    (next((ckpt / "step6").glob("*.distcp"))).write_bytes(b"\0" * 64)
    (ckpt / "step7.tmp").mkdir()
    (ckpt / "step7.tmp" / "__0_0.distcp").write_bytes(b"half")
    resumed = train("--steps", "8", *common)
    assert f"{ckpt / 'latest.json'} is unreadable" in resumed.stdout
    assert f"checkpoint {ckpt / 'step6'} is unreadable" in resumed.stdout
    assert "(resumed at step 4)" in resumed.stdout
    assert losses(log) == losses(uninterrupted)  # bitwise: the same floats
    assert json.loads(log.read_text())["resumed_at"] == [4]
    assert "Warning" not in resumed.stderr, resumed.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest.json", "step4", "step6", "step8"]


def test_a_checkpoint_missing_or_with_a_damaged_rng_file_of_rank_1_is_skipped_naming_it(tmp_path, uninterrupted_run_sh):
    # Before: a folder without rank 1's rng/rank1.pt was resumed (rank 1's generator
    # not restored, the losses after it not the uninterrupted run's) with a line
    # blaming "this number of ranks"; one with a truncated file was skipped, but rank 0
    # said only that it failed "on another rank".
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    common = ["--no-report", "--save-every", "2", "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    run_sh("--steps", "6", *common)
    (ckpt / "step6" / "rng" / "rank1.pt").unlink()
    rng4 = ckpt / "step4" / "rng" / "rank1.pt"
    rng4.write_bytes(rng4.read_bytes()[:50])
    resumed = run_sh("--steps", "7", *common)
    assert (f"checkpoint {ckpt / 'step6'} is unreadable (rng/rank1.pt is missing: the run saved "
            "there had 2 rank(s)") in resumed.stdout, resumed.stdout
    # (the size its checksums.json records tells, before anything is loaded)
    assert (f"checkpoint {ckpt / 'step4'} is unreadable (rng/rank1.pt is 50 bytes, and "
            in resumed.stdout), resumed.stdout
    assert "no random generator states" not in resumed.stdout
    assert "(resumed at step 2)" in resumed.stdout
    assert losses(log) == uninterrupted_run_sh(7)  # bitwise: the same floats


def test_a_shard_of_rank_1_whose_bytes_changed_on_disk_is_refused_with_one_line(tmp_path):
    # Before: the resume loaded it without a word, and trained on from damaged weights.
    ckpt = tmp_path / "ckpt"
    common = ["--no-report", "--save-every", "2", "--checkpoint-dir", str(ckpt)]
    run_sh("--steps", "4", *common)
    shard = ckpt / "step4" / "__1_0.distcp"
    flip_a_byte_of_tensor_data(shard)
    refused = run_sh("--steps", "6", *common, expect=2)
    assert refused.stderr.count(
        f"train.py: error: --checkpoint-dir {ckpt}: step 4's file {shard} does not match the "
        "checksum recorded when it was saved") == 1, refused.stderr[-3000:]
    assert f"move {ckpt / 'step4'} out of {ckpt} (or delete it)" in refused.stderr
    assert "Traceback" not in refused.stderr and "resumed at" not in refused.stdout


def test_a_new_launch_refuses_another_runs_log_json_on_every_rank_with_one_line(tmp_path):
    log = tmp_path / "log.json"
    log.write_text(json.dumps({"losses": {"1": 4.0, "2": 3.5}, "saved_bytes": {}, "world": 2}))
    refused = run_sh("--no-report", "--steps", "2", "--log-json", str(log), expect=2)
    assert refused.stderr.count(f"train.py: error: --log-json {log}: the file holds another run's "
                                "log (steps 1-2)") == 1, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr and "loss" not in refused.stdout
    assert json.loads(log.read_text())["losses"] == {"1": 4.0, "2": 3.5}


def test_the_last_step_is_saved_between_save_every_steps(tmp_path):
    # Before, --steps 3 --save-every 2 kept step 2 only: the trained model was lost,
    # and the same command again trained step 3 once more.
    ckpt = tmp_path / "ckpt"
    common = ["--save-every", "2", "--checkpoint-dir", str(ckpt)]
    train("--steps", "3", *common)
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest.json", "step2", "step3"]
    assert json.loads((ckpt / "latest.json").read_text()) == {"step": 3}
    again = train("--steps", "3", *common)
    assert "holds step 3 and --steps is 3: this run is finished" in again.stdout


@pytest.mark.parametrize(
    "launcher, signum, whom",
    [("run.sh", signal.SIGINT, "group"), ("run.sh", signal.SIGTERM, "launcher"),
     ("run.sh", signal.SIGTERM, "one rank"), ("one process", signal.SIGINT, "launcher")],
    ids=["ctrl-c-under-torchrun", "sigterm-to-torchrun", "sigterm-to-one-rank", "ctrl-c-one-process"],
)
def test_a_signal_ends_each_rank_with_one_line_and_the_run_resumes_exactly(tmp_path, launcher, signum, whom,
                                                                          uninterrupted_run_sh):
    # Before: every rank printed a KeyboardInterrupt (or torchrun's SignalException)
    # traceback, and the launch ended with torchrun's status 1 or its own traceback.
    ckpt, log, uninterrupted = tmp_path / "ckpt", tmp_path / "log.json", tmp_path / "full.json"
    common = ["--no-report", "--save-every", "2", "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    if launcher == "run.sh":
        cmd, env, ranks = ["bash", str(ROOT / "launch" / "run.sh"), *SMALL], _env(TORCH_REMAT_NO_SETUP="1", NPROC="2"), 2
    else:
        cmd, env, ranks = [sys.executable, str(ROOT / "launch" / "train.py"), *SMALL], _env(), 1
    proc = subprocess.Popen([*cmd, "--steps", "100000", *common], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (ckpt / "latest.json").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        if whom == "group":
            os.killpg(proc.pid, signum)  # Ctrl-C: the terminal signals every process of the job
        elif whom == "one rank":
            # a worker ended alone (kill PID of one rank): torchrun then stops the others
            # (run.sh execs launch/torchrun.py, whose children are the workers)
            children = pathlib.Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            os.kill(int(children[-1]), signum)
        else:
            proc.send_signal(signum)  # kill PID, or a scheduler ending the job
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, out[-3000:] + err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    saved = json.loads((ckpt / "latest.json").read_text())["step"]
    name = signal.Signals(signum).name
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == ranks, err[-3000:]
    for who in [f"rank {r}: " for r in range(ranks)] if ranks > 1 else [""]:
        assert sum(f"torch_remat train: {who}interrupted by {name} " in line for line in lines) == 1, lines
    for line in lines:
        assert " step " in line.split(";")[0], line  # where it was
        assert (f"the last saved checkpoint is step {saved} ({ckpt / f'step{saved}'}); the same command "
                "resumes from it") in line, line
    assert not list(ckpt.glob("*.tmp")) or all(not (p / ".metadata").exists() for p in ckpt.glob("*.tmp"))

    if whom == "one rank":
        return  # (the resume is that of the signal to the launch)
    # resumed, the run is the uninterrupted one, bit for bit
    steps = ["--steps", str(saved + 2)]
    resumed = subprocess.run([*cmd, *steps, *common], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0 and f"(resumed at step {saved})" in resumed.stdout, resumed.stderr[-3000:]
    if launcher == "run.sh":
        assert losses(log) == uninterrupted_run_sh(saved + 2)
        return
    full = subprocess.run([*cmd, *steps, "--no-report", "--log-json", str(uninterrupted)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert full.returncode == 0, full.stderr[-3000:]
    assert losses(log) == losses(uninterrupted)


def test_unwritable_checkpoint_dir_fails_before_training(tmp_path):
    ckpt = tmp_path / "read-only"
    ckpt.mkdir()
    ckpt.chmod(0o555)
    if os.access(ckpt, os.W_OK):  # root writes anywhere, but not in /sys
        ckpt = pathlib.Path("/sys")
    proc = train("--steps", "4", "--checkpoint-dir", str(ckpt), expect=2)
    assert f"--checkpoint-dir {ckpt}: cannot write there" in proc.stderr
    assert "torch_remat train:" not in proc.stdout and "Traceback" not in proc.stderr


def test_run_sh_parallel_none_trains_in_one_process(tmp_path):
    proc = run_sh("--parallel", "none", "--steps", "2")
    assert proc.stdout.count("torch_remat train:") == 1
    assert "parallel=none remat=selective ranks=1" in proc.stdout
    assert proc.stdout.count("step    2/2") == 1


@pytest.mark.parametrize("budget", ["budget=auto", "budget=0.01", "budget=-1"])
def test_run_sh_bad_budget_is_a_usage_error(budget):
    proc = run_sh("--remat", budget, "--steps", "1", expect=2)
    assert proc.stderr.count(f"train.py: error: --remat {budget}") == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # the worker's message alone: not torchrun's lines about ending the other workers
    assert "closing signal" not in proc.stderr and "exitcode" not in proc.stderr, proc.stderr[-3000:]


def test_setup_env_runs_pip_only_when_needed():
    setup = ["bash", str(ROOT / "scripts" / "setup_env.sh")]
    subprocess.run(setup, cwd=ROOT, check=True, capture_output=True, timeout=600)
    installed = sorted(ROOT.glob(".venv/lib/python*/site-packages/torch_remat-*.dist-info"))
    assert installed
    before = installed[0].stat().st_mtime_ns
    again = subprocess.run(setup, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == again.stderr == ""
    assert installed[0].stat().st_mtime_ns == before  # pip did not reinstall


@pytest.mark.parametrize(
    ("version", "venv"), [(None, ".venv"), ("2.13.0", ".venv"), ("2.15.0", ".venv-torch2.15.0")]
)
def test_each_torch_version_gets_a_venv_of_its_own_and_the_floor_keeps_venv(version, venv):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_VERSION"}
    if version is not None:
        env["TORCH_VERSION"] = version
    proc = subprocess.run(
        ["bash", "-c", ". scripts/venv_dir.sh && echo $TORCH_VERSION $VENV"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [version or "2.13.0", venv]


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("TORCH_VERSION", "../x", "TORCH_VERSION must be a release number such as 2.15.0, got '../x'"),
        ("TEST_TIER", "quick", "scripts/test.sh: TEST_TIER must be all or fast, got 'quick'"),
    ],
)
def test_test_sh_refuses_a_bad_version_or_tier_before_installing_anything(variable, value, message):
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "test.sh")], cwd=ROOT,
        env=dict(os.environ, **{variable: value}), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == message
