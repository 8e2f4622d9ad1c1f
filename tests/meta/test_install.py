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


def test_an_eager_program_does_not_load_dynamo(tmp_path, pytestconfig):
    # Importing Dynamo costs about a second per process (every torchrun rank); a
    # program that never compiles does not pay it for torch_remat.
    out = python(
        "import sys, runpy\n"
        f"runpy.run_path({str(SMOKE)!r}, run_name='__main__')\n"
        "print('dynamo loaded:', 'torch._dynamo' in sys.modules)\n",
        tmp_path, env=plugin_env(pytestconfig),
    )
    assert "checkpoint, SAVE regions and backward ok" in out
    assert "dynamo loaded: False" in out


def test_a_refusal_first_reached_inside_a_fullgraph_trace_keeps_its_message(tmp_path, pytestconfig):
    # The refusal functions are built once Dynamo is imported (import torch_remat
    # leaves it unloaded): a process whose first trace meets one still gets the
    # reason, not Dynamo's "torch.compiler.disable cannot be traced".
    out = python(
        "import sys, torch, torch_remat as remat\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "x = torch.randn(4, requires_grad=True)\n"
        "ck = remat.checkpoint(region_name='layers.2')(torch.sin)\n"
        "f = torch.compile(ck, backend='aot_eager', fullgraph=True)\n"
        "ident = (lambda t: t, lambda t: t)\n"
        "def inner(x):\n"
        "    return remat.checkpoint(region_name='layers.3', saved_tensors_hooks=ident)(torch.sin)(x)\n"
        "g = torch.compile(inner, backend='aot_eager', fullgraph=True)\n"
        "for label, call in (('ambient', lambda: f(x)), ('option', lambda: g(x))):\n"
        "    try:\n"
        "        if label == 'ambient':\n"
        "            with remat.saved_tensors_hooks(*ident):\n"
        "                call()\n"
        "        else:\n"
        "            call()\n"
        "    except Exception as e:\n"
        "        print(label, ' '.join(str(e).split()))\n",
        tmp_path, env=plugin_env(pytestconfig),
    )
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.split(" ", 1)[0] in ("ambient", "option"))
    assert "a remat.saved_tensors_hooks context is active around a compiled" in lines["ambient"], out
    assert "a remat.checkpoint option that cannot work under torch.compile" in lines["option"], out


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
