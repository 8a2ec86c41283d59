"""Mode `sampler`: april_jax decode vs transformers' generate and vs a plain static-batch
JAX sampler (whole generations, and one decode step in steady state), and
snapshot/restore cost.

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
from april_jax.benchmarks import common, static_sampler
from april_jax.models import hf_io, qwen3

BENCH_MODELS = {
    # The size of the CPU RL default: per-step framework overhead dominates.
    "tiny": qwen3.Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=384,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                              tie_word_embeddings=True),
    # 4M params (16 MB in float32): reading the weights bounds a decode step on a CPU.
    "small": qwen3.Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768,
                               num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                               tie_word_embeddings=True),
    # Qwen3-0.6B's widths and vocabulary with 2 layers: the output head and the sampling
    # over 151,936 tokens weigh as in the real model, and it still runs on a CPU.
    "wide": qwen3.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_layers=2, num_heads=16, num_kv_heads=8, head_dim=128,
                              tie_word_embeddings=True),
    # Real shapes, for accelerators (launch/bench_gpu.sh).
    "qwen3_0_6b": qwen3.Qwen3Config(vocab_size=151936, hidden_size=1024,
                                    intermediate_size=3072, num_layers=28, num_heads=16,
                                    num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3_4b": qwen3.Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                                  num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                                  tie_word_embeddings=True),
}


def decode_bound_tokens_per_s(cfg: qwen3.Qwen3Config, batch: int, mean_len: float,
                              param_bytes: int, kv_bytes: int, hbm_gbps: float) -> float:
  """Memory-bandwidth bound on decode: every step reads all params once and each live
  sequence's KV (mean_len tokens); tokens/s = batch x bandwidth / bytes per step."""
  kv_read = 2 * cfg.num_layers * batch * mean_len * cfg.num_kv_heads * cfg.head_dim * kv_bytes
  return batch * hbm_gbps * 1e9 / (cfg.num_params() * param_bytes + kv_read)


def _transformers_side(model_dir, prompts, new_tokens, repeats):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  model = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                         use_safetensors=True)
  model.train(False)  # inference mode (no dropout)
  batch = torch.as_tensor(np.stack(prompts))
  def run():
    with torch.no_grad():
      return model.generate(batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=0)[:, batch.shape[1]:].numpy()
  run()  # warm-up
  return common.best_of(repeats, run)


