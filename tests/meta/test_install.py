"""torch_remat as an installed library needs torch only: scripts/smoke_install.py (the
README's usage example, forward and backward) runs where numpy cannot be imported,
and ``torch_remat.integrations`` imports from the repository root without the
editable install's finder."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig

from helpers import plugin_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMOKE = ROOT / "scripts" / "smoke_install.py"


def python(code: str, cwd: pathlib.Path, *flags: str, env: dict | None = None):
    proc = subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_readme_example_runs_without_numpy(tmp_path, pytestconfig):
    # What an environment holding only torch and torch_remat sees: numpy unimportable.
    out = python(
        "import sys, runpy, warnings\n"
        "sys.modules['numpy'] = None\n"
        "warnings.simplefilter('ignore')  # torch warns that it found no numpy\n"
        f"runpy.run_path({str(SMOKE)!r}, run_name='__main__')\n"
        "assert sys.modules['numpy'] is None\n",
        tmp_path, env=plugin_env(pytestconfig),
    )
    assert "checkpoint, SAVE regions and backward ok" in out


def test_integrations_import_from_the_repository_root_without_an_editable_finder(tmp_path):
    # As after a non-editable install, run from the checkout: the repository root is
    # first on sys.path, so ``torch_remat`` is the source folder, whose subpackages
    # do not include the sibling folder integrations/. -S: no site-packages .pth files
    # (the editable install's finder); torch from its site-packages folder.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"]]))
    out = python(
        "import sys\n"
        "assert not any('editable' in type(f).__name__.lower() or 'editable' in repr(f).lower()"
        " for f in sys.meta_path), sys.meta_path\n"
        "import torch_remat, torch_remat.integrations, torch_remat.integrations.planner\n"
        "from torch_remat.integrations import apply_remat\n"
        "print(torch_remat.integrations.__file__)\n",
        ROOT, "-S", env=env,
    )
    assert pathlib.Path(out.strip()) == ROOT / "integrations" / "__init__.py"
