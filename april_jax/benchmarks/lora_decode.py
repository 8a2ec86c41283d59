"""Mode `lora_decode`: how the sampler should decode a LoRA policy, merged or unmerged.

A LoRA run trains adapters over a frozen base (models/lora.py). Its sampler decodes
merged params: once per update the adapters are merged into a decode copy of the base
(rl/update.py's decode_params), a second weight-sized array on the device. The other
way applies the adapters unmerged in every decode step (qwen3.decode_step(adapters=)):
no decode copy, but two skinny products per adapted projection and layer, every step.
Both sides, in one run:

  compiled  the decode step at a real shape (default Qwen3-8B, 64 rows, rank 32 on every
            projection) on one device, compiled and not run: XLA's FLOPs and bytes
            accessed (cost analysis), its arguments and temporaries (memory analysis;
            16-bit programs compiled as a GPU runs them, compile_check.GPU_LIKE), and
            what each side holds beyond the frozen base and the adapters that the
            learner holds anyway: merged, the decode copy. The rows attend to a short
            dense cache (256 positions), the same on both sides: XLA's cost model counts
            each row's in-place cache write as a pass over the whole cache, so the
            totals grow with the cache while the difference between the sides does not.
  timed     one decode step of a small model (the 0.6B's layer widths, 4 layers, a
            vocabulary of 8,192, float32; 64 rows at 64 cached positions, so the weights
            dominate) on this machine, each way, the median of `repeats` after a
            warm-up; and the largest difference of their logits.

  python -m april_jax.bench --mode=lora_decode --repeats=9
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from april_jax.planning import compile_check
from april_jax.benchmarks import common
from april_jax.settings.qwen3_shapes import QWEN3_SHAPES
from april_jax.models import lora, qwen3

# The timed model: Qwen3-0.6B's layer widths, 4 layers, an 8,192-token vocabulary.
SMALL = dict(QWEN3_SHAPES["qwen3_0_6b"], num_layers=4, vocab_size=8192)
RANK, ALPHA = 32, 32.0  # configs/qwen3_8b.py:lora's


def _step_fns(cfg: qwen3.Qwen3Config, spec: lora.LoraSpec):
  """The two decode steps, jitted, each donating its cache: merged(params, tokens,
  positions, cache) and unmerged(base, adapters, tokens, positions, cache)."""

  def merged(params, tokens, positions, cache):
    return qwen3.decode_step(cfg, params, tokens, positions, cache)

  def unmerged(base, adapters, tokens, positions, cache):
    return qwen3.decode_step(
        cfg, base, tokens, positions, cache, adapters=adapters, adapter_scale=spec.scale
    )

  return jax.jit(merged, donate_argnums=3), jax.jit(unmerged, donate_argnums=4)


def _cache_shape(cfg: qwen3.Qwen3Config, rows: int, context: int, dtype) -> qwen3.KVCache:
  shape = (cfg.num_layers, rows, cfg.num_kv_heads, context, cfg.head_dim)
  return qwen3.KVCache(*(jax.ShapeDtypeStruct(shape, dtype) for _ in range(2)))


def _compile(fn, *args):
  return fn.lower(*args).compile(compile_check.GPU_LIKE)


def _cost(compiled) -> tuple[float, float]:
  """XLA's (FLOPs, bytes accessed) of a compiled program."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def _abstract_model(cfg: qwen3.Qwen3Config, spec: lora.LoraSpec, dtype):
  base = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.key(0), dtype))
  return base, jax.eval_shape(lambda: lora.init(cfg, spec, jax.random.key(0)))


def _one_layer_costs(cfg, spec, rows: int, context: int, dtype) -> dict:
  """(FLOPs, bytes) of each side's step at one layer, and of its embedding and head
  alone. XLA's cost analysis counts a loop's body once, so a step's cost is built from
  these: head + layers x (one layer's step - head)."""
  one = dataclasses.replace(cfg, num_layers=1)
  base, adapters = _abstract_model(one, spec, dtype)
  ints = jax.ShapeDtypeStruct((rows,), jnp.int32)
  cache = _cache_shape(one, rows, context, dtype)
  merged, unmerged = _step_fns(one, spec)

  def head(params, tokens):
    x = params["embed"][tokens][:, None, :]
    return qwen3.logits_from_hidden(
        one, params, qwen3.rms_norm(x, params["final_norm"], one.rms_norm_eps)
    )

  return {
      "merged": _cost(_compile(merged, base, ints, ints, cache)),
      "unmerged": _cost(_compile(unmerged, base, adapters, ints, ints, cache)),
      "head": _cost(_compile(jax.jit(head), base, ints)),
  }


