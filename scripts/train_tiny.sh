#!/usr/bin/env bash
# Train a tiny DeepSeek-V3-style model (default configs/deepseek-v3-tiny.args) with --moe-backend mok on 2 ranks.
# Without a GPU: 2 CPU processes on gloo (EP=2, mock data). With GPUs: NCCL, one GPU per rank.
#   BACKEND=mok|alltoall|allgather|hybridep|deepep  (default mok)
#   NPROC=2                                          ranks (a multiple of the config's EP size, 2)
#   CONFIG=configs/deepseek-v3-tiny.args             e.g. configs/deepseek-v3-1gpu-tiny.args with NPROC=1
#                                                    (`#` starts a comment in a config)
#   extra arguments are passed to Megatron, e.g. --train-iters 50 --save /tmp/ckpt
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=$("$ROOT/scripts/setup_env.sh")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# shellcheck disable=SC2046
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" \
  -m megatron_mok.pretrain_gpt $(sed 's/#.*//' "${CONFIG:-$ROOT/configs/deepseek-v3-tiny.args}") \
  --moe-backend "${BACKEND:-mok}" "$@"
