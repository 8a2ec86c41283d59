"""Mode `step`: whole RL steps, APRIL against the synchronous baseline, each phase set
against a floor for the same work on this machine.

Both sides roll out as in the scheduler mode (scheduler_bench.make_side: random weights
of the config's shape, the config's engine, long-tailed lengths forced through per-sample
budgets with no stop token), then do what trainer.train_step does after a rollout:

  rollout     sched.step, split into decode (the engine's `step` calls), prefill
              (the engine's admission of new prompts and of resumed partials) and the
              rest (the step-end snapshot, admission, rewards, the scheduler's bookkeeping)
  batch       the step's TrainBatch (rl/batch.py: rows, shaped rewards)
  learner     rl/learn.py's learn on that batch: passes, advantages, updates (it reads
              its metrics back: the device is done)
  cast        learner.decode_params(), handed to both engines
  checkpoint  the learner's state (float32 masters, AdamW moments) saved with orbax into a
              temporary folder and waited for; the folder is removed after it is measured

The scheduler mode's reward is 0 for every sample, which would make every GRPO advantage
0; each step adds seeded uniform [0, 1) rewards per sample, so the advantages are not
zero (the learner runs the same programs either way).

One learner serves both sides, so its memory is held once: its version counts the
updates of both sides, and after each update both engines decode with the newest params
(each side's rollout is on the current policy, as in a run). The learner's programs are
compiled for every length bucket first (Learner.warm_up), the engines' by their own
warm_up; APRIL then runs one untimed step (its partial buffer filled as in a run's steady
state; the cast, orbax and the reward path run once). Then the sides alternate step by
step. Compilations while a step is timed are counted and reported (there should be none).

Floors (the arithmetic is in floors.py), per side and step:
  decode      bytes its decode steps must read / copy bandwidth: the decode params once a
              step, plus the KV of every live position. Each slot's length is read off the
              engine before and after each decode call: a slot that grew g tokens from
              length l read l + (l + 1) + ... + (l + g - 1) positions (exact to one
              position a step)
  prefill     forward FLOPs of the sequences prefilled, at their real lengths and without
              the logits head (a prefill only writes KV) / matmul rate
  batch       bytes of the built batch's arrays / host copy rate
  learner     FLOPs of the update over the token positions its calls compute (the
              learner's own plan: each row of a call at the call's length; attention causal
              over each sample of a packed row and over its trailing padding, as a
              segment-aware kernel computes it) / matmul rate. The same FLOPs over the real
              tokens (each sample's prompt + response) give the MFU of useful work. Both
              count a rematerialised layer's forward again, not the logits' chunks'
  prefill     (its seconds include putting resumed partials' KV back into the pool, which
              its floor does not count)
  cast        float32 masters read + the compute-dtype copy written / copy bandwidth
              (LoRA: the adapters and the frozen base read, the merged copy written)
  checkpoint  bytes on disk / disk write rate (the rate of a file written with fsync; a
              save that lands in the page cache unsynced can beat this floor)
Before any of it, the fast attention paths a run would take here are checked against the
portable ones as the trainer checks them (models/path_check.py: its line, and the JSON's
"fast_paths"), and packed_check compares the learner's packed attention on this device with
each sample's own row (the JSON's "packed_attention"; a mismatch is printed loudly).
The rest of the rollout has no floor (host work). MFU here is of the matmul rate measured
in this run, not of the device's peak; a floor over the time it bounds is its share.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from april_jax.benchmarks import common, floors, packed_check, scheduler_bench
from april_jax.models import hf_io, lora, path_check
from april_jax.rl import advantages as advantages_lib
from april_jax.rl import batch as batch_lib
from april_jax.rl import layout as layout_lib
from april_jax.rl import learn as learn_lib
from april_jax.rl import update as update_lib
from april_jax.settings.run import RunSettings

PROMPT_LEN = scheduler_bench.PROMPT_LEN
# Each side's phases, seconds a step; "rollout_other" is the rollout less decode and prefill.
PHASES = (
    "rollout",
    "decode",
    "prefill",
    "rollout_other",
    "batch",
    "learner",
    "cast",
    "checkpoint",
    "step",
)
FLOORED = ("decode", "prefill", "batch", "learner", "cast", "checkpoint")
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class EngineCounts:
  """The work an engine's calls do, as it reports them (engine_events.py): the KV
  positions its decode steps read, the lengths of what it prefilled."""

  def __init__(self, engine):
    self.kv_positions, self.prefill_lengths = 0, []
    engine.listen(self._heard)

  def _heard(self, event: str, seconds: float, kv_positions=0, lengths=(), **_) -> None:
    del seconds
    if event == "step":
      self.kv_positions += kv_positions
    elif event == "prefill":
      self.prefill_lengths.extend(lengths)

  def take(self) -> tuple[int, list[int]]:
    """What was counted since the last take."""
    out = (self.kv_positions, self.prefill_lengths)
    self.kv_positions, self.prefill_lengths = 0, []
    return out


@dataclasses.dataclass
class Side:
  name: str
  sched: Any
  clock: scheduler_bench.EngineClock
  counts: EngineCounts
  step: int = 0  # this side's RL steps so far


@dataclasses.dataclass
class Bench:
  """What both sides share: the config, the model shape, the learner, the checkpoints."""

  config: Any
  cfg: Any
  learner: update_lib.Learner
  sides: dict[str, Side]
  directory: str
  checkpointer: Any
  seed: int
  version: int = 0  # updates so far, both sides together

  @property
  def logprob_passes(self) -> int:
    """Forward passes before the gradients: the old policy's, the reference's."""
    old = self.learner.loss_cfg.ratio_anchor != "behavior"
    return int(old) + int(self.learner.ref_params is not None)


def _bench_config(config):
  """The config with the benchmark's prompt length as data.max_prompt_len (the longest
  row a batch can have, as the learner's train section reads it)."""
  config = RunSettings.from_config(config).overridden({"data.max_prompt_len": PROMPT_LEN})
  if config.train.advantage in advantages_lib.CRITIC_ADVANTAGES:
    raise ValueError(
        f"--mode=step times a policy update without a critic: train.advantage="
        f"{config.train.advantage!r} needs one; use grpo, rloo, ..."
    )
  return config


