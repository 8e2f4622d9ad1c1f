"""Every fenced block of README.md and docs/**/*.md is run, compared with a run, or
visibly marked (scripts/docs_check.py): the python blocks of each page run in order in
one process, and each output block after one must show what it printed."""

import importlib.util
import pathlib

import pytest
from helpers import set_plugin_env

_path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "docs_check.py"
_spec = importlib.util.spec_from_file_location("docs_check_pages", _path)
docs_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_check)

# Pages whose blocks compile or measure many steps: the slow tier (torchrun transcripts
# are checked by the tests that launch them, marked slow there).
SLOW = {"docs/compilation.md", "docs/planning.md"}


def _param(page):
    name = str(page.relative_to(docs_check.ROOT))
    return pytest.param(page, id=name, marks=[pytest.mark.slow] if name in SLOW else [])


def test_every_block_is_run_compared_or_marked():
    bad = docs_check.unmarked()
    assert not bad, (
        "blocks neither run, compared with a run, nor marked (see scripts/docs_check.py):\n"
        + "\n".join(f"  {b.where} ({b.lang or 'no language'})" for b in bad)
    )


@pytest.mark.parametrize("page", [_param(p) for p in docs_check.pages()])
def test_the_blocks_of_a_page_run_and_print_what_it_quotes(page, pytestconfig, monkeypatch):
    set_plugin_env(pytestconfig, monkeypatch)  # the page's process runs under -p plugins too
    docs_check.check_page(page)


def test_the_remat_config_table_of_distributed_md_lists_every_field():
    import dataclasses
    import re

    from torch_remat.integrations import RematConfig

    text = (docs_check.ROOT / "docs" / "distributed.md").read_text()
    start = text.index("| field | default | meaning |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    documented = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert documented == {f.name for f in dataclasses.fields(RematConfig)}


def test_every_name_the_docs_mention_exists():
    unknown = {str(p.relative_to(docs_check.ROOT)): docs_check.unknown_names(p.read_text())
               for p in docs_check.pages()}
    assert not {page: names for page, names in unknown.items() if names}
