#!/usr/bin/env bash
# The GPU check of kernels_cupy, in one call of at most 570 s (its budgets) on a lent GPU machine:
# a usable-GPU check, every module compiled once, the gpu-marked tests, the decode-attention and whole-step
# benchmarks, one results file.
#
#   scripts/gpu_check.sh [OUT_DIR]        # default: $OUT if set, else outputs/gpu_check (git-ignored)
#
# Needs python3 ($PYTHON) with torch, numpy, cupy, pytest and transformers (the real-K/V test loads
# the bundled stories260K; without transformers it skips, and a skip fails the check); no Hydra,
# W&B, lm-eval or platformdirs (the converted model goes to $XDG_CACHE_HOME/kvquant, default
# ~/.cache/kvquant). pytest-xdist and pytest-timeout are used where installed (tests on 8 workers, 120 s a
# test). Writes OUT_DIR/results.md (device, date, compile times, test verdict, benchmark tables), device.txt,
# compile.log, tests.log, tests.xml, bench.log, bench.md, graph.log, graph.md, step.log, step.md, aquakv.log and
# aquakv.md.
#
# The benchmarks are reduced versions of issues 32 and 33's: attention only, SDPA vs the paper's rule vs
# the block rule vs the 16-bit control at the Llama-2-7B shape, batch 1 and 8, contexts 4K-32K, with bytes
# read and % of the copy bandwidth measured in the same run, the block rule and the control also on the warp QK
# kernel and byte-permute SV reads (opt-in until validated here), issue 32's GPU targets read off each table
# (PASS / FAIL / not measured, block and block_w, the paper's rule on the new kernels beside them as aligned_w),
# the kernels one step runs at batch 8,
# 32K, and each method's host work per eager call at 4K batch 1 with the block rule's call profiled by Python
# function (scripts/bench_kernels.py); the same at 4K and 32K as CUDA-graph replays (device time, no host work);
# and whole decode steps on a random-weight Llama-2-7B layout at 4K and 32K,
# each cache against DynamicCache (each named with its backend, `kivi2@torch` beside `kivi2@cupy`: `auto` picks
# CuPy for some formats) with the torch operators and CuPy launches a step makes per layer, and one step of
# DynamicCache, fp16, kivi2@cupy and alignedkv_block@cupy under torch.profiler (operators by host time, in
# step.log), and AQUA-KV's (random predictors) on a Llama-3.1-8B layout at 4K against DynamicCache and its
# floor (scripts/bench_step.py).
#
# Fails closed. Exit 0 only when every module compiled, every gpu-marked test ran and passed (none skipped,
# at least one collected) and the four benchmark runs exited 0; 2 when CuPy or the GPU is unusable (one
# `error:` line, nothing else run); 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-outputs/gpu_check}}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled

# 1. Up front (<= 40 s): cupy and torch see a GPU and can run on it; else one line, exit 2.
probe=$(timeout 40 "$PY" - 2>&1 <<'EOF'
import sys

from kernels_cupy import cupy_status

ok, why = cupy_status()
if not ok:
    sys.exit(why)
import cupy
import numpy
import pytest
import torch

if int(cupy.arange(4).sum()) != 6 or torch.ones(4, device="cuda").sum().item() != 4:
    sys.exit("a 4-element sum on the GPU came out wrong")
print(f"gpu: {torch.cuda.get_device_name()}")
print(f"torch {torch.__version__}, numpy {numpy.__version__}, cupy {cupy.__version__}, pytest {pytest.__version__}")
EOF
)
probe_status=$?
if [ "$probe_status" -ne 0 ]; then
  reason=$(printf '%s\n' "$probe" | tail -n 1)
  [ "$probe_status" -eq 124 ] && reason="the probe did not finish in 40 s"
  echo "error: the kernels cannot run here: ${reason:-exit $probe_status}" >&2
  exit 2
fi
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/nvidia-smi: /'
  printf '%s\n' "$probe"
} > "$OUT_DIR/device.txt"
cat "$OUT_DIR/device.txt"

# 2. Compile (<= 90 s): every module at once, one process each, as the loader compiles it at first use
# (NVRTC; nvcc where NVRTC refuses), so CuPy's disk cache holds them before the test workers start.
timeout 90 "$PY" scripts/gpu_compile.py 2>&1 | tee "$OUT_DIR/compile.log"
compile_status=${PIPESTATUS[0]}

# 3. Tests (<= 180 s): every gpu-marked test of the kernels and of the caches on CUDA. The verdict is read
# from the JUnit report, so a skip counts against the check whatever pytest exits.
plugins=()
"$PY" -c "import xdist" 2>/dev/null && plugins+=(-n 8)
"$PY" -c "import pytest_timeout" 2>/dev/null && plugins+=(--timeout 120)
rm -f "$OUT_DIR/tests.xml"
timeout 180 "$PY" -m pytest tests/test_kernels_cupy.py tests/test_kernels_cupy_codes.py tests/test_kernels_cupy_higgs.py \
  tests/test_kernels_cupy_aquakv.py tests/test_cache.py -m gpu -q -rs --tb=short -p no:cacheprovider "${plugins[@]}" \
  --junitxml="$OUT_DIR/tests.xml" 2>&1 | tee "$OUT_DIR/tests.log"
