"""Mode `sampler`: april_jax decode vs transformers' generate and vs a plain static-batch
JAX sampler (whole generations, and one decode step in steady state), and
snapshot/restore cost; and a decode step at a long-tailed mix of lengths against a
uniform mix of the same live tokens (tail_step.py).

Same random tiny Qwen3 (saved by april_jax, loaded by transformers), same prompts, same
batch, greedy, every sequence forced to the same number of new tokens. Both sides are
warmed up once (JAX compiles; torch allocates), then timed best-of-N. Also measures what
it costs to park unfinished samples on the host and bring them back: mode `kv` (copy the
KV cache out and in) against mode `recompute` (keep tokens, re-prefill on resume).
"""

from __future__ import annotations

import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from april_jax import sampler
from april_jax.benchmarks import attention_split, common, floors, round_trip, static_sampler, tail_step
from april_jax.settings.qwen3_shapes import QWEN3_SHAPES
from april_jax.models import hf_io, qwen3

# Decode steps per host round trip of the bench's engines. The first engine call of a
# run is not timed, so a run needs more new tokens than this for a steady-state step.
SYNC_EVERY = 32

_SMALL = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    tie_word_embeddings=True,
)

BENCH_MODELS = {
    # The size of the CPU RL default: per-step framework overhead dominates.
    "tiny": qwen3.Qwen3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    ),
    # 4M params (16 MB in float32): reading the weights bounds a decode step on a CPU.
    "small": qwen3.Qwen3Config(**_SMALL),
    # Qwen3-0.6B's widths and vocabulary with 2 layers: the output head and the sampling
    # over 151,936 tokens weigh as in the real model, and it still runs on a CPU.
    "wide": qwen3.Qwen3Config(**dict(QWEN3_SHAPES["qwen3_0_6b"], num_layers=2)),
    # "small" with each feed-forward 16 experts of width 192, 4 a token (its active
    # width): a mixture of experts whose decode reads only the experts its tokens touch.
    "small_moe": qwen3.Qwen3Config(
        **_SMALL, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=192
    ),
    # Real shapes, for accelerators (launch/bench_gpu.sh).
    "qwen3_0_6b": qwen3.Qwen3Config(**QWEN3_SHAPES["qwen3_0_6b"]),
    "qwen3_4b": qwen3.Qwen3Config(**QWEN3_SHAPES["qwen3_4b"]),
    # Qwen3-30B-A3B's widths with 2 of its 48 layers: fits one GPU beside its KV.
    "qwen3_30b_a3b_2l": qwen3.Qwen3Config(**dict(QWEN3_SHAPES["qwen3_30b_a3b"], num_layers=2)),
}


def decode_bound_tokens_per_s(
    cfg: qwen3.Qwen3Config,
    batch: int,
    mean_len: float,
    param_bytes: int,
    kv_bytes: int,
    hbm_gbps: float,
) -> float:
  """Memory-bandwidth bound on decode: every step reads the params once (of a mixture of
  experts, those its tokens touch: floors.decode_params_read) and each live sequence's
  KV (mean_len tokens); tokens/s = batch x bandwidth / bytes per step."""
  kv_read = 2 * cfg.num_layers * batch * mean_len * cfg.num_kv_heads * cfg.head_dim * kv_bytes
  weights = floors.decode_params_read(cfg, batch) * param_bytes
  return batch * hbm_gbps * 1e9 / (weights + kv_read)


def random_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[np.ndarray]:
  """`num` random int32 prompts of `length` tokens in [1, vocab_size)."""
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab_size, length).astype(np.int32) for _ in range(num)]


def _warm_best_of(repeats: int, fn):
  """One untimed warm-up call (compiles, allocates), then `common.best_of`."""
  fn()
  return common.best_of(repeats, fn)


def _equal_frac(outs_a, outs_b) -> float:
  return float(np.mean([np.array_equal(a, b) for a, b in zip(outs_a, outs_b)]))


