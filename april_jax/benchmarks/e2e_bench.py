"""Mode `e2e`: the whole RL loop on the built-in task, APRIL against the baseline.

For each seed, two runs of the config (APRIL as configured; the baseline with
partial_rollout=False and N' = N), same prompts, same warm-start. Reported: reward against
step and against wall-clock time (rollout + learn, excluding evaluation and checkpoints),
the wall time APRIL needs to reach the baseline's final reward, final greedy reward on
held-out prompts, tokens/s, off-policy fraction and staleness, with the spread over seeds.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

from april_jax.benchmarks import common
from april_jax.trainer import Trainer

SIDES = ("april", "baseline")


def _run_side(config, side: str, seed: int, workdir: str) -> list[dict]:
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.seed = seed
    c.checkpoint_every = 0
    c.eval_every = c.num_steps
    c.train.warm_up = True  # compile before timing: the wall axis is steady-state steps
    if side == "baseline":
      c.rollout.partial_rollout = False
      c.rollout.over_sampling_batch_size = c.rollout.batch_size
  Trainer(c, workdir).run()
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _smooth(x: np.ndarray, window: int = 5) -> np.ndarray:
  return np.convolve(x, np.ones(window) / window, mode="valid")


def run(config, seeds=(0, 1), report=None, **unused) -> dict:
  del unused
  runs = {side: [] for side in SIDES}
  with tempfile.TemporaryDirectory() as root:
    for seed in seeds:
      for side in SIDES:
        print(f"e2e: seed {seed}, {side} ...", flush=True)
        runs[side].append(_run_side(config, side, seed,
                                    os.path.join(root, f"{side}_{seed}")))
  summary = {}
  for side in SIDES:
    per_seed = []
    for metrics in runs[side]:
      reward = np.array([m["rollout/reward_mean"] for m in metrics])
      wall = np.cumsum([m["time/step_s"] for m in metrics])
      per_seed.append({
          "final_reward": float(reward[-10:].mean()), "wall_s": float(wall[-1]),
          "eval_reward": float(metrics[-1].get("eval/reward_mean", np.nan)),
          "tokens_per_s": float(np.mean([m["rollout/tokens_per_s"] for m in metrics])),
          "off_policy_token_frac": float(np.mean(
              [m["rollout/off_policy_token_frac"] for m in metrics])),
          "staleness_max": float(max(m["rollout/staleness_max"] for m in metrics)),
          "rollout_ms_per_step": 1e3 * float(np.mean([m["time/rollout_s"] for m in metrics])),
          "train_ms_per_step": 1e3 * float(np.mean([m["time/train_s"] for m in metrics])),
          "reward": reward, "wall": wall})
    summary[side] = per_seed
  # Wall time for each side's smoothed reward to first reach the baseline's final reward.
  def time_to(run, target):
    hit = np.nonzero(_smooth(run["reward"]) >= target)[0]
    return float(run["wall"][hit[0] + 4]) if len(hit) else float("nan")
  reach = {side: [time_to(summary[side][i], summary["baseline"][i]["final_reward"])
                  for i in range(len(seeds))] for side in SIDES}
  out = {"mode": "e2e", "seeds": list(seeds), "num_steps": int(config.num_steps),
         "machine": common.machine(),
         "april_wall_to_baseline_final_reward_s": reach["april"],
         "baseline_wall_to_baseline_final_reward_s": reach["baseline"]}
  keys = ("final_reward", "wall_s", "eval_reward", "tokens_per_s", "off_policy_token_frac",
          "staleness_max", "rollout_ms_per_step", "train_ms_per_step")
  for side in SIDES:
    for k in keys:
      values = [s[k] for s in summary[side]]
      out[f"{side}_{k}_mean"] = float(np.mean(values))
      out[f"{side}_{k}_std"] = float(np.std(values))
  print(f"{'':>9} {'final reward':>14} {'eval reward':>13} {'wall s':>8} {'tokens/s':>9} "
        f"{'off-policy':>10} {'staleness':>9} {'rollout ms':>10} {'train ms':>8}")
  for side in SIDES:
    g = lambda k: (out[f"{side}_{k}_mean"], out[f"{side}_{k}_std"])
    print(f"{side:>9} {g('final_reward')[0]:>7.3f}±{g('final_reward')[1]:.3f} "
          f"{g('eval_reward')[0]:>6.3f}±{g('eval_reward')[1]:.3f} {g('wall_s')[0]:>8.1f} "
          f"{g('tokens_per_s')[0]:>9.0f} {g('off_policy_token_frac')[0]:>10.3f} "
          f"{g('staleness_max')[0]:>9.0f} {g('rollout_ms_per_step')[0]:>10.1f} "
          f"{g('train_ms_per_step')[0]:>8.1f}")
  fmt = lambda xs: [round(x, 2) for x in xs]
  print(f"wall s to first reach the baseline's final reward, per seed: APRIL "
        f"{fmt(reach['april'])}, baseline {fmt(reach['baseline'])} (baseline total "
        f"{fmt([s['wall_s'] for s in summary['baseline']])})")
  if report is not None:
    report.table("RL on the built-in task (mean ± std over seeds)",
                 ["side"] + list(keys),
                 [[side] + [f"{out[f'{side}_{k}_mean']:.3f} ± {out[f'{side}_{k}_std']:.3f}"
                            for k in keys] for side in SIDES])
    first = {side: summary[side][0] for side in SIDES}
    report.lines("reward_vs_time", {side: (first[side]["wall"][4:],
                                           _smooth(first[side]["reward"]))
                                    for side in SIDES}, "wall-clock s (rollout + learn)",
                 "training reward (5-step mean)")
    report.lines("reward_vs_step", {side: (np.arange(4, len(first[side]["reward"])),
                                           _smooth(first[side]["reward"]))
                                    for side in SIDES}, "step",
                 "training reward (5-step mean)")
  return out