def _take_checked_paths(config):
  """The fast paths a run of `config` would take here, checked as the trainer checks them
  (its lines printed), and `config` set to take what the check took."""
  paths = path_check.check(path_check.Settings.of(config, hf_io.model_config(config)))
  path_check.announce(paths)
  taken = config.overridden(
      {"model.attention": paths.attention, "rollout.decode_attention": paths.decode_attention}
  )
  return taken, paths


def _build(config, shape: str, ratio: float, seed: int, steps: int, directory: str, log) -> Bench:
  """Both sides' schedulers (engines warmed up) and one learner, compiled for every
  length bucket; both engines decode with the learner's params."""
  cfg, params = common.bench_model(config, seed)
  sides = {}
  for name, partial, r in (("april", True, ratio), ("baseline", False, 1.0)):
    log(f"{name}: engine (compiling its programs)")
    sched = scheduler_bench.make_side(cfg, params, config, shape, partial, r, seed)
    clock = scheduler_bench.EngineClock(sched.engine)
    sides[name] = Side(name, sched, clock, EngineCounts(sched.engine))
  t = layout_lib.train_section(config)
  learner = update_lib.Learner(
      cfg,
      params,
      t,
      config.rollout.temperature,
      total_updates=(2 * steps + 1) * t.num_minibatches * t.ppo_epochs,
      mesh=None,
      remat=config.model.remat,
      compute_dtype=config.model.dtype,
      lora=lora.LoraSpec.from_config(config.train.lora),  # its base: params, not copied
      seed=seed,
      lora_decode=config.train.lora.decode,
  )
  del params  # the engines decode with the learner's copy from here on
  decode = learner.decode_params()
  for side in sides.values():
    side.sched.engine.set_policy(decode, 0)
  r = config.rollout
  log("learner (compiling every length bucket)")
  learner.warm_up(
      r.batch_size * r.n_samples_per_prompt,
      batch_lib.all_bucket_lens(PROMPT_LEN + r.max_response_len),
  )
  return Bench(config, cfg, learner, sides, directory, ocp.StandardCheckpointer(), seed)


