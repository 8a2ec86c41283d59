"""Qwen3-30B-A3B (mixture of experts) with DAPO on DAPO-Math-17k: the 8B's recipe.

  python -m april_jax.main --config=configs/qwen3_30b_a3b.py --workdir=runs/qwen3_30b_a3b \
      --config.model.path=/models/Qwen3-30B-A3B \
      --config.data.source=/data/dapo-math-17k.parquet \
      --config.eval.path=/data/aime24.jsonl

configs/qwen3_8b.py's run (APRIL's DAPO setting: 32 groups of 8 a step, 64 admitted,
16,384-token responses, clip-higher, dynamic sampling, Adam 1e-6) with the 30B-A3B model:
48 layers, each 128 experts of width 768, 8 routed a token (30.5B weights, 3.3B active).
Colocated on one node of 8 x 80 GB, FSDP over all 8. The rollout records each token's
experts and the learner replays them (model.routing_replay, docs/moe.md); the router's
auxiliary loss stays off, as the peers' RL recipes for this model set it.

It does not fit 8 x 80 GB yet. Compiled at its shapes on 8 fake devices (python -m
april_jax.plan --config=configs/qwen3_30b_a3b.py --compile --devices=8
--device_memory_gb=80) the peak is 123.3 GB a device, in the gradients program (its
activations at 17,408 tokens a call), and the KV pool of 4 KV heads is whole on each of
the 8 devices. docs/moe.md says what is left.
AdamW's moments are kept in bfloat16 (train.moments_dtype): 15.3 GB a device less.

Variants, joined by '+', as configs/qwen3_8b.py's (baseline, tis, overlong, stale4), and
  lora   LoRA on attention (q, k, v, o; rank 32) over the frozen bfloat16 base, for fewer
         GPUs: the experts are not adapted.
"""

from april_jax.settings import base
from april_jax.settings.qwen3_shapes import QWEN3_SHAPES

_EIGHT_B = base.sibling(__file__, "qwen3_8b.py")


def _lora(c):
  c.train.lora.rank = 32
  c.train.lora.alpha = 32.0
  c.train.lora.targets = "q,k,v,o"  # a mixture-of-experts model's LoRA adapts attention
  c.train.lora.lr = 1e-5
  c.train.lora.decode = "merged"


VARIANTS = {name: _EIGHT_B.VARIANTS[name] for name in ("baseline", "tis", "overlong", "stale4")}
VARIANTS["lora"] = _lora


def get_config(arg=None):
  c = _EIGHT_B.get_config()
  for name in filter(None, (arg or "").split("+")):
    if name not in VARIANTS:
      raise ValueError(
          f"configs/qwen3_30b_a3b.py variant {name!r}: one of {sorted(VARIANTS)}, joined by '+'"
      )
  c.model.path = ""  # required: a Qwen3-30B-A3B HF folder
  c.model.init.update(QWEN3_SHAPES["qwen3_30b_a3b"])  # its shape, for the planner
  c.train.moments_dtype = "bfloat16"
  c.rollout.num_slots = 64
  c.rollout.kv_pages = 1024
  for name in filter(None, (arg or "").split("+")):
    VARIANTS[name](c)
  return c