def resume_costs(cfg, params, prompts, new_tokens, sync_every, kv_dtype="float32"):
  """Seconds per held token to snapshot + restore unfinished samples, kv vs recompute."""
  out = {}
  for mode in ("kv", "recompute"):
    config = sampler.EngineConfig(num_slots=len(prompts), max_len=len(prompts[0]) + new_tokens,
                                  sync_every=sync_every, kv_dtype=kv_dtype)
    engine = sampler.SlotEngine(cfg, params, config)
    keys = sampler.sample_keys(0, len(prompts))
    timings = []
    for trial in range(3):  # trial 0 warms up (compiles) the snapshot/restore path
      for i, p in enumerate(prompts):
        engine.add_group([sampler.SampleRecord(prompt=p, max_new_tokens=new_tokens,
                                               rng=keys[i], temperature=0.0)])
      for _ in range(new_tokens // (2 * sync_every)):
        engine.step()  # about half the budget
      jax.block_until_ready(engine.state)
      start = time.perf_counter()
      partials = engine.snapshot(with_kv=(mode == "kv"))
      held_tokens = sum(r.length for r in partials)
      host_bytes = sum(r.host_bytes() for r in partials)
      for r in partials:
        engine.add(r, mode=mode)
      jax.block_until_ready(engine.state)
      if trial:
        timings.append(time.perf_counter() - start)
      engine.snapshot(with_kv=False)  # clear the slots for the next trial
    best = min(timings)
    out[mode] = {"seconds": best, "us_per_token": 1e6 * best / held_tokens,
                 "held_tokens": held_tokens, "host_bytes": host_bytes}
  return out


def decode_step_seconds(cfg, params, prompts, new_tokens: int, sync_every: int,
                        kv_dtype: str, repeats: int) -> tuple[float, float]:
  """Seconds per decode step in steady state, (slot engine, static sampler): every slot
  live and running to the same length, admission and prefill left out. The engine's
  steps after its first host round trip are timed; the static sampler's per-step time is
  (time for new_tokens - time for 1) / (new_tokens - 1). The two sides alternate, trial
  by trial, so a slow spell of the machine hits both; best of `repeats` each."""
  B, P = len(prompts), len(prompts[0])
  # Slots as long as the static sampler's cache: both read the same window.
  config = sampler.EngineConfig(num_slots=B, max_len=P + new_tokens, sync_every=sync_every,
                                kv_dtype=kv_dtype)
  engine = sampler.SlotEngine(cfg, params, config)
  keys = sampler.sample_keys(0, B)
  stacked = jnp.asarray(np.stack(prompts))

  def engine_step():
    for i, p in enumerate(prompts):
      engine.add_group([sampler.SampleRecord(prompt=p, max_new_tokens=new_tokens,
                                             rng=keys[i], temperature=0.0)])
    engine.step()
    jax.block_until_ready(engine.state)
    steps, start = engine.decode_steps, time.perf_counter()
    while engine.num_live:
      engine.step()
    jax.block_until_ready(engine.state)
    return (time.perf_counter() - start) / max(engine.decode_steps - steps, 1)

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


def run_one(cfg: qwen3.Qwen3Config, batch: int, prompt_len: int, new_tokens: int,
            repeats: int, sync_every: int, seed: int, hf: bool = True,
            dtype: str = "float32", hbm_gbps: float = 0.0) -> dict:
  params = qwen3.init_params(cfg, jax.random.key(seed), std=0.1, dtype=jnp.dtype(dtype))
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, cfg.vocab_size, prompt_len).astype(np.int32)
             for _ in range(batch)]

  kv_dtype = "bfloat16" if dtype == "bfloat16" else "float32"

  def ours():
    return sampler.generate(cfg, params, prompts, max_new_tokens=new_tokens, num_slots=batch,
                            sync_every=sync_every, kv_dtype=kv_dtype)
  ours()  # warm-up: compiles
  ours_s, ours_out = common.best_of(repeats, ours)
  stacked = jnp.asarray(np.stack(prompts))
  static = lambda: np.asarray(static_sampler.greedy(cfg, params, stacked, new_tokens))
  static()  # warm-up: compiles
  static_s, static_out = common.best_of(repeats, static)
  tokens = batch * new_tokens
  step_s, static_step_s = decode_step_seconds(cfg, params, prompts, new_tokens, sync_every,
                                              kv_dtype, repeats)
  out = {"model_params": cfg.num_params(), "april_jax_tokens_per_s": tokens / ours_s,
         "static_tokens_per_s": tokens / static_s, "slots_vs_static": static_s / ours_s,
         "decode_step_ms": 1e3 * step_s, "static_decode_step_ms": 1e3 * static_step_s,
         "step_slots_vs_static": static_step_s / step_s,
         "static_outputs_equal_frac": float(np.mean([np.array_equal(a, b) for a, b in
                                                     zip(ours_out, static_out)]))}
  if hf:
    with tempfile.TemporaryDirectory() as model_dir:
      hf_io.save_pretrained(model_dir, cfg, params)
      hf_s, hf_out = _transformers_side(model_dir, prompts, new_tokens, repeats)
    out.update(transformers_tokens_per_s=tokens / hf_s, speedup_vs_transformers=hf_s / ours_s,
               greedy_outputs_equal_frac=float(np.mean([np.array_equal(a, b)
                                                        for a, b in zip(ours_out, hf_out)])))
  if hbm_gbps > 0:
    nbytes = jnp.dtype(dtype).itemsize
    bound = decode_bound_tokens_per_s(cfg, batch, prompt_len + new_tokens / 2, nbytes,
                                      jnp.dtype(kv_dtype).itemsize, hbm_gbps)
    out.update(bandwidth_bound_tokens_per_s=bound,
               bandwidth_utilisation=out["april_jax_tokens_per_s"] / bound)
  resume = resume_costs(cfg, params, prompts, new_tokens, sync_every, kv_dtype)
  out.update(resume_kv_us_per_token=resume["kv"]["us_per_token"],
             resume_recompute_us_per_token=resume["recompute"]["us_per_token"],
             resume_kv_host_bytes=resume["kv"]["host_bytes"],
             resume_recompute_host_bytes=resume["recompute"]["host_bytes"])
  return out


