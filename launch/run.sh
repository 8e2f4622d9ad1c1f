#!/usr/bin/env bash
# The main job: set up .venv if needed, then train the small GPT under torchrun.
#
#   bash launch/run.sh                          # 2 ranks on CPU (gloo), FSDP2, selective remat
#   bash launch/run.sh --remat none             # same run without remat, to compare memory
#   NPROC=4 bash launch/run.sh --parallel fsdp2+tp
#   MAX_RESTARTS=3 bash launch/run.sh --checkpoint-dir /tmp/ckpt   # resume after a crash
#
# Arguments go to launch/train.py (see --help), after the defaults
# --parallel fsdp2 --remat selective --report, which they override. Environment:
#   NPROC          processes per node (default: the GPU count, or 2 without GPUs)
#   NNODES         number of nodes (default 1: --standalone rendezvous)
#   RDZV_ENDPOINT  host:port of the rendezvous for multi-node runs (with NNODES > 1;
#                  run the same command on every node)
#   MAX_RESTARTS   torchrun --max-restarts (default 0)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${TORCH_REMAT_NO_SETUP:-}" ]; then
  bash scripts/setup_env.sh
fi
. .venv/bin/activate

if [ -z "${NPROC:-}" ]; then
  NPROC=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 2)")
fi
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
set -- --parallel fsdp2 --remat selective --report "$@"
if [ "$NNODES" -gt 1 ]; then
  : "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port for a multi-node run}"
  RDZV=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT")
else
  RDZV=(--standalone)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec torchrun "${RDZV[@]}" --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS" \
  launch/train.py "$@"