test_status=${PIPESTATUS[0]}
if [ -s "$OUT_DIR/tests.xml" ]; then
  verdict=$("$PY" - "$OUT_DIR/tests.xml" 2>&1 <<'EOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
n = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
print(f"{n['tests']} gpu tests: {passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped")
sys.exit(0 if n["tests"] > 0 and passed == n["tests"] else 1)
EOF
  )
  verdict_status=$?
else
  verdict="no test report: pytest did not finish (exit $test_status; 124 is the 180 s timeout)"
  verdict_status=1
fi

# 4. Benchmarks (<= 90 s + 30 s + 100 s + 40 s): whatever a budget leaves is listed as skipped, so the call ends in
# time. Attention only (AlignedKV's kernels vs SDPA), then whole decode steps on a random-weight Llama-2-7B
# layout (each cache vs DynamicCache, the torch path beside the CuPy kernels), then AQUA-KV's on a
# Llama-3.1-8B layout (8 KV heads: 1024-channel predictors; Llama-2-7B's 4096 would be 6 GB of weights).
timeout 90 "$PY" scripts/bench_kernels.py --shapes llama2_7b --contexts 4096,8192,16384,32768 --batches 1,8 \
  --methods sdpa,aligned,block,control,block_w,control_w,aligned_w --repeats 10 --max-seconds 60 --profile llama2_7b:8:32768 \
  --host llama2_7b:1:4096 --out "$OUT_DIR/bench.md" 2>&1 \
  | tee "$OUT_DIR/bench.log"
bench_status=${PIPESTATUS[0]}
timeout 30 "$PY" scripts/bench_kernels.py --shapes llama2_7b --contexts 4096,32768 --batches 1,8 \
  --methods sdpa,block,control,block_w,control_w,aligned_w --repeats 10 --max-seconds 20 --graph --out "$OUT_DIR/graph.md" 2>&1 \
  | tee "$OUT_DIR/graph.log"
graph_status=${PIPESTATUS[0]}
timeout 100 "$PY" scripts/bench_step.py --layout llama2_7b --contexts 4096,32768 --repeats 5 --max-seconds 70 \
  --methods fp16,kivi2@torch,kivi2@cupy,kivi4@cupy,gear2@torch,gear2@cupy,higgs_post_rope@cupy,alignedkv_block@torch,alignedkv_block@cupy \
  --profile DynamicCache,fp16,kivi2@cupy,alignedkv_block@cupy --out "$OUT_DIR/step.md" 2>&1 | tee "$OUT_DIR/step.log"
step_status=${PIPESTATUS[0]}
timeout 40 "$PY" scripts/bench_step.py --layout llama3.1_8b --contexts 4096 --repeats 3 --max-seconds 15 \
  --methods fp16,aquakv@torch,aquakv@cupy --out "$OUT_DIR/aquakv.md" 2>&1 | tee "$OUT_DIR/aquakv.log"
aquakv_status=${PIPESTATUS[0]}

status=0
[ "$compile_status" -eq 0 ] || status=1
[ "$test_status" -eq 0 ] && [ "$verdict_status" -eq 0 ] || status=1
[ "$bench_status" -eq 0 ] && [ "$graph_status" -eq 0 ] && [ "$step_status" -eq 0 ] && [ "$aquakv_status" -eq 0 ] || status=1
{
  echo "# kernels_cupy GPU check: $([ "$status" -eq 0 ] && echo PASSED || echo FAILED)"
  echo
  sed 's/^/    /' "$OUT_DIR/device.txt"
  echo
  echo "compile (exit $compile_status):"
  echo
  sed 's/^/    /' "$OUT_DIR/compile.log"
  echo
  echo "tests (pytest exit $test_status): $verdict"
  if grep -q '^SKIPPED' "$OUT_DIR/tests.log"; then
    echo
    grep '^SKIPPED' "$OUT_DIR/tests.log" | sed 's/^/    /'
  fi
  echo
  echo "benchmark (exit $bench_status):"
  echo
  if [ -s "$OUT_DIR/bench.md" ]; then cat "$OUT_DIR/bench.md"; else tail -n 20 "$OUT_DIR/bench.log"; fi
  echo
  echo "the same kernels as CUDA-graph replays (exit $graph_status):"
  echo
  if [ -s "$OUT_DIR/graph.md" ]; then cat "$OUT_DIR/graph.md"; else tail -n 20 "$OUT_DIR/graph.log"; fi
  echo
  echo "whole decode step (exit $step_status):"
  echo
  if [ -s "$OUT_DIR/step.md" ]; then cat "$OUT_DIR/step.md"; else tail -n 20 "$OUT_DIR/step.log"; fi
  echo
  echo "AQUA-KV whole decode step (exit $aquakv_status):"
  echo
  if [ -s "$OUT_DIR/aquakv.md" ]; then cat "$OUT_DIR/aquakv.md"; else tail -n 20 "$OUT_DIR/aquakv.log"; fi
} > "$OUT_DIR/results.md"
cat "$OUT_DIR/results.md"
if [ "$status" -ne 0 ]; then
  echo "error: GPU check failed: compile exit $compile_status; tests exit $test_status ($verdict); benchmarks exit $bench_status, $graph_status, $step_status, $aquakv_status" >&2
fi
exit "$status"
