"""Mode `scheduler`: APRIL against the synchronous baseline, side by side in one run.

Same model (random weights of the config's shape), the config's engine (slots, KV page
pool, decode attention, prefill width) at the benchmark's prompt length, the same prompt
stream with the same per-sample response budgets. Lengths come from a long-tailed distribution
(length_dists.py) and are enforced through the budgets with no stop token, so policy
randomness cannot blur the comparison. APRIL admits N' = ratio x N groups per step and
stops at N complete ones; the baseline admits N and waits for all of them. Steps
alternate between the two sides; every program is compiled before timing starts.

Two yardsticks for APRIL's speedup. The occupancy ideal (APRIL's slot occupancy over the
baseline's) is the speedup if a decode step cost the same however many slots are live;
on the paged engine a half-empty step costs less, so that ideal overstates what is
reachable. The host-free ideal is the speedup of the two sides' decoding alone (tokens
over the seconds their engines spent in `step`, device and round trip), so the measured
speedup over it is what admission, prefills, snapshots and scheduling on the host leave
of the gain; each side's rollout time is split between those engine calls and the rest.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np

from april_jax.benchmarks import common, length_dists
from april_jax.data import PromptItem
from april_jax.rollout import AprilScheduler, RewardRunner, RolloutSettings, rollout_metrics
from april_jax.sampler import EngineConfig, SlotEngine

PROMPT_LEN = 16


# The engine calls a scheduler step makes, timed one by one (engine_events.py): decoding
# (with its host round trip), its two admission phases (fresh prompts; partial samples
# continued) and its step-end snapshot.
CLOCKED = ("step", "start_fresh", "continue_partials", "snapshot")


class EngineClock:
  """Wall seconds an engine spends in each of the CLOCKED calls, as it reports them."""

  def __init__(self, engine):
    self.seconds = dict.fromkeys(CLOCKED, 0.0)
    engine.listen(self._heard)

  def _heard(self, event: str, seconds: float, **_) -> None:
    if event in self.seconds:
      self.seconds[event] += seconds


def engine_config(config) -> EngineConfig:
  """The run config's engine (its pool, pages, decode attention, prefill width, ...) at
  the benchmark's prompt length."""
  max_len = PROMPT_LEN + config.rollout.max_response_len
  return dataclasses.replace(
      EngineConfig.from_run_config(config),
      max_len=max_len,
      prompt_len=PROMPT_LEN,
      hold_stopped=False,
  )


def make_side(
    cfg, params, config, shape, partial, ratio, seed, resume_mode=None, prepared: int = 1024
):
  """A warmed-up scheduler over the shared workload (prompts and budgets from the seed)."""
  r = config.rollout
  n, max_resp = r.n_samples_per_prompt, r.max_response_len
  engine_cfg = dataclasses.replace(engine_config(config), resume_mode=resume_mode or r.resume_mode)
  engine = SlotEngine(cfg, params, engine_cfg)
  engine.warm_up()

  def item(i):
    prompt = np.random.default_rng([seed, i]).integers(1, cfg.vocab_size, PROMPT_LEN)
    budgets = length_dists.sample_lengths(shape, max_resp, n, seed=[seed, i, 1])
    return PromptItem(prompt_id=i, tokens=prompt, answer="", budgets=list(budgets))

  # The stream's first `prepared` items are made now, before any timing: drawing the
  # workload is the benchmark's cost, not the rollout's (a run's loader reads ahead).
  ready = [item(i) for i in range(prepared)]
  counter = itertools.count()

  def source():
    i = next(counter)
    return ready[i] if i < len(ready) else item(i)

  settings = RolloutSettings(
      batch_size=r.batch_size,
      n_samples_per_prompt=n,
      over_sampling_batch_size=int(round(ratio * r.batch_size)) if partial else r.batch_size,
      partial_rollout=partial,
      resume_mode=resume_mode or r.resume_mode,
      max_response_len=max_resp,
      temperature=r.temperature,
  )
  rewards = RewardRunner(
      lambda text, answer: 0.0, decode=lambda ids: "", num_workers=1, processes=False
  )
  return AprilScheduler(engine, settings, source, rewards, seed=seed)


