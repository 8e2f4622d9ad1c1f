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
