#!/usr/bin/env bash
# On a GPU machine: install the carried wheels, build the extension, run the GPU tests and the layer
# benchmark; full logs under $OUT (or ./gpu_check_out), a short summary at the end.
#
#   STAGES          space list of: build test1 test2 bench benchbwd baseline e2e profile
#                   (default: build test1 test2 bench)
#   BENCH_ARGS      scripts/bench_layer.py arguments of the bench stage
#   BWD_BENCH_ARGS  scripts/bench_layer.py arguments of the benchbwd stage
#   BASELINE_TREE   a copy of another commit's tree (e.g. `git archive <commit> | tar -x -C .baseline`):
#                   the baseline stage builds it in a folder of its own, beside the build stage, and
#                   runs its own bench_layer.py with BASELINE_BENCH_ARGS, then BASELINE_BWD_BENCH_ARGS,
#                   in the same run as this tree's benchmark (same machine, same clocks)
#   TEST_ARGS       extra pytest arguments, split at spaces (e.g. -x --maxfail=3)
#   TEST_K          a pytest -k expression, passed whole
# NVLink multicast stays off everywhere (also in children): NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"
STAGES="${STAGES:-build test1 test2 bench}"
BENCH_ARGS="${BENCH_ARGS:---shape deepseek-v3 --tokens 4096,8192 --backends mok,mok@precision=fp8,alltoall --pass fwd --iters 50}"
BWD_BENCH_ARGS="${BWD_BENCH_ARGS:---shape deepseek-v3 --tokens 4096 --backends mok,mok@precision=fp8,alltoall --pass bwd --iters 50}"
TEST_ARGS="${TEST_ARGS:-}"
TEST_K="${TEST_K:-}"
NGPU="$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
declare -A RESULT
T_START=$(date +%s)

stage() { [[ " $STAGES " == *" $1 "* ]]; }
elapsed() { echo "$(( $(date +%s) - $1 ))s"; }

{
  echo "== $(date -u +%FT%TZ) gpu_check: stages [$STAGES], $NGPU GPU(s)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.sm --format=csv,noheader 2>&1 || true
  python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.log"

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tail -2
  SITE=/tmp/site
else
  SITE=""
fi
export PYTHONPATH="$ROOT${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
# setup.py links -lcuda; the driver API itself is reached through cudaGetDriverEntryPoint, so the
# toolkit's link stub suffices at build time.
export LIBRARY_PATH="/usr/local/cuda/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"

build_tree() {  # dir, log, jobs: build the extension in place and check that it loads
  (cd "$1" && MOK_BUILD_EXT=1 MAX_JOBS="$3" timeout 600 python3 setup.py build_ext --inplace > "$2" 2>&1 \
    && PYTHONPATH="$1${SITE:+:$SITE}" python3 -c 'from megatron_mok import ops; assert ops.is_available(), ops.load_error()' \
    >> "$2" 2>&1)
}

BASE_DIR=/tmp/mok_baseline
if stage baseline; then  # the baseline tree builds in the background, beside this tree's build
  rm -rf "$BASE_DIR" && cp -r "${BASELINE_TREE:?BASELINE_TREE must name the baseline tree}" "$BASE_DIR"
  cp -r .whl "$BASE_DIR/" 2>/dev/null || true
  build_tree "$BASE_DIR" "$OUT/build_baseline.log" 8 &
  BASE_PID=$!
fi

if stage build; then
  t0=$(date +%s)
  if build_tree "$ROOT" "$OUT/build.log" "$(stage baseline && echo 8 || echo 16)"; then
    RESULT[build]="ok ($(elapsed $t0))"
  else
    RESULT[build]="FAIL ($(elapsed $t0))"; tail -40 "$OUT/build.log"
  fi
  grep -E "spill|warning" "$OUT/build.log" | grep -v "0 bytes spill" | head -20
fi
if stage baseline; then
  t0=$(date +%s)
  if wait "$BASE_PID"; then RESULT[build_baseline]="ok"; else RESULT[build_baseline]="FAIL"; tail -20 "$OUT/build_baseline.log"; fi
fi

run_pytest() {  # name, timeout, pytest args...
  local name=$1 to=$2; shift 2
  local t0=$(date +%s)
  # a hung kernel ends the run (thread method: stack dump, then exit) instead of eating the lease
  timeout -k 10 "$to" python3 -m pytest -q -rfEs -p no:cacheprovider --timeout="${TEST_TIMEOUT:-120}" \
    --timeout-method=thread "$@" $TEST_ARGS ${TEST_K:+-k "$TEST_K"} 2>&1 | tee "$OUT/$name.log" | tail -25
  local rc=${PIPESTATUS[0]}
  local line; line="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$OUT/$name.log" | tail -1)"
  RESULT[$name]="rc=$rc ${line:-no summary} ($(elapsed $t0))"
}

if stage test1; then
  run_pytest test1 "${T1_LIMIT:-300}" tests/gpu/test_*_1gpu.py
fi
if stage test2; then
  if [[ "$NGPU" -ge 2 ]]; then run_pytest test2 "${T2_LIMIT:-300}" -s tests/gpu/test_*_2gpu.py
  else RESULT[test2]="skipped (1 GPU)"; fi
