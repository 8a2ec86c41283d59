"""Mode `layout`: the token positions the learner computes per real token, packed rows
against a row per sample, at a config's batch shape (no model, no device: the layout is
decided on the host).

Each seed draws a batch of the config's size (rollout.batch_size x n_samples_per_prompt):
prompts uniform in [PROMPT_MIN, PROMPT_MAX] tokens (at most data.max_prompt_len), responses
from a length distribution (length_dists.py) up to rollout.max_response_len. Both layouts
come from the learner's own plan (rl/update.py), with a call's rows split over `devices`
(the last packed microbatch keeps at least that many rows):
  unpacked  rows sorted by length, each microbatch cut to its power-of-two bucket
            (train.packing off, microbatch_by_length on)
  packed    samples end to end in rows of train.pack_len (0: the run's longest row)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from april_jax.benchmarks import common, length_dists
from april_jax.rl import batch as batch_lib
from april_jax.rl import layout
from april_jax.settings.run import RunSettings

PROMPT_MIN, PROMPT_MAX = 100, 400


def sample_mask(config, shape: str, seed: int) -> np.ndarray:
  """A batch's loss mask [B, max_len]: each row's response after its prompt."""
  r = config.rollout
  B = r.batch_size * r.n_samples_per_prompt
  max_len = config.data.max_prompt_len + r.max_response_len
  rng = np.random.default_rng(seed)
  high = min(PROMPT_MAX, config.data.max_prompt_len)
  prompts = rng.integers(min(PROMPT_MIN, high), high + 1, B)
  responses = length_dists.sample_lengths(shape, r.max_response_len, B, seed=[seed, 7])
  mask = np.zeros((B, batch_lib.bucket_len(max_len, max_len=max_len)), np.float32)
  for b in range(B):
    mask[b, prompts[b] - 1 : prompts[b] + responses[b] - 1] = 1.0
  return mask


def run(config, shape: str = "dapo_math", seeds=(0, 1, 2, 3, 4), devices: int = 1) -> dict:
  config = RunSettings.from_config(config)
  packed_train = layout.train_section(config.overridden({"train.packing": True}))
  unpacked_train = dataclasses.replace(packed_train, packing=False, microbatch_by_length=True)
  rows = []
  for seed in seeds:
    mask = sample_mask(config, shape, seed)
    unpacked = layout.layout_stats(mask, unpacked_train, devices)
    packed = layout.layout_stats(mask, packed_train, devices)
    rows.append({"seed": seed, "unpacked": unpacked, "packed": packed})
  t = packed_train
  per_call = mask.shape[0] // (t.num_minibatches * t.num_microbatches)
  print(f"{shape}: {mask.shape[0]} samples, {per_call} rows a call, pack_len {t.pack_len}")
  print(f"{'seed':>4} {'unpacked':>9} {'calls':>6} {'packed':>9} {'calls':>6}   (padded / real)")
  for r in rows:
    u, p = r["unpacked"], r["packed"]
    print(
        f"{r['seed']:>4} {u['padded_per_real']:>9.3f} {u['calls']:>6.0f} "
        f"{p['padded_per_real']:>9.3f} {p['calls']:>6.0f}"
    )
  ratio = lambda side: [r[side]["padded_per_real"] for r in rows]
  return {
      "mode": "layout",
      "distribution": shape,
      "samples": int(mask.shape[0]),
      "rows_per_call": int(per_call),
      "pack_len": int(t.pack_len),
      "devices": devices,
      "seeds": rows,
      "unpacked_padded_per_real": [min(ratio("unpacked")), max(ratio("unpacked"))],
      "packed_padded_per_real": [min(ratio("packed")), max(ratio("packed"))],
      "machine": common.machine(),
  }
