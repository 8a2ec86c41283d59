"""Mode `multiturn`: what multi-turn episodes cost beyond the tokens they draw.

Four sides, each one APRIL scheduler step (rollout/scheduler.py) over the same prompts
on the same engine settings, random weights:

  single       single-turn samples, each with a budget of exactly the tokens its
               episode drew, no environment: the floor
  long_single  the same, with prompts longer by the observation tokens a drawn token
               attends to on average in an episode (obs_tokens x (turns - 1) / 2): the
               floor at the episodes' contexts, since a decode step's attention reads
               every live token's KV, the observations' included
  engine       3-turn episodes: each turn's observation (`obs_tokens` tokens) written
               into the slot's pages by one chunked prefill (EngineConfig.feed_given
               "prefill"), the tool's calls (`tool_s` seconds each) run while the other
               slots decode (env.overlap), and a parked slot given up to a waiting
               sample
  before       the same episodes as the engine ran them before: observations fed one
               decode step a token ("decode"), every call waited for on one thread
               right after the decode call that ended its turn

The model's output head is zero, so every token is drawn uniformly (each sample's draws
depend on its key and position alone: the sides draw the same tokens), and a turn ends
on any of vocab / turn_tokens stop tokens: turn lengths are geometric with mean
`turn_tokens`, the same on every side. The goals: the engine side's rollout at most
1.2x the single side's plus the observations' prefill time (measured here: the feed
calls, timed alone), and the engine idle on tool calls (waiting for a call with nothing
to decode) at most 5% of its rollout.

  python -m april_jax.bench --mode=multiturn [--decode_block=256]
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time

import jax
import numpy as np

from april_jax.data import PromptItem
from april_jax.rollout import episodes
from april_jax.envs.base import EnvStep
from april_jax.models import qwen3
from april_jax.rollout import AprilScheduler, RewardRunner, RolloutSettings
from april_jax.sampler import EngineConfig, SlotEngine
from april_jax.settings.env import EnvSettings

# A small model whose decode step takes about 8 ms on a 2-core CPU: 4 layers of width 512,
# where the weights, not the KV, are most of what a step reads (as in a real model).
MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_layers=4)
MODEL.update(num_heads=8, num_kv_heads=4, head_dim=64, tie_word_embeddings=False)


@dataclasses.dataclass(frozen=True)
class Shape:
  episodes: int = 16
  slots: int = 8
  turns: int = 3
  turn_tokens: int = 48  # mean drawn tokens per turn
  obs_tokens: int = 200
  tool_s: float = 0.1
  prompt_len: int = 24


class Tool:
  """Answers each turn after `tool_s` seconds with `obs_tokens` tokens (never a stop
  token), ends the episode at its last turn."""

  def __init__(self, shape: Shape, num_stops: int, vocab_size: int):
    self.shape, self.num_stops, self.vocab_size = shape, num_stops, vocab_size

  def reset(self, row):
    return {"turns": 0, "id": row["id"]}

  def step(self, state, turn):
    time.sleep(self.shape.tool_s)
    state = {"turns": state["turns"] + 1, "id": state["id"]}
    if state["turns"] == self.shape.turns:
      return EnvStep(observation=None, done=True, state=state)
    rng = np.random.default_rng([state["id"], state["turns"]])
    obs = rng.integers(self.num_stops, self.vocab_size, self.shape.obs_tokens)
    return EnvStep(observation=" ".join(map(str, obs)), done=False, state=state)


def _mean_observation_context(shape: Shape) -> int:
  """Observation tokens a drawn token attends to, on average over an episode: none in
  the first turn, one observation's in the second, ... (turns of equal mean length)."""
  return shape.obs_tokens * (shape.turns - 1) // 2


def _model(seed: int, model: dict):
  cfg = qwen3.Qwen3Config(**model)
  params = qwen3.init_params(cfg, jax.random.key(seed), std=0.05)
  params["lm_head"] = params["lm_head"] * 0  # uniform draws
  return cfg, params


