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


def run(config, shape: str = "deepmath", steps: int = 8, ratio: float = 2.0,
        seed: int = 0, report=None) -> dict:
  cfg, params = common.bench_model(config, seed)
  modes = ("kv", "recompute")
  sides = {m: scheduler_bench.make_side(cfg, params, config, shape, True, ratio, seed,
                                        resume_mode=m) for m in modes}
  results = {m: [] for m in modes}
  for step in range(steps):
    for mode, sched in sides.items():
      results[mode].append(sched.step(step, version=step))
    common.progress("resume", step + 1, steps)
  out = {"mode": "resume", "distribution": shape, "steps": steps,
         "num_slots": config.rollout.num_slots, "machine": common.machine()}
  for mode in modes:
    res = results[mode]
    summary = scheduler_bench.summarize(res, list(range(steps)))
    out[f"{mode}_tokens_per_s"] = summary["tokens_per_s"]
    out[f"{mode}_rollout_s_per_step"] = summary["rollout_s_per_step"]
    out[f"{mode}_partial_samples_per_step"] = float(np.mean(
        [r.stats.get("partial_samples", 0) for r in res]))
    out[f"{mode}_buffer_bytes_mean"] = float(np.mean([r.stats["buffer_bytes"] for r in res]))
    out[f"{mode}_buffer_bytes_max"] = float(np.max([r.stats["buffer_bytes"] for r in res]))
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, cfg.vocab_size, scheduler_bench.PROMPT_LEN).astype(np.int32)
             for _ in range(config.rollout.num_slots)]
  per_token = sampler_bench.resume_costs(cfg, params, prompts,
                                         config.rollout.max_response_len // 2,
                                         config.rollout.sync_every)
  for mode in modes:
    out[f"{mode}_us_per_held_token"] = per_token[mode]["us_per_token"]
  out["recompute_over_kv_step_time"] = (out["recompute_rollout_s_per_step"] /
                                        out["kv_rollout_s_per_step"])
  print(f"{'resume':>10} {'s/step':>8} {'tokens/s':>10} {'partials/step':>14} "
        f"{'buffer MB (mean/max)':>21} {'us/held token':>14}")
  for mode in modes:
    print(f"{mode:>10} {out[f'{mode}_rollout_s_per_step']:>8.3f} "
          f"{out[f'{mode}_tokens_per_s']:>10.0f} {out[f'{mode}_partial_samples_per_step']:>14.1f} "
          f"{out[f'{mode}_buffer_bytes_mean'] / 1e6:>10.2f} / "
          f"{out[f'{mode}_buffer_bytes_max'] / 1e6:<8.2f} {out[f'{mode}_us_per_held_token']:>14.2f}")
  if report is not None:
    report.table("Resume modes", ["mode", "s/step", "tokens/s", "partials resumed/step",
                                  "buffer bytes (mean)", "us per held token"],
                 [[m, out[f"{m}_rollout_s_per_step"], out[f"{m}_tokens_per_s"],
                   out[f"{m}_partial_samples_per_step"], out[f"{m}_buffer_bytes_mean"],
                   out[f"{m}_us_per_held_token"]] for m in modes])
    report.bars("cost_per_held_token", "us per held token (snapshot + restore)",
                {m: out[f"{m}_us_per_held_token"] for m in modes})
    report.bars("buffer_bytes", "host bytes held by the buffer (mean)",
                {m: out[f"{m}_buffer_bytes_mean"] for m in modes})
  return out
