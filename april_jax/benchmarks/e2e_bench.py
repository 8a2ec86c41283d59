"""Mode `e2e`: the whole RL loop on the built-in task, APRIL against the baseline.

For each seed, two runs of the config (APRIL as configured; the baseline with
partial_rollout=False and N' = N), same prompts, same warm-start. Reported: reward against
step and against wall-clock time (rollout + learn, excluding evaluation and checkpoints),
the wall time each side needs to reach the baseline's final reward, final greedy reward on
held-out prompts, tokens/s, off-policy fraction and staleness, with the spread over seeds.

Both sides are compared at the same number of steps (final training and eval reward after
step num_steps) and at the same wall-clock time: APRIL keeps training for up to
EXTRA_STEPS x num_steps steps (constant learning rate only, so its first num_steps are
exactly those of a num_steps run), and its rewards when it has used the baseline's whole
wall time are reported too.

Time to reach the baseline's final reward, two ways:
  training reward  the first wall time at which a side's batch reward, averaged over
                   WINDOW steps, reaches the baseline's mean over its last WINDOW steps.
                   Batches differ in difficulty (answer lengths), so this is noisy.
  eval reward      greedy reward on the same held-out prompts every EVAL_EVERY steps:
                   the first evaluation at or above the baseline's final one.
Each per seed (the two sides of a seed see the same prompts), and on the curves averaged
over seeds, where seed noise partly cancels.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

from april_jax.benchmarks import common
from april_jax.run.trainer import Trainer
from april_jax.settings.run import RunSettings

SIDES = ("april", "baseline")
EXTRA_STEPS = 1.5  # APRIL's step allowance, so it can spend the baseline's wall time
WINDOW = 10  # steps of training reward averaged for "final reward" and time to reach
EVAL_EVERY = 10  # steps between held-out evaluations (excluded from the wall clock)


def _run_side(
    config, side: str, seed: int, workdir: str, num_steps: int, eval_every: int
) -> list[dict]:
  c = RunSettings.from_config(config)
  changes = {"seed": seed, "checkpoint_every": 0, "eval_every": eval_every}
  changes.update(num_steps=num_steps)
  changes["train.warm_up"] = True  # compile before timing: the wall axis is steady-state steps
  if side == "baseline":
    changes["rollout.partial_rollout"] = False
    changes["rollout.over_sampling_batch_size"] = c.rollout.batch_size
  c = c.overridden(changes)
  Trainer(c, workdir).run()
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    lines = [json.loads(line) for line in f if line.strip()]
  return [l for l in lines if l["step"] >= 1]  # the steps, not the evaluation before them (0)


def _smooth(x: np.ndarray) -> np.ndarray:
  """WINDOW-step means: entry i covers steps i .. i + WINDOW - 1 (plot it at that end)."""
  if len(x) < WINDOW:
    return np.zeros(0)
  return np.convolve(x, np.ones(WINDOW) / WINDOW, mode="valid")


def time_to_reach(reward: np.ndarray, wall: np.ndarray, target: float) -> float:
  """Wall time at the end of the first WINDOW steps whose mean reward >= target; nan if
  never."""
  hit = np.nonzero(_smooth(reward) >= target - 1e-9)[0]
  return float(wall[hit[0] + WINDOW - 1]) if len(hit) else float("nan")


def first_at(values: np.ndarray, wall: np.ndarray, target: float) -> float:
  """Wall time of the first point whose value >= target; nan if never."""
  hit = np.nonzero(np.asarray(values) >= target - 1e-9)[0]
  return float(wall[hit[0]]) if len(hit) else float("nan")


def _spread(out: dict, name: str, values: list[float]) -> None:
  """out[name_mean], out[name_std] over seeds."""
  out[f"{name}_mean"], out[f"{name}_std"] = float(np.mean(values)), float(np.std(values))


def _summarize(all_metrics: list[dict], num_steps: int) -> dict:
  """One run's numbers at num_steps (equal steps), and its whole curves."""
  reward = np.array([m["rollout/reward_mean"] for m in all_metrics])
  wall = np.cumsum([m["time/step_s"] for m in all_metrics])
  evals = [i for i, m in enumerate(all_metrics) if "eval/reward_mean" in m]
  metrics = all_metrics[:num_steps]
  mean = lambda k: float(np.mean([m[k] for m in metrics]))
  return {
      "final_reward": float(reward[:num_steps][-WINDOW:].mean()),
      "wall_s": float(wall[num_steps - 1]),
      "eval_reward": float(metrics[-1].get("eval/reward_mean", np.nan)),
      "tokens_per_s": mean("rollout/tokens_per_s"),
      "off_policy_token_frac": mean("rollout/off_policy_token_frac"),
      "stale_token_frac": mean("rollout/stale_token_frac"),
      "staleness_max": float(max(m["rollout/staleness_max"] for m in metrics)),
      "rollout_ms_per_step": 1e3 * mean("time/rollout_s"),
      "train_ms_per_step": 1e3 * mean("time/train_s"),
      "reward": reward,
      "wall": wall,
      "eval_wall": wall[evals],
      "eval": np.array([all_metrics[i]["eval/reward_mean"] for i in evals]),
  }


