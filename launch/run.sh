#!/usr/bin/env bash
# The main job: set up .venv if needed, then run the training demo.
# Extra arguments are passed to the demo (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec python launch/demo.py "$@"