def _agreeing_prefix_frac(outs_a, outs_b) -> float:
  """The mean share of each pair of outputs before their first different token: in
  bfloat16 two correct samplers part ways at a near tie, so how early matters."""
  shares = []
  for a, b in zip(outs_a, outs_b):
    a, b = np.asarray(a), np.asarray(b)
    k = min(len(a), len(b))
    differ = np.flatnonzero(a[:k] != b[:k])
    shares.append((differ[0] if differ.size else k) / max(len(a), len(b), 1))
  return float(np.mean(shares))


def _transformers_side(cfg, params, prompts, new_tokens, repeats):
  """(best seconds, new tokens) of transformers' greedy generate on the saved params."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory() as model_dir:
    hf_io.save_pretrained(model_dir, cfg, params)
    model = transformers.Qwen3ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, use_safetensors=True
    )
    model.train(False)  # inference mode (no dropout)
    batch = torch.as_tensor(np.stack(prompts))

    def run():
      with torch.no_grad():
        return model.generate(
            batch,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )[:, batch.shape[1] :].numpy()

    return _warm_best_of(repeats, run)


def resume_costs(cfg, params, prompts, new_tokens, sync_every, kv_dtype="float32"):
  """Seconds per held token to snapshot + restore unfinished samples, kv vs recompute."""
  out = {}
  for mode in ("kv", "recompute"):
    engine = common.greedy_engine(cfg, params, prompts, new_tokens, sync_every, kv_dtype)
    keys = sampler.sample_keys(0, len(prompts))
    timings = []
    for trial in range(3):  # trial 0 warms up (compiles) the snapshot/restore path
      common.add_greedy_groups(engine, prompts, keys, new_tokens)
      for _ in range(new_tokens // (2 * sync_every)):
        engine.step()  # about half the budget
      jax.block_until_ready(engine.state)
      start = time.perf_counter()
      partials = engine.snapshot(with_kv=(mode == "kv"))
      held_tokens = sum(r.length for r in partials)
      host_bytes = sum(r.host_bytes() for r in partials)
      for r in partials:
        engine.admit([r], mode=mode)
      jax.block_until_ready(engine.state)
      if trial:
        timings.append(time.perf_counter() - start)
      engine.snapshot(with_kv=False)  # clear the slots for the next trial
    best = min(timings)
    out[mode] = {
        "seconds": best,
        "us_per_token": 1e6 * best / held_tokens,
        "held_tokens": held_tokens,
        "host_bytes": host_bytes,
    }
  return out


def decode_step_seconds(
    cfg,
    params,
    prompts,
    new_tokens: int,
    sync_every: int,
    kv_dtype: str,
    repeats: int,
    decode_attention: str = "auto",
) -> tuple[float, float]:
  """Seconds per decode step in steady state, (slot engine, static sampler): every slot
  live and running to the same length, admission and prefill left out. The engine's
  steps after its first host round trip are timed; the static sampler's per-step time is
  (time for new_tokens - time for 1) / (new_tokens - 1). The two sides alternate, trial
  by trial, so a slow spell of the machine hits both; best of `repeats` each."""
  # Slots as long as the static sampler's cache: both read the same window.
  engine = common.greedy_engine(
      cfg, params, prompts, new_tokens, sync_every, kv_dtype, decode_attention
  )
  keys = sampler.sample_keys(0, len(prompts))
  stacked = jnp.asarray(np.stack(prompts))

  def engine_step():
    common.add_greedy_groups(engine, prompts, keys, new_tokens)
    engine.step()
    jax.block_until_ready(engine.state)
    steps, start = engine.counters.decode_steps, time.perf_counter()
    while engine.num_live:
      engine.step()
    jax.block_until_ready(engine.state)
    return (time.perf_counter() - start) / max(engine.counters.decode_steps - steps, 1)

  def static_run(n):
    start = time.perf_counter()
    np.asarray(static_sampler.greedy(cfg, params, stacked, n))
    return time.perf_counter() - start

  engine_step(), static_run(1), static_run(new_tokens)  # compile
  best = {"engine": float("inf"), 1: float("inf"), new_tokens: float("inf")}
  for _ in range(max(repeats, 3)):
    best["engine"] = min(best["engine"], engine_step())
    for n in (1, new_tokens):
      best[n] = min(best[n], static_run(n))
  return best["engine"], (best[new_tokens] - best[1]) / max(new_tokens - 1, 1)


def _time_whole_generations(
    cfg, params, prompts, new_tokens, repeats, sync_every, kv_dtype, decode_attention="auto"
):
  """(best seconds, outputs) of whole greedy generations, (slot engine, static sampler)."""
  ours = lambda: sampler.generate(
      cfg,
      params,
      prompts,
      max_new_tokens=new_tokens,
      num_slots=len(prompts),
      sync_every=sync_every,
      kv_dtype=kv_dtype,
      decode_attention=decode_attention,
  )
  stacked = jnp.asarray(np.stack(prompts))
  static = lambda: np.asarray(static_sampler.greedy(cfg, params, stacked, new_tokens))
  return _warm_best_of(repeats, ours), _warm_best_of(repeats, static)


def _attention_split(cfg, batch, prompt_len, new_tokens, repeats, seed, kv_dtype, log) -> dict:
  """attention_split.run at the engine's default pages and decode block, every slot at the
  mean cached length over the timed steps."""
  engine_config = sampler.EngineConfig(num_slots=batch, max_len=prompt_len + new_tokens)
  log("one layer's attention, paged and dense")
  return attention_split.run(
      cfg,
      batch,
      prompt_len + new_tokens // 2,  # the mean cached length over the timed steps
      engine_config.page_size,
      engine_config.decode_block,
      repeats,
      seed=seed,
      dtype=kv_dtype,
  )


def _engine_vs_static(cfg, tokens, ours, static, step_s, static_step_s, split) -> dict:
  """The engine against the static sampler: whole generations ((seconds, outputs) of
  each), steady decode steps (seconds), their outputs' agreement; and the attention split."""
  (ours_s, ours_out), (static_s, static_out) = ours, static
  return {
      "model_params": cfg.num_params(),
      "april_jax_tokens_per_s": tokens / ours_s,
      "static_tokens_per_s": tokens / static_s,
      "slots_vs_static": static_s / ours_s,
      "decode_step_ms": 1e3 * step_s,
      "static_decode_step_ms": 1e3 * static_step_s,
      "step_slots_vs_static": static_step_s / step_s,
      "static_outputs_equal_frac": _equal_frac(ours_out, static_out),
      "static_outputs_agreeing_prefix_frac": _agreeing_prefix_frac(ours_out, static_out),
      "attention_paged_us": split["paged_us"],
      "attention_dense_us": split["dense_us"],
      "attention_gather_us": split["gather_us"],
      "attention_max_abs_diff": split["max_abs_diff"],
  }


