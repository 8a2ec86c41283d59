"""Response-length distributions for the scheduler benchmark, scaled to any max length.

Log-normals clipped at the maximum, shaped after the long tails the APRIL paper shows
(Figure 3): most responses short, a few per cent run into the cap. The three shapes
are synthetic stand-ins named after the paper's datasets, not measurements of them:
  dapo_math   median 0.18 x max, sigma 0.75
  deepscaler  median 0.12 x max, sigma 0.70  (shorter, thinner tail)
  deepmath    median 0.10 x max, sigma 0.95  (short bulk, heaviest tail)
"""

from __future__ import annotations

import numpy as np

from april_jax.tasks.longtail import longtail_lengths

SHAPES = {"dapo_math": (0.18, 0.75), "deepscaler": (0.12, 0.70), "deepmath": (0.10, 0.95)}


def sample_lengths(shape: str, max_len: int, size: int, seed) -> np.ndarray:
  if shape not in SHAPES:
    raise KeyError(f"unknown length distribution {shape!r}; known: {sorted(SHAPES)}")
  median_frac, sigma = SHAPES[shape]
  return longtail_lengths(np.random.default_rng(seed), size, max_len, median_frac * max_len, sigma)


def describe(shape: str, max_len: int, size: int = 20000) -> dict[str, float]:
  lengths = sample_lengths(shape, max_len, size, seed=12345)
  return {
      "mean": float(lengths.mean()),
      "p50": float(np.median(lengths)),
      "p90": float(np.percentile(lengths, 90)),
      "max": float(lengths.max()),
      "at_cap_frac": float(np.mean(lengths >= max_len)),
      "max_over_mean": float(max_len / lengths.mean()),
  }
