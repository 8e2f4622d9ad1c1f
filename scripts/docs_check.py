"""Every fenced block of README.md and docs/**/*.md, run or checked or marked.

Each fenced block of a page is one of:

* **a python block**: run. The python blocks of a page run in order in one
  namespace, like the cells of a notebook, so a block may use what earlier blocks
  of the same page defined. A python block right after a line naming a file
  (`` `ex_sites.py`: ``) is that whole script instead: it is written to a
  temporary folder under that name and run alone (``python ex_sites.py``), so
  file names and line numbers in its output are what a user sees.
* **an output block** (```` ```text ```` or a bare fence) directly after a python
  block (only blank lines between): compared with what that block printed,
  stdout and stderr together.
* **a marked block**, the comment line just before its fence (or before a markdown
  table, whose lines up to the first non-table line are the block)::

      <!-- docs-check: NAME -->            the test that runs the command producing
                                            this output passes it to check(NAME, ...)
                                            (tests/docs/test_docs_check.py lists them)
      <!-- docs-check: fragment: WHY -->    code that does not run alone (a signature,
                                            names the page does not define); not run
      <!-- docs-check: diagram -->          a picture in text: neither code nor output
      <!-- docs-check: command: WHY -->     a shell command for the reader (the whole
                                            test suite, a benchmark, a cluster job)
      <!-- docs-check: recorded: WHY -->    output of a run too long for the test suite,
                                            shown as recorded (the prose says of what)

Any other block fails the check (:func:`unmarked`), so a block added later is
run, compared or visibly marked. Comparison rules (:func:`matches`):

* a line ``...`` in the quote stands for any number of skipped lines (abridged output),
  a ``…`` inside a line for any characters of that line (a host name, a pid);
* numbers that depend on the machine are masked on both sides: throughput
  (``1,234 tok/s``), addresses (``0x7f...``), dates and times, ``+0.082 s`` offsets;
  everything else must match exactly, trailing spaces aside;
* a named quote that starts with ``$ command`` lines is a transcript: the output
  after them is compared, and :func:`quoted_commands` gives the commands to the test
  that ran them.

The pages' blocks run in a temporary folder (files they write land there), with the
repository root on ``sys.path``; a page's output is what a CPU build of torch prints.

Set ``DOCS_CHECK_WRITE=1`` to have a failing comparison rewrite the quote with the
fresh output instead (then review the diff, and abridge again by hand).

    python scripts/docs_check.py               # every block of every page and what it is
    python scripts/docs_check.py --check PAGE  # run PAGE's blocks and compare (what the tests do)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent


def pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


DOCS = pages()
MARKS = ("fragment", "diagram", "command", "recorded")
MARKER_LINE = re.compile(r"^<!-- docs-check: (?P<name>[\w.-]+)(?:: (?P<why>.*?))? -->$")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,})(?P<lang>[\w+-]*)[ \t]*$")
SCRIPT_LINE = re.compile(r"^`(?P<name>[\w.-]+\.py)`.*:$")
OUTPUT_LANGS = ("", "text", "console")
MACHINE_DEPENDENT = [
    (re.compile(r"[\d,]+ tok/s"), "N tok/s"),
    (re.compile(r"\+\d+\.\d{3} s\b"), "+N s"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "0xADDR"),
    (re.compile(r"\d{4}-\d\d-\d\d[T_]\d\d:\d\d:\d\d(?:\.\d+)?Z?"), "DATE"),
]


class Block:
    """One fenced block of a page."""

    def __init__(self, path: pathlib.Path, line: int, lang: str, indent: str, body: str,
                 offset: int, length: int):
        self.path = path
        self.line = line  # 1-based line of the opening fence
        self.lang = lang
        self.indent = indent
        self.body = body  # dedented text between the fences
        self.offset = offset  # character offset of the body in the file
        self.length = length  # characters of the (indented) body in the file
        self.marker: str | None = None
        self.why: str | None = None
        self.script: str | None = None  # `name.py` named in the line before
        self.after: Block | None = None  # the block this one directly follows
        self.kind = ""  # python, script, output, named, a MARKS entry, or unmarked

    @property
    def where(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


def _rel(path: pathlib.Path) -> pathlib.Path:
    try:
        return path.relative_to(ROOT)
    except ValueError:
        return path


def parse(path: pathlib.Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of one page, classified (``kind``)."""
    text = path.read_text() if text is None else text
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    found: list[Block] = []
    i = 0
    last_close = -10
    while i < len(lines):
        m = FENCE.match(lines[i].rstrip("\n"))
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        close = re.compile(rf"^{indent}{fence}[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j].rstrip("\n")):
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: a fence that is never closed")
        raw = "".join(lines[i + 1 : j])
        body = "".join(x[len(indent) :] if x.startswith(indent) else x.lstrip(" ")
                       for x in lines[i + 1 : j])
        block = Block(path, i + 1, m["lang"], indent, body, starts[i + 1], len(raw))
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        if k >= 0:
            prev = lines[k].strip()
            mark = MARKER_LINE.match(prev)
            if mark:
                block.marker, block.why = mark["name"], mark["why"]
            script = SCRIPT_LINE.match(prev)
            if script:
                block.script = script["name"]
        if found and k == last_close:
            block.after = found[-1]
        found.append(block)
        last_close = j
        i = j + 1
    for block in found:
        block.kind = _kind(block)
    return found


def _kind(block: Block) -> str:
    if block.marker in MARKS:
        return block.marker
    if block.marker:
        return "named"
    if block.lang == "python":
        return "script" if block.script else "python"
    if (block.lang in OUTPUT_LANGS and block.after is not None
            and block.after.kind in ("python", "script")):
        return "output"
    return "unmarked"


def all_blocks() -> list[Block]:
    return [b for path in pages() for b in parse(path)]


def unmarked() -> list[Block]:
    """Blocks that are neither run, nor compared with a run, nor marked."""
    return [b for b in all_blocks() if b.kind == "unmarked"]


# -- names the prose mentions ------------------------------------------------------------

NAME_MENTION = re.compile(r"(?<![\w.])remat\.([A-Za-z_]\w*)(?![\w:])")  # not profiler ranges
INTEGRATIONS_MENTION = re.compile(r"torch_remat\.integrations\.([A-Za-z_]\w*)")


def unknown_names(text: str) -> list[str]:
    """``remat.NAME`` and ``torch_remat.integrations.NAME`` mentions in ``text`` that
    the package does not have (renamed or removed names the docs still use)."""
    import importlib

    import torch_remat
    import torch_remat.integrations as integrations

    unknown = [f"remat.{n}" for n in NAME_MENTION.findall(text) if not hasattr(torch_remat, n)]
    for name in INTEGRATIONS_MENTION.findall(text):
        if not hasattr(integrations, name):
            try:
                importlib.import_module(f"torch_remat.integrations.{name}")
            except ImportError:
                unknown.append(f"torch_remat.integrations.{name}")
    return sorted(set(unknown))


# -- named blocks: checked by the tests that run their commands ----------------------

TABLE_MARKER = re.compile(r"^<!-- docs-check: (?P<name>[\w.-]+) -->\n(?P<table>(?:^\|[^\n]*\n)+)",
                          re.M)


def blocks() -> dict[str, tuple[pathlib.Path, str, int]]:
    """Every named block: name -> (file, quoted text, offset of the text in the file)."""
    found: dict[str, tuple[pathlib.Path, str, int]] = {}

    def add(name, path, text, offset):
        if name in found:
            raise ValueError(f"docs-check block '{name}' is marked twice ({path})")
        found[name] = (path, text, offset)

    for path in pages():
        text = path.read_text()
        for b in parse(path, text):
            if b.kind == "named":
                add(b.marker, path, b.body, b.offset)
        for m in TABLE_MARKER.finditer(text):
            if m["name"] not in MARKS:
                add(m["name"], path, m["table"], m.start("table"))
    return found


def _normalized(line: str) -> str:
    for pattern, replacement in MACHINE_DEPENDENT:
        line = pattern.sub(replacement, line)
    return line.rstrip()


def _line_matches(want: str, have: str) -> bool:
    if "…" not in want:
        return want == have
    pattern = ".*".join(re.escape(part) for part in want.split("…"))
    return re.fullmatch(pattern, have) is not None


def matches(quoted: str, actual: str) -> bool:
    """Whether ``actual`` output is what ``quoted`` shows: a ``...`` line skips any
    number of lines, a ``…`` inside a line any characters of that line."""
    want = [_normalized(x) for x in quoted.splitlines()]
    have = [_normalized(x) for x in actual.splitlines()]
    memo: dict[tuple[int, int], bool] = {}

    def match(i: int, j: int) -> bool:
        if (i, j) not in memo:
            if i == len(want):
                memo[i, j] = j == len(have)
            elif want[i] == "...":
                memo[i, j] = any(match(i + 1, k) for k in range(j, len(have) + 1))
            else:
                memo[i, j] = (j < len(have) and _line_matches(want[i], have[j])
                              and match(i + 1, j + 1))
        return memo[i, j]

    return match(0, 0)


def _rewrite(path: pathlib.Path, offset: int, length: int, indent: str, actual: str) -> None:
    text = path.read_text()
    new = "".join(indent + x if x.strip() else x
                  for x in actual.rstrip("\n").splitlines(keepends=True)) + "\n"
    path.write_text(text[:offset] + new + text[offset + length :])


def _split_commands(quoted: str) -> tuple[list[str], str]:
    """A transcript's leading ``$ command`` lines (continuations ending in ``\\``
    joined) and the output after them."""
    lines = quoted.splitlines(keepends=True)
    commands: list[str] = []
    i = 0
    while i < len(lines) and lines[i].startswith("$ "):
        command = lines[i][2:].rstrip("\n")
        while command.endswith("\\") and i + 1 < len(lines):
            i += 1
            command = command[:-1].rstrip() + " " + lines[i].strip()
        commands.append(command)
        i += 1
    return commands, "".join(lines[i:])


def quoted_commands(name: str) -> list[str]:
    """The ``$ command`` lines a named transcript starts with (the test that runs them
    asserts they are the commands it ran)."""
    return _split_commands(blocks()[name][1])[0]


def check(name: str, actual: str) -> None:
    """Fail (``AssertionError``) when block ``name`` does not show ``actual``; with
    ``DOCS_CHECK_WRITE=1`` write ``actual`` in its place instead (whole: abridge it
    again by hand). A quote that starts with ``$ command`` lines is a transcript:
    ``actual`` is compared with what follows them."""
    path, quoted, offset = blocks()[name]
    commands, output = _split_commands(quoted)
    skipped = len(quoted) - len(output)
    quoted, offset = output, offset + skipped
    if matches(quoted, actual):
        return
    if os.environ.get("DOCS_CHECK_WRITE") == "1":
        _rewrite(path, offset, len(quoted), "", actual)
        return
    raise AssertionError(
        f"{_rel(path)}: the block marked 'docs-check: {name}' no longer shows "
        f"what the code prints. Quoted:\n{quoted}\nActual:\n{actual}\n"
        "Update the quote (or rerun the test with DOCS_CHECK_WRITE=1 and review the diff)."
    )


# -- running the python blocks of a page ------------------------------------------------

def _run_cells(path: pathlib.Path) -> list[dict]:
    """Run the python blocks of ``path`` in order (in this process; scripts in a child
    process each). One record per block: where, output, error."""
    namespace: dict = {"__name__": "__main__"}
    results = []
    rel = _rel(path)
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # files a block writes (plan.json, memory.json) land here
        for block in parse(path):
            if block.kind == "script":
                script = pathlib.Path(tmp) / block.script
                script.write_text(block.body)
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
                done = subprocess.run([sys.executable, block.script], cwd=tmp, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, timeout=600)
                error = f"exit status {done.returncode}" if done.returncode else None
                # a script's path is the machine's: show it as the user's own folder
                output = done.stdout.replace(str(pathlib.Path(tmp).resolve()) + os.sep, "")
                results.append({"line": block.line, "output": output, "error": error})
            elif block.kind == "python":
                out = io.StringIO()
                error = None
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    try:
                        exec(compile(block.body, f"{rel}:{block.line}", "exec"), namespace)
                    except BaseException:  # noqa: B036 -- reported with the block
                        error = traceback.format_exc()
                results.append({"line": block.line, "output": out.getvalue(), "error": error})
    return results


def run_page(path: pathlib.Path, timeout: float = 1200) -> dict[int, dict]:
    """Run the python blocks of a page in a fresh process (cwd: a temporary folder;
    the repository root on ``sys.path``): line of each block -> {"output", "error"}."""
    with tempfile.TemporaryDirectory() as tmp:
        record = pathlib.Path(tmp) / "cells.json"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        done = subprocess.run([sys.executable, __file__, "--run", str(path), str(record)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"running the blocks of {path} failed:\n{done.stdout}{done.stderr}")
        return {r["line"]: r for r in json.loads(record.read_text())}


def check_page(path: pathlib.Path) -> int:
    """Run a page's python blocks and compare each output block with the output of
    the block before it; one ``AssertionError`` listing every failure. Returns the
    number of blocks run."""
    found = parse(path)
    if not any(b.kind in ("python", "script") for b in found):
        return 0
    runs = run_page(path)
    failures = []
    rewrites = []
    for block in found:
        if block.kind in ("python", "script") and runs[block.line]["error"]:
            failures.append(f"{block.where}: the {block.lang} block failed:\n"
                            f"{runs[block.line]['output']}{runs[block.line]['error']}")
        if block.kind != "output":
            continue
        actual = runs[block.after.line]["output"]
        if matches(block.body, actual):
            continue
        if os.environ.get("DOCS_CHECK_WRITE") == "1":
            rewrites.append((block, actual))
            continue
        failures.append(f"{block.where}: the output block no longer shows what the code "
                        f"above it prints. Quoted:\n{block.body}Actual:\n{actual}")
    for block, actual in sorted(rewrites, key=lambda r: -r[0].offset):
        _rewrite(path, block.offset, block.length, block.indent, actual)
    if failures:
        raise AssertionError("\n\n".join(failures) + "\n\nUpdate the quotes or the code "
                             "(or rerun with DOCS_CHECK_WRITE=1 and review the diff).")
    return sum(b.kind in ("python", "script") for b in found)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--run"]:
        path, record = pathlib.Path(argv[1]).resolve(), pathlib.Path(argv[2])
        sys.path.insert(0, str(ROOT))
        record.write_text(json.dumps(_run_cells(path)))
        return 0
    if argv[:1] == ["--check"]:
        for name in argv[1:]:
            print(f"{name}: {check_page(pathlib.Path(name).resolve())} block(s) run, outputs match")
        return 0
    bad = 0
    for b in all_blocks():
        label = b.kind + (f" {b.marker}" if b.kind == "named" else "")
        label += f" ({b.why})" if b.why else ""
        print(f"{b.where:36} {b.lang or '-':8} {label}")
        bad += b.kind == "unmarked"
    if bad:
        print(f"{bad} block(s) neither run, compared nor marked", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
