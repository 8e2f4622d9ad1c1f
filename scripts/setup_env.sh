#!/usr/bin/env bash
# Create (or reuse) .venv with the CPU build of torch and torch_remat installed
# editable with its test extras. Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  python -m pip install --quiet --upgrade pip
  # Pin torch: an unpinned install pulls a multi-gigabyte CUDA build.
  python -m pip install --quiet "torch==2.13.0"
fi
# The extras (accelerate, transformers) require torch too: restate the pin so that
# pip keeps 2.13.0 instead of resolving another version for them.
python -m pip install --quiet -e ".[test,accelerate,transformers,plot,frameworks]" "torch==2.13.0"
