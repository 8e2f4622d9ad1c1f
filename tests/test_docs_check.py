"""scripts/docs_check.py: how a quote is compared with real output, and that every
marked quote in README.md and docs/ is checked by a test."""

# Each marked block and the test that passes it the output of its run.
CHECKED = {
    "readme-main-job": "tests/launch/test_train.py::test_main_job_on_two_ranks_prints_what_the_readme_quotes",
    "readme-remat-policies": "tests/launch/test_train.py::test_losses_identical_across_remat_policies_single_process",
    "train-accelerate": "tests/launch/test_train_accelerate.py::test_output_is_what_the_docs_quote",
    "hooks-worked-example": "tests/test_offload.py::test_the_worked_example_of_the_hooks_page_prints_what_it_quotes",
    "frameworks-torchtune": "tests/test_frameworks.py::test_a_single_process_recipe_prints_what_the_page_quotes",
    "frameworks-torchtune-switch": "tests/test_frameworks.py::test_a_single_process_recipe_prints_what_the_page_quotes",
    "frameworks-lightning-ddp": "tests/test_frameworks.py::test_a_two_process_recipe_prints_what_the_page_quotes",
    "frameworks-lightning-fsdp2": "tests/test_frameworks.py::test_a_two_process_recipe_prints_what_the_page_quotes",
    "frameworks-peft": "tests/test_frameworks.py::test_a_single_process_recipe_prints_what_the_page_quotes",
    "frameworks-olmo-core": "tests/test_frameworks.py::test_a_single_process_recipe_prints_what_the_page_quotes",
    "frameworks-torchtitan": "tests/test_frameworks.py::test_a_single_process_recipe_prints_what_the_page_quotes",
}


def test_every_marked_block_is_checked_by_a_test(docs_check):
    assert set(docs_check.blocks()) == set(CHECKED)


def test_an_ellipsis_line_skips_any_number_of_lines(docs_check):
    assert docs_check.matches("a\n...\nd", "a\nb\nc\nd")
    assert docs_check.matches("a\n...\nd", "a\nd")
    assert not docs_check.matches("a\n...\nd", "a\nb\nc")


def test_throughput_is_machine_dependent_and_everything_else_exact(docs_check):
    assert docs_check.matches("loss 2.8822  1,833 tok/s", "loss 2.8822  97 tok/s")
    assert not docs_check.matches("loss 2.8822  1,833 tok/s", "loss 2.8823  1,833 tok/s")
    assert not docs_check.matches("a\nb", "a\nb\nc")  # no trailing lines unless '...'


def test_a_stale_quote_fails_with_the_file_and_both_texts(docs_check, monkeypatch):
    monkeypatch.delenv("DOCS_CHECK_WRITE", raising=False)
    try:
        docs_check.check("train-accelerate", "step    1  loss 0.0000")
    except AssertionError as e:
        assert "docs/distributed.md: the block marked 'docs-check: train-accelerate'" in str(e)
        assert "Actual:\nstep    1  loss 0.0000" in str(e)
    else:
        raise AssertionError("a stale quote passed")
