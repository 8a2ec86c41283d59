"""The CPU default: the whole RL loop on the built-in long-tail copy task, in minutes.

  python -m april_jax.main --config=configs/tiny.py --workdir=/tmp/april_tiny
  python -m april_jax.main --config=configs/tiny.py --workdir=/tmp/sync \
      --config.rollout.partial_rollout=False --config.rollout.over_sampling_batch_size=8
  python -m april_jax.bench --mode=scheduler --config=configs/tiny.py

A 2-layer Qwen3 with a 136-token vocabulary, randomly initialised, warm-started on a
sloppy demonstrator's walks (9 in 10 stop one symbol late), then trained with GRPO and DAPO's
clip-higher and dynamic sampling for 120 steps (about 2.5 minutes on 2 CPU cores). Held-out
greedy pass@1 before and after RL: docs/first_run.md.
Responses run up to 64 tokens; answer lengths follow a log-normal with a long tail (see
rewards/longtail_task.py).

Variant `lora` (`--config=configs/tiny.py:lora`): the same run training rank-8 LoRA
adapters (alpha 32, every projection, lr 3e-3) over the warm-started model, frozen.
"""

from april_jax.settings import base


def get_config(arg=None):
  if arg not in (None, "", "lora"):
    raise ValueError(f"configs/tiny.py variant {arg!r}: its one variant is 'lora'")
  c = base.get_config()
  c.seed = 0
  c.num_steps = 120
  c.checkpoint_every = 20
  c.eval_every = 20

  c.model.path = ""  # empty: random init from c.model.init
  c.model.init.vocab_size = 136  # the task tokenizer has 133 tokens
  c.model.init.hidden_size = 64
  c.model.init.intermediate_size = 192
  c.model.init.num_layers = 2
  c.model.init.num_heads = 4
  c.model.init.num_kv_heads = 2
  c.model.init.head_dim = 16
  c.model.init.tie_word_embeddings = True

  c.data.source = "longtail"
  c.data.max_prompt_len = 8
  c.data.task.demo_overshoot = 0.9

  c.rollout.batch_size = 8
  c.rollout.n_samples_per_prompt = 8
  c.rollout.over_sampling_batch_size = 16
  c.rollout.num_slots = 16
  c.rollout.sync_every = 8
  c.rollout.max_response_len = 64
  c.rollout.reward = "longtail"
  c.rollout.temperature = 0.7
  c.rollout.dynamic_sampling = True

  c.train.lr = 6e-4
  c.train.eps_clip_high = 0.28
  c.train.sft_steps = 300
  c.train.sft_lr = 3e-3
  c.train.sft_batch_size = 32

  c.eval.num_prompts = 64
  c.eval.k = 2
  if arg == "lora":
    # A tiny model's adapters move far per step: 5x the full fine-tune's lr (6e-4).
    c.train.lora.rank = 8
    c.train.lora.alpha = 32.0
    c.train.lora.lr = 3e-3
  return c