def _transformers_numbers(
    cfg, params, prompts, new_tokens, repeats, tokens, ours_s, ours_out, log
) -> dict:
  """transformers' generate against the engine: its tokens/s, the engine's speedup over
  it, and the fraction of their greedy outputs that are equal."""
  log("transformers' generate")
  hf_s, hf_out = _transformers_side(cfg, params, prompts, new_tokens, repeats)
  return dict(
      transformers_tokens_per_s=tokens / hf_s,
      speedup_vs_transformers=hf_s / ours_s,
      greedy_outputs_equal_frac=_equal_frac(ours_out, hf_out),
  )


def _bandwidth_bound_numbers(
    cfg, batch, prompt_len, new_tokens, dtype, kv_dtype, hbm_gbps, tokens_per_s
) -> dict:
  """The memory-bandwidth bound on decode tokens/s at hbm_gbps, and the share of it that
  tokens_per_s reaches."""
  nbytes, kv_nbytes = jnp.dtype(dtype).itemsize, jnp.dtype(kv_dtype).itemsize
  mean_len = prompt_len + new_tokens / 2
  bound = decode_bound_tokens_per_s(cfg, batch, mean_len, nbytes, kv_nbytes, hbm_gbps)
  return dict(bandwidth_bound_tokens_per_s=bound, bandwidth_utilisation=tokens_per_s / bound)


