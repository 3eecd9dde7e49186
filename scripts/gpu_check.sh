#!/usr/bin/env bash
# On the GPU box: install the carried wheels, build the extension, run the GPU tests (1 and 2 GPUs)
# and the layer benchmark; full logs under $OUT (or ./gpu_check_out), a short summary at the end.
#
#   STAGES   space list of build test1 test2 bench benchbwd bench1 e2e profile (default: build test1 test2 bench)
#   BENCH_ARGS  arguments of scripts/bench_layer.py (default: the full forward matrix without
#               symm_a2a, which runs in NVSHMEM child processes per rank; add it to compare)
#   BWD_BENCH_ARGS  arguments of the benchwd stage (default: DeepSeek-V3, T=4096, mok,
#               mok_recompute, alltoall, --pass bwd)
#   MOK_BENCH_NOTE  note stored in the benchmark JSON
#   TEST_ARGS   extra pytest arguments, split at spaces (e.g. -x --maxfail=3)
#   TEST_K      a pytest -k expression, passed whole (e.g. "misaligned or timeline")
#   NO_SKIP_PAD_RETRY  set: no second test1 run with MOK_GEMM_SKIP_PAD=0 after a failure (saves time)
#   MOK_BACKWARD  cuda (default) or reference: the backward the tests' autograd paths and e2e use
# NVLink multicast stays off everywhere (also in children): NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"
STAGES="${STAGES:-build test1 test2 bench}"
BENCH_ARGS="${BENCH_ARGS:---shape all --tokens 2048,4096 --backends mok,mok_staged,alltoall --pass fwd --iters 50}"
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
  nvidia-smi topo -m 2>&1 | head -5 || true
  python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.log"

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tail -2
  export PYTHONPATH="$ROOT:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

if stage build; then
  t0=$(date +%s)
  # setup.py links -lcuda; the driver API itself is reached through cudaGetDriverEntryPoint, so
  # the toolkit's link stub suffices at build time.
  export LIBRARY_PATH="/usr/local/cuda/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
  if MOK_BUILD_EXT=1 MAX_JOBS=16 timeout 600 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
     && python3 -c 'from megatron_mok import ops; assert ops.is_available(), ops.load_error()' >> "$OUT/build.log" 2>&1; then
    RESULT[build]="ok ($(elapsed $t0))"
  else
    RESULT[build]="FAIL ($(elapsed $t0))"; tail -40 "$OUT/build.log"
  fi
  grep -E "spill|warning" "$OUT/build.log" | grep -v "0 bytes spill" | head -20
  python3 -c 'import torch; print("torch._grouped_mm:", hasattr(torch, "_grouped_mm"))' 2>&1 | tee -a "$OUT/build.log"
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
  run_pytest test1 "${T1_LIMIT:-300}" tests/gpu/test_kernels_1gpu.py tests/gpu/test_backward_1gpu.py tests/gpu/test_fp8_1gpu.py
  if [[ "${RESULT[test1]}" != rc=0* && -z "${MOK_GEMM_SKIP_PAD:-}" && -z "${NO_SKIP_PAD_RETRY:-}" ]]; then
    # fallback: the GEMMs compute padding rows too (same bits when correct); keep it for the rest
    export MOK_GEMM_SKIP_PAD=0
    RESULT[test1_skip_pad_on]="${RESULT[test1]}"
    run_pytest test1 "${T1_LIMIT:-300}" tests/gpu/test_kernels_1gpu.py tests/gpu/test_backward_1gpu.py tests/gpu/test_fp8_1gpu.py
    RESULT[test1]="${RESULT[test1]} [MOK_GEMM_SKIP_PAD=0]"
  fi
fi
if stage test2; then
  if [[ "$NGPU" -ge 2 ]]; then run_pytest test2 "${T2_LIMIT:-300}" -s tests/gpu/test_kernels_2gpu.py tests/gpu/test_backward_2gpu.py
  else RESULT[test2]="skipped (1 GPU)"; fi
fi

