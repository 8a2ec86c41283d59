"""Rewards, registered by name: `get_reward("math")(response, answer) -> float`.

Each reward module registers its functions when imported; this package imports them
all, so `REWARDS` holds every reward a config can name.
"""

from april_jax.rewards.registry import REWARDS, get_reward, register

# Reward modules, imported only for their @register side effect. One line per module.
from april_jax.rewards import math  # noqa: F401  pylint: disable=unused-import
from april_jax.rewards import dapo_strict  # noqa: F401  pylint: disable=unused-import