def _copy_bandwidth_numbers(
    cfg, batch, prompt_len, new_tokens, dtype, kv_dtype, copy_gbps, step_s
) -> dict:
  """The bytes one steady-state decode step reads and their rate over step_s as a share
  of copy_gbps."""
  # Bytes one steady-state step reads (the weights once, each slot's live KV at the
  # mean length) over its time, against the copy bandwidth measured in this run.
  nbytes, kv_nbytes = jnp.dtype(dtype).itemsize, jnp.dtype(kv_dtype).itemsize
  mean_len = prompt_len + new_tokens / 2
  kv = 2 * cfg.num_layers * batch * mean_len * cfg.num_kv_heads * cfg.head_dim * kv_nbytes
  step_bytes = floors.decode_params_read(cfg, batch) * nbytes + kv
  return dict(
      step_bytes=step_bytes,
      copy_gbps=copy_gbps,
      copy_bandwidth_frac=step_bytes / step_s / (copy_gbps * 1e9),
  )


def _host_costs(cfg, params, prompts, new_tokens, sync_every, kv_dtype, log) -> dict:
  """The engine's host round trip (host_*) and what parking and resuming unfinished
  samples costs, kv against recompute (resume_*)."""
  out = {}
  log("host round trip")
  trip = round_trip.run(cfg, params, prompts, sync_every, kv_dtype)
  out.update({f"host_{k}": v for k, v in trip.items()})
  log("resume costs, kv and recompute")
  resume = resume_costs(cfg, params, prompts, new_tokens, sync_every, kv_dtype)
  for k in ("us_per_token", "host_bytes"):
    out.update({f"resume_{mode}_{k}": resume[mode][k] for mode in ("kv", "recompute")})
  return out


def run_one(
    cfg: qwen3.Qwen3Config,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    sync_every: int,
    seed: int,
    hf: bool = True,
    dtype: str = "float32",
    hbm_gbps: float = 0.0,
    copy_gbps: float = 0.0,
    log=lambda label: None,
    decode_attention: str = "auto",
) -> dict:
  """One model's numbers for the decode table (keys as in _COLUMNS, and more)."""
  log("random params")
  params = qwen3.init_params(cfg, jax.random.key(seed), std=0.1, dtype=jnp.dtype(dtype))
  prompts = random_prompts(cfg.vocab_size, batch, prompt_len, seed)
  kv_dtype = "bfloat16" if dtype == "bfloat16" else "float32"
  log("whole generations, engine and static sampler")
  (ours_s, ours_out), (static_s, static_out) = _time_whole_generations(
      cfg, params, prompts, new_tokens, repeats, sync_every, kv_dtype, decode_attention
  )
  tokens = batch * new_tokens
  log(
      f"whole generations: {tokens / ours_s:,.0f} tokens/s, static {tokens / static_s:,.0f}; "
      f"greedy outputs equal the static sampler's: {_equal_frac(ours_out, static_out):.0%}, "
      f"agree for {_agreeing_prefix_frac(ours_out, static_out):.0%} of their tokens"
  )
  log("steady decode steps")
  step_s, static_step_s = decode_step_seconds(
      cfg, params, prompts, new_tokens, sync_every, kv_dtype, repeats, decode_attention
  )
  log(f"steady decode step: {1e3 * step_s:.3f} ms, static {1e3 * static_step_s:.3f} ms")
  split = _attention_split(cfg, batch, prompt_len, new_tokens, repeats, seed, kv_dtype, log)
  out = _engine_vs_static(
      cfg, tokens, (ours_s, ours_out), (static_s, static_out), step_s, static_step_s, split
  )
  if hf:
    out.update(
        _transformers_numbers(
            cfg, params, prompts, new_tokens, repeats, tokens, ours_s, ours_out, log
        )
    )
  sizes = (cfg, batch, prompt_len, new_tokens, dtype, kv_dtype)
  if hbm_gbps > 0:
    out.update(_bandwidth_bound_numbers(*sizes, hbm_gbps, out["april_jax_tokens_per_s"]))
  if copy_gbps > 0:
    out.update(_copy_bandwidth_numbers(*sizes, copy_gbps, step_s))
  log(f"one layer's attention: paged {split['paged_us']:.1f} us, dense {split['dense_us']:.1f}")
  out.update(_host_costs(cfg, params, prompts, new_tokens, sync_every, kv_dtype, log))
  log("done")
  return out


