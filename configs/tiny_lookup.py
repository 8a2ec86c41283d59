"""The first run's task as a multi-turn episode with a tool, on the CPU in minutes.

  python -m april_jax.main --config=configs/tiny_lookup.py --workdir=/tmp/april_lookup

The prompt `c:<from>=` leaves the target out; only the lookup tool (envs/lookup.py) tells
it. An episode: the model ends a turn with ':' (the call), the tool's answer `<to>=` is
fed into the same slot, the model walks and stops. Observation tokens are given, not
drawn: outside the loss. The warm start imitates a sloppy demonstrator that calls the
tool and then, 9 times in 10, walks one symbol too far; RL teaches it to stop at the
target the tool named. Otherwise configs/tiny.py (docs/environments.md).
"""

from april_jax.settings import base


def get_config(arg=None):
  base.no_variants(arg, "configs/tiny_lookup.py")
  c = base.sibling(__file__, "tiny.py").get_config()
  c.data.task.hide_target = True
  c.rollout.reward = "lookup"
  c.rollout.max_response_len = 72  # the call, its answer and the longest walk
  c.env.name = "lookup"
  c.env.max_turns = 3
  c.env.max_observation_tokens = 4
  c.env.timeout_s = 5.0
  return c
