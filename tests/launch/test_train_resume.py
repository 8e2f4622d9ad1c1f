"""launch/train.py's resume from a --checkpoint-dir that a crash or a bad disk left
damaged, and what the resumed run then keeps, in process (``main`` with --parallel
none and a tiny model: each run takes a fraction of a second)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pathlib
import sys

import pytest
from checkpoint_damage import flip_a_byte_of_tensor_data
from helpers import recorded_replays

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("launch_train", ROOT / "launch" / "train.py")
train = importlib.util.module_from_spec(_spec)
sys.modules["launch_train"] = train  # dataclasses look their module up there
_spec.loader.exec_module(train)

TINY = ["--layers", "1", "--dim", "8", "--heads", "2", "--seq-len", "8", "--batch-size", "2"]


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def run(capsys, *args, expect=0):
    """``train.main(TINY ARGS)`` in this process; its (stdout, stderr). A run that
    trained a step under remat (the default, --remat selective) must have replayed
    its checkpoints: the resumes checked here are of a job that trains with remat."""
    with recorded_replays() as replayed:
        if expect:
            with pytest.raises(SystemExit) as info:
                train.main([*TINY, *args])
            assert info.value.code == expect
        else:
            train.main([*TINY, *args])
    captured = capsys.readouterr()
    if " loss " in captured.out and "--remat" not in args:
        assert replayed, "the run trained without replaying a checkpoint"
    return captured


def losses(log: pathlib.Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads(log.read_text())["losses"].items()}


def folders(ckpt: pathlib.Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir())


def files(ckpt: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(ckpt)): p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}


def truncate(path: pathlib.Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


# ------------------------------------------------------------------ --keep-checkpoints


@pytest.mark.parametrize("keep, kept", [(1, ["step5"]), (2, ["step3", "step5"])])
def test_keep_checkpoints_counts_readable_ones_and_leaves_an_unreadable_newer_one(
        capsys, tmp_path, keep, kept):
    # Before: pruning ranked the folders by step alone. Resumed from step3 past an
    # unreadable step6, --keep-checkpoints 1 deleted step3 and the step5 just written
    # and kept step6: the next run found nothing to resume from.
    ckpt = tmp_path / "ckpt"
    run(capsys, "--steps", "6", "--save-every", "3", "--checkpoint-dir", str(ckpt))
    truncate(ckpt / "step6" / "__0_0.distcp", 100)

    out, _ = run(capsys, "--steps", "5", "--save-every", "5", "--keep-checkpoints", str(keep),
                 "--checkpoint-dir", str(ckpt))
    assert "(resumed at step 3)" in out
    assert folders(ckpt) == ["latest.json", *kept, "step6"]
    assert json.loads((ckpt / "latest.json").read_text()) == {"step": 5}
    # said once, naming the folder left and what to do about it
    assert out.count(f"{ckpt / 'step6'} was unreadable at the resume") == 1, out
    assert "move it away" in out

    out, _ = run(capsys, "--steps", "5", "--checkpoint-dir", str(ckpt))  # the same again
    assert "holds step 5 and --steps is 5: this run is finished" in out

    # a save of step 6 replaces the unreadable folder, which then counts as any other
    run(capsys, "--steps", "6", "--save-every", "3", "--keep-checkpoints", "1",
        "--checkpoint-dir", str(ckpt))
    assert folders(ckpt) == ["latest.json", "step6"]
    out, _ = run(capsys, "--steps", "7", "--checkpoint-dir", str(ckpt))
    assert "(resumed at step 6)" in out and "unreadable" not in out


def test_keep_checkpoints_never_deletes_the_checkpoint_just_written(tmp_path):
    import torch

    torch.manual_seed(0)
    model = train.GPT(train.GPTConfig(vocab=10, seq_len=8, layers=1, dim=8, heads=2))
    opt = torch.optim.AdamW(model.parameters())
    for step in (2, 4, 8):
        train.save_checkpoint(tmp_path, model, opt, step, rank=0, keep=0)
    # a save below a readable folder (not one a resume skipped): the save is kept, the
    # newer folder is not this run's to count or delete
    train.save_checkpoint(tmp_path, model, opt, 6, rank=0, keep=1)
    assert folders(tmp_path) == ["latest.json", "step6", "step8"]


def test_keep_checkpoints_does_not_count_an_older_folder_with_damaged_run_files(capsys, tmp_path):
    # the resume never tries the older folders; one whose small files are damaged
    # would be no checkpoint to fall back to, so it is not one of the K kept
    ckpt = tmp_path / "ckpt"
    run(capsys, "--steps", "6", "--save-every", "2", "--checkpoint-dir", str(ckpt))
    truncate(ckpt / "step4" / "model_config.json", 20)
    out, _ = run(capsys, "--steps", "8", "--save-every", "2", "--keep-checkpoints", "3",
                 "--checkpoint-dir", str(ckpt))
    assert "(resumed at step 6)" in out
    assert folders(ckpt) == ["latest.json", "step2", "step6", "step8"]


def test_a_log_whose_steps_are_not_numbers_makes_the_folder_unreadable(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    run(capsys, "--steps", "6", "--save-every", "3", "--checkpoint-dir", str(ckpt))
    log = json.loads((ckpt / "step6" / "log.json").read_text())
    log["losses"]["six"] = log["losses"].pop("6")
    (ckpt / "step6" / "log.json").write_text(json.dumps(log))
    out, _ = run(capsys, "--steps", "7", "--checkpoint-dir", str(ckpt))
    assert f"checkpoint {ckpt / 'step6'} is unreadable (log.json cannot be read (its losses names a step 'six'))" in out
    assert "(resumed at step 3)" in out


# -------------------------------------------------------- damaged run files of a folder


@pytest.mark.parametrize(
    "damage, cause",
    [
        (lambda f: truncate(f / "model_config.json", 20), "model_config.json cannot be read"),
        (lambda f: (f / "model_config.json").unlink(), "model_config.json is missing"),
        (lambda f: truncate(f / "log.json", 20), "log.json cannot be read"),
        (lambda f: (f / "log.json").unlink(), "log.json is missing"),
    ],
    ids=["model_config-truncated", "model_config-deleted", "log-truncated", "log-deleted"],
)
def test_a_damaged_model_config_or_log_makes_the_folder_unreadable(capsys, tmp_path, damage, cause):
    # Before: a truncated or missing model_config.json read as "a checkpoint from before
    # it was recorded", and a resume with another --seed, --batch-size and --lr went on
    # from that folder without a word.
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    uninterrupted = tmp_path / "uninterrupted.json"
    run(capsys, "--steps", "9", "--log-json", str(uninterrupted))
    common = ["--save-every", "3", "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    run(capsys, "--steps", "6", *common)
    damage(ckpt / "step6")
    before = files(ckpt)

    out, err = run(capsys, "--steps", "9", "--seed", "1", "--batch-size", "4", "--lr", "0.01",
                   *common, expect=2)
    assert f"checkpoint {ckpt / 'step6'} is unreadable ({cause}" in out, out
    assert ("this run has --seed 1, --batch-size 4, --lr 0.01, but the checkpoints there were "
            "saved with --seed 0, --batch-size 2, --lr 0.003") in err, err
    assert files(ckpt) == before  # nothing there was changed

    out, _ = run(capsys, "--steps", "9", *common)
    assert f"checkpoint {ckpt / 'step6'} is unreadable ({cause}" in out, out
    assert "(resumed at step 3)" in out
    assert losses(log) == losses(uninterrupted)  # bitwise: the same floats


def test_a_folder_with_neither_run_file_is_an_older_checkpoint_and_resumes(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    run(capsys, "--steps", "3", "--save-every", "3", "--checkpoint-dir", str(ckpt))
    (ckpt / "step3" / "model_config.json").unlink()
    (ckpt / "step3" / "log.json").unlink()
    (ckpt / "step3" / "checksums.json").unlink()  # (recorded later still)
    out, _ = run(capsys, "--steps", "4", "--checkpoint-dir", str(ckpt))
    assert "(resumed at step 3)" in out and "unreadable" not in out


# ------------------------------------------------------------------------ checksums


def test_a_save_records_the_size_and_sha256_of_every_file_it_writes(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    run(capsys, "--steps", "3", "--save-every", "3", "--checkpoint-dir", str(ckpt))
    folder = ckpt / "step3"
    recorded = json.loads((folder / "checksums.json").read_text())["files"]
    written = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*")
               if p.is_file() and p.name != "checksums.json"}
    assert {"__0_0.distcp", ".metadata", "rng/rank0.pt", "model_config.json", "log.json"} <= set(written)
    assert recorded == {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                        for name, data in written.items()}


def test_a_shard_whose_bytes_changed_on_disk_is_refused_naming_the_file_and_step(capsys, tmp_path):
    # Before: a bit flipped in a tensor's data in a shard loaded without a word, and the
    # resumed run trained on from the damaged weights.
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    uninterrupted = tmp_path / "uninterrupted.json"
    run(capsys, "--steps", "9", "--log-json", str(uninterrupted))
    common = ["--save-every", "3", "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    run(capsys, "--steps", "6", *common)
    flip_a_byte_of_tensor_data(ckpt / "step6" / "__0_0.distcp")
    before = files(ckpt)

    out, err = run(capsys, "--steps", "9", *common, expect=2)
    assert (f"train.py: error: --checkpoint-dir {ckpt}: step 6's file "
            f"{ckpt / 'step6' / '__0_0.distcp'} does not match the checksum recorded when it was "
            "saved") in err, err
    assert f"move {ckpt / 'step6'} out of {ckpt}" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "resumed at" not in out and "loss" not in out
    assert files(ckpt) == before  # nothing there was changed

    # moved away as the message says: the resume goes on from the step before, exactly
    (ckpt / "step6").rename(tmp_path / "step6.damaged")
    out, _ = run(capsys, "--steps", "9", *common)
    assert "(resumed at step 3)" in out
    assert losses(log) == losses(uninterrupted)  # bitwise: the same floats


def test_a_shard_of_another_size_is_unreadable_and_the_next_older_one_resumes(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    run(capsys, "--steps", "6", "--save-every", "3", "--checkpoint-dir", str(ckpt))
    shard = ckpt / "step6" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes() + b"appended")  # still loads: the data is read by offset
    out, _ = run(capsys, "--steps", "7", "--checkpoint-dir", str(ckpt))
    size = shard.stat().st_size
    assert (f"checkpoint {ckpt / 'step6'} is unreadable (__0_0.distcp is {size:,} bytes, and "
            f"{size - 8:,} were saved)") in out, out
    assert "(resumed at step 3)" in out


def test_a_checkpoint_saved_before_checksums_were_recorded_resumes(capsys, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    uninterrupted = tmp_path / "uninterrupted.json"
    run(capsys, "--steps", "6", "--log-json", str(uninterrupted))
    common = ["--save-every", "3", "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    run(capsys, "--steps", "3", *common)
    (ckpt / "step3" / "checksums.json").unlink()
    out, err = run(capsys, "--steps", "6", *common)
    assert "(resumed at step 3)" in out
    assert f"{ckpt / 'step3'} records no checksums" in out and out.count("checksums") == 1
    assert losses(log) == losses(uninterrupted)


def test_a_damaged_checksums_file_makes_the_folder_unreadable(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    run(capsys, "--steps", "6", "--save-every", "3", "--checkpoint-dir", str(ckpt))
    truncate(ckpt / "step6" / "checksums.json", 20)
    out, _ = run(capsys, "--steps", "7", "--checkpoint-dir", str(ckpt))
    assert f"checkpoint {ckpt / 'step6'} is unreadable (checksums.json cannot be read" in out, out
    assert "(resumed at step 3)" in out


# ---------------------------------------------------------------- random generator files


def test_a_missing_rng_file_of_a_saving_rank_makes_the_folder_unreadable(capsys, tmp_path):
    # Before: the folder was resumed without that rank's generators ("holds no random
    # generator states for this number of ranks"), and the losses after it differed
    # from the uninterrupted run's.
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    uninterrupted = tmp_path / "uninterrupted.json"
    run(capsys, "--steps", "9", "--log-json", str(uninterrupted))
    common = ["--save-every", "3", "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    run(capsys, "--steps", "6", *common)
    (ckpt / "step6" / "rng" / "rank0.pt").unlink()

    out, _ = run(capsys, "--steps", "9", *common)
    assert f"checkpoint {ckpt / 'step6'} is unreadable (rng/rank0.pt is missing" in out, out
    assert "no random generator states" not in out
    assert "(resumed at step 3)" in out
    assert losses(log) == losses(uninterrupted)


def test_rng_files_a_checkpoint_should_hold():
    # saved by 2 ranks: each of them wrote its file; a third rank resuming has none
    saved = {"ranks": 2}
    assert train.expected_rng_files(saved, world=2) == ["rng/rank0.pt", "rng/rank1.pt"]
    assert train.expected_rng_files(saved, world=3) == ["rng/rank0.pt", "rng/rank1.pt"]
    assert train.expected_rng_files(saved, world=1) == ["rng/rank0.pt"]
    # an older checkpoint, which did not record its ranks: nothing to check against
    assert train.expected_rng_files({"layers": 2}, world=2) == []
    assert train.expected_rng_files(None, world=2) == []


# ------------------------------------------------------------------------- --log-json


def test_a_resumed_log_takes_the_checkpoints_log_not_another_runs_file(capsys, tmp_path):
    # Before: the entries of the file at --log-json were merged in, whatever run wrote
    # it: another run's resume points and saved bytes joined this run's log.
    ckpt, own = tmp_path / "ckpt", tmp_path / "own.json"
    run(capsys, "--steps", "3", "--save-every", "3", "--checkpoint-dir", str(ckpt),
        "--log-json", str(own))
    saved = json.loads(own.read_text())
    other = tmp_path / "other_run.json"
    other.write_text(json.dumps({"losses": {"1": 9.0, "2": 9.0, "3": 9.0},
                                 "saved_bytes": {"2": [2]}, "world": 1, "resumed_at": [2]}))

    out, _ = run(capsys, "--steps", "4", "--checkpoint-dir", str(ckpt), "--log-json", str(other))
    result = json.loads(other.read_text())
    assert result["resumed_at"] == [3]
    assert {k: v for k, v in result["losses"].items() if k != "4"} == saved["losses"]
    assert {k: v for k, v in result["saved_bytes"].items() if k != "4"} == saved["saved_bytes"]
    assert set(result["losses"]) == {"1", "2", "3", "4"}
    assert f"--log-json {other} is not the log of the run saved in {ckpt / 'step3'}" in out, out


def test_a_new_run_refuses_a_log_json_file_another_run_wrote_unless_told_to_overwrite(capsys, tmp_path):
    # Before: a new run replaced it without a word, at its first save or at its end.
    log = tmp_path / "log.json"
    run(capsys, "--steps", "2", "--log-json", str(log))
    first = log.read_bytes()
    out, err = run(capsys, "--steps", "3", "--log-json", str(log), expect=2)
    assert (f"train.py: error: --log-json {log}: the file holds another run's log (steps 1-2); "
            "this new run would replace it: pass --overwrite-log-json to replace it") in err, err
    assert err.count("\n") == 1 and "Traceback" not in err and "loss" not in out
    assert log.read_bytes() == first  # nothing written

    out, err = run(capsys, "--steps", "3", "--log-json", str(log), "--overwrite-log-json")
    assert sorted(losses(log)) == [1, 2, 3] and err == ""

    # a file that is not a log: named as such
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    _, err = run(capsys, "--steps", "1", "--log-json", str(notes), expect=2)
    assert f"--log-json {notes}: the file exists and is not a log this launcher wrote" in err, err
    assert notes.read_text() == "my notes"

    # an empty file (mktemp's) is no run's log
    empty = tmp_path / "empty.json"
    empty.write_text("")
    run(capsys, "--steps", "1", "--log-json", str(empty))
    assert sorted(losses(empty)) == [1]


def test_a_resumed_run_writes_on_in_the_log_json_file_of_its_run(capsys, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    common = ["--save-every", "2", "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    run(capsys, "--steps", "2", *common)
    out, err = run(capsys, "--steps", "3", *common)
    assert "(resumed at step 2)" in out and "error" not in err
    assert sorted(losses(log)) == [1, 2, 3]


def test_a_resumed_log_keeps_its_own_earlier_steps_and_drops_those_after_the_resume(capsys, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    common = ["--save-every", "3", "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    run(capsys, "--steps", "5", *common)  # step3 and step5 saved, the log to step 5
    (ckpt / "step5" / ".metadata").write_text("garbage")  # resume from step 3
    out, _ = run(capsys, "--steps", "4", *common)
    assert "(resumed at step 3)" in out and "is not the log" not in out, out
    result = json.loads(log.read_text())
    assert sorted(result["losses"], key=int) == ["1", "2", "3", "4"] and result["resumed_at"] == [3]


def test_a_checkpoint_without_its_log_resumes_the_log_from_the_log_json_file(tmp_path):
    # a checkpoint from before each folder held its log: the file is all there is
    folder = tmp_path / "step2"
    folder.mkdir()
    path = tmp_path / "log.json"
    path.write_text(json.dumps({"losses": {"1": 4.0, "2": 3.5, "3": 3.0}, "saved_bytes": {"1": [100]},
                                "world": 1, "resumed_at": []}))
    log = train.Log(str(path), 2, 1, checkpoint=folder)
    assert log.losses == {1: 4.0, 2: 3.5} and log.saved_bytes == {1: [100]}
    assert log.resumed_at == [2]


def test_a_log_json_written_before_the_save_is_this_runs_and_says_nothing(capsys, tmp_path):
    # killed between the save of step 4 and the log's write: the file holds fewer steps
    # and resume points than the checkpoint's log, and agrees with it on those it holds
    folder = tmp_path / "step4"
    folder.mkdir()
    checkpoint_log = {"losses": {"1": 4.0, "2": 3.5, "3": 3.2, "4": 3.0},
                      "saved_bytes": {"1": [100], "3": [100]}, "world": 2, "resumed_at": [2]}
    (folder / "log.json").write_text(json.dumps(checkpoint_log))
    path = tmp_path / "log.json"
    path.write_text(json.dumps({"losses": {"1": 4.0, "2": 3.5}, "saved_bytes": {"1": [100]},
                                "world": 2, "resumed_at": []}))
    log = train.Log(str(path), 4, 2, checkpoint=folder)
    assert log.losses == {1: 4.0, 2: 3.5, 3: 3.2, 4: 3.0} and log.saved_bytes == {1: [100], 3: [100]}
    assert log.resumed_at == [2, 4]
    assert capsys.readouterr().out == ""
    # one loss of its own: another run's, dropped with a line saying where it differs
    path.write_text(json.dumps({"losses": {"1": 4.0, "2": 3.25}, "saved_bytes": {}, "world": 2}))
    log = train.Log(str(path), 4, 2, checkpoint=folder)
    assert log.losses == {1: 4.0, 2: 3.5, 3: 3.2, 4: 3.0}
    assert "(step 2's loss: 3.25 there, 3.5 in the checkpoint's log)" in capsys.readouterr().out


# ------------------------------------------------------------------ --oom-dump-dir


def test_an_oom_dump_dir_that_cannot_be_created_is_a_usage_error_before_training(capsys, tmp_path):
    # (a folder below a file: mkdir fails, as for a read-only mount)
    afile = tmp_path / "afile"
    afile.write_text("")
    bad = afile / "dumps"
    out = run(capsys, "--steps", "1", "--parallel", "none", "--oom-dump-dir", str(bad), expect=2)
    assert f"--oom-dump-dir {bad}: cannot write there" in out.err
    assert "Traceback" not in out.err and "loss" not in out.out
    good = tmp_path / "dumps"
    run(capsys, "--steps", "1", "--parallel", "none", "--oom-dump-dir", str(good))
    assert sorted(p.name for p in good.iterdir()) == []  # created, no probe left
