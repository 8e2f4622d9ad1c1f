#!/usr/bin/env bash
# Install torch_remat as a library, alone: a fresh virtual environment, then
# `pip install "torch==2.13.0" .` (no extras, so no numpy, accelerate or
# transformers), and scripts/smoke_install.py (the README's usage example, forward
# and backward) run from outside the repository and from its root.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENV=$(mktemp -d "${TMPDIR:-/tmp}/torch_remat_install.XXXXXX")
trap 'rm -rf "$VENV"' EXIT
"$PYTHON" -m venv "$VENV"
# Pinned as in scripts/setup_env.sh: an unpinned torch is a multi-gigabyte CUDA build.
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0" "$ROOT"
if "$VENV/bin/python" -c "import numpy" 2>/dev/null; then
  echo "check_install: numpy is installed, the check would not show a dependency on it" >&2
  exit 1
fi
# torch itself warns once that it found no numpy.
export PYTHONWARNINGS="ignore::UserWarning"
(cd "$VENV" && "$VENV/bin/python" "$ROOT/scripts/smoke_install.py")
"$VENV/bin/python" -c "import torch_remat.integrations.planner, torch_remat.integrations.oom"
"$VENV/bin/torch-remat-oom" --help > /dev/null
