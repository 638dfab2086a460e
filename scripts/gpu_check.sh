#!/usr/bin/env bash
# The GPU check of kernels_cupy, in one call of at most 8 minutes on a lent GPU machine:
# the gpu-marked kernel tests, then the decode-attention benchmark, then one results file.
#
#   scripts/gpu_check.sh [OUT_DIR]        # default: $OUT if set, else outputs/gpu_check (git-ignored)
#
# Needs python3 with torch, numpy, cupy and pytest (transformers only for the real-K/V test,
# which skips without it); no Hydra, W&B or lm-eval. Writes OUT_DIR/results.md (device, date,
# test summary, benchmark table), tests.log, bench.log and bench.md. Exit status: the tests'.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-outputs/gpu_check}}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  "$PY" -c 'import torch, numpy, cupy; print(f"torch {torch.__version__}, numpy {numpy.__version__}, cupy {cupy.__version__}")'
} > "$OUT_DIR/device.txt" 2>&1
cat "$OUT_DIR/device.txt"

# Tests: every gpu-marked test of the kernels (first use compiles the modules; CuPy caches them).
timeout 270 "$PY" -m pytest tests/test_kernels_cupy.py -m gpu -q -rs -p no:cacheprovider 2>&1 | tee "$OUT_DIR/tests.log"
test_status=${PIPESTATUS[0]}

# Benchmark: whatever the budget leaves is listed as skipped, so the call ends in time.
timeout 170 "$PY" scripts/bench_kernels.py --max-seconds 120 --out "$OUT_DIR/bench.md" 2>&1 | tee "$OUT_DIR/bench.log"
bench_status=${PIPESTATUS[0]}

{
  echo "# kernels_cupy GPU check"
  echo
  sed 's/^/    /' "$OUT_DIR/device.txt"
  echo
  echo "tests (exit $test_status): $(grep -E '(passed|failed|error|skipped)' "$OUT_DIR/tests.log" | tail -n 1)"
  echo
  echo "benchmark (exit $bench_status):"
  echo
  if [ -s "$OUT_DIR/bench.md" ]; then cat "$OUT_DIR/bench.md"; else tail -n 20 "$OUT_DIR/bench.log"; fi
} > "$OUT_DIR/results.md"
cat "$OUT_DIR/results.md"
exit "$test_status"
