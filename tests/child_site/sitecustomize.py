"""Loaded at the start of every Python child whose ``PYTHONPATH`` begins with this
folder (``helpers.plugin_env``): imports each plugin named in
``TORCH_REMAT_TEST_PLUGINS`` and calls its ``pytest_configure(None)``, so that the
child runs under the ``-p`` plugins of the pytest run that started it."""

import importlib
import os

for _name in filter(None, os.environ.get("TORCH_REMAT_TEST_PLUGINS", "").split(",")):
    _configure = getattr(importlib.import_module(_name), "pytest_configure", None)
    if _configure is not None:
        _configure(None)
