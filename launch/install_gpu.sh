#!/usr/bin/env bash
# Installs april_jax for GPUs.
#   NVIDIA:  bash launch/install_gpu.sh cuda
#   AMD:     bash launch/install_gpu.sh rocm
# NVIDIA uses jax's CUDA 12 wheels (driver >= 525 suffices; the wheels bring CUDA and cuDNN).
# AMD uses jax's ROCm 7 plugin (`jax[rocm7-local]`: the plugin wheels built against the
# ROCm 7 installed on the host; MI200/MI300-class GPUs). For other ROCm versions use AMD's
# rocm/jax container, then `pip install -e .` inside it.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-cuda}" in
  cuda) python -m pip install -e ".[cuda]" ;;
  rocm) python -m pip install -e . && python -m pip install "jax[rocm7-local]" ;;
  *) echo "usage: $0 cuda|rocm" >&2; exit 2 ;;
esac
python -c "import jax; print(jax.devices())"
