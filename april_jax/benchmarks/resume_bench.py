"""Mode `resume`: what continuing partial samples costs, KV kept vs recomputed.

Two APRIL schedulers over the same workload (model, slots, prompts, long-tailed budgets),
one resuming partials from their host KV (`kv`), one re-prefilling prompt + partial
response under the current params (`recompute`); steps alternate. Reported per step
(rollout time, tokens/s, partials resumed, host bytes held by the buffer) and per held
token (snapshot + restore alone, from the sampler benchmark's measurement).
"""

from __future__ import annotations

import numpy as np

from april_jax.benchmarks import common, sampler_bench, scheduler_bench

MODES = ("kv", "recompute")
# (report header, per-mode key) of each column of the table after the mode's name.
_COLUMNS = (
    ("s/step", "rollout_s_per_step"),
    ("tokens/s", "tokens_per_s"),
    ("partials resumed/step", "partial_samples_per_step"),
    ("buffer bytes (mean)", "buffer_bytes_mean"),
    ("us per held token", "us_per_held_token"),
)


def _add_step_stats(out: dict, mode: str, results: list, steps: int) -> None:
  """One mode's numbers per step: rollout time, tokens/s, partials resumed, buffer bytes."""
  summary = scheduler_bench.summarize(results, list(range(steps)))
  partials = [r.stats.get("partial_samples", 0) for r in results]
  buffer_bytes = [r.stats["buffer_bytes"] for r in results]
  out[f"{mode}_tokens_per_s"] = summary["tokens_per_s"]
  out[f"{mode}_rollout_s_per_step"] = summary["rollout_s_per_step"]
  out[f"{mode}_partial_samples_per_step"] = float(np.mean(partials))
  out[f"{mode}_buffer_bytes_mean"] = float(np.mean(buffer_bytes))
  out[f"{mode}_buffer_bytes_max"] = float(np.max(buffer_bytes))


def _print(out: dict) -> None:
  print(
      f"{'resume':>10} {'s/step':>8} {'tokens/s':>10} {'partials/step':>14} "
      f"{'buffer MB (mean/max)':>21} {'us/held token':>14}"
  )
  for mode in MODES:
    print(
        f"{mode:>10} {out[f'{mode}_rollout_s_per_step']:>8.3f} "
        f"{out[f'{mode}_tokens_per_s']:>10.0f} {out[f'{mode}_partial_samples_per_step']:>14.1f} "
        f"{out[f'{mode}_buffer_bytes_mean'] / 1e6:>10.2f} / "
        f"{out[f'{mode}_buffer_bytes_max'] / 1e6:<8.2f} {out[f'{mode}_us_per_held_token']:>14.2f}"
    )


def _report(report, out: dict) -> None:
  report.table(
      "Resume modes",
      ["mode"] + [header for header, _ in _COLUMNS],
      [[m] + [out[f"{m}_{k}"] for _, k in _COLUMNS] for m in MODES],
  )
  for name, ylabel, key in (
      ("cost_per_held_token", "us per held token (snapshot + restore)", "us_per_held_token"),
      ("buffer_bytes", "host bytes held by the buffer (mean)", "buffer_bytes_mean"),
  ):
    report.bars(name, ylabel, {m: out[f"{m}_{key}"] for m in MODES})


def run(
    config, shape: str = "deepmath", steps: int = 8, ratio: float = 2.0, seed: int = 0, report=None
) -> dict:
  cfg, params = common.bench_model(config, seed)
  sides = {
      m: scheduler_bench.make_side(cfg, params, config, shape, True, ratio, seed, resume_mode=m)
      for m in MODES
  }
  results = {m: [] for m in MODES}
  for step in range(steps):
    for mode, sched in sides.items():
      sched.engine.set_policy(sched.engine.params, step)
      results[mode].append(sched.step(step))
    common.progress("resume", step + 1, steps)
  r = config.rollout
  out = {
      "mode": "resume",
      "distribution": shape,
      "steps": steps,
      "num_slots": r.num_slots,
      "machine": common.machine(),
  }
  for mode in MODES:
    _add_step_stats(out, mode, results[mode], steps)
  prompts = sampler_bench.random_prompts(
      cfg.vocab_size, r.num_slots, scheduler_bench.PROMPT_LEN, seed
  )
  per_token = sampler_bench.resume_costs(
      cfg, params, prompts, r.max_response_len // 2, r.sync_every
  )
  for mode in MODES:
    out[f"{mode}_us_per_held_token"] = per_token[mode]["us_per_token"]
  out["recompute_over_kv_step_time"] = (
      out["recompute_rollout_s_per_step"] / out["kv_rollout_s_per_step"]
  )
  _print(out)
  if report is not None:
    _report(report, out)
  return out