fi

run_bench() {  # name, tree, args: one bench_layer.py run on all GPUs, its JSON copied into $OUT
  local name=$1 tree=$2 args=$3 t0=$(date +%s)
  local json="$OUT/$name.json"
  (cd "$tree" && PYTHONPATH="$tree${SITE:+:$SITE}" timeout -k 10 "${BENCH_LIMIT:-420}" \
    torchrun --nproc-per-node="$NGPU" --master-port=$((29500 + NGPU)) scripts/bench_layer.py $args --out "$json") \
    2>&1 | tee "$OUT/$name.log" | grep -E "^\[gate\]|TFLOP|ERROR|Error|roofline" | tail -40
  RESULT[$name]="rc=${PIPESTATUS[0]} ($(elapsed $t0))"
}
if [[ "$NGPU" -ge 1 ]]; then
  stage baseline && [[ "${RESULT[build_baseline]:-}" == ok ]] && run_bench baseline_fwd "$BASE_DIR" "${BASELINE_BENCH_ARGS:-$BENCH_ARGS}"
  stage bench && run_bench bench_fwd "$ROOT" "$BENCH_ARGS"
  stage baseline && [[ "${RESULT[build_baseline]:-}" == ok ]] && [[ -n "${BASELINE_BWD_BENCH_ARGS:-}" ]] \
    && run_bench baseline_bwd "$BASE_DIR" "$BASELINE_BWD_BENCH_ARGS"
  stage benchbwd && run_bench bench_bwd "$ROOT" "$BWD_BENCH_ARGS"
fi

# Hardware counters of the GEMM kernels (not in the default stages): ncu over one short bench_layer.py
# run, the kernels whose names match NCU_KERNELS, NCU_COUNT launches after the first NCU_SKIP (the
# shared expert's small GEMMs come first in a backward); the report, its text, its raw metrics (CSV)
# and the per-instruction stall samples (SourceCounters; ncu.source.csv) under $OUT.
#   PROFILE_ARGS [DeepSeek-V3 T=8192 staged bf16 and fp8 forward, 2 iterations]
if stage profile && [[ "$NGPU" -ge 1 ]]; then
  t0=$(date +%s)
  PROFILE_ARGS="${PROFILE_ARGS:---shape deepseek-v3 --tokens 8192 --backends mok@forward_kernel=staged,mok@precision=fp8 --pass fwd --iters 2 --warmup 1 --skip-gate}"
  timeout -k 10 "${PROFILE_LIMIT:-300}" ncu --clock-control none --target-processes all \
    -k "regex:${NCU_KERNELS:-gemm|wgrad}" --launch-skip "${NCU_SKIP:-0}" --launch-count "${NCU_COUNT:-6}" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
    --section SourceCounters \
    -f -o "$OUT/ncu" torchrun --nproc-per-node=1 scripts/bench_layer.py $PROFILE_ARGS --out /tmp/mok_profile.json \
    > "$OUT/profile.log" 2>&1
  RESULT[profile]="rc=$? ($(elapsed $t0))"
  ncu --import "$OUT/ncu.ncu-rep" --page details > "$OUT/ncu.txt" 2>&1
  ncu --import "$OUT/ncu.ncu-rep" --page raw --csv > "$OUT/ncu.raw.csv" 2>&1
  ncu --import "$OUT/ncu.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu.source.csv" 2>&1 \
    || echo "ncu: no source page (see ncu.source.csv)"
  grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Registers Per|Stall" "$OUT/ncu.txt" | head -80
fi

# End-to-end Megatron training on one recipe (not in the default stages).
#   E2E_CONFIG [configs/deepseek-v3-1gpu.args]  E2E_ITERS [12]  E2E_BACKENDS [mok,alltoall]  E2E_ARGS
if stage e2e && [[ "$NGPU" -ge 1 ]]; then
  t0=$(date +%s)
  e2e_out=/tmp/mok_e2e
  timeout -k 10 "${E2E_LIMIT:-420}" python3 scripts/compare_backends.py --config "${E2E_CONFIG:-configs/deepseek-v3-1gpu.args}" \
    --backends "${E2E_BACKENDS:-mok,alltoall}" --nproc-per-node "$NGPU" --iters "${E2E_ITERS:-12}" --warmup 3 \
    --timeout "${E2E_BACKEND_LIMIT:-240}" --python python3 --out "$e2e_out" ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log" | tail -30
  RESULT[e2e]="rc=${PIPESTATUS[0]} ($(elapsed $t0))"
  cp "$e2e_out"/compare.{json,md,png} "$OUT/" 2>/dev/null || true
  tar -czf "$OUT/e2e_logs.tar.gz" -C "$e2e_out" logs 2>/dev/null || true  # for compare_backends.py --from-logs
fi

echo
echo "== summary ($(elapsed $T_START) total)"
for k in build build_baseline test1 test2 baseline_fwd bench_fwd baseline_bwd bench_bwd profile e2e; do
  [[ -n "${RESULT[$k]:-}" ]] && printf '%-15s %s\n' "$k" "${RESULT[$k]}"
done
exit 0