def run(models=("tiny", "small"), batch: int = 16, prompt_len: int = 32,
        new_tokens: int = 128, repeats: int = 3, sync_every: int = 32, seed: int = 0,
        report=None, hf: bool = True, dtype: str = "float32",
        hbm_gbps: float = 0.0) -> dict:
  result = {"mode": "sampler", "batch": batch, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "machine": common.machine()}
  print(f"{'model':>6} {'params':>10} {'april_jax tok/s':>16} {'static tok/s':>13} "
        f"{'ratio':>6} {'step ms':>8} {'static step ms':>15} {'ratio':>6} "
        f"{'transformers tok/s':>19} {'ratio':>6} {'equal':>6} {'kv us/tok':>10} "
        f"{'recompute us/tok':>17}")
  for name in models:
    r = run_one(BENCH_MODELS[name], batch, prompt_len, new_tokens, repeats, sync_every, seed,
                hf=hf, dtype=dtype, hbm_gbps=hbm_gbps)
    r.setdefault("transformers_tokens_per_s", float("nan"))
    r.setdefault("speedup_vs_transformers", float("nan"))
    r.setdefault("greedy_outputs_equal_frac", float("nan"))
    result.update({f"{name}_{k}": v for k, v in r.items()})
    print(f"{name:>6} {r['model_params']:>10,} {r['april_jax_tokens_per_s']:>16.1f} "
          f"{r['static_tokens_per_s']:>13.1f} {r['slots_vs_static']:>5.2f}x "
          f"{r['decode_step_ms']:>8.3f} {r['static_decode_step_ms']:>15.3f} "
          f"{r['step_slots_vs_static']:>5.2f}x "
          f"{r['transformers_tokens_per_s']:>19.1f} {r['speedup_vs_transformers']:>5.2f}x "
          f"{r['greedy_outputs_equal_frac']:>6.0%} {r['resume_kv_us_per_token']:>10.2f} "
          f"{r['resume_recompute_us_per_token']:>17.2f}", flush=True)
    if "bandwidth_bound_tokens_per_s" in r:
      print(f"{'':>6} memory-bandwidth bound {r['bandwidth_bound_tokens_per_s']:,.0f} tokens/s"
            f" -> {r['bandwidth_utilisation']:.0%} of it", flush=True)
  if report is not None:
    report.table("Decode, april_jax vs a static-batch JAX sampler and transformers", [
        "model", "params", "april_jax tokens/s", "static tokens/s", "ratio",
        "decode step ms", "static decode step ms", "step ratio", "transformers tokens/s",
        "ratio", "greedy outputs equal", "kv us/token", "recompute us/token"],
                 [[name] + [result[f"{name}_{k}"] for k in (
                     "model_params", "april_jax_tokens_per_s", "static_tokens_per_s",
                     "slots_vs_static", "decode_step_ms", "static_decode_step_ms",
                     "step_slots_vs_static", "transformers_tokens_per_s",
                     "speedup_vs_transformers", "greedy_outputs_equal_frac",
                     "resume_kv_us_per_token", "resume_recompute_us_per_token")]
                  for name in models])
    for name in models:
      report.bars(f"decode_{name}", "tokens/s",
                  {"april_jax": result[f"{name}_april_jax_tokens_per_s"],
                   "static JAX": result[f"{name}_static_tokens_per_s"],
                   "transformers": result[f"{name}_transformers_tokens_per_s"]})
  return result
