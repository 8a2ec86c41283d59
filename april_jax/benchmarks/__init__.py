"""Benchmarks run by `python -m april_jax.bench --mode=...`; each prints both sides."""
