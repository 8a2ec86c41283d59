"""RL training of Qwen3 LLMs in JAX."""
