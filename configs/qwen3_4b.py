"""Qwen3-4B with DAPO on DAPO-Math-17k: configs/qwen3_8b.py with the 4B model.

  python -m april_jax.main --config=configs/qwen3_4b.py --workdir=runs/qwen3_4b \
      --config.model.path=/models/Qwen3-4B \
      --config.data.source=/data/dapo-math-17k.parquet \
      --config.eval.path=/data/aime24.jsonl
"""

import importlib.util
from pathlib import Path

from april_jax.configs.qwen3_shapes import QWEN3_SHAPES


def get_config(arg=None):
  """Variants: `gpu` (default) one 141 GB GPU; `node` 8 x 80 GB GPUs, the paper's slots."""
  variant = arg or "gpu"
  if variant not in ("gpu", "node"):
    raise ValueError(f"configs/qwen3_4b.py variant {variant!r}: one of 'gpu', 'node'")
  spec = importlib.util.spec_from_file_location(
      "qwen3_8b", Path(__file__).resolve().parent / "qwen3_8b.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.model.init.update(QWEN3_SHAPES["qwen3_4b"])
  if variant == "gpu":
    # One H200: float32 masters and AdamW (48 GB), the decode copy (8 GB), 24 slots of
    # 9,216 tokens (33 GB of KV) and one row's gradients, or the optimizer update's
    # temporaries (29 GB), fit 141 GB (python -m april_jax.plan
    # --config=configs/qwen3_4b.py --compile --devices=1 --device_memory_gb=141).
    c.rollout.num_slots = 24
    c.train.num_microbatches = 64
  else:
    c.rollout.num_slots = 192   # a smaller model than 8B leaves room for more KV
  return c