def _batch(bench: Bench, result) -> batch_lib.TrainBatch:
  """trainer.train_step's batch, with seeded random rewards added (see the docstring)."""
  c = bench.config
  batch = batch_lib.TrainBatch.from_groups(
      result.groups,
      bench.version,
      pad_id=0,
      max_len=PROMPT_LEN + c.rollout.max_response_len,
      train=c.train,
      max_response_len=c.rollout.max_response_len,
  )
  rng = np.random.default_rng([bench.seed, bench.version])
  noise = rng.random(batch.rewards.shape, np.float32)
  return dataclasses.replace(batch, rewards=batch.rewards + noise)


def _save(bench: Bench) -> str:
  """The learner's arrays saved with orbax, waited for; the folder."""
  arrays, _ = bench.learner.state()
  path = os.path.join(bench.directory, f"state_{bench.version}")
  bench.checkpointer.save(path, arrays)
  bench.checkpointer.wait_until_finished()
  return path


def _cast(bench: Bench) -> None:
  """The learner's new params (one more update than bench.version) to both engines."""
  decode = bench.learner.decode_params()
  jax.block_until_ready(decode)
  for side in bench.sides.values():
    side.sched.engine.set_policy(decode, bench.version + 1)


def _side_step(bench: Bench, side: Side) -> dict[str, Any]:
  """One RL step of one side: each phase's seconds, and the work done (for the floors)."""
  clock0 = dict(side.clock.seconds)
  marks = [time.perf_counter()]
  result = side.sched.step(side.step)
  marks.append(time.perf_counter())
  batch = _batch(bench, result)
  marks.append(time.perf_counter())
  learners = learn_lib.Learners(bench.learner)
  state, _ = learn_lib.learn(learners.state(), batch, learners)  # its metrics: read on the host
  learners.put(state)
  jax.block_until_ready(bench.learner.params)
  marks.append(time.perf_counter())
  _cast(bench)
  marks.append(time.perf_counter())
  path = _save(bench)
  marks.append(time.perf_counter())
  checkpoint_bytes = floors.folder_bytes(path)
  shutil.rmtree(path, ignore_errors=True)
  side.step, bench.version = side.step + 1, bench.version + 1
  seconds = dict(zip(("rollout", "batch", "learner", "cast", "checkpoint"), np.diff(marks)))
  clocked = {k: v - clock0[k] for k, v in side.clock.seconds.items()}
  seconds["decode"] = clocked["step"]
  seconds["prefill"] = clocked["start_fresh"] + clocked["continue_partials"]
  seconds["rollout_other"] = seconds["rollout"] - seconds["decode"] - seconds["prefill"]
  seconds["step"] = marks[-1] - marks[0]
  return {"seconds": seconds, **_work(bench, side, result, batch, checkpoint_bytes)}


