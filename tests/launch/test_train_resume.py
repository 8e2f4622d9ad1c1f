"""launch/train.py's resume from a --checkpoint-dir that a crash or a bad disk left
damaged, and what the resumed run then keeps, in process (``main`` with --parallel
none and a tiny model: each run takes a fraction of a second)."""

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

TINY = ["--layers", "1", "--dim", "8", "--heads", "2", "--seq-len", "8", "--batch-size", "2"]


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def run(capsys, *args, expect=0):
    """``train.main(TINY ARGS)`` in this process; its (stdout, stderr)."""
    if expect:
        with pytest.raises(SystemExit) as info:
            train.main([*TINY, *args])
        assert info.value.code == expect
    else:
        train.main([*TINY, *args])
    return capsys.readouterr()


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
    out, _ = run(capsys, "--steps", "4", "--checkpoint-dir", str(ckpt))
    assert "(resumed at step 3)" in out and "unreadable" not in out


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