def summarize(results: list, versions: list[int]) -> dict[str, float]:
  st = lambda key: sum(res.stats.get(key, 0) for res in results)
  metrics = [rollout_metrics(res, v) for res, v in zip(results, versions)]
  trained = sum(len(s.response) for res in results for g in res.groups for s in g.samples)
  slot_steps = results[0].stats["num_slots"] * st("decode_steps")
  return {
      "tokens_per_s": st("new_tokens") / st("rollout_s"),
      "trained_tokens_per_s": trained / st("rollout_s"),
      "slot_occupancy": st("new_tokens") / slot_steps,
      "rollout_s_per_step": st("rollout_s") / len(results),
      "off_policy_token_frac": float(
          np.mean([m["rollout/off_policy_token_frac"] for m in metrics])
      ),
      "stale_token_frac": float(np.mean([m["rollout/stale_token_frac"] for m in metrics])),
      "staleness_max": float(max(m["rollout/staleness_max"] for m in metrics)),
      "buffer_groups_end": float(results[-1].stats["buffer_groups"]),
  }


def trained_samples(results: list, versions: list[int]):
  """(response lengths, staleness) of every trained sample."""
  lengths, staleness = [], []
  for res, version in zip(results, versions):
    for s in (s for g in res.groups for s in g.samples):
      lengths.append(len(s.response))
      staleness.append(version - int(s.versions.min()) if len(s.versions) else 0)
  return np.array(lengths), np.array(staleness)


# (report header, summary key) of each column of the rollout table after the side's name.
_COLUMNS = (
    ("tokens/s", "tokens_per_s"),
    ("trained tokens/s", "trained_tokens_per_s"),
    ("slot occupancy", "slot_occupancy"),
    ("s/step", "rollout_s_per_step"),
    ("off-policy token frac", "off_policy_token_frac"),
    ("staleness max", "staleness_max"),
)


def add_plots(report, out: dict, results: dict, shape: str, max_len: int) -> None:
  """Throughput bars, the length distribution with its tail, APRIL's staleness."""
  report.table(
      "Rollout, APRIL vs the synchronous baseline",
      ["side"] + [header for header, _ in _COLUMNS],
      [
          [name] + [out[f"{key}_{k}"] for _, k in _COLUMNS]
          for name, key in (("APRIL", "april"), ("baseline", "baseline"))
      ],
  )
  report.bars(
      "throughput",
      "rollout tokens/s",
      {"APRIL": out["april_tokens_per_s"], "baseline": out["baseline_tokens_per_s"]},
  )
  report.bars(
      "slot_occupancy",
      "kept tokens / slot-steps",
      {"APRIL": out["april_slot_occupancy"], "baseline": out["baseline_slot_occupancy"]},
  )
  lengths, staleness = trained_samples(results["april"], list(range(len(results["april"]))))
  report.histogram(
      "response_lengths",
      {
          f"{shape} (sampled budgets)": length_dists.sample_lengths(shape, max_len, 20000, seed=1),
          "trained by APRIL": lengths,
      },
      "response tokens",
      log_y=True,
  )
  report.histogram(
      "staleness",
      {"APRIL": staleness},
      "policy versions behind (per trained sample)",
      bins=np.arange(-0.5, out["april_staleness_max"] + 1.5),
  )


def _run_steps(sides: dict, params, steps: int) -> dict:
  """`steps` scheduler steps, the sides taking turns step by step: each side's results."""
  results = {name: [] for name in sides}
  for step in range(steps):
    for name, sched in sides.items():
      sched.engine.set_policy(params, step)
      results[name].append(sched.step(step))
    common.progress("scheduler", step + 1, steps)
  return results


