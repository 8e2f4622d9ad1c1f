"""launch/train.py's argument checks, in process: each bad value is a usage error
(status 2, one line naming the flag) before anything trains, and the checkpoint
folder's model config is compared with the run's at resume."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("launch_train", ROOT / "launch" / "train.py")
train = importlib.util.module_from_spec(_spec)
sys.modules["launch_train"] = train  # dataclasses look their module up there
_spec.loader.exec_module(train)


def usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        train.parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--heads", "5"], "--heads 5: --dim 64 must be a multiple of it"),
        (["--batch-size", "0"], "--batch-size 0: expected an integer >= 1"),
        (["--save-every", "0"], "--save-every 0: expected an integer >= 1"),
        (["--steps", "0"], "--steps 0: expected an integer >= 1"),
        (["--steps", "-3"], "--steps -3: expected an integer >= 1"),
        (["--layers", "0"], "--layers 0: expected an integer >= 1"),
        (["--seq-len", "0"], "--seq-len 0: expected an integer >= 1"),
        (["--device-memory", "40GiB"], "--device-memory is read by --forecast only"),
        (["--overwrite-log-json"], "--overwrite-log-json lets a new run replace the file at --log-json"),
        (["--offload"], "--offload is a choice the planner makes: it needs --remat budget="),
        (["--remat", "budget=0.3", "--offload", "1MiB"], "--offload 1MiB: expected MIN_BYTES"),
        (["--remat", "budget=0.3", "--offload", "--parallel", "tp"],
         "--offload with --parallel tp: tensor-parallel activations are DTensors"),
        (["--device-profile", "H100 SXM"], "--device-profile is what the planner predicts step times for"),
        (["--remat", "budget=0.3", "--device-profile", "B300"],
         "--device-profile B300: expected a published profile's name (A100 80GB SXM, "),
        (["--remat", "budget=0.3", "--device-profile", "/nonexistent/p.json"],
         "--device-profile /nonexistent/p.json: cannot read it: "),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(capsys, argv, message):
    err = usage_error(capsys, argv)
    assert f"train.py: error: {message}" in err and "Traceback" not in err


def test_an_oom_dump_dir_that_is_a_file_is_a_usage_error(capsys, tmp_path):
    file = tmp_path / "dumps"
    file.write_text("")
    err = usage_error(capsys, ["--oom-dump-dir", str(file)])
    assert f"train.py: error: --oom-dump-dir {file}: is a file, not a folder" in err


def test_a_log_json_path_that_cannot_be_written_is_a_usage_error_before_training(capsys, tmp_path):
    for bad in (tmp_path / "missing" / "log.json", tmp_path):
        with pytest.raises(SystemExit) as info:
            train.check_log_json(str(bad), rank=0)
        assert info.value.code == 2
        assert f"train.py: error: --log-json {bad}: cannot write there" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no .tmp left
    train.check_log_json(str(tmp_path / "log.json"), rank=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "parallel, world, message",
    [
        ("tp", 3, "--parallel tp on 3 ranks: --heads 4 must be a multiple of the 3 tensor-parallel ranks"),
        ("fsdp2+tp", 4, None),
        ("tp", 2, None),
    ],
)
def test_tensor_parallel_needs_heads_divisible_by_its_ranks(capsys, parallel, world, message):
    args = train.parse_args(["--parallel", parallel])
    if message is None:
        train.check_layout(args, world, rank=0)
        return
    with pytest.raises(SystemExit) as info:
        train.check_layout(args, world, rank=0)
    assert info.value.code == 2 and f"train.py: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "world, mesh", [(2, "dp=1 x tp=2"), (3, "dp=3 x tp=1"), (4, "dp=2 x tp=2")]
)
def test_fsdp2_tp_says_its_mesh(world, mesh):
    args = train.parse_args(["--parallel", "fsdp2+tp"])
    assert mesh in train.layout_line(args, world)


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # as wrapped to any width
    for default in ("(default: 40)", "(default: selective)", "(default: 80GiB)", "(default: 10)"):
        assert default in out


def _config(**changes):
    args = train.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in changes.items()])
    return train.model_config(args, vocab=90)


def test_a_checkpoint_of_another_model_shape_is_refused_naming_flag_and_values(capsys, tmp_path):
    saved = _config()  # --layers 4 --dim 64 --heads 4 --seq-len 64
    (tmp_path / "step10").mkdir()
    (tmp_path / "step10" / "model_config.json").write_text(json.dumps(saved))
    for changes, message in (
        ({"layers": 2}, "--layers 2, but the checkpoints there were saved with --layers 4"),
        ({"dim": 32, "heads": 4}, "--dim 32, but the checkpoints there were saved with --dim 64"),
    ):
        with pytest.raises(SystemExit) as info:
            train.check_model_config(tmp_path, 10, _config(**changes), rank=0)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "pass --" in err
    train.check_model_config(tmp_path, 10, saved, rank=0)  # the same: fine


def _run_config(world=2, **changes):
    args = train.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in changes.items()])
    return train.model_config(args, vocab=90, world=world)


def test_a_resume_with_another_seed_batch_size_or_learning_rate_is_refused_naming_them(capsys, tmp_path):
    # Before: only the model's shape was compared; a resume with --seed 5 trained seed
    # 5's batches on seed 0's weights, and one whose --steps the folder had reached
    # said "this run is finished" for a run never trained
    (tmp_path / "step10").mkdir()
    (tmp_path / "step10" / "model_config.json").write_text(json.dumps(_run_config(parallel="fsdp2")))
    for changes, message in (
        ({"seed": 5}, "--seed 5, but the checkpoints there were saved with --seed 0"),
        ({"batch_size": 4, "lr": 1.0}, "--batch-size 4, --lr 1.0, but the checkpoints there were "
                                       "saved with --batch-size 8, --lr 0.003"),
    ):
        with pytest.raises(SystemExit) as info:
            train.check_model_config(tmp_path, 10, _run_config(**changes), rank=0)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "to resume it" in err
    # another layout resumes (the states are resharded), saying so
    assert train.check_model_config(tmp_path, 10, _run_config(world=3, parallel="ddp"), rank=0)
    out = capsys.readouterr().out
    assert "saved with --parallel fsdp2 on 2 rank(s), and this run is --parallel ddp on 3" in out
    assert train.check_model_config(tmp_path, 10, _run_config(parallel="fsdp2"), rank=0)  # the same: silent
    assert capsys.readouterr().out == ""
    # a checkpoint that recorded only the model's shape resumes as before
    (tmp_path / "step10" / "model_config.json").write_text(json.dumps(_config()))
    assert train.check_model_config(tmp_path, 10, _run_config(seed=5), rank=0)


@pytest.mark.parametrize(
    "saved, resumed, says",
    [
        # the same data-parallel ranks and generators: nothing differs but the sharding
        (("fsdp2", 2), ("ddp", 2), "each rank trains on the batches, and draws the dropout masks, "
                                   "it would have in the run saved there"),
        (("ddp", 4), ("fsdp2", 4), "each rank trains on the batches, and draws the dropout masks"),
        (("fsdp2+tp", 2), ("tp", 2), "each rank trains on the batches, and draws the dropout masks"),
        # one batch per step either way, each rank's own heads: other dropout masks
        (("tp", 2), ("none", 1), "each step after the resume trains on the batches of the run "
                                 "saved there; the dropout masks differ"),
        (("fsdp2+tp", 4), ("fsdp2", 2), "each step after the resume trains on the batches of the run "
                                        "saved there; the dropout masks differ"),
        # other data-parallel ranks
        (("fsdp2", 2), ("ddp", 3), "each rank's batches (and dropout masks) after the resume differ"),
        (("fsdp2", 2), ("none", 1), "each rank's batches (and dropout masks) after the resume differ"),
        (("fsdp2", 4), ("fsdp2+tp", 4), "each rank's batches (and dropout masks) after the resume differ"),
    ],
)
def test_a_resume_in_another_layout_says_whether_the_batches_and_masks_are_the_saved_runs(
        capsys, tmp_path, saved, resumed, says):
    # Before: every other layout was said to draw other batches, fsdp2 -> ddp on as many
    # ranks among them, whose resumed run is the saved run's bit for bit.
    (tmp_path / "step10").mkdir()
    (tmp_path / "step10" / "model_config.json").write_text(
        json.dumps(_run_config(world=saved[1], parallel=saved[0])))
    assert train.check_model_config(tmp_path, 10, _run_config(world=resumed[1], parallel=resumed[0]), rank=0)
    out = capsys.readouterr().out
    assert (f"saved with --parallel {saved[0]} on {saved[1]} rank(s), and this run is --parallel "
            f"{resumed[0]} on {resumed[1]}: the model and optimizer states are resharded") in out, out
    assert says in out, out
    assert out.count("\n") == 1


def test_a_whole_number_budget_is_bytes_however_written_and_a_fraction_is_at_most_one(capsys):
    # Before: budget=2 was 2 bytes but budget=2.0 a fraction (no budget), and
    # budget=1e9 a fraction of 10^9
    assert train.parse_budget("2.0") == train.parse_budget("2") == 2
    assert train.parse_budget("1e9") == 1_000_000_000
    assert train.parse_budget("1.0") == 1.0 and train.parse_budget("0.3") == 0.3
    # 1 is the fraction 1 (the whole no-remat bytes), as usage says, not 1 byte
    assert train.parse_budget("1") == train.parse_budget("01") == 1.0
    assert isinstance(train.parse_budget("1"), float)
    with pytest.raises(SystemExit) as info:
        train.parse_args(["--remat=budget=1.5"])
    assert info.value.code == 2
    assert "a fraction in (0, 1]" in capsys.readouterr().err


def test_a_parallel_mode_without_torchrun_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as info:
        train.main(["--parallel", "fsdp2", "--steps", "1"])
    assert info.value.code == 2
    assert "train.py: error: --parallel fsdp2 needs torchrun" in capsys.readouterr().err


@pytest.mark.parametrize("lr", ["nan", "-1", "inf"])
def test_a_learning_rate_adamw_refuses_is_a_usage_error(capsys, lr):
    # Before: AdamW's ValueError traceback after the model was built
    with pytest.raises(SystemExit) as info:
        train.parse_args(["--lr", lr])
    assert info.value.code == 2
    assert f"train.py: error: --lr {float(lr)}: expected a finite learning rate >= 0" in capsys.readouterr().err
    assert train.parse_args(["--lr", "0"]).lr == 0.0


def test_a_sequence_longer_than_the_training_text_is_a_usage_error(capsys):
    # Before: a RuntimeError traceback from torch.randint at the first batch
    characters = len(train.load_text())
    train.parse_args(["--seq-len", str(characters - 2)])
    with pytest.raises(SystemExit) as info:
        train.parse_args(["--seq-len", str(characters - 1)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--seq-len {characters - 1}: the training text (launch/data/corpus.txt) has {characters:,} characters" in err
    x, y = train.Batches(train.load_text(), characters - 2, 2, 0, 0)(1)
    assert x.shape == y.shape == (2, characters - 2)


def test_parallel_none_under_torchrun_with_several_processes_is_a_usage_error(capsys, monkeypatch, tmp_path):
    # Before: each of torchrun's processes trained the whole model alone as rank 0,
    # printing every line twice and writing one --log-json; with --checkpoint-dir the
    # second found the folder locked ("another run is writing there") and exited
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    log = tmp_path / "log.json"
    with pytest.raises(SystemExit) as info:
        train.main(["--steps", "1", "--layers", "1", "--dim", "16", "--seq-len", "8", "--log-json", str(log)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "train.py: error: --parallel none under torchrun with 2 processes" in err
    assert "--parallel fsdp2" in err and "--nproc-per-node 1" in err
    assert not log.exists()
    # one process under torchrun is one run: no error
    assert train.check_one_process_per_run(train.parse_args(["--steps", "1"]), 1, 0) is None


def test_a_checkpoint_saves_the_model_config_and_the_log_up_to_its_step(tmp_path):
    log = train.Log(str(tmp_path / "log.json"), 0, 1)
    log.losses.update({1: 4.0, 2: 3.5})
    log.saved_bytes[1] = [100]
    folder = tmp_path / "step2"
    folder.mkdir()
    train.write_run_metadata(folder, _config(), log)
    assert json.loads((folder / "model_config.json").read_text()) == _config()
    # killed before --log-json was written: the resumed log takes the steps from the checkpoint
    resumed = train.Log(str(tmp_path / "log.json"), 2, 1, checkpoint=folder)
    assert resumed.losses == {1: 4.0, 2: 3.5} and resumed.saved_bytes == {1: [100]}
    assert resumed.resumed_at == [2]


def test_a_corrupt_checkpoint_is_skipped_with_one_line_and_no_traceback(capfd, caplog, tmp_path):
    import logging

    import torch

    def model_and_opt():
        torch.manual_seed(0)
        model = train.GPT(train.GPTConfig(vocab=10, seq_len=8, layers=1, dim=8, heads=2))
        return model, torch.optim.AdamW(model.parameters())

    model, opt = model_and_opt()
    for step in (2, 4):
        train.save_checkpoint(tmp_path, model, opt, step, rank=0, keep=0)
    (tmp_path / "step4" / ".metadata").write_text("garbage")
    capfd.readouterr()
    assert train.load_checkpoint(tmp_path, *model_and_opt(), rank=0) == 2
    out, err = capfd.readouterr()
    # torch.distributed.checkpoint logs each failed read with its traceback (on
    # stderr outside pytest): not shown
    assert err == "" and [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert out.startswith(f"torch_remat train: checkpoint {tmp_path / 'step4'} is unreadable (")
    assert out.count("\n") == 1


@pytest.mark.parametrize("nproc", ["abc", "0", "-1", "2x"])
def test_run_sh_refuses_a_bad_nproc_before_starting_anything(nproc):
    import os
    import subprocess

    env = dict(os.environ, NPROC=nproc, TORCH_REMAT_NO_SETUP="1")
    proc = subprocess.run(["bash", str(ROOT / "launch" / "run.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == f"run.sh: NPROC={nproc}: expected a number of processes >= 1\n"


def test_a_checkpoint_without_model_config_is_checked_by_its_tensors(capsys, tmp_path):
    import torch

    def model_and_opt(layers, dim=8):
        torch.manual_seed(0)
        model = train.GPT(train.GPTConfig(vocab=10, seq_len=8, layers=layers, dim=dim, heads=2))
        return model, torch.optim.AdamW(model.parameters())

    train.save_checkpoint(tmp_path, *model_and_opt(2), 2, rank=0, keep=0)  # no model_config.json
    assert not (tmp_path / "step2" / "model_config.json").exists()
    config = {"layers": 1, "dim": 8, "heads": 2, "seq_len": 8, "vocab": 10}
    for layers, dim, detail in ((1, 8, "it holds blocks.1."), (2, 4, "tok.weight is (10, 8) there and (10, 4) here")):
        with pytest.raises(SystemExit) as info:
            train.load_checkpoint(tmp_path, *model_and_opt(layers, dim), rank=0, config=config)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"step2 holds a model of another shape than this run's ({detail}" in err
    assert train.load_checkpoint(tmp_path, *model_and_opt(2), rank=0, config=config) == 2


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"name": "x", "flops": {"float32": 1e9}}, "expected a JSON object with flops, host_link_bandwidth"),
        ({"name": "x", "flops": {"float32": 1e9}, "memory_bandwidth": 1e9, "host_link_bandwidth": 1e9,
          "tflops": 3}, "unknown fields: tflops"),
        ({"name": "x", "flops": {"float32": 0}, "memory_bandwidth": 1e9, "host_link_bandwidth": 1e9},
         "must be numbers > 0"),
        ({"name": "x", "flops": {"float32": True}, "memory_bandwidth": 1e9, "host_link_bandwidth": 1e9},
         "must be numbers > 0"),
        ({"name": "x", "flops": {"float32": 1e9}, "memory_bandwidth": 1e9, "host_link_bandwidth": 1e9,
          "overlap_copies": "no"}, "overlap_copies must be true or false"),
    ],
)
def test_a_device_profile_file_without_its_fields_is_a_usage_error(capsys, tmp_path, fields, message):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(fields))
    err = usage_error(capsys, ["--remat", "budget=0.3", "--device-profile", str(path)])
    assert f"train.py: error: --device-profile {path}: " in err and message in err, err


def test_a_device_profile_is_read_from_its_name_or_its_file(tmp_path):
    path = tmp_path / "profile.json"
    fields = {"name": "mine", "flops": {"float32": 2e12}, "memory_bandwidth": 1e11,
              "host_link_bandwidth": 2e10, "overlap_copies": True}
    path.write_text(json.dumps(fields))
    mine = train.device_profile(str(path))
    assert (mine.name, dict(mine.flops), mine.host_link_bandwidth) == ("mine", {"float32": 2e12}, 2e10)
    assert train.device_profile("H100 SXM").name == "H100 SXM"
    assert train.device_profile(None) is None


def test_run_sh_refuses_several_nodes_without_a_rendezvous_endpoint_as_a_usage_error():
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "RDZV_ENDPOINT"}
    env.update(NNODES="2", TORCH_REMAT_NO_SETUP="1")
    proc = subprocess.run(["bash", str(ROOT / "launch" / "run.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2  # (was 1: the shell's own message for an unset variable)
    assert proc.stderr == ("run.sh: NNODES=2: set RDZV_ENDPOINT=host:port (the first node's rendezvous) "
                           "for a multi-node run\n")


def test_an_abbreviated_flag_is_refused(capsys):
    # argparse took --par for --parallel, and run.sh (which starts one process for
    # --parallel none) did not: two single-process runs wrote one folder
    err = usage_error(capsys, ["--par", "none"])
    assert "train.py: error: unrecognized arguments: --par none" in err


def test_relative_paths_name_places_under_the_folder_the_job_was_started_from(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_REMAT_CALLER_DIR", str(tmp_path))
    args = train.parse_args(["--checkpoint-dir", "ck", "--log-json", "log.json", "--oom-dump-dir",
                             "dumps"])
    assert (args.checkpoint_dir, args.log_json, args.oom_dump_dir) == (
        str(tmp_path / "ck"), str(tmp_path / "log.json"), str(tmp_path / "dumps"))
    absolute = train.parse_args(["--checkpoint-dir", "/elsewhere/ck"])
    assert absolute.checkpoint_dir == "/elsewhere/ck"


def test_a_checkpoint_dir_another_run_writes_is_refused(capsys, tmp_path):
    import fcntl
    import os
    import subprocess

    # another process holds the folder's lock (as a running job's rank 0 does)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit) as info:
            train.lock_checkpoint_dir(tmp_path, rank=0)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert (f"train.py: error: --checkpoint-dir {tmp_path}: another run is writing there (it "
                "holds a lock on the folder); wait for it to end or choose another directory") in err
        assert train._held_lock is None
    finally:
        holder.kill()
        holder.wait()
    # once that process is gone the folder is free, and nothing was written there
    train.lock_checkpoint_dir(tmp_path, rank=0)
    assert train._held_lock is not None
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(OSError):  # held now by this run
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    train.release_checkpoint_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_file_named_like_a_checkpoint_is_moved_aside_not_deleted(capsys, tmp_path):
    # shutil.rmtree of it raised NotADirectoryError at the first save, after training
    import torch

    torch.manual_seed(0)
    model = train.GPT(train.GPTConfig(vocab=10, seq_len=8, layers=1, dim=8, heads=2))
    (tmp_path / "step2").write_text("notes")
    train.save_checkpoint(tmp_path, model, torch.optim.AdamW(model.parameters()), 2, rank=0, keep=0)
    assert (tmp_path / "step2").is_dir() and (tmp_path / "step2" / ".metadata").exists()
    assert (tmp_path / "step2.not-a-checkpoint").read_text() == "notes"
    assert f"{tmp_path / 'step2'} is a file, not a checkpoint folder; moved it to" in capsys.readouterr().out


def test_a_save_the_system_refuses_ends_the_run_with_one_line_naming_the_folder(capsys, monkeypatch, tmp_path):
    # A full disk gave seven tracebacks, the reason buried in them
    import errno

    import torch

    torch.manual_seed(0)
    model = train.GPT(train.GPTConfig(vocab=10, seq_len=8, layers=1, dim=8, heads=2))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "step2.tmp" / "rng"))

    monkeypatch.setattr(train.torch, "save", full)
    with pytest.raises(SystemExit) as info:
        train.save_checkpoint(tmp_path, model, torch.optim.AdamW(model.parameters()), 2, rank=0, keep=0)
    assert info.value.code == train.SAVE_FAILED == 3
    err = capsys.readouterr().err
    assert err.startswith(f"torch_remat train: rank 0: saving step 2 to {tmp_path} failed: No space "
                          f"left on device ({tmp_path / 'step2.tmp' / 'rng'}); ")
    assert " B free there. Free space there or choose another --checkpoint-dir" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    monkeypatch.undo()
    with pytest.raises(ZeroDivisionError):  # anything else is not the system's: raised
        monkeypatch.setattr(train, "_save_checkpoint", lambda *a: 1 / 0)
        train.save_checkpoint(tmp_path, model, torch.optim.AdamW(model.parameters()), 2, rank=0, keep=0)
