"""Environments and tools for multi-turn rollouts (the calculator, so far)."""
