"""The end-of-run report: the summary's numbers are the metrics' own, and the plot is a
PNG of every evaluation."""

import numpy as np

from april_jax.run import report as run_report


def _lines():
  lines = []
  for step in range(12):
    line = {
        "step": step + 1,
        "rollout/reward_mean": step / 10,
        "rollout/tokens_per_s": 1000.0,
        "rollout/slot_occupancy": 0.5 + step / 100,
        "rollout/partial_samples": 3.0,
        "rollout/off_policy_token_frac": 0.25,
    }
    if step in (3, 11):
      line.update({"eval/pass@1": step / 20, "eval/avg@4": step / 30})
    lines.append(line)
  return lines


def test_summary_reports_first_and_last_values_and_where_the_files_are(tmp_path):
  text = run_report.summary(_lines(), str(tmp_path))
  assert text.splitlines()[0] == "run summary: steps 1-12"
  # Reward: the mean of steps 1-5 (0.2) and of steps 8-12 (0.9).
  assert "reward           0.200 -> 0.900 (mean of the first and last 5 steps)" in text
  assert "eval pass@1      0.150 (step 4) -> 0.550 (step 12)" in text
  occupancy = np.mean([0.5 + s / 100 for s in range(12)])
  assert f"1,000 tokens/s, slot occupancy {occupancy:.2f}" in text
  assert "3.0 partial samples carried per step, off-policy token fraction 0.25" in text
  assert str(tmp_path / "progress.png") in text and str(tmp_path / "tb") in text


def test_plot_writes_a_png_into_the_workdir(tmp_path):
  path = run_report.plot(_lines(), str(tmp_path))
  assert path == str(tmp_path / "progress.png")
  assert (tmp_path / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert run_report.summary([], str(tmp_path)).startswith("no steps")


def test_the_evaluation_before_training_is_the_first_eval_and_not_a_step(tmp_path):
  lines = [{"step": 0, "eval/pass@1": 0.05, "eval/avg@4": 0.04}] + _lines()
  text = run_report.summary(lines, str(tmp_path))
  assert text.splitlines()[0] == "run summary: steps 1-12"
  assert "reward           0.200 -> 0.900" in text  # the steps' rewards alone
  assert "eval pass@1      0.050 (step 0) -> 0.550 (step 12)" in text
  assert run_report.plot(lines, str(tmp_path)) == str(tmp_path / "progress.png")