def _work(bench: Bench, side: Side, result, batch, checkpoint_bytes: int) -> dict[str, Any]:
  """What one side's step had to do: bytes, FLOPs and token counts."""
  kv_positions, prefilled = side.counts.take()
  mask = batch.mask
  t = bench.learner.train
  plan = layout_lib.plan(mask, t, bench.learner.min_rows)
  padded = [n for mb in plan for p in mb for n in p.run_lengths()]
  flops = lambda lengths: floors.learner_flops(
      bench.cfg,
      lengths,
      bench.logprob_passes,
      t.ppo_epochs,
      bench.config.model.remat,
      frozen_base=bench.learner.lora is not None,
  )
  layout = layout_lib.layout_stats(mask, t, bench.learner.min_rows)
  return {
      "new_tokens": result.stats["new_tokens"],
      "preemptions": result.stats.get("preemptions", 0),
      "decode_steps": result.stats["decode_steps"],
      "kv_positions": kv_positions,
      "prefill_flops": floors.body_flops(bench.cfg, prefilled) if prefilled else 0.0,
      "batch_bytes": batch.nbytes,
      "learner_flops": flops(padded),
      "learner_real_flops": flops(batch_lib.row_lengths(mask)),
      "padded_tokens": layout["padded_tokens"],
      "real_tokens": layout["real_tokens"],
      "checkpoint_bytes": checkpoint_bytes,
  }


class CompileCounter:
  """XLA compilations (and their seconds) while in the `with` block."""

  def __init__(self):
    self.count, self.seconds = 0, 0.0

  def _listener(self, name, seconds, *_, **__):
    if name == COMPILE_EVENT:
      self.count, self.seconds = self.count + 1, self.seconds + seconds

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listener)


def _timed_steps(bench: Bench, steps: int) -> tuple[dict[str, list[dict]], CompileCounter]:
  records = {name: [] for name in bench.sides}
  with CompileCounter() as compiles:
    for step in range(steps):
      for name, side in bench.sides.items():
        records[name].append(_side_step(bench, side))
      common.progress("step", step + 1, steps)
  return records, compiles


def _floors(bench: Bench, records: list[dict], ceilings: dict[str, float]) -> dict[str, float]:
  """Each phase's floor, seconds a step (the mean over the side's timed steps)."""
  work = lambda key: float(np.mean([r[key] for r in records]))
  engine = bench.sides["april"].sched.engine
  decode_bytes = floors.tree_bytes(engine.params)
  kv_bytes = floors.kv_bytes_per_position(bench.cfg, engine.config.kv_dtype)
  copy, matmul = ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"]
  trained = floors.tree_bytes(bench.learner.params)
  out = {
      "decode": (decode_bytes * work("decode_steps") + kv_bytes * work("kv_positions")) / copy,
      "prefill": work("prefill_flops") / matmul,
      "batch": work("batch_bytes") / ceilings["host_copy_bytes_per_s"],
      "learner": work("learner_flops") / matmul,
      "cast": (trained + floors.tree_bytes(bench.learner.frozen) + decode_bytes) / copy,
      "checkpoint": work("checkpoint_bytes") / ceilings["disk_bytes_per_s"],
  }
  out["rollout"] = out["decode"] + out["prefill"]
  out["step"] = sum(out[k] for k in FLOORED)
  return out


def _summarize(bench: Bench, records: list[dict], ceilings: dict[str, float]) -> dict[str, Any]:
  """One side's phases (seconds a step), floors, MFU and throughput."""
  total = lambda key: float(np.sum([r[key] for r in records]))
  seconds = lambda phase: float(np.sum([r["seconds"][phase] for r in records]))
  phases = {p: seconds(p) / len(records) for p in PHASES}
  matmul = ceilings["matmul_flops_per_s"]
  return {
      "phases": phases,
      "floors": _floors(bench, records, ceilings),
      "mfu": {
          "padded": total("learner_flops") / seconds("learner") / matmul,
          "real": total("learner_real_flops") / seconds("learner") / matmul,
      },
      "padded_per_real": total("padded_tokens") / total("real_tokens"),
      "tokens_per_s": total("new_tokens") / seconds("rollout"),
      "outside_rollout_learner_frac": 1.0
      - (phases["rollout"] + phases["learner"]) / phases["step"],
      "checkpoint_bytes": total("checkpoint_bytes") / len(records),
      "preemptions_per_step": total("preemptions") / len(records),
  }


