"""benchmarks/gpu_check.py: its arguments on any machine; the checks themselves only
where CUDA is available."""

import pytest
import torch

from benchmarks import gpu_check


def test_defaults_run_every_check():
    args = gpu_check.parse_args([])
    assert args.only == ["calibrate", "offload", "rng", "sites", "oom", "w1", "plan"]
    assert (args.layers, args.prefetch, args.steps) == (8, 2, 10)


def test_a_subset_of_checks_can_be_chosen_and_unknown_ones_are_refused(capsys):
    assert gpu_check.parse_args(["--only", "rng,oom"]).only == ["rng", "oom"]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--only", "rng,warp"])
    assert "unknown check(s) ['warp']" in capsys.readouterr().err


def test_the_w1_and_plan_checks_run_their_code_path_on_the_cpu(capsys):
    assert gpu_check.main(["--cpu-dry-run", "--only", "w1,plan", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "w1 (CPU dry run): ok" in out
    assert "plan (CPU dry run): ok" in out
    # every mode's gradients were compared with no AC, and the plan's too
    assert out.count('"gradients_equal_no_ac": true') == 7
    assert '"gradients_bitwise_equal": true' in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_without_cuda_it_exits_with_status_2_and_says_why(capsys):
    assert gpu_check.main(["--only", "rng"]) == 2
    assert "no CUDA device available" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_gpu_check_passes():
    assert gpu_check.main(["--steps", "3", "--layers", "4", "--seq", "256"]) == 0
