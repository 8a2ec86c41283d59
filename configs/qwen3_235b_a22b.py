"""Qwen3-235B-A22B (mixture of experts) with configs/qwen3_30b_a3b.py's recipe, for the
planner: what 8 nodes of 8 x 80 GB would hold.

  python -m april_jax.plan --config=configs/qwen3_235b_a22b.py --devices=64 --device_memory_gb=80

94 layers, each 128 experts of width 1,536, 8 a token (235B weights, 22B active), FSDP
over all 64 devices, AdamW's moments in bfloat16. docs/moe.md gives the plan's lines; a
run on several hosts takes `distributed.*` (docs/multihost.md).
"""

from april_jax.settings import base
from april_jax.settings.qwen3_shapes import QWEN3_SHAPES


def get_config(arg=None):
  c = base.sibling(__file__, "qwen3_30b_a3b.py").get_config(arg)
  c.model.init.update(QWEN3_SHAPES["qwen3_235b_a22b"])
  c.rollout.num_slots = 256
  c.rollout.kv_pages = 2048
  c.train.num_microbatches = 4  # 64 rows a gradient call: one per device
  return c