def compiled_sides(shape: str, rows: int, rank: int, context: int, dtype="bfloat16") -> dict:
  """Both decode steps at QWEN3_SHAPES[shape], `rows` rows attending to `context` cached
  positions, adapters of `rank` on every projection: compiled, never run. Per side: a
  step's FLOPs and bytes accessed, its arguments and temporaries, and the bytes it needs
  held beyond the base and the adapters."""
  cfg = qwen3.Qwen3Config(**QWEN3_SHAPES[shape])
  spec, dt = lora.LoraSpec(rank, ALPHA, lora.TARGETS), jnp.dtype(dtype)
  base, adapters = _abstract_model(cfg, spec, dt)
  ints = jax.ShapeDtypeStruct((rows,), jnp.int32)
  cache = _cache_shape(cfg, rows, context, dt)
  merged, unmerged = _step_fns(cfg, spec)
  compiled = {
      "merged": _compile(merged, base, ints, ints, cache),
      "unmerged": _compile(unmerged, base, adapters, ints, ints, cache),
  }
  one = _one_layer_costs(cfg, spec, rows, context, dt)
  size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  out = dict(shape=shape, rows=rows, rank=rank, context=context, dtype=dtype)
  out.update(weight_bytes=size(base), adapter_bytes=size(adapters))
  for side, program in compiled.items():
    memory = program.memory_analysis()
    step = [h + cfg.num_layers * (o - h) for o, h in zip(one[side], one["head"])]
    out[side] = {
        "flops": step[0],
        "bytes_accessed": step[1],
        "layer_flops": one[side][0] - one["head"][0],
        "layer_bytes_accessed": one[side][1] - one["head"][1],
        "argument_bytes": int(memory.argument_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "resident_extra_bytes": size(base) if side == "merged" else 0,  # the decode copy
    }
  return out


def small_model(seed: int = 0, rank: int = RANK, shape: dict | None = None):
  """The timed model's config (`shape`, default SMALL), float32 base, adapters (B drawn
  too, so that they change the logits) and spec."""
  cfg = qwen3.Qwen3Config(**(shape or SMALL))
  spec = lora.LoraSpec(rank, ALPHA, lora.TARGETS)
  k_base, k_a, k_b = jax.random.split(jax.random.key(seed), 3)
  base = qwen3.init_params(cfg, k_base, jnp.float32)
  adapters = lora.init(cfg, spec, k_a)
  keys = iter(jax.random.split(k_b, len(spec.targets)))
  for ab in adapters["layers"].values():
    ab["b"] = 0.02 * jax.random.normal(next(keys), ab["b"].shape, jnp.float32)
  return cfg, base, adapters, spec


def _time_both(sides: dict, repeats: int) -> tuple[dict, dict]:
  """sides: name -> (step, args, cache). Seconds of each of `repeats` calls of
  step(*args, cache) per side, the sides taking turns (so a slower spell of a shared
  machine falls on both), after a warm-up call each (the cache carried through, donated);
  and each side's warm-up logits."""
  caches, seconds, first = {}, {name: [] for name in sides}, {}
  for name, (step, args, cache) in sides.items():
    first[name], caches[name] = step(*args, cache)
    jax.block_until_ready(first[name])
  for _ in range(repeats):
    for name, (step, args, _) in sides.items():
      start = time.perf_counter()
      logits, caches[name] = step(*args, caches[name])
      jax.block_until_ready(logits)
      seconds[name].append(time.perf_counter() - start)
  return seconds, first


def timed_sides(
    rows: int = 64,
    context: int = 64,
    repeats: int = 9,
    seed: int = 0,
    rank: int = RANK,
    shape: dict | None = None,
) -> dict:
  """One decode step of the small model each way on this machine: seconds (median and
  each), and the largest difference of their logits (the same cache, rows at `context`
  // 2 positions)."""
  cfg, base, adapters, spec = small_model(seed, rank, shape)
  merged_params = jax.jit(lambda b, a: lora.merge(b, a, spec))(base, adapters)
  merged, unmerged = _step_fns(cfg, spec)
  stand_in = _cache_shape(cfg, rows, context, jnp.float32)
  k = jax.random.key(seed + 1)
  fill = lambda: qwen3.KVCache(
      *(jax.random.normal(key, s.shape, s.dtype) for key, s in zip(jax.random.split(k), stand_in))
  )
  tokens = jax.random.randint(jax.random.key(seed + 2), (rows,), 0, cfg.vocab_size)
  positions = jnp.full((rows,), context // 2, jnp.int32)
  seconds, logits = _time_both(
      {
          "merged": (merged, (merged_params, tokens, positions), fill()),
          "unmerged": (unmerged, (base, adapters, tokens, positions), fill()),
      },
      repeats,
  )
  merged_s, unmerged_s = seconds["merged"], seconds["unmerged"]
  diff = np.abs(np.asarray(logits["merged"]) - np.asarray(logits["unmerged"]))
  ratios = [u / m for m, u in zip(merged_s, unmerged_s)]
  return {
      "model": dict(shape or SMALL, dtype="float32"),
      "rows": rows,
      "rank": spec.rank,
      "context": context,
      "repeats": repeats,
      "merged_s": statistics.median(merged_s),
      "unmerged_s": statistics.median(unmerged_s),
      "unmerged_per_merged": statistics.median(ratios),  # of the turns' ratios
      "merged_each_s": merged_s,
      "unmerged_each_s": unmerged_s,
      "max_logit_diff": float(diff.max()),
      "max_abs_logit": float(np.abs(np.asarray(logits["merged"])).max()),
  }


def _print(compiled: dict, timed: dict) -> None:
  m, u = compiled["merged"], compiled["unmerged"]
  print(
      f"compiled: {compiled['shape']}, one device, {compiled['rows']} rows, "
      f"{compiled['context']:,} cached positions, rank {compiled['rank']} on every "
      f"projection, {compiled['dtype']} weights"
  )
  print(f"{'':<28}{'merged':>10}{'unmerged':>10}{'difference':>12}")
  for label, key, scale in (
      ("GFLOPs a layer", "layer_flops", 1e9),
      ("GB accessed a layer", "layer_bytes_accessed", 1e9),
      ("GFLOPs a step", "flops", 1e9),
      ("GB accessed a step", "bytes_accessed", 1e9),
      ("arguments (GB)", "argument_bytes", 1e9),
      ("temporaries (GB)", "temp_bytes", 1e9),
      ("resident beyond base (GB)", "resident_extra_bytes", 1e9),
  ):
    print(
        f"{label:<28}{m[key] / scale:10.2f}{u[key] / scale:10.2f}"
        f"{(u[key] - m[key]) / scale:+12.3f}"
    )
  t = timed
  print(
      f"timed: {t['model']['num_layers']} layers of width {t['model']['hidden_size']}, "
      f"{t['rows']} rows, {t['context']} cached positions, float32, on "
      f"{jax.devices()[0].platform}: merged {t['merged_s'] * 1e3:.1f} ms, unmerged "
      f"{t['unmerged_s'] * 1e3:.1f} ms a step (medians of {t['repeats']}, taking turns); "
      f"unmerged / merged x{t['unmerged_per_merged']:.3f} (the median of the turns' ratios)"
  )
  print(
      f"logits differ by at most {t['max_logit_diff']:.2e} (largest |logit| "
      f"{t['max_abs_logit']:.2f})"
  )


def run(
    shape: str = "qwen3_8b",
    rows: int = 64,
    rank: int = RANK,
    context: int = 256,
    repeats: int = 9,
    timed_context: int = 64,
    report=None,
) -> dict:
  """Both sides, printed; the numbers as one dict (bench.py prints it as JSON)."""
  compiled = compiled_sides(shape, rows, rank, context)
  timed = timed_sides(rows, timed_context, repeats, rank=rank)
  _print(compiled, timed)
  if report is not None:
    m, u = compiled["merged"], compiled["unmerged"]
    keys = ("flops", "bytes_accessed", "argument_bytes", "temp_bytes", "resident_extra_bytes")
    report.table(
        "Compiled decode step",
        ["measure", "merged", "unmerged"],
        [(k, float(m[k]), float(u[k])) for k in keys],
    )
    report.table(
        "Timed decode step (s)", ["merged", "unmerged"], [(timed["merged_s"], timed["unmerged_s"])]
    )
  return {"mode": "lora_decode", "compiled": compiled, "timed": timed, "machine": common.machine()}
