#!/usr/bin/env bash
# Trains on the GPUs of one node: one process drives all of them (JAX's single-controller
# mode on one host); the mesh in the config spans the node's devices.
#
#   bash launch/train_gpu_node.sh configs/qwen3_8b.py runs/8b \
#       --config.model.path=/models/Qwen3-8B --config.data.source=/data/dapo.parquet
#   GPU_VENDOR=amd bash launch/train_gpu_node.sh configs/qwen3_8b.py runs/8b ...
#
# Install first: bash launch/install_gpu.sh cuda   (AMD: rocm). Rerunning the same command
# resumes from the workdir's latest checkpoint.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 CONFIG WORKDIR [--config.field=value ...]" >&2
  exit 2
fi
CONFIG=$(realpath "$1") WORKDIR=$(realpath -m "$2")  # relative to where you run this
shift 2
cd "$(dirname "$0")/.."
source launch/gpu_env.sh
exec python -m april_jax.main --config="$CONFIG" --workdir="$WORKDIR" "$@"