def run(
    config,
    shape: str = "deepmath",
    steps: int = 3,
    ratio: float = 2.0,
    seed: int = 0,
    report=None,
    directory: str | None = None,
) -> dict:
  """`steps` timed RL steps a side; checkpoints go to `directory` (default: a temporary
  folder, removed at the end)."""
  log = common.stage_logger("step")
  config = _bench_config(config)
  own = directory is None
  directory = tempfile.mkdtemp(prefix="april_step_bench_") if own else directory
  try:
    log("fast attention paths against the portable ones")
    config, paths = _take_checked_paths(config)
    log("packed attention against each sample alone")
    check = packed_check.run(hf_io.model_config(config), config.model.dtype, seed)
    _print_check(check)
    log("measuring this machine's ceilings")
    ceilings = floors.measure_ceilings(directory, config.model.dtype)
    bench = _build(config, shape, ratio, seed, steps, directory, log)
    log("warm-up step (APRIL, untimed)")
    _side_step(bench, bench.sides["april"])
    log(f"{steps} timed steps a side")
    records, compiles = _timed_steps(bench, steps)
    bench.checkpointer.close()
  finally:
    if own:
      shutil.rmtree(directory, ignore_errors=True)
  sides = {name: _summarize(bench, recs, ceilings) for name, recs in records.items()}
  out = _result(bench, sides, ceilings, shape, steps, ratio)
  out.update(compiles_while_timed=compiles.count, compile_s_while_timed=compiles.seconds)
  out["packed_attention"] = check
  out["fast_paths"] = paths.as_dict()
  _print(out)
  if report is not None:
    _report(report, out)
  return out


def _result(bench: Bench, sides: dict, ceilings: dict, shape: str, steps: int, ratio: float):
  april, base = sides["april"], sides["baseline"]
  r = bench.config.rollout
  out = {
      "mode": "step",
      "distribution": shape,
      "steps": steps,
      "N": r.batch_size,
      "n": r.n_samples_per_prompt,
      "N_prime": int(round(ratio * r.batch_size)),
      "num_slots": r.num_slots,
      "max_response_len": r.max_response_len,
      "model_params": bench.cfg.num_params(),
      "compute_dtype": bench.config.model.dtype,
      "remat": bool(bench.config.model.remat),
      "lora": None if bench.learner.lora is None else bench.learner.lora.describe(),
      "ceilings": {
          "copy_gbps": ceilings["copy_bytes_per_s"] / 1e9,
          "matmul_tflops": ceilings["matmul_flops_per_s"] / 1e12,
          "disk_mb_per_s": ceilings["disk_bytes_per_s"] / 1e6,
          "host_copy_gbps": ceilings["host_copy_bytes_per_s"] / 1e9,
      },
      "step_speedup": base["phases"]["step"] / april["phases"]["step"],
      "rollout_speedup": april["tokens_per_s"] / base["tokens_per_s"],
      "machine": common.machine(),
  }
  for key in ("phases", "floors"):
    out.update({f"{name}_{key}": side[key] for name, side in sides.items()})
  for key in ("mfu", "padded_per_real", "tokens_per_s", "outside_rollout_learner_frac"):
    out[key if key != "mfu" else "learner_mfu"] = {name: s[key] for name, s in sides.items()}
  for key in ("checkpoint_bytes", "preemptions_per_step"):
    out[key] = {name: s[key] for name, s in sides.items()}
  return out


_LABELS = {
    "rollout": "rollout",
    "decode": "  decode",
    "prefill": "  prefill",
    "rollout_other": "  the rest",
    "batch": "batch",
    "learner": "learner",
    "cast": "cast",
    "checkpoint": "checkpoint",
    "step": "step",
}


