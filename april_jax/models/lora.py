"""LoRA adapters for Qwen3's projections: their shapes, initialisation, shardings and merge.

A target projection W (q, k, v, o, gate, up, down; layer-stacked as qwen3.init_params
holds them) gains a low-rank update: W' = W + (alpha / rank) * A @ B, with A [in, rank]
and B [rank, out] per layer. A keeps W's input dims and B its output dims, so each
shards like the side of W it touches (`logical_axes`). B starts at zero, so the adapted
model is the base model until the first update; A starts uniform in +-1/sqrt(in), as
PEFT's default (Kaiming-uniform with a = sqrt(5)) does.

    spec = LoraSpec(rank=16, alpha=32, targets=("q", "v"))
    adapters = init(cfg, spec, key)            # {"layers": {"q": {"a", "b"}, ...}}
    params = merge(base, adapters, spec)       # the adapted params, in the base's dtype

`merge` computes the update in float32 and adds it to W in W's dtype; it is
differentiable in the adapters, so a loss of the merged params trains them alone.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from april_jax.models import qwen3

# Each target: how many of its dims (after the layer dim) are inputs; the rest are outputs.
INPUT_DIMS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
TARGETS = tuple(INPUT_DIMS)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  rank: int
  alpha: float
  targets: tuple[str, ...] = TARGETS

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def weight_dims(cfg: qwen3.Qwen3Config, target: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The target weight's input and output dims (its layer dim apart)."""
  shape = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.key(0)))["layers"][target].shape
  n = INPUT_DIMS[target]
  return tuple(shape[1 : 1 + n]), tuple(shape[1 + n :])


def problems(cfg: qwen3.Qwen3Config, spec: LoraSpec, prefix: str = "") -> list[str]:
  """What is wrong with the spec for this model, each naming its field (prefix + name)."""
  unknown = [t for t in spec.targets if t not in INPUT_DIMS]
  if unknown:
    return [f"{prefix}targets has unknown modules {unknown}: choose from {list(TARGETS)}"]
  if not spec.targets:
    return [f"{prefix}targets is empty: choose from {list(TARGETS)}"]
  narrowest = min(
      min(math.prod(i), math.prod(o)) for i, o in map(lambda t: weight_dims(cfg, t), spec.targets)
  )
  if not 1 <= spec.rank <= narrowest:
    return [
        f"{prefix}rank must be in [1, {narrowest}] (the narrowest side of the adapted "
        f"projections), got {spec.rank}"
    ]
  if not spec.alpha > 0:
    return [f"{prefix}alpha must be > 0, got {spec.alpha}"]
  return []


def init(cfg: qwen3.Qwen3Config, spec: LoraSpec, key: jax.Array) -> dict:
  """Float32 adapters: A uniform in +-1/sqrt(in), B zero (the base model at step 0)."""
  found = problems(cfg, spec)
  if found:
    raise ValueError("; ".join(found))
  L, out = cfg.num_layers, {}
  for target, k in zip(spec.targets, jax.random.split(key, len(spec.targets))):
    ins, outs = weight_dims(cfg, target)
    bound = 1.0 / math.sqrt(math.prod(ins))
    a = jax.random.uniform(k, (L, *ins, spec.rank), jnp.float32, -bound, bound)
    out[target] = {"a": a, "b": jnp.zeros((L, spec.rank, *outs), jnp.float32)}
  return {"layers": out}


def logical_axes(cfg: qwen3.Qwen3Config, spec: LoraSpec) -> dict:
  """Logical axes of the adapters: A's input dims and B's output dims as their weight's."""
  weights = qwen3.param_logical_axes(cfg)["layers"]
  out = {}
  for target in spec.targets:
    axes, n = weights[target], INPUT_DIMS[target]
    out[target] = {"a": (*axes[: 1 + n], None), "b": (axes[0], None, *axes[1 + n :])}
  return {"layers": out}


def delta(adapter: dict, spec: LoraSpec) -> jax.Array:
  """(alpha / rank) * A @ B per layer, in the weight's layout, float32."""
  a, b = adapter["a"], adapter["b"]
  L, r = a.shape[0], a.shape[-1]
  ins, outs = a.shape[1:-1], b.shape[2:]
  flat = jnp.matmul(a.reshape(L, -1, r), b.reshape(L, r, -1), precision=jax.lax.Precision.HIGHEST)
  return spec.scale * flat.reshape(L, *ins, *outs)


def merge(params: dict, adapters: dict, spec: LoraSpec) -> dict:
  """The adapted params: each target W + delta, in W's dtype; everything else as is."""
  layers = dict(params["layers"])
  for target, adapter in adapters["layers"].items():
    w = layers[target]
    layers[target] = (w.astype(jnp.float32) + delta(adapter, spec)).astype(w.dtype)
  return {**params, "layers": layers}


def num_params(cfg: qwen3.Qwen3Config, spec: LoraSpec) -> int:
  """Trainable numbers in the adapters."""
  total = 0
  for target in spec.targets:
    ins, outs = weight_dims(cfg, target)
    total += cfg.num_layers * spec.rank * (math.prod(ins) + math.prod(outs))
  return total
