"""The scheduler benchmark runs end to end and reports both sides (no timing asserted)."""

import importlib.util
from pathlib import Path

from april_jax.benchmarks import length_dists, scheduler_bench


def _tiny_config():
  spec = importlib.util.spec_from_file_location(
      "tiny", Path(__file__).resolve().parents[1] / "configs" / "tiny.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_scheduler_bench_reports_both_sides_and_april_fills_slots_better():
  config = _tiny_config()
  config.rollout.max_response_len = 96
  out = scheduler_bench.run(config, shape="deepmath", steps=3)
  for key in ("april_tokens_per_s", "baseline_tokens_per_s", "speedup",
              "april_slot_occupancy", "baseline_slot_occupancy", "off_policy_token_frac",
              "staleness_max"):
    assert key in out
  # Occupancy is a count (kept tokens / slot-steps), not a timing.
  assert out["april_slot_occupancy"] > out["baseline_slot_occupancy"]
  assert out["baseline_off_policy_token_frac"] == 0.0 == out["baseline_staleness_max"]


def test_length_distributions_are_long_tailed():
  for shape in length_dists.SHAPES:
    d = length_dists.describe(shape, 512)
    assert d["p50"] < d["mean"] < d["p90"] < d["max"] == 512
    assert 0 < d["at_cap_frac"] < 0.05


def test_scheduler_sweep_reports_one_row_per_ratio_and_no_gain_at_ratio_one():
  config = _tiny_config()
  config.rollout.max_response_len = 64
  out = scheduler_bench.sweep(config, steps=2, ratios=(1.0, 2.0))
  assert [r["ratio"] for r in out["sweep"]] == [1.0, 2.0]
  one, two = out["sweep"]
  # N' = N leaves nothing to over-provision: the same slot-steps as the baseline.
  assert one["april_slot_occupancy"] == one["baseline_slot_occupancy"]
  assert two["april_slot_occupancy"] > two["baseline_slot_occupancy"]


def test_resume_bench_compares_kv_and_recompute_on_the_same_workload():
  from april_jax.benchmarks import resume_bench  # pylint: disable=g-import-not-at-top
  config = _tiny_config()
  config.rollout.max_response_len = 64
  out = resume_bench.run(config, steps=2)
  # Same workload: the same partials are resumed; only kv holds KV bytes on the host.
  assert out["kv_partial_samples_per_step"] == out["recompute_partial_samples_per_step"] > 0
  assert out["kv_buffer_bytes_max"] > 10 * out["recompute_buffer_bytes_max"]
