"""The built-in task with more of a response tail: APRIL against the baseline on a CPU.

  python -m april_jax.bench --mode=e2e --config=configs/tiny_tail.py --seeds=0,1,2,3,4,5,6,7,8,9
  python -m april_jax.main --config=configs/tiny_tail.py --workdir=/tmp/april_tail

`configs/tiny.py` with longer answers (median 12 symbols, a heavier tail to the ring's
32) and 64 slots, so that every admitted sample decodes at once, as a large inference
batch does on a GPU: a synchronous step then lasts as long as its longest answer. A
32-symbol ring and a short warm-start (40 steps) leave RL a reward that climbs for the
whole run (~0.25 to ~0.4), so "time to reach a reward" is not decided by noise alone.
Length-sorted microbatches (train.microbatch_by_length) keep the tail's padding off the
short rows in the update. The baseline decodes with the same 64 slots (as on a GPU, where
a step costs about the same with 32 or 64 in flight); see BENCHMARKS.md for what changes
with 32 on a CPU.
"""

from april_jax.settings import base


def get_config(arg=None):
  base.no_variants(arg, "configs/tiny_tail.py")
  c = base.sibling(__file__, "tiny.py").get_config()
  c.num_steps = 80
  c.data.task.ring_size = 32
  c.data.task.median = 12.0
  c.data.task.sigma = 1.0
  c.rollout.num_slots = 64  # N' x n: APRIL's whole over-provisioned batch in flight
  c.train.sft_steps = 40
  c.data.task.demo_overshoot = 0.0  # clean demonstrations; RL works on the walk's tail
  # GRPO as before tiny.py's first run that teaches: n = 4 (N' x n = the 64 slots), a
  # constant 3e-4, no dynamic sampling (the e2e's steps stay alike across seeds).
  c.rollout.n_samples_per_prompt = 4
  c.rollout.dynamic_sampling = False
  c.train.lr = 3e-4
  c.train.num_microbatches = 4
  c.eval.num_prompts = 64  # greedy reward on held-out walks: the e2e's accuracy signal
  c.eval.k = 0
  return c
