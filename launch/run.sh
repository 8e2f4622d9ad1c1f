#!/usr/bin/env bash
# The main job: set up .venv if needed, then train the small GPT under torchrun.
#
#   bash launch/run.sh                          # 2 ranks on CPU (gloo), FSDP2, selective remat
#   bash launch/run.sh --remat none             # same run without remat, to compare memory
#   NPROC=4 bash launch/run.sh --parallel fsdp2+tp
#   MAX_RESTARTS=3 bash launch/run.sh --checkpoint-dir /tmp/ckpt   # resume after a crash
#   bash launch/run.sh --parallel none          # one process
#
# Several nodes: run the same command on every node, at about the same time. The
# c10d rendezvous runs on the first host named in RDZV_ENDPOINT (its agent hosts
# the store; the others connect) and hands out node and global ranks:
#
#   NNODES=2 NPROC=8 RDZV_ENDPOINT=node0.cluster:29500 RDZV_ID=$JOB_ID bash launch/run.sh
#
# (under SLURM, see docs/distributed.md; tests/launch/test_multi_node.py runs two
# agents of this command on one machine, over 127.0.0.1).
#
# Arguments go to launch/train.py (see --help), after the defaults
# --parallel fsdp2 --remat selective --report, which they override. Environment:
#   NPROC          processes per node (default: the GPU count, or 2 without GPUs;
#                  always 1 with --parallel none)
#   NNODES         number of nodes (default 1: --standalone rendezvous)
#   RDZV_ENDPOINT  host:port of the rendezvous for multi-node runs (with NNODES > 1;
#                  the same on every node)
#   RDZV_ID        the job's id, the same on every node (default torch_remat); it is
#                  also TORCHELASTIC_RUN_ID, which keeps OOM dumps of jobs apart
#   LOCAL_ADDR     the address this node's workers are reached at (torchrun
#                  --local-addr; default: the hostname); the network interface of
#                  gloo and NCCL is chosen by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
#   MAX_RESTARTS   torchrun --max-restarts (default 0)
#   TORCH_REMAT_NO_SETUP  skip scripts/setup_env.sh (torch_remat already installed;
#                  .venv is used when present, else the python on PATH). Without it,
#                  setup_env.sh installs only what is missing, one call at a time.
# A bad argument ends the run with status 2 and train.py's message (launch/torchrun.py).
set -euo pipefail
# relative --checkpoint-dir, --log-json and --oom-dump-dir name places under the folder
# the job is started from (train.py resolves them against it)
export TORCH_REMAT_CALLER_DIR=${TORCH_REMAT_CALLER_DIR:-$PWD}
cd "$(dirname "$0")/.."
# a bad count ends here with a usage error, not in torchrun's traceback
for var in NPROC:processes NNODES:nodes; do
  name=${var%%:*}
  value=${!name:-1}
  case "$value" in
    ''|*[!0-9]*|0*) echo "run.sh: $name=$value: expected a number of ${var#*:} >= 1" >&2; exit 2 ;;
  esac
done
if [ -z "${TORCH_REMAT_NO_SETUP:-}" ]; then
  bash scripts/setup_env.sh
fi
if [ -f .venv/bin/activate ]; then
  . .venv/bin/activate
fi

if [ -z "${NPROC:-}" ]; then
  NPROC=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 2)")
fi
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
set -- --parallel fsdp2 --remat selective --report "$@"
# --parallel none trains in one process (the last --parallel given wins, as in
# train.py): more would be independent runs of the same job.
PARALLEL=
previous=
for arg in "$@"; do
  case "$arg" in
    --parallel=*) PARALLEL=${arg#--parallel=} ;;
    *) if [ "$previous" = --parallel ]; then PARALLEL=$arg; fi ;;
  esac
  previous=$arg
done
if [ "$PARALLEL" = none ]; then
  if [ "$NNODES" -gt 1 ]; then
    echo "run.sh: --parallel none trains in one process; it takes NNODES=1, not $NNODES" >&2
    exit 2
  fi
  NPROC=1
fi
if [ "$NNODES" -gt 1 ]; then
  if [ -z "${RDZV_ENDPOINT:-}" ]; then
    echo "run.sh: NNODES=$NNODES: set RDZV_ENDPOINT=host:port (the first node's rendezvous) for a multi-node run" >&2
    exit 2
  fi
  RDZV=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
        --rdzv-id "${RDZV_ID:-torch_remat}")
  if [ -n "${LOCAL_ADDR:-}" ]; then
    RDZV+=(--local-addr "$LOCAL_ADDR")
  fi
else
  RDZV=(--standalone)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# torchrun, but for a worker's usage error (exit status 2), which ends the launch
# with the worker's message alone (see launch/torchrun.py).
exec python launch/torchrun.py "${RDZV[@]}" --nproc-per-node "$NPROC" \
  --max-restarts "$MAX_RESTARTS" launch/train.py "$@"