def _rows(out: dict) -> list[list]:
  """Per phase: label, then for each side its seconds a step, floor and floor / seconds
  (None where a phase has no floor)."""
  rows = []
  for phase in PHASES:
    row = [_LABELS[phase]]
    for name in ("april", "baseline"):
      seconds = out[f"{name}_phases"][phase]
      floor = out[f"{name}_floors"].get(phase)
      row += [seconds, floor, None if floor is None else floor / seconds]
    rows.append(row)
  return rows


def _print_check(check: dict) -> None:
  verdict = "agrees" if check["ok"] else "DISAGREES: the learner's packed rows are wrong here"
  print(
      f"packed attention ({check['implementation']}) against each sample alone: max "
      f"|difference| / max |value| {check['max_rel_diff']:.1e} (tolerance "
      f"{check['tolerance']:.0e}), {verdict}",
      flush=True,
  )


def _print(out: dict) -> None:
  fmt = lambda v, spec: "-" if v is None else format(v, spec)
  print(f"{'':<12}{' APRIL ':-^29} {' baseline ':-^29}")
  print(f"{'phase':<12}" + f"{'s/step':>10}{'floor s':>10}{'of floor':>10}" * 2)
  for row in _rows(out):
    cells = [
        f"{fmt(s, '.4f'):>10}{fmt(f, '.4f'):>10}{fmt(x, '.1%'):>10}"
        for s, f, x in (row[1:4], row[4:7])
    ]
    print(f"{row[0]:<12}" + "".join(cells))
  c, mfu = out["ceilings"], out["learner_mfu"]
  print(
      f"ceilings measured: copy {c['copy_gbps']:,.1f} GB/s, matmul {c['matmul_tflops']:,.3f} "
      f"TFLOP/s ({out['compute_dtype']}), disk {c['disk_mb_per_s']:,.0f} MB/s (fsync), host "
      f"copy {c['host_copy_gbps']:,.1f} GB/s"
  )
  for name, label in (("april", "APRIL"), ("baseline", "baseline")):
    print(
        f"{label}: learner MFU (of the measured matmul rate) {mfu[name]['padded']:.1%} over "
        f"the positions computed, {mfu[name]['real']:.1%} over real tokens; padded/real "
        f"{out['padded_per_real'][name]:.2f}; outside rollout and learner "
        f"{out['outside_rollout_learner_frac'][name]:.1%} of the step; checkpoint "
        f"{out['checkpoint_bytes'][name] / 1e6:,.1f} MB; preemptions a step "
        f"{out['preemptions_per_step'][name]:.1f}"
    )
  print(
      f"APRIL over the baseline: step time {out['step_speedup']:.2f}x, rollout tokens/s "
      f"{out['rollout_speedup']:.2f}x ({out['tokens_per_s']['april']:,.0f} vs "
      f"{out['tokens_per_s']['baseline']:,.0f})  [{out['distribution']}, N={out['N']}, "
      f"n={out['n']}, N'={out['N_prime']}, slots={out['num_slots']}, "
      f"max_len={out['max_response_len']}, steps a side {out['steps']}]; compilations "
      f"while timed: {out['compiles_while_timed']}"
  )


def _report(report, out: dict) -> None:
  headers = ["phase"] + [
      f"{side} {col}" for side in ("APRIL", "baseline") for col in ("s/step", "floor s", "of floor")
  ]
  cell = lambda v: "-" if v is None else v if isinstance(v, str) else f"{v:.4g}"
  rows = [
      [("rollout: " + row[0].strip()) if row[0].startswith(" ") else row[0]]
      + [cell(v) for v in row[1:]]
      for row in _rows(out)
  ]
  report.table("Seconds per RL step, each phase against its floor", headers, rows)
  report.table(
      "Ceilings measured in this run", list(out["ceilings"]), [list(out["ceilings"].values())]
  )
  report.bars(
      "step_seconds",
      "seconds per RL step",
      {"APRIL": out["april_phases"]["step"], "baseline": out["baseline_phases"]["step"]},
  )
