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

`merge` computes the update in float32 and adds it to W in W's dtype, a layer at a time;
it is differentiable in the adapters. The learner applies adapters unmerged instead
(qwen3.hidden_states(adapters=)); the sampler decodes merged params, or with
train.lora.decode "unmerged" the base itself with the adapters beside it (`decode_view`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from april_jax import sharding
from april_jax.runtime import distributed
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

  @classmethod
  def from_config(cls, section) -> "LoraSpec | None":
    """From the config's train.lora section (targets comma-separated, in any order: kept
    in TARGETS' order, as PEFT folders read back); None at rank 0."""
    if int(section.rank) == 0:
      return None
    targets = [t.strip() for t in str(section.targets).split(",") if t.strip()]
    order = lambda t: TARGETS.index(t) if t in TARGETS else len(TARGETS)
    return cls(int(section.rank), float(section.alpha), tuple(sorted(targets, key=order)))

  def describe(self) -> dict:
    """The spec as JSON (a checkpoint's record of what it trained)."""
    return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}


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
  twice = sorted({t for t in spec.targets if spec.targets.count(t) > 1})
  if twice:
    return [f"{prefix}targets lists {twice} more than once"]
  feed_forward = [t for t in spec.targets if t in ("gate", "up", "down")]
  if cfg.num_experts and feed_forward:
    return [
        f"{prefix}targets has {feed_forward}, but LoRA on a mixture-of-experts model "
        "adapts attention only: use q,k,v,o"
    ]
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


def shardings(cfg: qwen3.Qwen3Config, spec: LoraSpec, mesh, rules) -> dict:
  """NamedShardings of the adapters under `rules` (each factor like its weight's side)."""
  shapes = jax.eval_shape(lambda: init(cfg, spec, jax.random.key(0)))
  return sharding.named_shardings(logical_axes(cfg, spec), shapes, mesh, rules)


def delta(adapter: dict, spec: LoraSpec) -> jax.Array:
  """(alpha / rank) * A @ B per layer, in the weight's layout, float32."""
  return jax.lax.map(lambda ab: _layer_delta(*ab, spec.scale), (adapter["a"], adapter["b"]))


def _layer_delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """One layer's scale * A @ B, float32 [*in, *out]."""
  r = a.shape[-1]
  flat = jnp.matmul(
      a.reshape(-1, r).astype(jnp.float32),
      b.reshape(r, -1).astype(jnp.float32),
      precision=jax.lax.Precision.HIGHEST,
  )
  return scale * flat.reshape(*a.shape[:-1], *b.shape[1:])


def merge(params: dict, adapters: dict, spec: LoraSpec) -> dict:
  """The adapted params: each target W + delta, in W's dtype; everything else as is.
  One layer at a time: a float32 copy of one layer's weight is the largest temporary."""
  layers = dict(params["layers"])
  for target, adapter in adapters["layers"].items():
    merge_layer = lambda x: (
        x[0].astype(jnp.float32) + _layer_delta(x[1], x[2], spec.scale)
    ).astype(x[0].dtype)
    layers[target] = jax.lax.map(merge_layer, (layers[target], adapter["a"], adapter["b"]))
  return {**params, "layers": layers}


def decode_adapters(adapters: dict, spec: LoraSpec, dtype) -> dict:
  """The adapters as a sampler applies them unmerged: in `dtype`, the scale folded into B."""
  return {
      "layers": {
          t: {"a": ab["a"].astype(dtype), "b": (spec.scale * ab["b"]).astype(dtype)}
          for t, ab in adapters["layers"].items()
      }
  }


def decode_view(base: dict, decoded: dict) -> dict:
  """Params a sampler decodes with, the adapters unmerged: the base's own arrays (no copy)
  and decode_adapters' output as params["adapters"] (qwen3 applies them in every step)."""
  return {**base, "adapters": decoded}


def fingerprint(params: dict, samples: int = 64) -> str:
  """A fingerprint of weights: every leaf's path, shape, dtype and `samples` of its
  values at fixed positions, hashed. Exact (no sums, so no dependence on how the
  weights are sharded) and cheap; two different checkpoints of a model differ in
  nearly every weight, so in the samples."""
  digest = hashlib.sha256()
  # Indexed in place (a flat view of a sharded weight would gather it, and a flat index
  # past 2^31 overflows).
  pick = jax.jit(
      lambda x: x[np.unravel_index(_positions(x.size, samples), x.shape)] if x.ndim else x
  )
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    values = np.asarray(distributed.to_host(pick(leaf))).astype(np.float32)
    digest.update(f"{jax.tree_util.keystr(path)}{leaf.shape}{leaf.dtype}".encode())
    digest.update(values.tobytes())
  return digest.hexdigest()[:16]


def _positions(size: int, samples: int) -> np.ndarray:
  return np.unique(np.linspace(0, size - 1, min(size, samples)).astype(np.int64))


def num_params(cfg: qwen3.Qwen3Config, spec: LoraSpec) -> int:
  """Trainable numbers in the adapters."""
  total = 0
  for target in spec.targets:
    ins, outs = weight_dims(cfg, target)
    total += cfg.num_layers * spec.rank * (math.prod(ins) + math.prod(outs))
  return total