# (report header, run_one key) of each column of the decode table after the model's name.
_COLUMNS = (
    ("params", "model_params"),
    ("april_jax tokens/s", "april_jax_tokens_per_s"),
    ("static tokens/s", "static_tokens_per_s"),
    ("ratio", "slots_vs_static"),
    ("decode step ms", "decode_step_ms"),
    ("static decode step ms", "static_decode_step_ms"),
    ("step ratio", "step_slots_vs_static"),
    ("transformers tokens/s", "transformers_tokens_per_s"),
    ("ratio", "speedup_vs_transformers"),
    ("greedy outputs equal", "greedy_outputs_equal_frac"),
    ("attention us/layer, paged", "attention_paged_us"),
    ("its gathers us", "attention_gather_us"),
    ("attention us/layer, dense", "attention_dense_us"),
    ("host round trip us", "host_round_trip_us"),
    ("kv us/token", "resume_kv_us_per_token"),
    ("recompute us/token", "resume_recompute_us_per_token"),
)


def _print_row(name: str, r: dict) -> None:
  """One model's table row, and its roofline when it has one."""
  print(
      f"{name:>6} {r['model_params']:>10,} {r['april_jax_tokens_per_s']:>16.1f} "
      f"{r['static_tokens_per_s']:>13.1f} {r['slots_vs_static']:>5.2f}x "
      f"{r['decode_step_ms']:>8.3f} {r['static_decode_step_ms']:>15.3f} "
      f"{r['step_slots_vs_static']:>5.2f}x "
      f"{r['transformers_tokens_per_s']:>19.1f} {r['speedup_vs_transformers']:>5.2f}x "
      f"{r['greedy_outputs_equal_frac']:>6.0%} {r['resume_kv_us_per_token']:>10.2f} "
      f"{r['resume_recompute_us_per_token']:>17.2f}",
      flush=True,
  )
  print(
      f"{'':>6} one layer's decode attention: paged {r['attention_paged_us']:.1f} us (its "
      f"page gathers alone {r['attention_gather_us']:.1f}), dense {r['attention_dense_us']:.1f}"
      f" us: {r['attention_dense_us'] / r['attention_paged_us']:.2f}x",
      flush=True,
  )
  print(
      f"{'':>6} host round trip: {r['host_round_trip_us']:.0f} us a call (a decode step "
      f"{r['host_step_us_one_per_call']:.0f} us at one step a call, "
      f"{r['host_step_us']:.0f} us at {r['host_sync_every']} a call)",
      flush=True,
  )
  if "copy_bandwidth_frac" in r:
    print(
        f"{'':>6} decode step reads {r['step_bytes'] / 1e9:.3f} GB: "
        f"{r['copy_bandwidth_frac']:.0%} of the measured copy bandwidth "
        f"({r['copy_gbps']:,.0f} GB/s)",
        flush=True,
    )
  if "bandwidth_bound_tokens_per_s" in r:
    print(
        f"{'':>6} memory-bandwidth bound {r['bandwidth_bound_tokens_per_s']:,.0f} tokens/s"
        f" -> {r['bandwidth_utilisation']:.0%} of it",
        flush=True,
    )


def _report(report, result: dict, models) -> None:
  """The decode table, and a tokens/s bar chart per model."""
  report.table(
      "Decode, april_jax vs a static-batch JAX sampler and transformers",
      ["model"] + [header for header, _ in _COLUMNS],
      [[name] + [result[f"{name}_{k}"] for _, k in _COLUMNS] for name in models],
  )
  for name in models:
    report.bars(
        f"decode_{name}",
        "tokens/s",
        {
            "april_jax": result[f"{name}_april_jax_tokens_per_s"],
            "static JAX": result[f"{name}_static_tokens_per_s"],
            "transformers": result[f"{name}_transformers_tokens_per_s"],
        },
    )