def _run_all(config, seeds, num_steps: int, april_steps: int, eval_every: int) -> dict:
  """Per side, the summary of each seed's run (APRIL's runs april_steps long)."""
  runs = {side: [] for side in SIDES}
  with tempfile.TemporaryDirectory() as root:
    for seed in seeds:
      for side in SIDES:
        print(f"e2e: seed {seed}, {side} ...", flush=True)
        steps = april_steps if side == "april" else num_steps
        workdir = os.path.join(root, f"{side}_{seed}")
        metrics = _run_side(config, side, seed, workdir, steps, eval_every)
        runs[side].append(_summarize(metrics, num_steps))
  return runs


def _same_wall_clock(out: dict, april: list[dict], baseline: list[dict]) -> None:
  """APRIL once it has used the baseline's whole wall time (or, if it ran all its steps
  sooner, at its last step: counted as capped)."""
  for a, b in zip(april, baseline):
    within = int(np.searchsorted(a["wall"], b["wall_s"], side="right"))
    a["capped"] = within == len(a["wall"])
    a["steps_in_baseline_wall"] = float(within)
    last = a["reward"][within - WINDOW : within]
    a["reward_at_baseline_wall"] = float(last.mean()) if within >= WINDOW else float("nan")
    done = a["eval_wall"] <= b["wall_s"]
    a["eval_at_baseline_wall"] = float(a["eval"][done][-1]) if done.any() else float("nan")
  for k in ("steps_in_baseline_wall", "reward_at_baseline_wall", "eval_at_baseline_wall"):
    _spread(out, f"april_{k}", [a[k] for a in april])
  out["april_capped_seeds"] = int(sum(a["capped"] for a in april))


def _seed_mean_curves(runs: dict) -> tuple[dict, dict]:
  """Each side's curves averaged over seeds; the baseline's final reward and eval on them."""
  curves = {
      side: {
          k: np.mean([r[k] for r in runs[side]], axis=0)
          for k in ("reward", "wall", "eval", "eval_wall")
      }
      for side in SIDES
  }
  base = curves["baseline"]
  targets = {
      "reward": float(base["reward"][-WINDOW:].mean()),
      "eval": float(base["eval"][-1]) if len(base["eval"]) else float("nan"),
  }
  return curves, targets


def _time_to_baseline_final(out: dict, runs: dict, curves: dict, targets: dict) -> None:
  """Wall time to reach the baseline's final reward: per seed, then on the seed-mean curves."""
  for side in SIDES:
    pairs = list(zip(runs[side], runs["baseline"]))
    out[f"{side}_wall_to_baseline_final_reward_s"] = [
        time_to_reach(r["reward"], r["wall"], b["final_reward"]) for r, b in pairs
    ]
    out[f"{side}_wall_to_baseline_final_eval_s"] = [
        first_at(r["eval"], r["eval_wall"], b["eval_reward"]) for r, b in pairs
    ]
    out[f"{side}_seed_mean_wall_to_target_reward_s"] = time_to_reach(
        curves[side]["reward"], curves[side]["wall"], targets["reward"]
    )
    out[f"{side}_seed_mean_wall_to_target_eval_s"] = first_at(
        curves[side]["eval"], curves[side]["eval_wall"], targets["eval"]
    )
  out["seed_mean_target_reward"], out["seed_mean_target_eval"] = targets["reward"], targets["eval"]
  for key in ("reward", "eval"):  # paired by seed: APRIL's time over the baseline's
    april_s = np.nan_to_num(out[f"april_wall_to_baseline_final_{key}_s"], nan=np.inf)
    ratio = april_s / np.array(out[f"baseline_wall_to_baseline_final_{key}_s"])
    out[f"time_to_final_{key}_ratio_median"] = float(np.median(ratio))  # inf: never
    out[f"april_first_on_{key}_seeds"] = int(np.sum(ratio < 1))


def run(config, seeds=(0, 1), report=None, **unused) -> dict:
  del unused
  num_steps = int(config.num_steps)
  extended = (
      int(np.ceil(EXTRA_STEPS * num_steps)) if config.train.lr_schedule == "constant" else num_steps
  )
  eval_every = EVAL_EVERY if num_steps % EVAL_EVERY == 0 else num_steps
  runs = _run_all(config, seeds, num_steps, extended, eval_every)
  out = {
      "mode": "e2e",
      "seeds": list(seeds),
      "num_steps": num_steps,
      "april_max_steps": extended,
      "eval_every": eval_every,
      "machine": common.machine(),
  }
  keys = (
      "final_reward",
      "wall_s",
      "eval_reward",
      "tokens_per_s",
      "off_policy_token_frac",
      "stale_token_frac",
      "staleness_max",
      "rollout_ms_per_step",
      "train_ms_per_step",
  )
  for side in SIDES:
    for k in keys:
      _spread(out, f"{side}_{k}", [r[k] for r in runs[side]])
  _same_wall_clock(out, runs["april"], runs["baseline"])
  curves, targets = _seed_mean_curves(runs)
  _time_to_baseline_final(out, runs, curves, targets)
  _print(out, num_steps)
  if report is not None:
    _report(report, out, curves, targets, len(seeds), keys)
  return out


