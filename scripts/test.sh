#!/usr/bin/env bash
# The test suite: CPU tests everywhere (GPU tests skip without CUDA and the compiled extension).
# Extra arguments go to pytest, e.g. scripts/test.sh -k functional
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=$("$ROOT/scripts/setup_env.sh")
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m pytest -ra "$@" tests