def _scheduler(cfg, params, shape: Shape, budgets, side: str, num_stops: int, decode_block: int):
  """One scheduler over `shape.episodes` prompts; side: single, long_single, engine or
  before. long_single's prompts are longer by the observations' mean context."""
  multi = not side.endswith("single")
  extra = _mean_observation_context(shape) if side == "long_single" else 0
  # One engine setting on every side: the same slots, max_len and KV pool.
  max_new = shape.turns * (8 * shape.turn_tokens + shape.obs_tokens)
  config = EngineConfig(
      num_slots=shape.slots,
      max_len=shape.prompt_len + extra + max_new,
      sync_every=16,
      stop_ids=tuple(range(num_stops)) if multi else (),
      hold_stopped=multi,
      feed_given="decode" if side == "before" else "prefill",
      prompt_len=shape.prompt_len + extra,
      page_size=16,
      decode_block=decode_block,
  )
  engine = SlotEngine(cfg, params, config)
  engine.warm_up()
  feeds = _record_feeds(engine)
  items = iter(range(shape.episodes))

  def source():
    i = next(items, None)
    if i is None:
      return None
    prompt = np.random.default_rng(i).integers(num_stops, cfg.vocab_size, shape.prompt_len + extra)
    budget = None if multi else [budgets[i]]
    return PromptItem(prompt_id=i, tokens=prompt, answer="", budgets=budget, row={"id": i})

  settings = RolloutSettings(
      batch_size=shape.episodes,
      n_samples_per_prompt=1,
      over_sampling_batch_size=shape.episodes,
      partial_rollout=False,
      max_response_len=max_new,
      temperature=1.0,
  )
  encode = lambda text: [int(t) for t in text.split()]
  decode = lambda ids: " ".join(str(int(t)) for t in ids)
  runner = None
  if multi:
    runner = episodes.EpisodeRunner(
        Tool(shape, num_stops, cfg.vocab_size),
        encode,
        decode,
        EnvSettings(
            max_turns=shape.turns,
            max_observation_tokens=shape.obs_tokens,
            timeout_s=30.0,
            workers=1 if side == "before" else shape.slots,
            overlap=side != "before",
        ),
    )
  rewards = RewardRunner(lambda text, answer: 0.0, decode=decode, timeout_s=30.0, processes=False)
  scheduler = AprilScheduler(engine, settings, source, rewards, episodes=runner)
  scheduler.feed_calls = feeds
  return scheduler


def _rollout(scheduler) -> dict:
  result = scheduler.step(0)
  samples = [s for g in result.groups for s in g.samples]
  drawn = [int(np.sum(s.logprobs != 0)) for s in samples]
  counters = scheduler.engine.counters
  out = dict(
      rollout_s=result.stats["rollout_s"],
      samples=len(samples),
      drawn_tokens=sum(drawn),
      decode_steps=counters.decode_steps,
      feeds=counters.feeds,
      feed_rows=counters.feed_rows,
      tokens_fed=counters.tokens_fed,
  )
  if scheduler.episodes is not None:
    counts = scheduler.episodes.counts
    out.update(
        env_wait_s=result.stats["env_wait_s"],
        turns=int(counts["env/turns"]),
        observation_tokens=int(counts["env/observation_tokens"]),
    )
    scheduler.episodes.close()
  out["drawn_by_id"] = {g.prompt_id: d for g, d in zip(result.groups, drawn)}
  out["feed_calls"] = {f"{rows}x{T}": n for (rows, T), n in sorted(scheduler.feed_calls.items())}
  return out


def _record_feeds(engine: SlotEngine) -> collections.Counter:
  """Counts the engine's feed calls by (rows, length bucket), as it reports them."""
  calls = collections.Counter()

  def heard(event: str, seconds: float, rows=0, bucket=0, **_) -> None:
    del seconds
    if event == "feed":
      calls[(rows, bucket)] += 1

  engine.listen(heard)
  return calls


def _feed_seconds(engine: SlotEngine, rows: int, T: int, repeats: int) -> float:
  """One feed call of `rows` rows at length bucket T, timed alone, the median of
  `repeats`: over slots whose KV is empty it reads no pages, so this is the chunk's own
  work, what a feed call adds to decoding."""
  slots = np.arange(rows, dtype=np.int32) % engine.config.num_slots
  ends = np.ones(rows, np.int32)
  times = []
  for _ in range(repeats + 1):
    began = time.perf_counter()
    engine.device.feed(engine.params, slots, ends, T, engine.kv.table())
    jax.block_until_ready(engine.state.length)
    times.append(time.perf_counter() - began)
  return statistics.median(times[1:])


