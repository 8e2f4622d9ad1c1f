"""Multi-process checks on real gloo process groups.

Each world size is launched once per session (dist_worker.py spawns the ranks and
runs every check of its module in order); each test below asserts that one check
passed on every rank. The checks themselves, with their assertions, are in
checks_2rank.py and checks_4rank.py.
"""

from __future__ import annotations

import pytest
from dist_harness import assert_check_passed, check_names, launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results_2rank(tmp_path_factory, pytestconfig):
    return launch("checks_2rank", 2, str(tmp_path_factory.mktemp("ranks2")), pytestconfig)


@pytest.fixture(scope="module")
def results_4rank(tmp_path_factory, pytestconfig):
    return launch("checks_4rank", 4, str(tmp_path_factory.mktemp("ranks4")), pytestconfig)


@pytest.mark.parametrize("check", check_names("checks_2rank"))
def test_2_ranks(results_2rank, check, record_property):
    data = assert_check_passed(results_2rank, check)
    for key, value in data.items():
        record_property(key, value)


@pytest.mark.parametrize("check", check_names("checks_4rank"))
def test_4_ranks(results_4rank, check, record_property):
    data = assert_check_passed(results_4rank, check)
    for key, value in data.items():
        record_property(key, value)


# Quotes of docs/distributed.md and the check (and rank) whose output they show.
DOCS_QUOTES = [
    ("distributed-report-uneven", "report_uneven_batches_show_min_median_max_and_flag_imbalance", 1, "report"),
    ("distributed-report-even", "report_even_batches_are_balanced", 0, "report"),
    ("distributed-report-timeout", "report_names_a_rank_that_skips_the_call", 0, "error"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, check, rank, key", DOCS_QUOTES)
def test_the_docs_quote_what_the_report_checks_print(results_2rank, docs_check, name, check, rank, key):
    assert_check_passed(results_2rank, check)
    docs_check.check(name, results_2rank[rank][check]["data"][key])
