#!/usr/bin/env bash
# Set up .venv if needed, lint, and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
ruff check .
# -m "": every test (plain pytest deselects the slow ones). Two workers, one test file
# each at a time (module fixtures launch once); -n 0 runs in this process.
python -m pytest -q -m "" -n 2 --dist loadfile "$@"
