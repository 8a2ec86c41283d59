"""What fits where: the memory plan by arithmetic (memory.py), the split of rollout and
learner devices (split.py), and every program compiled at a config's shapes
(compile_check.py). `python -m april_jax.plan` is the command."""
