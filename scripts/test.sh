#!/usr/bin/env bash
# Set up the venv if needed, lint, and run the test suite. Extra arguments go to pytest.
#   TORCH_VERSION  the torch to test on: 2.13.0 by default (in .venv); another version
#                  is installed into a venv of its own (scripts/setup_env.sh)
#   TEST_TIER      all (default): every test; fast: the fast tier, what plain pytest
#                  runs (the tests not marked slow)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv_dir.sh
export TORCH_VERSION
case "${TEST_TIER:-all}" in
  all) MARKS="" ;;
  fast) MARKS="not slow" ;;
  *)
    echo "scripts/test.sh: TEST_TIER must be all or fast, got '$TEST_TIER'" >&2
    exit 2
    ;;
esac
bash scripts/setup_env.sh
. "$VENV/bin/activate"
ruff check .
# Two workers, one test file each at a time (module fixtures launch once); -n 0 runs
# in this process.
python -m pytest -q -m "$MARKS" -n 2 --dist loadfile "$@"
