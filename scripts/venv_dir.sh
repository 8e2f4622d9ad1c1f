# Sourced by scripts/setup_env.sh and scripts/test.sh: sets TORCH_VERSION (default
# 2.13.0, the floor) and VENV, the virtual environment that holds that torch: .venv
# for the floor, .venv-torch<version> for any other, so that .venv stays on the floor.
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if ! [[ "$TORCH_VERSION" =~ ^[0-9]+(\.[0-9]+)*$ ]]; then
  echo "TORCH_VERSION must be a release number such as 2.15.0, got '$TORCH_VERSION'" >&2
  exit 2
fi
if [ "$TORCH_VERSION" = 2.13.0 ]; then
  VENV=.venv
else
  VENV=.venv-torch$TORCH_VERSION
fi
