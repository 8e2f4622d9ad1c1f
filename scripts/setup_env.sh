#!/usr/bin/env bash
# Create (or reuse) .venv with the CPU build of torch and torch_remat installed
# editable with its test extras. Safe to run repeatedly, and at once: one call sets
# up at a time (under flock), and a call finds nothing to do (and is silent) while
# .venv holds the install of the current pyproject.toml and of this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mkdir -p .venv
exec 9> .venv/.setup.lock
flock 9
STAMP=.venv/.torch_remat-setup
WANT="$PWD $(cat pyproject.toml scripts/setup_env.sh | sha256sum)"
installed() {
  [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] &&
    compgen -G ".venv/lib/python*/site-packages/__editable__.torch_remat-*.pth" > /dev/null
}
if installed; then
  exit 0
fi
rm -f "$STAMP"
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
echo "$WANT" > "$STAMP"
