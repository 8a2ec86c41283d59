"""Benchmark shapes for one GPU: random weights of a real Qwen3 shape (no checkpoint needed).

  python -m april_jax.bench --mode=scheduler --config=configs/gpu_bench.py:qwen3_0_6b
  bash launch/bench_gpu.sh                      # every mode, under 10 minutes on an H100/H200

Variants: qwen3_0_6b (default), qwen3_4b. Only the model shape, the rollout shape and the
precision are set; the scheduler and resume modes draw their own prompts and lengths.
"""

from april_jax.configs import base

SHAPES = {
    "qwen3_0_6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128),
    "qwen3_4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128),
}


def get_config(arg=None):
  shape = arg or "qwen3_0_6b"
  if shape not in SHAPES:
    raise ValueError(f"configs/gpu_bench.py variant {shape!r}: one of {sorted(SHAPES)}")
  c = base.get_config()
  c.model.init.update(SHAPES[shape])
  c.model.init.tie_word_embeddings = True
  c.model.dtype = "bfloat16"
  c.model.kv_dtype = "bfloat16"
  c.rollout.batch_size = 16
  c.rollout.n_samples_per_prompt = 8
  c.rollout.over_sampling_batch_size = 32
  c.rollout.num_slots = 64
  c.rollout.sync_every = 64
  c.rollout.max_response_len = 2048
  return c