def _add_engine_split(side: dict, results: list, seconds: dict, engine, steps: int) -> None:
  """Adds to a side's summary where its rollout time went (decoding, starting groups,
  resuming partials, the step-end snapshot, the host), its decoding tokens/s, and its
  prefills, KV host traffic and preemptions per step."""
  tokens = sum(res.stats["new_tokens"] for res in results)
  rollout_s = sum(res.stats["rollout_s"] for res in results)
  side["decode_tokens_per_s"] = tokens / seconds["step"]
  side["decode_frac"] = seconds["step"] / rollout_s
  # The rest of the rollout: starting groups, resuming partials, the step-end snapshot,
  # and the scheduler's own host work (admission, rewards, bookkeeping).
  side["start_frac"] = seconds["start_fresh"] / rollout_s
  side["resume_frac"] = seconds["continue_partials"] / rollout_s
  side["snapshot_frac"] = seconds["snapshot"] / rollout_s
  side["host_frac"] = 1.0 - sum(seconds.values()) / rollout_s
  counters = engine.counters
  side["prefills_per_step"] = counters.prefills / steps
  # KV between the pool and the host (snapshots kept in the pool move none).
  side["kv_host_mb_per_step"] = (
      (counters.kv_bytes_to_host + counters.kv_bytes_to_device) / steps / 1e6
  )
  side["preemptions_per_step"] = sum(res.stats.get("preemptions", 0) for res in results) / steps


def _comparison(config, shape: str, steps: int, ratio: float, april: dict, base: dict) -> dict:
  """The mode's result: the run's settings, APRIL's speedup against its two ideals, and
  both sides' summaries (april_*, baseline_*)."""
  r = config.rollout
  speedup = april["tokens_per_s"] / base["tokens_per_s"]
  occupancy_ideal = april["slot_occupancy"] / base["slot_occupancy"]
  host_free_ideal = april["decode_tokens_per_s"] / base["decode_tokens_per_s"]
  out = {
      "mode": "scheduler",
      "distribution": shape,
      "lengths": length_dists.describe(shape, r.max_response_len),
      "N": r.batch_size,
      "n": r.n_samples_per_prompt,
      "N_prime": int(round(ratio * r.batch_size)),
      "num_slots": r.num_slots,
      "max_response_len": r.max_response_len,
      "steps": steps,
      "speedup": speedup,
      "occupancy_ideal": occupancy_ideal,
      "of_occupancy_ideal": speedup / occupancy_ideal,
      "host_free_ideal": host_free_ideal,
      "of_host_free_ideal": speedup / host_free_ideal,
      "trained_speedup": april["trained_tokens_per_s"] / base["trained_tokens_per_s"],
      "machine": common.machine(),
  }
  out.update({f"april_{k}": v for k, v in april.items()})
  out.update({f"baseline_{k}": v for k, v in base.items()})
  out.update({k: april[k] for k in ("off_policy_token_frac", "stale_token_frac", "staleness_max")})
  return out


def _print_comparison(out: dict, april: dict, base: dict, r, shape: str) -> None:
  """The two sides' table, the speedup against its ideals, and each side's time split."""
  print(
      f"{'':>10} {'tokens/s':>10} {'trained tok/s':>14} {'occupancy':>10} "
      f"{'s/step':>8} {'off-policy':>10} {'staleness':>9}"
  )
  for name, s in (("APRIL", april), ("baseline", base)):
    print(
        f"{name:>10} {s['tokens_per_s']:>10.0f} {s['trained_tokens_per_s']:>14.0f} "
        f"{s['slot_occupancy']:>10.3f} {s['rollout_s_per_step']:>8.3f} "
        f"{s['off_policy_token_frac']:>10.3f} {s['staleness_max']:>9.0f}"
    )
  print(
      f"speedup (rollout tokens/s) {out['speedup']:.2f}x, trained tokens/s "
      f"{out['trained_speedup']:.2f}x  [{shape}, N={r.batch_size}, n={r.n_samples_per_prompt}, "
      f"N'={out['N_prime']}, slots={r.num_slots}, max_len={r.max_response_len}]"
  )
  print(
      f"of the occupancy ideal ({out['occupancy_ideal']:.2f}x): {out['of_occupancy_ideal']:.0%}; "
      f"of the host-free ideal ({out['host_free_ideal']:.2f}x, decoding alone): "
      f"{out['of_host_free_ideal']:.0%}; time in decoding: APRIL {april['decode_frac']:.0%}, "
      f"baseline {base['decode_frac']:.0%}; prefills per step: APRIL "
      f"{april['prefills_per_step']:.1f}, baseline {base['prefills_per_step']:.1f}"
  )
  for name, s in (("APRIL", april), ("baseline", base)):
    print(
        f"{name} rollout time: decoding {s['decode_frac']:.0%}, starting groups "
        f"{s['start_frac']:.0%}, resuming partials {s['resume_frac']:.0%}, step-end snapshot "
        f"{s['snapshot_frac']:.0%}, the rest {s['host_frac']:.0%}; preemptions per step "
        f"{s['preemptions_per_step']:.1f}; KV to and from the host "
        f"{s['kv_host_mb_per_step']:.1f} MB per step"
    )


