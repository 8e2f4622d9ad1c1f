"""docs/frameworks.md: every recipe on the page runs, as written, as a script against
the installed framework, and prints what the page quotes (gradients bitwise equal to
no checkpointing are asserted inside each recipe)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import plugin_env

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "frameworks.md"
# Marked as fragments for the page runner (scripts/docs_check.py), which runs a
# page's blocks in one process without the frameworks; each is a whole script.
RECIPE = re.compile(
    r"^<!-- docs-check: fragment: recipe (?P<name>[\w.-]+), [^\n]* -->\n```python\n"
    r"(?P<code>.*?)^```$",
    re.M | re.S,
)

# recipe -> (module it needs, runs two processes, the docs-check block of its output)
RECIPES = {
    "torchtune": ("torchtune", False, "frameworks-torchtune"),
    "torchtune-switch": ("torchtune", False, "frameworks-torchtune-switch"),
    "lightning-ddp": ("lightning", True, "frameworks-lightning-ddp"),
    "lightning-fsdp2": ("lightning", True, "frameworks-lightning-fsdp2"),
    "peft": ("peft", False, "frameworks-peft"),
    "olmo-core": ("olmo_core", False, "frameworks-olmo-core"),
    "torchtitan": ("torchtitan", False, "frameworks-torchtitan"),
}


def recipes() -> dict[str, str]:
    return {m["name"]: m["code"] for m in RECIPE.finditer(PAGE.read_text())}


def test_every_python_block_of_the_page_is_a_recipe_this_file_runs():
    # The page's other python blocks (the mixture-of-experts one) run in the docs
    # check (tests/docs), which skips only fragments: every fragment is a recipe here.
    text = PAGE.read_text()
    fragments = re.findall(r"<!-- docs-check: fragment: [^\n]*-->\n```python\n", text)
    assert len(fragments) == len(recipes())
    assert set(recipes()) == set(RECIPES)


def _torchao_too_old_for_peft() -> bool:
    try:
        version = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return False
    major, minor = (int(x) for x in version.split(".")[:2])
    return (major, minor) < (0, 16)


def run_recipe(name: str, tmp_path: Path, config) -> str:
    module = RECIPES[name][0]
    pytest.importorskip(module)
    script = tmp_path / f"recipe_{name.replace('-', '_')}.py"
    script.write_text(recipes()[name])
    command = [sys.executable, str(script)]
    if name == "peft" and _torchao_too_old_for_peft():
        # PEFT refuses torchao < 0.16 (torchtune's pin is 0.14.1): run as if absent.
        command = [
            sys.executable, "-c",
            "import runpy, sys; sys.modules['torchao'] = None; "
            f"runpy.run_path({str(script)!r}, run_name='__main__')",
        ]
    env = plugin_env(config, {**os.environ, "OMP_NUM_THREADS": "1"})
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        if name == "torchtitan" and "No module named 'triton'" in done.stderr:
            pytest.skip("torchtitan 0.3 imports triton, which is not installed")
        raise AssertionError(f"recipe '{name}' failed:\n{done.stdout}\n{done.stderr[-4000:]}")
    return done.stdout


@pytest.mark.parametrize("name", [n for n, r in RECIPES.items() if not r[1]])
def test_a_single_process_recipe_prints_what_the_page_quotes(name, tmp_path, docs_check, pytestconfig):
    docs_check.check(RECIPES[name][2], run_recipe(name, tmp_path, pytestconfig))


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n, r in RECIPES.items() if r[1]])
def test_a_two_process_recipe_prints_what_the_page_quotes(name, tmp_path, docs_check, pytestconfig):
    docs_check.check(RECIPES[name][2], run_recipe(name, tmp_path, pytestconfig))