def run(
    shape: Shape = Shape(),
    seed: int = 0,
    repeats: int = 5,
    report=None,
    model: dict = MODEL,
    decode_block: int = 1024,
) -> dict:
  cfg, params = _model(seed, model)
  num_stops = max(1, cfg.vocab_size // shape.turn_tokens)
  make = lambda budgets, side: _scheduler(
      cfg, params, shape, budgets, side, num_stops, decode_block
  )
  engine_side = _rollout(make(None, "engine"))
  drawn = engine_side.pop("drawn_by_id")
  budgets = [max(1, drawn[i]) for i in range(shape.episodes)]
  single = _rollout(make(budgets, "single"))
  single.pop("drawn_by_id")
  long_single = _rollout(make(budgets, "long_single"))
  long_single.pop("drawn_by_id")
  before_side = _rollout(make(None, "before"))
  before_side.pop("drawn_by_id")
  probe = make(None, "engine").engine
  prefill_s = 0.0
  for call, n in engine_side["feed_calls"].items():
    rows, T = map(int, call.split("x"))
    prefill_s += n * _feed_seconds(probe, rows, T, repeats)
  result = dict(
      shape=dataclasses.asdict(shape),
      model=model,
      decode_block=decode_block,
      single=single,
      long_single=long_single,
      engine=engine_side,
      before=before_side,
      prefill_s=prefill_s,
      engine_vs_floor=engine_side["rollout_s"] / (single["rollout_s"] + prefill_s),
      before_vs_floor=before_side["rollout_s"] / (single["rollout_s"] + prefill_s),
      engine_vs_long_floor=engine_side["rollout_s"] / (long_single["rollout_s"] + prefill_s),
      engine_idle_frac=engine_side["env_wait_s"] / engine_side["rollout_s"],
      before_idle_frac=before_side["env_wait_s"] / before_side["rollout_s"],
  )
  _print(result)
  if report is not None:
    report.table(
        "multi-turn rollout",
        ["side", "rollout s", "drawn", "decode steps", "feeds", "waited on calls s"],
        [
            [name, f"{r['rollout_s']:.2f}", r["drawn_tokens"], r["decode_steps"], r["feeds"]]
            + [f"{r.get('env_wait_s', 0.0):.2f}"]
            for name, r in (
                ("single", single),
                ("long_single", long_single),
                ("engine", engine_side),
                ("before", before_side),
            )
        ],
    )
  return result


def _print(r: dict) -> None:
  s = r["shape"]
  print(
      f"{s['episodes']} episodes of {s['turns']} turns (mean {s['turn_tokens']} drawn tokens "
      f"a turn), {s['obs_tokens']}-token observations, a {s['tool_s'] * 1000:.0f} ms tool, "
      f"{s['slots']} slots, decode attention read {r['decode_block']} positions a chunk"
  )
  print(
      f"{'side':<11} {'rollout s':>10} {'drawn':>7} {'decode steps':>13} {'feeds':>6} {'idle':>7}"
  )
  for name in ("single", "long_single", "engine", "before"):
    x = r[name]
    idle = x.get("env_wait_s", 0.0) / x["rollout_s"]
    print(
        f"{name:<11} {x['rollout_s']:>10.2f} {x['drawn_tokens']:>7} {x['decode_steps']:>13} "
        f"{x['feeds']:>6} {idle:>7.1%}"
    )
  e = r["engine"]
  print(
      f"observations' prefill: {r['prefill_s']:.2f} s ({e['feeds']} feed calls, {e['feed_rows']} "
      f"rows, {e['tokens_fed']} tokens), each call timed alone"
  )
  print(
      f"engine / (single + prefill) = {r['engine_vs_floor']:.2f}x (goal <= 1.2x); before: "
      f"{r['before_vs_floor']:.2f}x"
  )
  print(
      f"engine / (long_single + prefill) = {r['engine_vs_long_floor']:.2f}x: the floor with "
      f"prompts longer by the observations' mean context ({_mean_observation_context(Shape(**s))} "
      "tokens)"
  )
  print(
      f"idle on tool calls: engine {r['engine_idle_frac']:.1%} (goal <= 5%), before "
      f"{r['before_idle_frac']:.1%}"
  )
