#!/usr/bin/env bash
# Installs april_jax for GPUs.
#   NVIDIA:  bash launch/install_gpu.sh cuda
#   AMD:     bash launch/install_gpu.sh rocm
# NVIDIA uses jax's CUDA 12 wheels (driver >= 525 suffices; the wheels bring CUDA and cuDNN).
# AMD uses jax's ROCm plugin wheels (ROCm 6.x installed on the host, gfx90a/gfx942 class GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-cuda}" in
  cuda) python -m pip install -e ".[cuda]" ;;
  rocm) python -m pip install -e . && python -m pip install "jax[rocm]" ;;
  *) echo "usage: $0 cuda|rocm" >&2; exit 2 ;;
esac
python -c "import jax; print(jax.devices())"
