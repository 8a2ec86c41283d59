"""Qwen3-4B with DAPO on DAPO-Math-17k: configs/qwen3_8b.py with the 4B model.

  python -m april_jax.main --config=configs/qwen3_4b.py --workdir=runs/qwen3_4b \
      --config.model.path=/models/Qwen3-4B \
      --config.data.source=/data/dapo-math-17k.parquet \
      --config.eval.path=/data/aime24.jsonl
"""

import importlib.util
from pathlib import Path


def get_config(arg=None):
  spec = importlib.util.spec_from_file_location(
      "qwen3_8b", Path(__file__).resolve().parent / "qwen3_8b.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(arg)
  c.rollout.num_slots = 192   # a smaller model leaves room for more KV
  return c
