"""Small helpers shared by the benchmark modes: timing, machine facts, JSON output."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from april_jax import sampler
from april_jax.models import hf_io, qwen3


def machine() -> dict[str, Any]:
  return {
      "platform": jax.default_backend(),
      "devices": len(jax.devices()),
      "device_kind": jax.devices()[0].device_kind,
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
      "jax": jax.__version__,
  }


# Peak memory bandwidth (GB/s) of accelerators the decode roofline knows by name.
HBM_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "MI300X": 5300.0}


def hbm_gbps() -> float:
  """The device's memory bandwidth if its kind is known, else 0 (no roofline)."""
  kind = jax.devices()[0].device_kind
  return next((v for k, v in HBM_GBPS.items() if k in kind), 0.0)


def copy_gbps(nbytes: int | None = None, repeats: int = 5) -> float:
  """The device's copy bandwidth, measured: GB/s read + written by a jitted x + 1 over
  `nbytes` (default 1 GiB on an accelerator, 64 MiB on a CPU), best of `repeats`."""
  import time  # pylint: disable=g-import-not-at-top

  if nbytes is None:
    nbytes = (1 << 26) if jax.devices()[0].platform == "cpu" else (1 << 30)
  x = jnp.ones((nbytes // 4,), jnp.float32)
  bump = jax.jit(lambda a: a + 1)
  jax.block_until_ready(bump(x))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(bump(x))
    best = min(best, time.perf_counter() - start)
  return 2 * nbytes / best / 1e9


def bench_model(config, seed: int):
  """The config's model shape and random params as the run's sampler holds them: in the
  compute dtype (`model.dtype`), with the config's attention settings."""
  cfg = hf_io.model_config(config)
  params = qwen3.init_params(
      cfg, jax.random.key(seed), dtype=jnp.dtype(config.model.dtype), std=config.model.init.std
  )
  return cfg, params


def greedy_engine(
    cfg, params, prompts, new_tokens: int, sync_every: int, kv_dtype: str, decode_attention="auto"
):
  """A slot engine with a slot per prompt, each prompt + new_tokens long."""
  config = sampler.EngineConfig(
      num_slots=len(prompts),
      max_len=len(prompts[0]) + new_tokens,
      sync_every=sync_every,
      kv_dtype=kv_dtype,
      decode_attention=decode_attention,
  )
  return sampler.SlotEngine(cfg, params, config)


def add_greedy_groups(engine, prompts, keys, new_tokens: int) -> None:
  """Admits each prompt as a one-sample greedy group, prompt i drawing from keys[i]."""
  for i, p in enumerate(prompts):
    engine.admit(
        [sampler.SampleRecord(prompt=p, max_new_tokens=new_tokens, rng=keys[i], temperature=0.0)]
    )


def best_of(repeats: int, fn: Callable[[], Any]) -> tuple[float, Any]:
  """Runs fn `repeats` times; returns the fastest wall time and the last result."""
  best, out = float("inf"), None
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - start)
  return best, out


def progress(label: str, done: int, total: int) -> None:
  """A one-line progress bar on stderr (stdout stays tables + the JSON line)."""
  width = 30
  filled = int(width * done / max(total, 1))
  end = "\n" if done >= total else ""
  print(
      f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}",
      end=end,
      file=sys.stderr,
      flush=True,
  )


def stage_logger(name: str) -> Callable[[str], None]:
  """log(label): one stderr line, `name: label (seconds since this call)`, so a run cut
  short by a time limit still says which stage it was in and where the time went."""
  start = time.perf_counter()

  def log(label: str) -> None:
    print(f"{name}: {label} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)

  return log


def emit(result: dict[str, Any]) -> None:
  """The last stdout line of every mode: one JSON object."""
  print(json.dumps(result, sort_keys=True), flush=True)
