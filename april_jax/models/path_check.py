"""The accelerator's fast attention paths, checked on this device before a run takes them.

A run's settings may send it down paths that only an accelerator runs:
  cudnn         cuDNN's flash attention, a row per sample (jax.nn.dot_product_attention):
                the sampler's prefills and an unpacked learner (model.attention)
  cudnn_packed  cuDNN's flash attention over packed rows (jax's cuDNN module, segments):
                the learner with train.packing (model.attention)
  pallas        the Pallas decode-attention kernel (rollout.decode_attention)
`check` runs each one the run would take once at start-up, on a small seeded input at the
model's head counts and the run's dtypes (attention: forward and gradients), and compares
it with the portable path on the same input (blockwise attention; the XLA decode
attention), in a few seconds. A path that raises, or that differs by more than TOLERANCE
(of the largest |value| it compares), is not taken:
  - chosen by `auto`: one line says which path failed and why, and the run takes the
    portable path of that family (model.attention -> blockwise, every row; decode ->
    xla); the family's other fast path is not checked then;
  - named (model.attention=cudnn, rollout.decode_attention=pallas): FastPathFailed, an
    InputError (one line, exit 2), naming the setting and what failed.
Where `auto` takes the portable paths (a CPU, a 32-bit compute dtype) nothing is checked
and nothing changes. The kernel interpreted on a CPU (rollout.decode_attention=pallas
there) is Pallas' reference semantics, not a fast path: not checked.

    paths = path_check.check(path_check.Settings.of(config, model_cfg))
    model_cfg, engine_config = paths.model_config(model_cfg), paths.engine_config(econf)
    path_check.announce(paths)   # the summary on stdout, a fallback's line on stderr
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Mapping, NamedTuple

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from april_jax import errors
from april_jax.runtime import distributed
from april_jax.models import attention
from april_jax.models import hf_io
from april_jax.models import paged_attention
from april_jax.models import paged_attention_kernel
from april_jax.models import qwen3
from april_jax.settings.model import ModelSettings
from april_jax.settings.rollout import RolloutSettings

# The largest |fast - portable| allowed, over the largest |portable| it compares, by the
# dtype compared: a few roundings of 16 bits; float32 on GPUs may multiply in TF32.
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 5e-3}
ROW = 256  # the attention probe's row: packed with SAMPLES, then padding
SAMPLES = (100, 90, 40)
CHUNK = 64  # blockwise attention's keys per block in the probe (ROW > CHUNK: blockwise runs)


class FastPath(NamedTuple):
  """How the run's lines name a fast path, the setting that chooses it, and its portable
  counterpart."""

  what: str  # for the run's lines
  setting: str  # the config field that chooses it: its family
  portable: str  # the path it is held to, which the family falls back to


PATHS = {
    "cudnn": FastPath(
        "cuDNN attention (a row per sample)", "model.attention", "blockwise attention"
    ),
    "cudnn_packed": FastPath(
        "cuDNN attention (packed rows)", "model.attention", "blockwise attention"
    ),
    "pallas": FastPath(
        "the Pallas decode kernel", "rollout.decode_attention", "the XLA decode attention"
    ),
}
FALLBACK = {"model.attention": "blockwise", "rollout.decode_attention": "xla"}


@dataclasses.dataclass(frozen=True)
class Settings:
  """What decides the paths a run takes, and the shapes its probes are made at."""

  attention: str = ModelSettings.attention
  decode_attention: str = RolloutSettings.decode_attention
  dtype: str = "bfloat16"  # model.dtype: whole-sequence attention's
  kv_dtype: str = "bfloat16"  # model.kv_dtype: decode attention's
  packed: bool = True  # train.packing: the learner's rows are packed
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  page_size: int = RolloutSettings.page_size

  @classmethod
  def of(cls, config, model_cfg) -> "Settings":
    """A run config's (model.*, rollout.*, train.packing), at model_cfg's head shapes."""
    return cls(
        attention=config.model.attention,
        decode_attention=config.rollout.decode_attention,
        dtype=config.model.dtype,
        kv_dtype=config.model.kv_dtype,
        packed=bool(config.train.packing),
        num_heads=model_cfg.num_heads,
        num_kv_heads=model_cfg.num_kv_heads,
        head_dim=model_cfg.head_dim,
        page_size=config.rollout.page_size,
    )


def takes(s: Settings) -> dict[str, bool]:
  """The fast paths these settings take on this device: name -> named explicitly (True)
  or chosen by auto (False)."""
  out = {}
  if attention.resolve(s.attention, s.dtype) == "cudnn":
    out["cudnn"] = s.attention != "auto"
  if s.packed and attention.resolve(s.attention, s.dtype, segments=True) == "cudnn":
    out["cudnn_packed"] = s.attention != "auto"
  kernel = paged_attention_kernel.choose(s.decode_attention, s.page_size, s.head_dim)
  if kernel == "pallas" and jax.default_backend() != "cpu":
    out["pallas"] = s.decode_attention != "auto"
  return out


# ------------------------------------------------------------------------------ probes


def attention_probe(impl: str, packed: bool) -> Callable[[Settings], tuple]:
  """causal_attention by `impl` on the probe's row (packed: three samples and padding):
  its output and the gradients of q, k and v."""

  def run(s: Settings) -> tuple:
    N, K, H = s.num_heads, s.num_kv_heads, s.head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    normal = lambda key, heads: jax.random.normal(key, (1, ROW, heads, H), jnp.dtype(s.dtype))
    q, k, v, cot = normal(keys[0], N), normal(keys[1], K), normal(keys[2], K), normal(keys[3], N)
    segments = None
    if packed:
      segments = np.zeros((1, ROW), np.int32)  # 0: the trailing padding, a run of its own
      ends = np.cumsum(SAMPLES)
      for i, (a, b) in enumerate(zip(ends - SAMPLES, ends)):
        segments[0, a:b] = i + 1
      segments = jnp.asarray(segments)

    # Padding is never trained (the learner masks it): it is neither compared nor given
    # a cotangent, so paths that differ only in what they write there agree.
    real = (
        jnp.ones((1, ROW, 1, 1), s.dtype) if segments is None else (segments > 0)[..., None, None]
    )

    def loss(q, k, v, segments):
      out = attention.causal_attention(q, k, v, impl, CHUNK, segments) * real.astype(s.dtype)
      return jnp.sum((out * cot).astype(jnp.float32)), out

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = grad(q, k, v, segments)
    return (out, *grads)

  return run


def decode_probe(kernel: bool) -> Callable[[Settings], tuple]:
  """Paged decode attention (the kernel, or the XLA path) for four slots over a shuffled
  pool: an empty slot, one token, past a page boundary, several pages and blocks."""

  def run(s: Settings) -> tuple:
    rng = np.random.default_rng(0)
    K, G, H, T = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim, s.page_size
    past = np.array([0, 1, T + 1, 4 * T + 5], np.int32)
    need = -(-past // T)
    P = int(need.sum()) + 1
    table = np.full((len(past), int(need.max())), -1, np.int32)
    ids = list(rng.permutation(P))
    for slot, n in enumerate(need):
      table[slot, :n] = [ids.pop() for _ in range(n)]
    normal = lambda dtype, *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(
        dtype
    )
    storage = qwen3.kv_storage_dtype(s.kv_dtype)
    pool = lambda: qwen3.kv_store(normal(s.kv_dtype, 2, P, K, T, H), storage)
    args = (normal(s.dtype, len(past), K, G, H), normal(s.kv_dtype, len(past), K, H))
    args += (normal(s.kv_dtype, len(past), K, H), pool(), pool(), jnp.int32(1))
    args += (jnp.asarray(past), jnp.asarray(table))
    if kernel:
      fn = lambda *a: paged_attention_kernel.paged_decode_attention(*a, view=qwen3.kv_view)
    else:
      fn = lambda *a: paged_attention.paged_decode_attention(*a, 2, view=qwen3.kv_view)
    return (jax.jit(fn)(*args),)

  return run


FAST = {
    "cudnn": attention_probe("cudnn", packed=False),
    "cudnn_packed": attention_probe("cudnn", packed=True),
    "pallas": decode_probe(kernel=True),
}
PORTABLE = {
    "cudnn": attention_probe("blockwise", packed=False),
    "cudnn_packed": attention_probe("blockwise", packed=True),
    "pallas": decode_probe(kernel=False),
}


# ------------------------------------------------------------------------------- check


@dataclasses.dataclass(frozen=True)
class Paths:
  """What the check found and what the run takes: `attention` and `decode_attention`
  are the settings to run with (the config's, or the portable one after a failure
  under auto); `verified` the fast paths that agreed (name: max relative difference);
  `warnings` one line per family that fell back; `taken` the implementation of each
  kind of attention the run computes."""

  attention: str
  decode_attention: str
  verified: dict[str, float]
  warnings: tuple[str, ...]
  taken: dict[str, str]
  seconds: float

  def model_config(self, cfg: qwen3.Qwen3Config) -> qwen3.Qwen3Config:
    return dataclasses.replace(cfg, attention=self.attention)

  def engine_config(self, engine_config):
    """The engine's settings (sampler.EngineConfig) with the decode attention taken."""
    return dataclasses.replace(engine_config, decode_attention=self.decode_attention)

  def summary(self) -> str | None:
    """One line for the run's log, or None when nothing was checked."""
    if not self.verified and not self.warnings:
      return None
    verified = ", ".join(
        f"{PATHS[name].what} within {diff:.1e}" for name, diff in self.verified.items()
    )
    taken = ", ".join(f"{kind} {impl}" for kind, impl in self.taken.items())
    failed = f"; {len(self.warnings)} fell back" if self.warnings else ""
    return (
        f"fast paths checked against the portable ones in {self.seconds:.1f} s (max |difference|"
        f" over the largest |value|): verified {verified or 'none'}{failed}; taken: {taken}"
    )

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def _difference(fast: tuple, portable: tuple) -> float:
  """The largest |fast - portable| over the largest |portable|, the worst output's (inf
  for a NaN, an inf or another shape)."""
  worst = 0.0
  for x, y in zip(fast, portable, strict=True):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    if x.shape != y.shape:
      return float("inf")
    diff = float(np.nan_to_num(np.abs(x - y), nan=np.inf, posinf=np.inf).max(initial=0.0))
    worst = max(worst, diff / max(float(np.abs(y).max(initial=0.0)), 1e-30))
  return worst


