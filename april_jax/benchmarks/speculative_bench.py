"""Speculative decoding against plain decoding: the same prompts and keys on both sides.

  python -m april_jax.bench --mode=speculative --config=configs/tiny.py
  python -m april_jax.bench --mode=speculative --config=configs/tiny.py \
      --spec_model=qwen3_1_7b --spec_live=1,8,32 --spec_tokens=4   # on a GPU

Three parts, each side run twice on the same records (the first compiles; the second is
timed):
  task        the config's model (random weights, in float32) and sampling: groups of
              n_samples_per_prompt, drafts from each sample's own tokens and its group's.
              Token mismatches (expected 0), tokens per decode pass, time per token,
              acceptance by source.
  controlled  `--spec_model`'s shape (default the config's; params in --dtype) at the
              config's sampling, one wave of `live` samples in an engine of the config's
              slots (more if more are live: few live is a step's tail) that all run the
              whole budget (no stop tokens), drafts suggested from the true
              continuation (the plain side's tokens) with each token replaced at rate
              r: the speedup against acceptance and live slots.
  bfloat16    the task's records in bfloat16: the verify pass sums attention in another
              order than a decode step, so a near tie may draw another token; counted
              (samples that differ, and where they first do).
The task part runs a third side, `auto` (rollout.speculative_auto: each call speculates
or not by the measured rates). The last line is JSON; its `faster` names the side with
the lower time per token in the task part (plain or speculative), and each controlled
row names its own. Times are the best of `repeats` runs after one that compiles.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from april_jax.benchmarks import common
from april_jax.benchmarks.sampler_bench import BENCH_MODELS
from april_jax.settings.qwen3_shapes import QWEN3_SHAPES
from april_jax.models import qwen3
from april_jax.sampler import EngineConfig, SampleRecord, SlotEngine

RATES = (0.0, 0.1, 0.3, 0.6, 1.0)


def _records(prompts, n, budget, sampling, seed):
  keys = np.random.default_rng([seed, 7]).integers(0, 2**32, (len(prompts) * n, 2), np.uint32)
  return [
      SampleRecord(
          prompt=prompts[i // n],
          max_new_tokens=budget,
          rng=keys[i],
          group_id=i // n,
          index=i,
          **sampling,
      )
      for i in range(len(prompts) * n)
  ]


def _decode(cfg, params, make_records, config: EngineConfig, suggest=None, repeats: int = 3):
  """Every record to its end on a fresh engine (refilled as slots free), 1 + `repeats`
  times: the records, the fastest of the timed runs' seconds (the first run compiles),
  and the counters of the last run."""
  times = []
  for _ in range(1 + repeats):
    engine = SlotEngine(cfg, params, config)
    records = make_records()
    queue = list(records)
    start = time.perf_counter()
    while queue or engine.num_live:
      if queue and engine.num_free:
        n = engine.room_for(queue)
        for r in queue[:n]:
          engine.admit([r])
          if suggest is not None:
            engine.suggest(r, suggest[r.index])
        queue = queue[n:]
      engine.step(refill=bool(queue))
    times.append(time.perf_counter() - start)
  return records, min(times[1:] or times), engine.counters


def _side(records, seconds, counters) -> dict:
  tokens = counters.tokens_generated
  drafted, accepted = counters.drafted, counters.accepted
  return {
      "tokens": tokens,
      "passes": counters.decode_steps,
      "tokens_per_pass": tokens / max(counters.decode_steps, 1),
      "ms_per_token": 1e3 * seconds / max(tokens, 1),
      "seconds": seconds,
      "acceptance": {s: accepted[s] / drafted[s] for s in drafted if drafted[s]},
      "drafted": dict(drafted),
      "speculative_calls": counters.speculative_calls,
      "calls": counters.decode_calls,
  }


def _mismatches(a, b) -> dict:
  """Samples whose tokens differ, positions that differ, and where they first do."""
  differ, firsts, positions = 0, [], 0
  for x, y in zip(a, b):
    n = min(len(x.response), len(y.response))
    wrong = np.flatnonzero(x.response[:n] != y.response[:n])
    if len(wrong) or len(x.response) != len(y.response):
      differ += 1
      firsts.append(int(wrong[0]) if len(wrong) else n)
      positions += len(wrong) + abs(len(x.response) - len(y.response))
  logprob = max(
      (float(np.abs(x.logprobs - y.logprobs).max()) for x, y in zip(a, b) if len(x.logprobs)
       and np.array_equal(x.response, y.response)),
      default=0.0,
  )  # fmt: skip
  return {
      "samples_differing": differ,
      "positions_differing": positions,
      "first_difference_mean": float(np.mean(firsts)) if firsts else None,
      "max_logprob_diff_equal_samples": logprob,
  }


def _model(name: str | None, config, seed: int, dtype=jnp.float32):
  if name:
    shape = QWEN3_SHAPES.get(name)
    cfg = qwen3.Qwen3Config(**shape) if shape else BENCH_MODELS[name]
  else:
    cfg, _ = common.bench_model(config, seed)
  params = qwen3.init_params(cfg, jax.random.key(seed), dtype=dtype, std=config.model.init.std)
  return cfg, params


def _engine(config, num_slots, max_len, K, stop_ids=(), auto=False) -> EngineConfig:
  r = config.rollout
  return EngineConfig(
      num_slots=num_slots,
      max_len=max_len,
      sync_every=r.sync_every,
      page_size=r.page_size,
      stop_ids=stop_ids,
      speculative_tokens=K,
      speculative_auto=auto,
      speculative_ngram=r.speculative_ngram,
  )


def run(
    config, K: int = 4, model: str = "", live=(1, 4, 16), budget: int = 0, seed: int = 0,
    rates=RATES, dtype: str = "float32", repeats: int = 3,
):  # fmt: skip
  """The three parts (module docstring); prints their tables, returns the JSON result."""
  log = common.stage_logger("speculative")
  budget = budget or config.rollout.max_response_len
  out = {"machine": common.machine(), "K": K, "budget": budget}
  out.update(_task_and_bfloat16(config, K, budget, seed, repeats, log))
  cfg, params = _model(model, config, seed, jnp.dtype(dtype))
  out["controlled"] = [
      row
      for n_live in live
      for row in _controlled(config, cfg, params, K, n_live, budget, rates, seed, repeats, log)
  ]
  out["controlled_model"] = f"{model or 'config'}, {dtype}"
  _print(out)
  return out


def _sampling(config) -> dict:
  r = config.rollout
  return dict(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


def _task_and_bfloat16(config, K, budget, seed, repeats, log) -> dict:
  """The task part (plain, speculative, auto on the config's model, float32) and the
  bfloat16 part (plain and speculative on the same records)."""
  r, prompt_len = config.rollout, config.data.max_prompt_len
  cfg, params = _model("", config, seed)
  prompts = [
      np.random.default_rng([seed, i]).integers(1, cfg.vocab_size, prompt_len).astype(np.int32)
      for i in range(max(r.num_slots // r.n_samples_per_prompt, 1) * 2)
  ]
  make = lambda: _records(prompts, r.n_samples_per_prompt, budget, _sampling(config), seed)
  stops = (int(cfg.vocab_size - 1),)  # a stop token, so lengths vary
  engine = lambda k, auto=False: _engine(config, r.num_slots, prompt_len + budget, k, stops, auto)
  sides = {}
  for name, k, auto in (("plain", 0, False), ("speculative", K, False), ("auto", K, True)):
    log(f"task, {name}")
    sides[name] = _decode(cfg, params, make, engine(k, auto), repeats=repeats)
  task = {name: _side(*side) for name, side in sides.items()}
  task["mismatches"] = _mismatches(sides["plain"][0], sides["speculative"][0])
  task["auto_mismatches"] = _mismatches(sides["plain"][0], sides["auto"][0])
  ms = {name: task[name]["ms_per_token"] for name in ("plain", "speculative")}
  # bfloat16: where the verify pass's sums may flip a near tie
  log("bfloat16")
  params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  b16 = [_decode(cfg, params16, make, engine(k), repeats=0)[0] for k in (0, K)]
  return {"task": task, "faster": min(ms, key=ms.get), "bfloat16": _mismatches(*b16)}


def _controlled(config, cfg, params, K, n_live, budget, rates, seed, repeats, log) -> list:
  """One wave of n_live samples, plain and then with drafts from the true continuation
  wrong at each rate: a row each."""
  prompt_len = config.data.max_prompt_len
  lone = [
      np.random.default_rng([seed, 99, i]).integers(1, cfg.vocab_size, prompt_len)
      for i in range(n_live)
  ]
  make = lambda: _records([p.astype(np.int32) for p in lone], 1, budget, _sampling(config), seed)
  # The config's slots (the tail of a step: few of them live), or more if more are live.
  slots = max(config.rollout.num_slots, n_live)
  engine = lambda k: _engine(config, slots, prompt_len + budget, k)
  log(f"controlled, {n_live} live, plain")
  truth, plain_s, plain_c = _decode(cfg, params, make, engine(0), repeats=repeats)
  plain_ms = 1e3 * plain_s / max(plain_c.tokens_generated, 1)
  rows = []
  for rate in rates:
    rng = np.random.default_rng([seed, int(rate * 1000)])
    suggest = {t.index: _corrupt(t.response, rate, rng, cfg.vocab_size) for t in truth}
    log(f"controlled, {n_live} live, wrong rate {rate}")
    spec = _decode(cfg, params, make, engine(K), suggest, repeats=repeats)
    side = _side(*spec)
    rows.append({
        "live": n_live,
        "wrong_rate": rate,
        "plain_ms_per_token": plain_ms,
        "spec_ms_per_token": side["ms_per_token"],
        "tokens_per_pass": side["tokens_per_pass"] / n_live,
        "acceptance": side["acceptance"].get("suggested", 0.0),
        "speedup": plain_ms / side["ms_per_token"],
        "mismatches": _mismatches(truth, spec[0])["samples_differing"],
        "faster": "speculative" if side["ms_per_token"] < plain_ms else "plain",
    })  # fmt: skip
  return rows


def _corrupt(tokens, rate: float, rng, vocab: int) -> np.ndarray:
  """tokens with each replaced by another token at `rate`."""
  tokens = np.array(tokens)
  wrong = rng.random(len(tokens)) < rate
  tokens[wrong] = (tokens[wrong] + 1 + rng.integers(0, vocab - 1, int(wrong.sum()))) % vocab
  return tokens


def _print(out: dict) -> None:
  t = out["task"]
  print(
      f"speculative decoding, K={out['K']}, budget {out['budget']} ({out['machine']['device_kind']})"
  )
  print("task (the config's model and sampling, float32):")
  print(f"  {'side':<12} {'tokens':>7} {'passes':>7} {'tok/pass':>9} {'ms/token':>9}  acceptance")
  for name in ("plain", "speculative", "auto"):
    s = t[name]
    acc = ", ".join(f"{k} {v:.2f}" for k, v in s["acceptance"].items()) or "-"
    print(
        f"  {name:<12} {s['tokens']:>7} {s['passes']:>7} {s['tokens_per_pass']:>9.2f} "
        f"{s['ms_per_token']:>9.3f}  {acc}"
    )
  m = t["mismatches"]
  print(
      f"  token mismatches: {m['samples_differing']} samples (expected 0); logprobs within "
      f"{m['max_logprob_diff_equal_samples']:.1e}; faster: {out['faster']}; auto: "
      f"{t['auto_mismatches']['samples_differing']} samples differ, "
      f"{t['auto']['speculative_calls']} of {t['auto']['calls']} calls speculated"
  )
  b = out["bfloat16"]
  print(
      f"bfloat16: {b['samples_differing']} samples differ, {b['positions_differing']} "
      f"positions, first at {b['first_difference_mean']}"
  )
  print(
      f"controlled acceptance ({out['controlled_model']}): drafts = the true continuation, wrong at a rate"
  )
  print(
      f"  {'live':>4} {'wrong':>6} {'accept':>7} {'tok/pass/slot':>13} {'plain ms/tok':>12} {'spec ms/tok':>11} {'speedup':>8} {'mism':>5}"
  )
  for row in out["controlled"]:
    print(
        f"  {row['live']:>4} {row['wrong_rate']:>6.2f} {row['acceptance']:>7.2f} "
        f"{row['tokens_per_pass']:>13.2f} {row['plain_ms_per_token']:>12.3f} "
        f"{row['spec_ms_per_token']:>11.3f} {row['speedup']:>8.2f} {row['mismatches']:>5}"
    )
