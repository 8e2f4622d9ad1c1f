"""Quoted output in README.md and docs/*.md, checked against real runs.

A quoted block is marked in the markdown by the comment line before its fence (or
before a markdown table, whose lines up to the first non-table line are the block)::

    <!-- docs-check: NAME -->
    ```text
    ...the output...
    ```

The test that already runs the command producing NAME's output passes that output
to :func:`check`, so a quote that no longer matches the code fails the suite
instead of going stale. Set ``DOCS_CHECK_WRITE=1`` to have :func:`check` rewrite the
block with the fresh output (then review the diff). Comparison rules:

* a line ``...`` in the quote stands for any number of skipped lines (abridged output);
* throughput (``1,234 tok/s``) and wall-clock times depend on the machine and are
  compared as ``N tok/s``; everything else must match exactly.

    python scripts/docs_check.py            # list the marked blocks and where they are
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(
    r"^<!-- docs-check: (?P<name>[\w.-]+) -->\n"
    r"(?:(?P<fence>```[\w-]*\n)(?P<body>.*?)^```$|(?P<table>(?:^\|[^\n]*\n)+))",
    re.M | re.S,
)
MACHINE_DEPENDENT = [(re.compile(r"[\d,]+ tok/s"), "N tok/s")]


def blocks() -> dict[str, tuple[pathlib.Path, str, int]]:
    """Every marked block: name -> (file, quoted text, offset of the text in the file)."""
    found: dict[str, tuple[pathlib.Path, str, int]] = {}
    for path in DOCS:
        for m in MARKER.finditer(path.read_text()):
            if m["name"] in found:
                raise ValueError(f"docs-check block '{m['name']}' is marked twice ({path})")
            group = "body" if m["fence"] else "table"
            found[m["name"]] = (path, m[group], m.start(group))
    return found


def _normalized(line: str) -> str:
    for pattern, replacement in MACHINE_DEPENDENT:
        line = pattern.sub(replacement, line)
    return line.rstrip()


def matches(quoted: str, actual: str) -> bool:
    """Whether ``actual`` output is what ``quoted`` shows (``...`` lines skip any lines)."""
    want = [_normalized(x) for x in quoted.splitlines()]
    have = [_normalized(x) for x in actual.splitlines()]

    def match(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(have)
        if want[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(have) + 1))
        return j < len(have) and want[i] == have[j] and match(i + 1, j + 1)

    return match(0, 0)


def check(name: str, actual: str) -> None:
    """Fail (``AssertionError``) when block ``name`` does not show ``actual``; with
    ``DOCS_CHECK_WRITE=1`` write ``actual`` in its place instead (whole: abridge it
    again by hand)."""
    path, quoted, offset = blocks()[name]
    if matches(quoted, actual):
        return
    if os.environ.get("DOCS_CHECK_WRITE") == "1":
        text = path.read_text()
        path.write_text(text[:offset] + actual.rstrip("\n") + "\n" + text[offset + len(quoted) :])
        return
    raise AssertionError(
        f"{path.relative_to(ROOT)}: the block marked 'docs-check: {name}' no longer shows "
        f"what the code prints. Quoted:\n{quoted}\nActual:\n{actual}\n"
        "Update the quote (or rerun the test with DOCS_CHECK_WRITE=1 and review the diff)."
    )


if __name__ == "__main__":
    for block_name, (block_path, _, _) in blocks().items():
        print(f"{block_name:32} {block_path.relative_to(ROOT)}")
    sys.exit(0)
