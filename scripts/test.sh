#!/usr/bin/env bash
# Set up .venv if needed, lint, and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
ruff check .
python -m pytest -q -m "" "$@"  # -m "": every tier (plain pytest skips the slow one)
