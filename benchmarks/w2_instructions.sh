#!/usr/bin/env bash
# Instructions per W2 step for each mode named (default: the two SAVE-region modes
# and their SAC peers), by the difference of two callgrind runs (see
# benchmarks/w2_instructions.py). Needs valgrind; run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
SHORT=${SHORT:-2}
LONG=${LONG:-7}
modes=("$@")
if [ ${#modes[@]} -eq 0 ]; then
  modes=("remat save matmuls" "SAC mm/addmm/bmm" "remat save linears" "SAC mm/addmm")
fi
out=$(mktemp -d)
for mode in "${modes[@]}"; do
  total() {
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file="$out/cg" python benchmarks/w2_instructions.py "$mode" "$1" \
      2>&1 | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
  }
  a=$(total "$SHORT")
  b=$(total "$LONG")
  echo "$mode: $(( (b - a) / (LONG - SHORT) )) instructions per step ($a after $SHORT steps, $b after $LONG)"
done
