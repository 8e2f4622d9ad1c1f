"""docs/migrating.md: every python block runs (each in a fresh namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks() -> list[tuple[int, str]]:
    text = DOC.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in FENCE.finditer(text)]


def test_the_page_has_an_example_for_each_difference():
    assert len(python_blocks()) >= 8


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("line, code", python_blocks(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_every_python_block_of_the_migration_page_runs(line, code):
    torch.manual_seed(0)
    # padded so that tracebacks give line numbers of docs/migrating.md
    exec(compile("\n" * line + code, str(DOC), "exec"), {"__name__": "migrating_example"})
