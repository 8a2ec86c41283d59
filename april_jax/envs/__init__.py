"""Environments and tools for multi-turn rollouts: the interface (base.py), the
episode loop on the slot engine (episodes.py), the calculator (calculator.py), the
Python interpreter for math (python_tool.py, its child process's side in
python_sandbox.py) and the built-in task's lookup tool (lookup.py)."""

# Registers "calculator", "lookup" and "python_tool".
from april_jax.envs import calculator, lookup, python_tool
