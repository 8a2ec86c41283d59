"""The built-in task with a tiny mixture-of-experts Qwen3 (Qwen3-MoE), on a CPU.

  python -m april_jax.main --config=configs/tiny_moe.py --workdir=/tmp/april_tiny_moe

configs/tiny.py's run (the long-tail copy task, warm start, GRPO with DAPO's clip-higher
and dynamic sampling) with each feed-forward a mixture of 8 experts of width 96, 2 routed a
token (the top 2 renormalised, as Qwen3-30B-A3B's 8 of 128): the same active width as
tiny.py's dense 192. The rollout records each token's experts and the learner replays them
(model.routing_replay); the router's auxiliary loss is off, as the RL recipes of
Qwen3-MoE set it. Held-out greedy pass@1 before and after RL: docs/moe.md.
"""

from april_jax.settings import base


def get_config(arg=None):
  base.no_variants(arg, "configs/tiny_moe.py")
  c = base.sibling(__file__, "tiny.py").get_config()
  c.model.init.num_experts = 8
  c.model.init.num_experts_per_tok = 2
  c.model.init.moe_intermediate_size = 96
  c.model.init.norm_topk_prob = True
  return c
