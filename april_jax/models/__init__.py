"""Qwen3 in JAX (`qwen3`) and Hugging Face checkpoints in and out (`hf_io`)."""