run_bench() {  # name, nproc
  local name=$1 np=$2 t0=$(date +%s)
  export MOK_BENCH_CMD="torchrun --nproc-per-node=$np scripts/bench_layer.py $BENCH_ARGS"
  timeout -k 10 "${BENCH_LIMIT:-900}" torchrun --nproc-per-node="$np" --master-port=$((29500 + np)) scripts/bench_layer.py $BENCH_ARGS \
    2>&1 | tee "$OUT/$name.log" | grep -E "^\[gate\]|TFLOP|ERROR|wrote|Error" | tail -60
  RESULT[$name]="rc=${PIPESTATUS[0]} ($(elapsed $t0))"
  # only the file this run wrote ($OUT brings back at most 8 files)
  local newest; newest="$(ls -t bench/results/*.json 2>/dev/null | head -1)"
  [[ -n "$newest" && "$newest" -nt "$OUT/env.log" ]] && cp "$newest" "$OUT/"
}
stage bench && [[ "$NGPU" -ge 1 ]] && run_bench bench "$NGPU"
stage bench1 && [[ "$NGPU" -ge 1 ]] && run_bench bench1 1
if stage benchbwd && [[ "$NGPU" -ge 1 ]]; then
  BENCH_ARGS="${BWD_BENCH_ARGS:---shape deepseek-v3 --tokens 4096 --backends mok,mok_recompute,alltoall --pass bwd --iters 50}" \
    run_bench benchbwd "$NGPU"
fi

# End-to-end Megatron training, mok against alltoall, on one recipe (not in the default stages).
#   E2E_CONFIG [configs/deepseek-v3-proxy.args]  E2E_ITERS [12]  E2E_BACKENDS [mok,alltoall]
#   E2E_ARGS: more compare_backends.py arguments, e.g. "--rerun mok --param-digest-every 50"
if stage e2e && [[ "$NGPU" -ge 2 ]]; then
  t0=$(date +%s)
  e2e_out=/tmp/mok_e2e
  timeout -k 10 "${E2E_LIMIT:-420}" python3 scripts/compare_backends.py --config "${E2E_CONFIG:-configs/deepseek-v3-proxy.args}" \
    --backends "${E2E_BACKENDS:-mok,alltoall}" --nproc-per-node "$NGPU" --iters "${E2E_ITERS:-12}" --warmup 3 \
    --timeout "${E2E_BACKEND_LIMIT:-240}" --python python3 --out "$e2e_out" ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log" | tail -30
  RESULT[e2e]="rc=${PIPESTATUS[0]} ($(elapsed $t0))"
  cp "$e2e_out"/compare.{json,md,png} "$OUT/" 2>/dev/null || true
  for b in $(tr , ' ' <<< "${E2E_BACKENDS:-mok,alltoall}") mok_rerun; do
    f="$e2e_out/logs/$b.log"; [[ -f "$f" ]] && tail -c 200000 "$f" > "$OUT/e2e_$b.log"
  done
fi

# Where a training step's GPU time goes: one short run per backend with Megatron's torch profiler on
# rank 0 (steps 10-11 of 14), summarized by scripts/trace_summary.py into $OUT/profile_<backend>.json.
#   PROFILE_CONFIG [configs/deepseek-v3-proxy.args]  PROFILE_BACKENDS [mok,alltoall]
if stage profile && [[ "$NGPU" -ge 2 ]]; then
  t0=$(date +%s)
  for b in $(tr , ' ' <<< "${PROFILE_BACKENDS:-mok,alltoall}"); do
    d=/tmp/mok_profile_$b
    rm -rf "$d"
    timeout -k 10 "${PROFILE_LIMIT:-240}" python3 scripts/compare_backends.py --config "${PROFILE_CONFIG:-configs/deepseek-v3-proxy.args}" \
      --backends "$b" --nproc-per-node "$NGPU" --iters 14 --warmup 3 --timeout "${PROFILE_LIMIT:-240}" --python python3 \
      --out "$d" -- --profile --use-pytorch-profiler --profile-step-start 10 --profile-step-end 12 --profile-ranks 0 \
      --tensorboard-dir "$d/tb" > "$OUT/profile_$b.log" 2>&1
    # to a file first: piping into head would end the script (SIGPIPE) before it writes the JSON
    python3 scripts/trace_summary.py "$d/torch_profile/rank-0.json.gz" --steps 2 --json "$OUT/profile_$b.json" \
      > "$OUT/profile_$b.txt" 2>&1
    head -30 "$OUT/profile_$b.txt"
  done
  RESULT[profile]="done ($(elapsed $t0))"
fi

echo
echo "== summary ($(elapsed $T_START) total)"
for k in build test1_skip_pad_on test1 test2 bench benchbwd bench1 e2e profile; do
  [[ -n "${RESULT[$k]:-}" ]] && printf '%-7s %s\n' "$k" "${RESULT[$k]}"
done
newest="$(ls -t bench/results/*.json 2>/dev/null | head -1)"
if [[ -n "$newest" ]] && stage bench; then
  python3 scripts/plot_bench.py --no-plot "$newest" 2>/dev/null | tail -40 || true
fi
