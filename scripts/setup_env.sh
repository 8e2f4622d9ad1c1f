#!/usr/bin/env bash
# Create (or reuse) a virtual environment with torch and torch_remat installed
# editable with its test extras. TORCH_VERSION picks torch (default 2.13.0, the
# floor: the CPU build, in .venv); any other version gets a venv of its own,
# .venv-torch<version>, so that .venv stays on the floor. Prints the venv's path.
# Safe to run repeatedly, and at once: one call sets up a venv at a time (under
# flock), and a call finds nothing to do while the venv holds the install of the
# current pyproject.toml, of this script and of that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if [ "$TORCH_VERSION" = 2.13.0 ]; then
  VENV=.venv
else
  VENV=.venv-torch$TORCH_VERSION
fi
mkdir -p "$VENV"
exec 9> "$VENV/.setup.lock"
flock 9
STAMP=$VENV/.torch_remat-setup
WANT="$PWD torch==$TORCH_VERSION $(cat pyproject.toml scripts/setup_env.sh | sha256sum)"
installed() {
  [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] &&
    compgen -G "$VENV/lib/python*/site-packages/__editable__.torch_remat-*.pth" > /dev/null
}
if ! installed; then
  rm -f "$STAMP"
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
  fi
  if [ "$TORCH_VERSION" != 2.13.0 ]; then
    # The version is named exactly, so a machine-wide cap on torch (a pip constraint
    # file) could only make this install fail: lift it for the installs into this venv.
    export PIP_CONSTRAINT=/dev/null
  fi
  # The version torch reports carries a local tag (2.13.0+cpu).
  if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
    # Pin torch: an unpinned install pulls whatever build the index serves newest.
    "$VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION" >&2
  fi
  # The extras (accelerate, transformers, the frameworks) require torch too: restate
  # the pin so that pip keeps this torch instead of resolving another version for them.
  "$VENV/bin/python" -m pip install --quiet -e ".[test,accelerate,transformers,plot,frameworks]" "torch==$TORCH_VERSION" >&2
  echo "$WANT" > "$STAMP"
fi
echo "$VENV"
