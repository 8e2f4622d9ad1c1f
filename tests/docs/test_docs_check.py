"""scripts/docs_check.py: how a quote is compared with real output, how the blocks of a
page are classified and run, and that every named quote in README.md and docs/ is
checked by a test."""

import pytest

# Each marked block and the test that passes it the output of its run.
CHECKED = {
    "readme-main-job": "tests/launch/test_train.py::test_main_job_on_two_ranks_prints_what_the_readme_quotes",
    "readme-remat-policies": "tests/launch/test_train.py::test_losses_identical_across_remat_policies_single_process",
    "train-accelerate": "tests/launch/test_train_accelerate.py::test_output_is_what_the_docs_quote",
    "hooks-worked-example": "tests/offload/test_offload.py::test_the_worked_example_of_the_hooks_page_prints_what_it_quotes",
    "frameworks-torchtune": "tests/integrations/test_frameworks.py::test_a_single_process_recipe_prints_what_the_page_quotes",
    "frameworks-torchtune-switch": "tests/integrations/test_frameworks.py::test_a_single_process_recipe_prints_what_the_page_quotes",
    "frameworks-lightning-ddp": "tests/integrations/test_frameworks.py::test_a_two_process_recipe_prints_what_the_page_quotes",
    "frameworks-lightning-fsdp2": "tests/integrations/test_frameworks.py::test_a_two_process_recipe_prints_what_the_page_quotes",
    "frameworks-peft": "tests/integrations/test_frameworks.py::test_a_single_process_recipe_prints_what_the_page_quotes",
    "frameworks-olmo-core": "tests/integrations/test_frameworks.py::test_a_single_process_recipe_prints_what_the_page_quotes",
    "frameworks-torchtitan": "tests/integrations/test_frameworks.py::test_a_single_process_recipe_prints_what_the_page_quotes",
    "distributed-multi-node": "tests/launch/test_multi_node.py::test_the_docs_transcript_shows_what_the_first_node_prints",
    "distributed-oom-train": "tests/distributed/test_integrations_oom_train.py::test_train_with_oom_dump_dir_writes_the_failing_ranks_dump",
    "distributed-oom-merge": "tests/distributed/test_integrations_oom_train.py::test_train_with_oom_dump_dir_writes_the_failing_ranks_dump",
    "distributed-oom-3-ranks": "tests/distributed/test_integrations_oom_multi_rank.py::test_the_docs_quote_the_merge_of_the_two_jobs",
    "distributed-oom-skipped": "tests/distributed/test_integrations_oom_multi_rank.py::test_the_docs_quote_what_the_merge_says_of_unusable_files",
    "distributed-report-uneven": "tests/distributed/test_integrations_multi_rank.py::test_the_docs_quote_what_the_report_checks_print",
    "distributed-report-even": "tests/distributed/test_integrations_multi_rank.py::test_the_docs_quote_what_the_report_checks_print",
    "distributed-report-timeout": "tests/distributed/test_integrations_multi_rank.py::test_the_docs_quote_what_the_report_checks_print",
    "benchmarks-w5-quick": "tests/meta/test_benchmarks_quick.py::test_the_docs_quote_the_quick_w5_table",
    "benchmarks-w6-quick": "tests/meta/test_benchmarks_quick.py::test_the_docs_quote_the_quick_w6_output",
}


def test_every_marked_block_is_checked_by_a_test(docs_check):
    assert set(docs_check.blocks()) == set(CHECKED)
    for name, test in CHECKED.items():
        path, function = test.split("::")
        source = (docs_check.ROOT / path).read_text()
        assert f"def {function}(" in source and f'"{name}"' in source, (name, test)


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


PAGE = """# A page

```python
x = 6 * 7
```

```python
print("x is", x)  # the blocks of a page share one namespace
```

```text
x is {answer}
```

`ex_alone.py`:

```python
print("alone:", "x" in globals())
```

```text
alone: False
```

<!-- docs-check: fragment: uses a model the page does not define -->
```python
model(batch)
```
"""


def _page(tmp_path, text):
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


def test_each_block_of_a_page_is_classified(docs_check, tmp_path):
    page = _page(tmp_path, PAGE.format(answer=42) + "\n```\nunmarked output\n```\n")
    kinds = [b.kind for b in docs_check.parse(page)]
    assert kinds == ["python", "python", "output", "script", "output", "fragment", "unmarked"]


def test_an_output_block_is_compared_with_what_the_block_before_it_printed(
    docs_check, tmp_path, monkeypatch
):
    monkeypatch.delenv("DOCS_CHECK_WRITE", raising=False)
    assert docs_check.check_page(_page(tmp_path, PAGE.format(answer=42))) == 3
    with pytest.raises(AssertionError, match=r"page.md:11: the output block no longer shows"):
        docs_check.check_page(_page(tmp_path, PAGE.format(answer=43)))


def test_a_block_that_raises_fails_the_page(docs_check, tmp_path):
    page = _page(tmp_path, "```python\nraise KeyError('boom')\n```\n")
    with pytest.raises(AssertionError, match=r"(?s)page.md:1: the python block failed.*KeyError"):
        docs_check.check_page(page)


def test_write_mode_rewrites_a_stale_quote_in_place(docs_check, tmp_path, monkeypatch):
    monkeypatch.setenv("DOCS_CHECK_WRITE", "1")
    page = _page(tmp_path, "- item:\n\n  ```python\n  print(1)\n  ```\n\n  ```\n  2\n  ```\n")
    docs_check.check_page(page)
    assert page.read_text() == "- item:\n\n  ```python\n  print(1)\n  ```\n\n  ```\n  1\n  ```\n"


def test_addresses_and_dates_are_machine_dependent(docs_check):
    assert docs_check.matches("at 0x7f00aa  2026-11-29T13:27:45.196Z", "at 0x55d1  2027-01-02T00:00:00.001Z")
    assert not docs_check.matches("at 0x7f00aa rank 1", "at 0x7f00aa rank 2")


def test_an_ellipsis_inside_a_line_skips_any_characters_of_that_line(docs_check):
    assert docs_check.matches("first: rank 1 (…, oom_…_1.json)", "first: rank 1 (node7, oom_ab_12_1.json)")
    assert not docs_check.matches("first: rank 1 (…)", "first: rank 2 (node7)")


def test_a_transcript_is_compared_after_its_command_lines(docs_check):
    commands, output = docs_check._split_commands("$ run a \\\n    --flag\n$ merge\nout\n")
    assert (commands, output) == (["run a --flag", "merge"], "out\n")


def test_a_name_the_package_does_not_have_is_reported(docs_check):
    text = "Use `remat.checkpoint`, `remat.no_such_hook()` and `torch_remat.integrations.nope`; ranges `remat.forward:layers.0`."
    assert docs_check.unknown_names(text) == ["remat.no_such_hook", "torch_remat.integrations.nope"]