def _print(out: dict, num_steps: int) -> None:
  capped = out["april_capped_seeds"]
  print(
      f"{'':>9} {'final reward':>14} {'eval reward':>13} {'wall s':>8} {'tokens/s':>9} "
      f"{'off-policy':>10} {'stale tok':>9} {'staleness':>9} {'rollout ms':>10} "
      f"{'train ms':>8}"
  )
  for side in SIDES:
    g = lambda k: (out[f"{side}_{k}_mean"], out[f"{side}_{k}_std"])
    print(
        f"{side:>9} {g('final_reward')[0]:>7.3f}±{g('final_reward')[1]:.3f} "
        f"{g('eval_reward')[0]:>6.3f}±{g('eval_reward')[1]:.3f} {g('wall_s')[0]:>8.1f} "
        f"{g('tokens_per_s')[0]:>9.0f} {g('off_policy_token_frac')[0]:>10.3f} "
        f"{g('stale_token_frac')[0]:>9.3f} {g('staleness_max')[0]:>9.0f} "
        f"{g('rollout_ms_per_step')[0]:>10.1f} {g('train_ms_per_step')[0]:>8.1f}"
    )
  fmt = lambda xs: [round(x, 2) for x in xs]
  for what, key in (("training reward", "reward"), ("eval reward", "eval")):
    print(
        f"wall s to reach the baseline's final {what}, per seed: APRIL "
        f"{fmt(out[f'april_wall_to_baseline_final_{key}_s'])}, baseline "
        f"{fmt(out[f'baseline_wall_to_baseline_final_{key}_s'])}; on the seed-mean curves "
        f"(target {out[f'seed_mean_target_{key}']:.3f}): APRIL "
        f"{out[f'april_seed_mean_wall_to_target_{key}_s']:.2f}, baseline "
        f"{out[f'baseline_seed_mean_wall_to_target_{key}_s']:.2f}; APRIL first on "
        f"{out[f'april_first_on_{key}_seeds']} of {len(out['seeds'])} seeds, median time "
        f"ratio {out[f'time_to_final_{key}_ratio_median']:.2f}"
    )
  print(
      f"same wall clock: in the baseline's {out['baseline_wall_s_mean']:.1f} s "
      f"({num_steps} steps) APRIL ran {out['april_steps_in_baseline_wall_mean']:.0f} steps; "
      f"training reward {out['april_reward_at_baseline_wall_mean']:.3f}±"
      f"{out['april_reward_at_baseline_wall_std']:.3f} vs "
      f"{out['baseline_final_reward_mean']:.3f}±{out['baseline_final_reward_std']:.3f}, "
      f"eval reward {out['april_eval_at_baseline_wall_mean']:.3f}±"
      f"{out['april_eval_at_baseline_wall_std']:.3f} vs "
      f"{out['baseline_eval_reward_mean']:.3f}±{out['baseline_eval_reward_std']:.3f}"
      + (f" (APRIL ran out of steps first on {capped} seeds)" if capped else "")
  )


def _report(report, out: dict, curves: dict, targets: dict, num_seeds: int, keys) -> None:
  report.table(
      "RL on the built-in task (mean ± std over seeds)",
      ["side"] + list(keys),
      [
          [side] + [f"{out[f'{side}_{k}_mean']:.3f} ± {out[f'{side}_{k}_std']:.3f}" for k in keys]
          for side in SIDES
      ],
  )
  label = f"mean of {num_seeds} seeds"
  smooth = {side: _smooth(curves[side]["reward"]) for side in SIDES}
  report.lines(
      "reward_vs_time",
      {side: (curves[side]["wall"][WINDOW - 1 :], smooth[side]) for side in SIDES},
      "wall-clock s (rollout + learn)",
      f"training reward ({WINDOW}-step mean, {label})",
      hline=("baseline final", targets["reward"]),
  )
  report.lines(
      "reward_vs_step",
      {side: (np.arange(WINDOW, len(curves[side]["reward"]) + 1), smooth[side]) for side in SIDES},
      "step",
      f"training reward ({WINDOW}-step mean, {label})",
      hline=("baseline final", targets["reward"]),
  )
  report.lines(
      "eval_vs_time",
      {side: (curves[side]["eval_wall"], curves[side]["eval"]) for side in SIDES},
      "wall-clock s (rollout + learn)",
      f"held-out greedy reward ({label})",
      hline=("baseline final", targets["eval"]),
  )