def run(
    config, shape: str = "deepmath", steps: int = 8, ratio: float = 2.0, seed: int = 0, report=None
) -> dict:
  """APRIL at N'/N = ratio against the synchronous baseline, `steps` steps each on the
  same workload: prints the comparison and returns its numbers."""
  cfg, params = common.bench_model(config, seed)
  sides = {
      "april": make_side(cfg, params, config, shape, True, ratio, seed),
      "baseline": make_side(cfg, params, config, shape, False, 1.0, seed),
  }
  clocks = {name: EngineClock(sched.engine) for name, sched in sides.items()}
  results = _run_steps(sides, params, steps)
  versions = list(range(steps))
  april, base = summarize(results["april"], versions), summarize(results["baseline"], versions)
  for name, side in (("april", april), ("baseline", base)):
    _add_engine_split(side, results[name], clocks[name].seconds, sides[name].engine, steps)
  out = _comparison(config, shape, steps, ratio, april, base)
  if report is not None:
    add_plots(report, out, results, shape, config.rollout.max_response_len)
  _print_comparison(out, april, base, config.rollout, shape)
  return out


# What each ratio's row of the sweep keeps from its `run`.
_SWEEP_KEYS = (
    "N_prime",
    "speedup",
    "trained_speedup",
    "april_slot_occupancy",
    "baseline_slot_occupancy",
    "off_policy_token_frac",
    "staleness_max",
)


def _print_sweep(rows: list[dict], shape: str) -> None:
  print(f"\nN'/N sweep [{shape}]")
  print(
      f"{'N_prime/N':>9} {'speedup':>8} {'trained':>8} {'occupancy':>10} {'off-policy':>10} "
      f"{'staleness':>9}"
  )
  for r in rows:
    print(
        f"{r['ratio']:>9.1f} {r['speedup']:>7.2f}x {r['trained_speedup']:>7.2f}x "
        f"{r['april_slot_occupancy']:>10.3f} {r['off_policy_token_frac']:>10.3f} "
        f"{r['staleness_max']:>9.0f}"
    )


def _report_sweep(report, rows: list[dict], ratios, shape: str) -> None:
  """The sweep's table (APRIL's side) and its speedups against N'/N."""
  keys = ["ratio"] + [k for k in _SWEEP_KEYS if k != "baseline_slot_occupancy"]
  report.table(f"N'/N sweep ({shape})", keys, [[r[k] for k in keys] for r in rows])
  report.lines(
      "speedup_vs_ratio",
      {
          "rollout tokens/s": (np.array(ratios), np.array([r["speedup"] for r in rows])),
          "trained tokens/s": (np.array(ratios), np.array([r["trained_speedup"] for r in rows])),
      },
      "N'/N",
      "speedup over the baseline",
  )


def sweep(
    config,
    shape: str = "deepmath",
    steps: int = 8,
    ratios=(1.0, 1.5, 2.0, 3.0),
    seed: int = 0,
    report=None,
) -> dict:
  """APRIL at several N'/N, each against its own baseline run (paired, same seeds)."""
  rows = []
  for ratio in ratios:
    out = run(config, shape=shape, steps=steps, ratio=float(ratio), seed=seed)
    rows.append({k: out[k] for k in _SWEEP_KEYS})
    rows[-1]["ratio"] = float(ratio)
  _print_sweep(rows, shape)
  if report is not None:
    _report_sweep(report, rows, ratios, shape)
  return {
      "mode": "scheduler_sweep",
      "distribution": shape,
      "sweep": rows,
      "machine": common.machine(),
  }