def _why_not(name: str, s: Settings, fast: Callable) -> tuple[str | None, float]:
  """Why the fast path `name` may not be taken (None: it agrees), and its difference: the
  error's class and first line, or how far it is from the portable path."""
  try:
    got = tuple(np.asarray(x, np.float32) for x in fast(s))  # waits for the device
  except Exception as e:  # pylint: disable=broad-except
    return errors.cause_line(e), float("nan")
  dtype = jnp.dtype(s.kv_dtype if PATHS[name].setting == "rollout.decode_attention" else s.dtype)
  tolerance = TOLERANCE.get(str(dtype), TOLERANCE["bfloat16"])
  diff = _difference(got, PORTABLE[name](s))
  if not diff <= tolerance:
    why = f"max |difference| {diff:.1e} of the largest |value| against {PATHS[name].portable}"
    return f"{why}, over the tolerance {tolerance:.0e} in {dtype}", diff
  return None, diff


def check(
    s: Settings,
    agree: Callable[[bool], bool] | None = None,
    fast: Mapping[str, Callable] | None = None,
    paths: Mapping[str, bool] | None = None,
) -> Paths:
  """Checks the fast paths `s` takes here (`paths`, default takes(s)) against the
  portable ones; Paths says what the run takes. `agree(failed)`: True on every process
  when it is True on any (a multi-host run takes the same paths everywhere). `fast`
  replaces FAST's probes by name. Raises FastPathFailed for a failed path named
  explicitly."""
  start = time.perf_counter()
  fast = {**FAST, **(fast or {})}
  agree = agree or bool
  settings = {"model.attention": s.attention, "rollout.decode_attention": s.decode_attention}
  verified, warnings = {}, []
  for name, explicit in (takes(s) if paths is None else paths).items():
    what, setting, portable = PATHS[name]
    if settings[setting] == FALLBACK[setting]:
      continue  # its family fell back already
    why, diff = _why_not(name, s, fast[name])
    if not agree(why is not None):
      verified[name] = diff
      continue
    why = f"failed its check on this device ({why})" if why else "failed on another process"
    if explicit:
      raise errors.FastPathFailed(
          f"{setting}={settings[setting]}: {what} {why}; set {setting}={FALLBACK[setting]} "
          f"(or auto) to run {portable} instead"
      )
    settings[setting] = FALLBACK[setting]
    warnings.append(f"{what} {why}; the run takes {portable} ({setting}=auto)")
  return Paths(
      attention=settings["model.attention"],
      decode_attention=settings["rollout.decode_attention"],
      verified=verified,
      warnings=tuple(warnings),
      taken=_taken(s, settings),
      seconds=time.perf_counter() - start,
  )


def _taken(s: Settings, settings: dict[str, str]) -> dict[str, str]:
  """The implementation each kind of attention the run computes resolves to."""
  impl = settings["model.attention"]
  out = {"attention": attention.resolve(impl, s.dtype)}
  if s.packed:
    out["packed attention"] = attention.resolve(impl, s.dtype, segments=True)
  decode = settings["rollout.decode_attention"]
  out["decode attention"] = paged_attention_kernel.choose(decode, s.page_size, s.head_dim)
  return out


def announce(paths: Paths) -> None:
  """The run's lines: each fallback on stderr, the summary (when something was checked)
  on stdout; both in the log."""
  for line in paths.warnings:
    logging.info("fast path fell back: %s", line)
    print(f"april_jax: warning: {line}", file=sys.stderr, flush=True)
  if (line := paths.summary()) is not None:
    logging.info("%s", line)
    print(line, flush=True)


def checked_model(config):
  """(the model's config, the fast attention paths this device takes): each path is
  held to the portable one first (path_check.py), and process 0 says which it took."""
  model_cfg = hf_io.model_config(config)
  paths = check(Settings.of(config, model_cfg), agree=distributed.any_process)
  if distributed.is_primary():
    announce(paths)
  return paths.model_config(model_cfg), paths
