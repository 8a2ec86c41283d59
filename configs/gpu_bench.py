"""Benchmark shapes for one GPU: random weights of a real Qwen3 shape (no checkpoint needed).

  python -m april_jax.bench --mode=scheduler --config=configs/gpu_bench.py:qwen3_0_6b
  python -m april_jax.bench --mode=step --config=configs/gpu_bench.py:qwen3_1_7b
  bash launch/bench_gpu.sh                      # every mode, each part at most 5 minutes

Variants: qwen3_0_6b (default), qwen3_1_7b, qwen3_4b, qwen3_8b_lora (LoRA over the
frozen 8B shape, for the step mode on one 80 GB GPU), and qwen3_30b_a3b_4l (Qwen3-30B-A3B's
widths and experts with 4 of its 48 layers: a mixture of experts on one GPU). Only the model shape, the rollout
shape, the precision and (LoRA) the adapters are set; the scheduler, resume and step
modes draw their own prompts and lengths.
"""

from april_jax.settings import base
from april_jax.settings.qwen3_shapes import QWEN3_SHAPES

SHAPES = {name: QWEN3_SHAPES[name] for name in ("qwen3_0_6b", "qwen3_1_7b", "qwen3_4b")}
SHAPES["qwen3_8b_lora"] = QWEN3_SHAPES["qwen3_8b"]
SHAPES["qwen3_30b_a3b_4l"] = dict(QWEN3_SHAPES["qwen3_30b_a3b"], num_layers=4)


def get_config(arg=None):
  shape = arg or "qwen3_0_6b"
  if shape not in SHAPES:
    raise ValueError(f"configs/gpu_bench.py variant {shape!r}: one of {sorted(SHAPES)}")
  c = base.get_config()
  c.model.init.update(SHAPES[shape])
  c.model.dtype = "bfloat16"
  c.model.kv_dtype = "bfloat16"
  c.rollout.batch_size = 16
  c.rollout.n_samples_per_prompt = 8
  c.rollout.over_sampling_batch_size = 32
  # 640 pages of 256 positions: the KV of 64 sequences at max_len (2,560), shared by
  # 256 slots (18.8 GB at the 0.6B shape, 24.2 GB at the 4B one; the 1.7B one, below).
  c.rollout.num_slots = 256
  c.rollout.page_size = 256
  c.rollout.kv_pages = 640
  c.rollout.decode_block = 32768
  c.rollout.sync_every = 64
  c.rollout.max_response_len = 2048
  # The learner at these shapes fits one GPU too (python -m april_jax.plan --compile).
  c.model.remat = True
  c.train.num_microbatches = 16
  if shape == "qwen3_1_7b":
    # Sized for the step mode, which holds two engines (APRIL's and the baseline's) beside
    # the learner on one 80 GB GPU: 448 pages (13.2 GB a pool) hold APRIL's steady state at
    # 1,024-token responses (about 360 pages; at 2,048 some samples are preempted), and
    # microbatches of 4 rows halve the gradient pass's activations. Compiled at those shapes
    # (python -m april_jax.plan --config=configs/gpu_bench.py:qwen3_1_7b --compile
    # --devices=1 --device_memory_gb=80 --config.rollout.max_response_len=1024
    # --config.data.max_prompt_len=16) the peak is 59.6 GB (the gradients); the second
    # pool brings it to 72.8 GB.
    c.rollout.kv_pages = 448
    c.train.num_microbatches = 32
  if shape == "qwen3_8b_lora":
    _lora_8b(c)
  return c


def _lora_8b(c):
  """The 8B shape with configs/qwen3_8b.py:lora's adapters (rank 32, alpha 32, every
  projection, decoded unmerged), sized for the step mode on one 80 GB GPU: the frozen
  base (16.4 GB, which both engines read), the adapters with their moments (1.0 GB), two
  engines' pools of 384 pages (14.5 GB each: the steady state of APRIL at 1,024-token
  responses), and microbatches of 2 rows. `--config.train.lora.decode=merged` times the
  merged decode copy instead (16.4 GB more, a third copy while it is remade)."""
  c.train.lora.rank = 32
  c.train.lora.alpha = 32.0
  c.train.lora.lr = 1e-5
  c.train.lora.decode = "unmerged"
  c.rollout.kv_pages = 384
  c.train.num_microbatches = 64
