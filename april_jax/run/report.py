"""The end of a run: a short summary of metrics.jsonl, and reward and evaluation plotted
against step in <workdir>/progress.png.

Both read the whole metrics.jsonl, so a resumed run reports its history from step 1. Step k
is the k-th update (its line holds the params after it); step 0, the evaluation before
training.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

PLOT_NAME = "progress.png"
SMOOTH = 5  # steps averaged at each end of the reward curve


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def summary(lines: list[dict[str, Any]], workdir: str) -> str:
  """A few lines: reward and evaluation first -> last, rollout speed and APRIL's numbers,
  and where the run's files are."""
  evals = [l for l in lines if "eval/pass@1" in l]
  lines = [l for l in lines if l["step"] >= 1]  # not the evaluation before training (0)
  if not lines:
    return f"no steps in {workdir}/metrics.jsonl"
  mean = lambda key, part=lines: float(np.mean([l[key] for l in part if key in l] or [0.0]))
  n = min(SMOOTH, len(lines))
  out = [
      f"run summary: steps {lines[0]['step']}-{lines[-1]['step']}",
      f"  reward           {mean('rollout/reward_mean', lines[:n]):.3f} -> "
      f"{mean('rollout/reward_mean', lines[-n:]):.3f} (mean of the first and last {n} steps)",
  ]
  if evals:
    out.append(
        f"  eval pass@1      {evals[0]['eval/pass@1']:.3f} (step {evals[0]['step']}) -> "
        f"{evals[-1]['eval/pass@1']:.3f} (step {evals[-1]['step']})"
    )
  total = lambda key: int(sum(l.get(key) or 0 for l in lines))
  failed = {
      "reward errors": total("rollout/reward_errors"),
      "reward timeouts": total("rollout/reward_timeouts"),
      "environment errors": total("rollout/env/errors"),
      "environment timeouts": total("rollout/env/timeouts"),
  }
  out.append(
      "  failures         "
      + (", ".join(f"{n} {what}" for what, n in failed.items() if n) or "none")
      + (
          " (samples scored the fallback; the console named each step's first)"
          if any(failed.values())
          else ""
      )
  )
  out += [
      f"  rollout          {mean('rollout/tokens_per_s'):,.0f} tokens/s, slot occupancy "
      f"{mean('rollout/slot_occupancy'):.2f}",
      f"  APRIL            {mean('rollout/partial_samples'):.1f} partial samples carried per "
      f"step, off-policy token fraction {mean('rollout/off_policy_token_frac'):.2f}",
      f"  files            {os.path.join(workdir, 'checkpoints')} (checkpoints), "
      f"{os.path.join(workdir, 'tb')} (TensorBoard), {os.path.join(workdir, PLOT_NAME)} "
      f"(plot), {os.path.join(workdir, 'metrics.jsonl')}",
  ]
  return "\n".join(out)


def plot(lines: list[dict[str, Any]], workdir: str) -> str:
  """Writes reward (per step and smoothed) and every eval/* metric against step."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  trained = [l for l in lines if "rollout/reward_mean" in l]
  steps = np.array([l["step"] for l in trained])
  reward = np.array([l["rollout/reward_mean"] for l in trained])
  fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(10, 3.8))
  ax_r.plot(steps, reward, alpha=0.35, label="per step")
  if len(reward) >= SMOOTH:
    smooth = np.convolve(reward, np.ones(SMOOTH) / SMOOTH, mode="valid")
    ax_r.plot(steps[SMOOTH - 1 :], smooth, label=f"mean of {SMOOTH}")
  ax_r.set(title="rollout reward", xlabel="step")
  ax_r.legend()
  for key in sorted(
      {k for l in lines for k in l if k in ("eval/pass@1",) or k.startswith("eval/avg@")}
  ):
    points = [(l["step"], l[key]) for l in lines if key in l]
    ax_e.plot(*zip(*points), marker="o", label=key[len("eval/") :])
  ax_e.set(title="held-out evaluation", xlabel="step", ylim=(0, 1))
  if ax_e.lines:
    ax_e.legend()
  fig.tight_layout()
  path = os.path.join(workdir, PLOT_NAME)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
