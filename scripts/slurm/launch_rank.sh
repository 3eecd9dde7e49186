#!/usr/bin/env bash
# One training rank under `srun` (started by scripts/slurm/train.sbatch; not meant to be run by hand).
#
# Maps Slurm's task ids onto the torch.distributed env contract (the same variables torchrun sets):
#   RANK=SLURM_PROCID  LOCAL_RANK=SLURM_LOCALID  WORLD_SIZE=SLURM_NTASKS  NODE_RANK=SLURM_NODEID
#   LOCAL_WORLD_SIZE=MOK_GPUS_PER_NODE
# MASTER_ADDR / MASTER_PORT come from train.sbatch. It prints one `[mok-launch] rank=... local_rank=...
# world_size=... node_rank=... host=... master_addr=... master_port=...` line to stderr, then execs
#   $MOK_PYTHON scripts/slurm/rank_stats.py -m $MOK_ENTRY ARGS...      (MOK_RANK_STATS=1, default)
#   $MOK_PYTHON -m $MOK_ENTRY ARGS...                                   (MOK_RANK_STATS=0)
set -euo pipefail

: "${SLURM_PROCID:?launch_rank.sh must run under srun}"
: "${MOK_REPO:?MOK_REPO is not set (train.sbatch sets it)}"
: "${MASTER_ADDR:?MASTER_ADDR is not set (train.sbatch sets it)}"
: "${MASTER_PORT:?MASTER_PORT is not set (train.sbatch sets it)}"

export RANK="$SLURM_PROCID"
export LOCAL_RANK="${SLURM_LOCALID:-0}"
export WORLD_SIZE="${SLURM_NTASKS:?}"
export NODE_RANK="${SLURM_NODEID:-0}"
export GROUP_RANK="$NODE_RANK"
export LOCAL_WORLD_SIZE="${MOK_GPUS_PER_NODE:-1}"

# One line per rank, before anything else: the launch contract as this rank sees it (the sbatch
# script reads these lines to name the ranks that were lost when a step fails).
echo "[mok-launch] rank=$RANK local_rank=$LOCAL_RANK world_size=$WORLD_SIZE node_rank=$NODE_RANK" \
     "host=$(hostname -s 2>/dev/null || hostname) master_addr=$MASTER_ADDR master_port=$MASTER_PORT" \
     "job=${SLURM_JOB_ID:-?} step=${SLURM_STEP_ID:-?} pid=$$" >&2

cd "$MOK_REPO"
py="${MOK_PYTHON:-python3}"
entry="${MOK_ENTRY:-megatron_mok.pretrain_gpt}"
if [[ "${MOK_RANK_STATS:-1}" == 1 ]]; then
  exec "$py" "$MOK_REPO/scripts/slurm/rank_stats.py" -m "$entry" "$@"
else
  exec "$py" -m "$entry" "$@"
fi
