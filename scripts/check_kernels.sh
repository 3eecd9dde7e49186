#!/usr/bin/env bash
# CPU compile check of every CUDA kernel file (no GPU; torch headers only for the link check):
#   nvcc -gencode=arch=compute_90a,code=sm_90a per csrc/kernels/**/*.cu, -Xptxas -v;
#   prints compiler warnings; fails on any compile error, on register spills / stack frames in the GEMM kernels, on
#   ptxas serializing their wgmmas (C751x), if the SASS of the GEMM objects holds no HGMMA (wgmma),
#   and if a bf16 GEMM kernel fences at GPU scope more than twice (a per-stage fence); then a link check:
#   every kernel launcher the bindings (csrc/bindings/*.cpp, compiled on the host against torch's headers)
#   call is defined by a kernel object with the same signature.
# Usage: scripts/check_kernels.sh [python]   (default: python3). Installs nvidia-cutlass==4.2.0.0
# (--no-deps) into that python when its headers are missing. nvcc 13.0 must be on PATH.
set -euo pipefail
PY="${1:-${PYTHON:-python3}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

cutlass_dir() {
  "$PY" - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("cutlass_library")
print(os.path.join(spec.submodule_search_locations[0], "source", "include") if spec else "")
PY
}
CUT="$(cutlass_dir)"
if [[ -z "$CUT" || ! -d "$CUT/cute" ]]; then
  echo "installing nvidia-cutlass==4.2.0.0 (headers only, --no-deps) into $PY"
  "$PY" -m pip install -q --no-deps nvidia-cutlass==4.2.0.0
  CUT="$(cutlass_dir)"
fi

CUOBJDUMP="$(command -v cuobjdump || true)"
if [[ -z "$CUOBJDUMP" ]]; then
  CUOBJDUMP="$("$PY" - <<'PY'
import glob, importlib.util, os
spec = importlib.util.find_spec("triton")
hits = glob.glob(os.path.join(spec.submodule_search_locations[0], "backends", "nvidia", "bin", "cuobjdump")) if spec else []
print(hits[0] if hits else "")
PY
)"
fi
if [[ -z "$CUOBJDUMP" ]]; then
  echo "FAIL: no cuobjdump (neither on PATH nor in the triton wheel)"; exit 1
fi

NVCC_FLAGS=(-gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr
            -Xptxas -v -I"$ROOT/csrc" -I"$ROOT/csrc/kernels" -I"$CUT")
GEMM_FILES=(grouped_gemm expert_gemm expert_wgrad expert_gemm_fp8 megakernel)  # must use wgmma and must not spill
FENCE_FILES=(grouped_gemm expert_gemm expert_wgrad)  # at most the two cluster barriers fence at GPU scope
status=0
printf '%-16s %8s  %s\n' file seconds result
mapfile -t SOURCES < <(find "$ROOT/csrc/kernels" -name '*.cu' | sort)
for src in "${SOURCES[@]}"; do
  name="$(basename "$src" .cu)"
  t0=$(date +%s%N)
  if ! nvcc "${NVCC_FLAGS[@]}" -c "$src" -o "$OUT/$name.o" > "$OUT/$name.log" 2>&1; then
    printf '%-16s %8s  %s\n' "$name" "-" "COMPILE ERROR"; cat "$OUT/$name.log"; status=1; continue
  fi
  secs=$(( ($(date +%s%N) - t0) / 1000000 ))ms
  result="ok"
  if grep -q -E "warning" "$OUT/$name.log"; then grep -E "warning" "$OUT/$name.log"; fi
  if [[ " ${GEMM_FILES[*]} " == *" $name "* ]]; then
    if grep -E "bytes spill (stores|loads)" "$OUT/$name.log" | grep -v -q -E "^ *0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"; then
      result="SPILLS"; grep -E "stack frame|spill" "$OUT/$name.log"; status=1
    elif grep -q -E "C751[0-9]" "$OUT/$name.log"; then
      result="WGMMA SERIALIZED (C751x)"; grep -E "C751[0-9]" "$OUT/$name.log"; status=1
    elif ! "$CUOBJDUMP" --dump-sass "$OUT/$name.o" | grep -q -E "[HQ]GMMA"; then
      result="NO HGMMA/QGMMA in SASS"; status=1
    elif [[ " ${FENCE_FILES[*]} " == *" $name "* ]] && "$CUOBJDUMP" --dump-sass "$OUT/$name.o" \
         | awk '/Function :/{n=0} /MEMBAR.ALL.GPU/{if(++n>2) bad=1} END{exit !bad}'; then
      # only the two cluster barriers (start, end) may fence at GPU scope; a fence per ring stage
      # (e.g. a .release.cluster arrival) costs ~25% of the GEMM
      result="MEMBAR.ALL.GPU in the GEMM main loop"; status=1
    else
      sass="$("$CUOBJDUMP" --dump-sass "$OUT/$name.o")"
      result="ok (HGMMA: $(grep -c HGMMA <<< "$sass"), QGMMA (e4m3): $(grep -c QGMMA <<< "$sass"), $(grep -o 'Used [0-9]* registers' "$OUT/$name.log" | sort -u | tr '\n' ' '))"
    fi
  fi
  printf '%-16s %8s  %s\n' "$name" "$secs" "$result"
