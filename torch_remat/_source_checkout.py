"""``torch_remat.integrations`` when ``torch_remat`` is imported from a source checkout.

The adapters live in the repository's top-level folder ``integrations/``, which the
build installs as ``torch_remat.integrations`` (``package-dir`` in pyproject.toml).
Where the repository root itself comes first on ``sys.path`` (``python -c ...`` or
``python -m pytest`` run there), ``torch_remat`` is this source folder, whose
subpackages do not include that sibling folder; an editable install maps it with a
finder of its own, a regular install does not. :func:`install` then maps that one
name to the sibling folder, so that the checkout imports the same way installed or not.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

NAME = "torch_remat.integrations"


class _SiblingFolder(importlib.abc.MetaPathFinder):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        return importlib.util.spec_from_file_location(
            NAME, os.path.join(self.folder, "__init__.py"), submodule_search_locations=[self.folder]
        )


def install(package_dir: str) -> None:
    """Map ``torch_remat.integrations`` to ``../integrations`` if ``package_dir`` is
    the ``torch_remat`` folder of a source checkout (no ``integrations`` inside it,
    the sibling folder and pyproject.toml beside it)."""
    root = os.path.dirname(os.path.abspath(package_dir))
    folder = os.path.join(root, "integrations")
    if os.path.isdir(os.path.join(package_dir, "integrations")):
        return  # an installed package
    if not (os.path.isfile(os.path.join(folder, "__init__.py"))
            and os.path.isfile(os.path.join(root, "pyproject.toml"))):
        return
    if not any(isinstance(f, _SiblingFolder) for f in sys.meta_path):
        # First: an editable install of another checkout maps the name to its own
        # folder, and this checkout's torch_remat goes with its own sibling.
        sys.meta_path.insert(0, _SiblingFolder(folder))
