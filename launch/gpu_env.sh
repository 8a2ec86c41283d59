#!/usr/bin/env bash
# Environment for training on GPUs; sourced by the launch scripts (GPU_VENDOR=nvidia|amd).
#
# XLA flags, and why:
#   --xla_gpu_enable_latency_hiding_scheduler=true
#       schedules the FSDP all-gathers / reduce-scatters of the learner early, so the
#       collectives overlap the matmuls instead of stalling them (NVIDIA and AMD builds).
#   XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
#       JAX preallocates 75% of device memory by default; the slots' KV cache and the
#       learner's activations want most of it (the start-up memory plan counts on it).
# Communication: NCCL on NVIDIA, RCCL on AMD; RCCL reads the same NCCL_* variables.
#   NCCL_DEBUG=WARN        a failing link or a dead peer says so in the log
# AMD (ROCm): HIP_VISIBLE_DEVICES selects GPUs (not CUDA_VISIBLE_DEVICES), and
#   HSA_FORCE_FINE_GRAIN_PCIE=1 lets RCCL use fine-grained PCIe memory between GPUs
#   (needed on MI200/MI300 boxes without xGMI between every pair).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
if [[ "${GPU_VENDOR:-nvidia}" == "amd" ]]; then
  export HSA_FORCE_FINE_GRAIN_PCIE=${HSA_FORCE_FINE_GRAIN_PCIE:-1}
fi
