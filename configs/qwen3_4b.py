"""Qwen3-4B with DAPO on DAPO-Math-17k: configs/qwen3_8b.py with the 4B model.

  python -m april_jax.main --config=configs/qwen3_4b.py --workdir=runs/qwen3_4b \
      --config.model.path=/models/Qwen3-4B \
      --config.data.source=/data/dapo-math-17k.parquet \
      --config.eval.path=/data/aime24.jsonl
"""

from april_jax.settings import base
from april_jax.settings.qwen3_shapes import QWEN3_SHAPES


def get_config(arg=None):
  """Variants, joined by '+': `gpu` (default) one 141 GB GPU or `node` 8 x 80 GB GPUs;
  and any of configs/qwen3_8b.py's (`node+baseline`, `tis+overlong`, ...). `lora` is
  LoRA on one 80 GB GPU (`lora`, `lora+ppo`), not with `node`."""
  names = list(filter(None, (arg or "").split("+")))
  shapes = [n for n in names if n in ("gpu", "node")]
  if len(shapes) > 1:
    raise ValueError(f"configs/qwen3_4b.py variants {shapes}: 'gpu' or 'node', not both")
  if "lora" in names and "node" in shapes:
    raise ValueError("configs/qwen3_4b.py variant 'lora' runs on one GPU: not with 'node'")
  variant = "lora" if "lora" in names else shapes[0] if shapes else "gpu"
  module = base.sibling(__file__, "qwen3_8b.py")
  c = module.apply_variants(
      module.get_config(), "+".join(n for n in names if n not in shapes), path="configs/qwen3_4b.py"
  )
  c.model.init.update(QWEN3_SHAPES["qwen3_4b"])
  if variant == "gpu":
    # One H200: float32 masters and AdamW (48 GB), the decode copy (8 GB), a KV pool of
    # 408 pages of 256 positions (15 GB: 6 sequences at max_len, about 34 at a mean of
    # 3.1k) shared by 24 slots, and one row's gradients (63 GB with its temporaries) fit
    # 141 GB (python -m april_jax.plan --config=configs/qwen3_4b.py --compile
    # --devices=1 --device_memory_gb=141).
    c.rollout.num_slots = 24
    c.rollout.kv_pages = 408
    c.train.num_microbatches = 256
  elif variant == "lora":
    # One 80 GB GPU (configs/qwen3_8b.py's `lora`, decoding unmerged): the frozen bfloat16
    # base (8.0 GB), the adapters and their AdamW (0.8 GB) and the gradients program's
    # 29.5 GB (compiled) leave 1,080 KV pages of 256 positions (40.8 GB: 15 sequences at
    # max_len, about 89 at a mean of 3.1k) for 64 slots; 1,056 beside PPO's critic
    # (python -m april_jax.plan --config=configs/qwen3_4b.py:lora --compile --devices=1
    # --device_memory_gb=80).
    c.rollout.num_slots = 64
    c.rollout.kv_pages = 1056 if c.train.advantage == "gae" else 1080
  else:
    # A smaller model than 8B leaves room for more KV: 8,704 pages per device (41 GB: 128
    # sequences at max_len), 512 slots.
    c.rollout.num_slots = 512
    c.rollout.kv_pages = 8704
  return c
