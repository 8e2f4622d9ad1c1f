#!/usr/bin/env bash
# Create (or reuse) a virtual environment with torch and torch_remat installed
# editable with its test extras. TORCH_VERSION picks torch: 2.13.0 by default (the
# floor, the CPU build, in .venv); any other version gets a venv of its own,
# .venv-torch<version> (scripts/venv_dir.sh). Safe to run repeatedly, and at once:
# one call sets up a venv at a time (under flock), and a call finds nothing to do
# (and is silent) while the venv holds the install of the current pyproject.toml,
# of these scripts and of that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
. scripts/venv_dir.sh
mkdir -p "$VENV"
exec 9> "$VENV/.setup.lock"
flock 9
STAMP=$VENV/.torch_remat-setup
WANT="$PWD torch==$TORCH_VERSION $(cat pyproject.toml scripts/setup_env.sh scripts/venv_dir.sh | sha256sum)"
installed() {
  [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] &&
    compgen -G "$VENV/lib/python*/site-packages/__editable__.torch_remat-*.pth" > /dev/null
}
if installed; then
  exit 0
fi
rm -f "$STAMP"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
. "$VENV/bin/activate"
if [ "$TORCH_VERSION" != 2.13.0 ]; then
  # The version is named exactly, so a machine-wide cap on torch (a pip constraint
  # file, as some machines set for their default environment) could only make this
  # install fail: lifted for the installs into this venv, by an empty constraint file
  # of the venv's own (not /dev/null: on some machines that is a plain file, holding
  # whatever was last sent there).
  : > "$VENV/.no-constraints"
  export PIP_CONSTRAINT="$PWD/$VENV/.no-constraints"
fi
# torch reports the version with a local tag (2.13.0+cpu).
if ! python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  python -m pip install --quiet --upgrade pip
  # Pin torch: an unpinned install pulls whichever build is newest (for the floor,
  # the CPU build is installed; the index may hold only CUDA builds of later
  # versions, with several gigabytes of dependencies, which run on CPU too).
  python -m pip install --quiet "torch==$TORCH_VERSION"
fi
# The extras (accelerate, transformers, the frameworks) require torch too: restate
# the pin so that pip keeps this torch instead of resolving another version for them.
python -m pip install --quiet -e ".[test,accelerate,transformers,plot,frameworks]" "torch==$TORCH_VERSION"
echo "$WANT" > "$STAMP"