done
# Link check: every launcher the torch ops call is defined by a kernel object with that exact
# signature (a declaration in api.h that no .cu defines alike links to nothing, and the extension
# fails at import on the GPU machine: "undefined symbol"). The bindings compile against the torch
# headers of $PY (module.cpp, Python's registration only, is left out).
TORCH_INC="$("$PY" -c 'import torch.utils.cpp_extension as c; print(" ".join("-I" + p for p in c.include_paths()))' 2>/dev/null)"
t0=$(date +%s%N)
pids=()
for src in "$ROOT"/csrc/bindings/*.cpp; do
  name="bindings_$(basename "$src" .cpp)"
  [[ "$name" == bindings_module ]] && continue
  # shellcheck disable=SC2086
  # nvcc as the host-compiler driver: it adds the CUDA headers' path (c10/cuda includes cuda_runtime.h)
  nvcc -x c++ -std=c++17 -w -O0 -c $TORCH_INC -I"$ROOT/csrc" -I"$ROOT/csrc/kernels" -DTORCH_EXTENSION_NAME=_C \
    "$src" -o "$OUT/$name.o" > "$OUT/$name.log" 2>&1 &
  pids+=($!)
done
link="ok"
for pid in "${pids[@]}"; do wait "$pid" || link="COMPILE ERROR"; done
if [[ "$link" != ok ]]; then
  cat "$OUT"/bindings_*.log | grep -E "error" | head -20; status=1
else
  nm -C --defined-only "$OUT"/*.o 2>/dev/null | grep -E " [TW] mok::" | sed -E 's/^[0-9a-f]+ [TW] //' | sort -u > "$OUT/defined.txt"
  missing="$(nm -C --undefined-only "$OUT"/bindings_*.o | sed -nE 's/^ +U (mok::.*)$/\1/p' | sort -u | grep -vxF -f "$OUT/defined.txt" || true)"
  if [[ -n "$missing" ]]; then
    link="UNDEFINED: $(tr '\n' ';' <<< "$missing")"; status=1
  else
    link="ok ($(nm -C --undefined-only "$OUT"/bindings_*.o | grep -c " U mok::") launcher references, all defined)"
  fi
fi
printf '%-16s %8s  %s\n' "bindings link" "$(( ($(date +%s%N) - t0) / 1000000 ))ms" "$link"
[[ $status -eq 0 ]] && echo "check_kernels: PASS" || echo "check_kernels: FAIL"
exit $status