def _check_timeable(new_tokens: int, sync_every: int) -> None:
  """Refuses a run whose engine would finish in its first (untimed) call."""
  if new_tokens <= sync_every:
    raise ValueError(
        f"new_tokens ({new_tokens}) must exceed sync_every ({sync_every}): the engine's "
        "first call is not timed, so nothing would be left to time a decode step by"
    )


def _print_header() -> None:
  """The decode table's header line."""
  print(
      f"{'model':>6} {'params':>10} {'april_jax tok/s':>16} {'static tok/s':>13} "
      f"{'ratio':>6} {'step ms':>8} {'static step ms':>15} {'ratio':>6} "
      f"{'transformers tok/s':>19} {'ratio':>6} {'equal':>6} {'kv us/tok':>10} "
      f"{'recompute us/tok':>17}",
      flush=True,
  )


def _fill_transformers_columns(r: dict) -> None:
  """NaN in the transformers columns of a row run without transformers."""
  r.setdefault("transformers_tokens_per_s", float("nan"))
  r.setdefault("speedup_vs_transformers", float("nan"))
  r.setdefault("greedy_outputs_equal_frac", float("nan"))


def _long_tail_step(tail_model: str, tail_rounds: int, seed: int, decode_attention: str) -> dict:
  """tail_step.run on BENCH_MODELS[tail_model]: a decode step at a long-tailed mix of
  lengths against a uniform mix of the same live tokens; prints its line."""
  common.stage_logger(tail_model)("decode steps, long-tailed mix vs uniform")
  tail = tail_step.run(
      BENCH_MODELS[tail_model], repeats=tail_rounds, seed=seed, decode_attention=decode_attention
  )
  print(
      f"{tail_model}: decode step, long-tailed mix ({tail['tail_prompt_lens']}) "
      f"{tail['tail_step_ms']:.2f} ms vs uniform ({tail['uniform_prompt_lens']}) "
      f"{tail['uniform_step_ms']:.2f} ms: {tail['tail_over_uniform']:.2f}x (median of "
      f"{tail['rounds']} rounds, {tail['tail_over_uniform_min']:.2f}-"
      f"{tail['tail_over_uniform_max']:.2f}x)",
      flush=True,
  )
  return tail


def run(
    models=("tiny", "small"),
    batch: int = 16,
    prompt_len: int = 32,
    new_tokens: int = 128,
    repeats: int = 3,
    sync_every: int = SYNC_EVERY,
    seed: int = 0,
    report=None,
    hf: bool = True,
    dtype: str = "float32",
    hbm_gbps: float = 0.0,
    tail_model: str | None = None,
    copy_gbps: float = 0.0,
    tail_rounds: int = 5,
    decode_attention: str = "auto",
) -> dict:
  """The decode table and the long-tail step (the engine's decode step reading the pool by
  `decode_attention`; its host round trip and resume costs by the engine's default,
  auto); copy_gbps > 0 also gives each model's bytes per decode step over its time as a
  fraction of that (measured) copy bandwidth."""
  _check_timeable(new_tokens, sync_every)
  result = {
      "mode": "sampler",
      "batch": batch,
      "prompt_len": prompt_len,
      "new_tokens": new_tokens,
      "decode_attention": decode_attention,
      "machine": common.machine(),
  }
  _print_header()
  for name in models:
    r = run_one(
        BENCH_MODELS[name],
        batch,
        prompt_len,
        new_tokens,
        repeats,
        sync_every,
        seed,
        hf=hf,
        dtype=dtype,
        hbm_gbps=hbm_gbps,
        copy_gbps=copy_gbps,
        log=common.stage_logger(name),
        decode_attention=decode_attention,
    )
    _fill_transformers_columns(r)
    result.update({f"{name}_{k}": v for k, v in r.items()})
    _print_row(name, r)
  if tail_model:
    tail = _long_tail_step(tail_model, tail_rounds, seed, decode_attention)
    result.update({f"{tail_model}_{k}": v for k, v in tail.items()})
  if report is not None:
    _report(report, result, models)
  return result
