#!/usr/bin/env bash
# Measure tuned vs baseline plans on ONE GPU (prepared for an H200) and compare with predictions.
#
#   scripts/bench_gpu.sh RESULTS_DIR
#
# GPT-3 1.3B and 2.7B, sequence 2048, global batch 16, memory budgets of 32 and 64 GiB emulated on the
# big card (the tuner plans for the budget; XLA's and the allocator's peaks show what the plan used).
# Writes RESULTS_DIR/bench_gpu.json (+ bench_gpu.log); finishes in under 8 minutes (the Python part stops
# starting new runs after 420 s and the whole script is killed at 470 s). On a machine without a GPU:
#   scripts/bench_gpu.sh RESULTS_DIR --dry-run      (gpt3-tiny on the CPU, seconds)
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 RESULTS_DIR [extra args for scripts/bench_gpu.py]" >&2
  exit 2
fi
RESULTS_DIR=$1
shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-$HERE/.venv/bin/python}
[[ -x $PY ]] || PY=python3
mkdir -p "$RESULTS_DIR"
# One process owns the whole card; let XLA grow its pool on demand so the allocator's peak is meaningful.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
unset XLA_FLAGS  # no simulated host devices here
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$RESULTS_DIR/gpu.csv" 2>/dev/null || true
timeout 470 "$PY" "$HERE/scripts/bench_gpu.py" --results "$RESULTS_DIR" --deadline 420 "$@" \
  2>&1 | tee "$RESULTS_DIR/bench_gpu.log"
