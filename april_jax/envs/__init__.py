"""Environments and tools for multi-turn rollouts: the interface (base.py), the
episode loop on the slot engine (episodes.py), the calculator (calculator.py) and
the built-in task's lookup tool (lookup.py)."""

from april_jax.envs import calculator, lookup  # registers "calculator" and "lookup"
