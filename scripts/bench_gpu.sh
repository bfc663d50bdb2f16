#!/usr/bin/env bash
# Measure tuned vs baseline plans on ONE GPU (prepared for an H200) and compare with predictions.
#
#   scripts/bench_gpu.sh RESULTS_DIR
#
# GPT-3 1.3B and 2.7B, sequence 2048, global batch 16, memory budgets of 32 and 64 GiB emulated on the
# big card (the tuner plans for the budget; XLA's and the allocator's peaks show what the plan used).
# First the kernel curves the time model needs (scripts/bench_kernels.py: GEMMs over m, n, k, fused attention
# by shape, memory-bound kernels by size, each beside the preset's prediction; at most 100 s), then the plans.
# Writes RESULTS_DIR/kernels.json, RESULTS_DIR/bench_gpu.json (+ bench_gpu.log); finishes in under 8 minutes
# (the plans' Python part stops starting new runs after 320 s and is killed at 370 s). Without a GPU:
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
SMOKE=""
[[ " $* " == *" --dry-run "* ]] && SMOKE="--smoke"
timeout 100 "$PY" "$HERE/scripts/bench_kernels.py" --json "$RESULTS_DIR/kernels.json" --deadline 80 $SMOKE \
  2>&1 | tee "$RESULTS_DIR/bench_kernels.log" || echo "bench_kernels stopped early; the plans run next" >&2
timeout 370 "$PY" "$HERE/scripts/bench_gpu.py" --results "$RESULTS_DIR" --deadline 320 "$@" \
  2>&1 | tee "$RESULTS_DIR/bench_gpu.log"
