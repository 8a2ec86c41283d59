"""Qwen3 (dense, every size) and Qwen3-MoE as pure JAX functions over a params pytree.

One model, four uses:
  forward(cfg, params, tokens)          -> float32 logits [B, T, V], causal, positions 0..T-1
  prefill(cfg, params, tokens, lengths) -> last-token logits and the prompt's KV
  decode_step(cfg, params, tok, pos, kv) -> next-token logits, KV with the token written
  token_logprobs(cfg, params, ...)      -> per-token logprobs (+ entropy) computed in chunks
                                           over the sequence, so [B, T, V] never exists.
hidden_states and token_logprobs also take packed rows (rl/layout.py): `segments` [B, T]
keep each sample's attention to itself, `positions` [B, T] restart at each sample.

Params (layers are stacked on a leading axis L and run with `lax.scan`; LoRA params
for the sampler may add "adapters", applied unmerged: models/lora.py):
  embed         [V, D]
  layers        attn_norm [L, D]; q [L, D, N, H]; k, v [L, D, K, H]; o [L, N, H, D];
                q_norm, k_norm [L, H]; mlp_norm [L, D]; gate, up [L, D, F]; down [L, F, D]
  final_norm    [D]
  lm_head       [D, V]  (absent when tie_word_embeddings: the head is embed^T)
Shapes: B batch, T query length, S key length, D hidden, N query heads, K kv heads,
H head_dim (independent of D / N), G = N // K, F intermediate, V vocab.

Qwen3-MoE (num_experts > 0): the dense feed-forward stacks hold the dense layers only
[Ld, ...], and the sparse layers [Ls, ...] have router [Ls, D, E], experts_gate and
experts_up [Ls, E, D, Fe], experts_down [Ls, E, Fe, D] (models/moe.py computes them;
models/layer_runs.py says which layers are which and scans each run of one kind). The
model can return each token's experts in every sparse layer, [B, T, Ls, k] (what the
sampler records), and can replay given ones (`routes`: routing replay, the learner
computing the rollout's experts with its own router's gates).

Numerics follow transformers' Qwen3ForCausalLM: RMSNorm in float32, RoPE on the
rotate-half layout, attention scores, softmax and logits in float32. The compute dtype
is the params' dtype (the learner casts its float32 masters; the sampler holds a cast
copy). Attention over whole sequences is selected by `Qwen3Config.attention`
(models/attention.py): never a T x T score matrix unless "dense" is asked for.
Activations are pinned with `sharding.constrain` to the rules of the program being
traced (a no-op outside a mesh).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from april_jax import sharding
from april_jax.models import attention as attention_lib
from april_jax.models import layer_runs
from april_jax.models import moe
from april_jax.settings.model import InitSettings, ModelSettings

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
  """The shape of a Qwen3 (or Qwen3-MoE) model; hashable, so it can be a static jit
  argument."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = InitSettings.rope_theta
  rms_norm_eps: float = InitSettings.rms_norm_eps
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 40960
  # Whole-sequence attention (auto | dense | blockwise | cudnn) and keys per block of
  # blockwise attention: model.attention and model.attention_chunk.
  attention: str = ModelSettings.attention
  attention_chunk: int = ModelSettings.attention_chunk
  # Qwen3-MoE, by config.json's names; num_experts = 0 is a dense model.
  num_experts: int = InitSettings.num_experts
  num_experts_per_tok: int = InitSettings.num_experts_per_tok
  moe_intermediate_size: int = InitSettings.moe_intermediate_size
  norm_topk_prob: bool = InitSettings.norm_topk_prob
  decoder_sparse_step: int = InitSettings.decoder_sparse_step
  mlp_only_layers: tuple[int, ...] = InitSettings.mlp_only_layers
  # How experts group their tokens (moe.IMPLS): model.experts_impl.
  experts_impl: str = ModelSettings.experts_impl

  def __post_init__(self):
    if not isinstance(self.mlp_only_layers, tuple):  # a list would not hash (jit's static)
      raise TypeError(f"mlp_only_layers must be a tuple, got {self.mlp_only_layers!r}")
    self._check_experts()
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
          f"({self.num_kv_heads})"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    if self.attention not in attention_lib.IMPLEMENTATIONS:
      raise ValueError(
          f"attention must be one of {attention_lib.IMPLEMENTATIONS}, got " f"{self.attention!r}"
      )
    if self.attention_chunk < 1:
      raise ValueError(f"attention_chunk must be >= 1, got {self.attention_chunk}")

  def _check_experts(self):
    if self.num_experts == 0:
      return
    if not 1 <= self.num_experts_per_tok <= self.num_experts:
      raise ValueError(
          f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), got "
          f"{self.num_experts_per_tok}"
      )
    if self.num_experts > moe.UNRECORDED:  # recorded routes are uint8, 255 "not recorded"
      raise ValueError(
          f"num_experts above {moe.UNRECORDED} is not supported, got {self.num_experts}"
      )
    if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
      raise ValueError(
          "moe_intermediate_size and decoder_sparse_step must be >= 1, got "
          f"{self.moe_intermediate_size} and {self.decoder_sparse_step}"
      )
    if self.experts_impl not in moe.IMPLS:
      raise ValueError(f"experts_impl must be one of {moe.IMPLS}, got {self.experts_impl!r}")

  @property
  def sparse_layers(self) -> int:
    """How many layers have experts."""
    return layer_runs.counts(self)[1]

  @property
  def route_shape(self) -> tuple[int, int]:
    """A token's recorded route: its experts in every sparse layer, (Ls, k); (0, 1) for
    a dense model, which records nothing."""
    return (self.sparse_layers, max(self.num_experts_per_tok, 1))

  @classmethod
  def from_init(cls, init) -> "Qwen3Config":
    """From a config's `model.init` section (a random init, or a known model's shape)."""
    return cls(
        vocab_size=init.vocab_size,
        hidden_size=init.hidden_size,
        intermediate_size=init.intermediate_size,
        num_layers=init.num_layers,
        num_heads=init.num_heads,
        num_kv_heads=init.num_kv_heads,
        head_dim=init.head_dim,
        rope_theta=init.rope_theta,
        rms_norm_eps=init.rms_norm_eps,
        tie_word_embeddings=init.tie_word_embeddings,
        num_experts=init.num_experts,
        num_experts_per_tok=init.num_experts_per_tok,
        moe_intermediate_size=init.moe_intermediate_size,
        norm_topk_prob=init.norm_topk_prob,
        decoder_sparse_step=init.decoder_sparse_step,
        mlp_only_layers=tuple(init.mlp_only_layers),
    )

  def num_params(self, active: bool = False) -> int:
    """Every weight's count; with `active`, those a token uses (its k experts of each
    sparse layer)."""
    d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * h
    dense, sparse = layer_runs.counts(self)
    experts = self.num_experts_per_tok if active else self.num_experts
    sparse_mlp = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
    layers = self.num_layers * (attn + 2 * d) + dense * 3 * d * f + sparse * sparse_mlp
    head = 0 if self.tie_word_embeddings else d * self.vocab_size
    return self.vocab_size * d + layers + d + head


class KVCache(NamedTuple):
  """Keys and values for every layer. A slot cache: k, v [L, B, K, S, H] (KV head before
  position: decode's matmuls need no transpose). Prefill returns [L, B, T, K, H].

  routes: a Qwen3-MoE sequence's experts at each of those positions, [B, T, Ls, k] uint8
  (the sampler's prefilled KV carries them to the slots that record them); None otherwise."""

  k: jax.Array
  v: jax.Array
  routes: jax.Array | None = None


# ----------------------------------------------------------------------------- init


def init_params(cfg: Qwen3Config, rng: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
  """Random params: normal(0, std) matrices, ones for norms (transformers' init)."""
  L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
  N, K, H, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
  Ld, Ls = layer_runs.counts(cfg)
  E, Fe = cfg.num_experts, cfg.moe_intermediate_size
  shapes = {"q": (L, D, N, H), "k": (L, D, K, H), "v": (L, D, K, H), "o": (L, N, H, D)}
  if Ld:
    shapes.update(gate=(Ld, D, F), up=(Ld, D, F), down=(Ld, F, D))
  if Ls:
    shapes.update(router=(Ls, D, E), experts_gate=(Ls, E, D, Fe), experts_up=(Ls, E, D, Fe))
    shapes.update(experts_down=(Ls, E, Fe, D))
  keys = jax.random.split(rng, len(shapes) + 2)
  normal = lambda key, shape: (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
  layers = {name: normal(key, shape) for key, (name, shape) in zip(keys, shapes.items())}
  ones = lambda *shape: jnp.ones(shape, dtype)
  layers.update(attn_norm=ones(L, D), mlp_norm=ones(L, D), q_norm=ones(L, H), k_norm=ones(L, H))
  params = {"embed": normal(keys[-2], (V, D)), "layers": layers, "final_norm": ones(D)}
  if not cfg.tie_word_embeddings:
    params["lm_head"] = normal(keys[-1], (D, V))
  return params


def param_logical_axes(cfg: Qwen3Config) -> Params:
  """Logical axis names for every param; `sharding.py` maps them onto the mesh."""
  layers = {
      "attn_norm": ("layers", "norm"),
      "mlp_norm": ("layers", "norm"),
      "q_norm": ("layers", "head_dim"),
      "k_norm": ("layers", "head_dim"),
      "q": ("layers", "embed", "heads", "head_dim"),
      "k": ("layers", "embed", "kv_heads", "head_dim"),
      "v": ("layers", "embed", "kv_heads", "head_dim"),
      "o": ("layers", "heads", "head_dim", "embed"),
      "gate": ("layers", "embed", "mlp"),
      "up": ("layers", "embed", "mlp"),
      "down": ("layers", "mlp", "embed"),
      "router": ("layers", "embed", None),
      "experts_gate": ("layers", "experts", "embed", "mlp"),
      "experts_up": ("layers", "experts", "embed", "mlp"),
      "experts_down": ("layers", "experts", "mlp", "embed"),
  }
  Ld, Ls = layer_runs.counts(cfg)
  drop = (layer_runs.DENSE_MLP if not Ld else ()) + (layer_runs.EXPERTS if not Ls else ())
  layers = {k: v for k, v in layers.items() if k not in drop}
  axes = {"embed": ("vocab", "embed"), "layers": layers, "final_norm": ("norm",)}
  if not cfg.tie_word_embeddings:
    axes["lm_head"] = ("embed", "vocab")
  return axes


def param_shardings(cfg: Qwen3Config, mesh, rules=sharding.DEFAULT_RULES, dtype="float32"):
  """NamedShardings of a params pytree under `rules` (see sharding.py)."""
  shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype))
  return sharding.named_shardings(param_logical_axes(cfg), shapes, mesh, rules)


def init_params_sharded(
    cfg: Qwen3Config,
    rng: jax.Array,
    mesh,
    rules=sharding.DEFAULT_RULES,
    dtype="float32",
    std: float = 0.02,
) -> Params:
  """Random params created directly in their shardings (never whole on one device)."""
  init = jax.jit(
      lambda key: init_params(cfg, key, dtype, std),
      out_shardings=param_shardings(cfg, mesh, rules, dtype),
  )
  return init(rng)


def kv_storage_dtype(dtype) -> jnp.dtype:
  """How a slot cache of `dtype` is stored: bfloat16 as its uint16 bit pattern.

  Reads and writes are free bitcasts. Stored as a float, XLA's CPU backend computes a
  bfloat16 cache update in float32, which copies the whole cache at every update.
  """
  return jnp.dtype(jnp.uint16) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)


def kv_view(x: jax.Array) -> jax.Array:
  """Cache storage -> values (uint16 bit patterns are bfloat16)."""
  return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def kv_store(x: jax.Array, storage_dtype) -> jax.Array:
  """Values -> cache storage of `storage_dtype`."""
  if jnp.dtype(storage_dtype) == jnp.uint16:
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
  return x.astype(storage_dtype)


KV_LOGICAL_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
_X = ("batch", "seq", "act_embed")  # activations [B, T, D]


# ------------------------------------------------------------------------ building blocks


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * x32.astype(x.dtype)


def apply_rope(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, rotate-half layout (first half of head_dim pairs with second)."""
  H = x_BxTxNxH.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
  freqs_BxTxH2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
  angles = jnp.concatenate([freqs_BxTxH2, freqs_BxTxH2], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles).astype(x_BxTxNxH.dtype), jnp.sin(angles).astype(x_BxTxNxH.dtype)
  x1, x2 = jnp.split(x_BxTxNxH, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BxTxNxH * cos + rotated * sin


def _low_rank(eq: str, x, a, b, scale: float):
  """scale * (x @ a) @ b for the projection einsum `eq` (x, W -> y): a [*in, r] holds W's
  contracted dims, b [r, *out] the rest. Never forms a weight-sized array."""
  operands, out = eq.split("->")
  xs, ws = operands.split(",")
  contracted = "".join(c for c in ws if c in xs)
  kept = "".join(c for c in ws if c not in xs)
  rows = "".join(c for c in xs if c not in ws)
  xa = jnp.einsum(f"{xs},{contracted}r->{rows}r", x, a)
  return scale * jnp.einsum(f"{rows}r,r{kept}->{out}", xa, b)


def _project(eq: str, x, lp: Params, name: str):
  """x through the layer's projection `name`, plus its LoRA update when the layer
  carries adapters (lp["lora"], see models/lora.py): W x + scale * B A x, unmerged."""
  y = jnp.einsum(eq, x, lp[name])
  lora = lp.get("lora")
  if lora is None or name not in lora["adapters"]:
    return y
  ab = lora["adapters"][name]
  return y + _low_rank(eq, x, ab["a"], ab["b"], lora["scale"]).astype(y.dtype)


def _qkv(cfg: Qwen3Config, lp: Params, x_BxTxD, positions_BxT):
  h = rms_norm(x_BxTxD, lp["attn_norm"], cfg.rms_norm_eps)
  q = _project("btd,dnh->btnh", h, lp, "q")
  k = _project("btd,dkh->btkh", h, lp, "k")
  v = _project("btd,dkh->btkh", h, lp, "v")
  q = apply_rope(rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), positions_BxT, cfg.rope_theta)
  k = apply_rope(rms_norm(k, lp["k_norm"], cfg.rms_norm_eps), positions_BxT, cfg.rope_theta)
  heads, kv_heads = ("batch", "seq", "heads", "head_dim"), ("batch", "seq", "kv_heads", "head_dim")
  return (
      sharding.constrain(q, heads),
      sharding.constrain(k, kv_heads),
      sharding.constrain(v, kv_heads),
  )


def _attn_out(lp: Params, x_BxTxD, attn_BxTxNxH):
  return sharding.constrain(x_BxTxD + _project("btnh,nhd->btd", attn_BxTxNxH, lp, "o"), _X)


def _dense_mlp(lp: Params, h_BxTxD):
  gate = _project("btd,df->btf", h_BxTxD, lp, "gate")
  up = _project("btd,df->btf", h_BxTxD, lp, "up")
  hidden_BxTxF = sharding.constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
  return _project("btf,fd->btd", hidden_BxTxF, lp, "down")


class MoeOut(NamedTuple):
  """What the sparse layers did: each token's own top-k experts (its router's choice,
  whatever was computed) [B, T, Ls, k] int32, and the load-balancing loss's terms over the
  experts computed, f and P [Ls, E] (moe.balance_loss)."""

  experts: jax.Array
  fraction: jax.Array
  mean_prob: jax.Array


def _sparse_mlp(cfg: Qwen3Config, lp: Params, h_BxTxD, replay_BxTxK, mask_BxT):
  """The experts' feed-forward. Tokens are routed within each shard of the batch (the
  rows a device holds), never gathered across it; `replay_BxTxK` (recorded experts)
  replaces the router's top k, the gates still from this router. Returns (out, (own
  experts [B, T, k], f [E], P [E]))."""
  B, T, D = h_BxTxD.shape
  K = cfg.num_experts_per_tok
  groups = sharding.active_shards("batch")
  groups = groups if B % groups == 0 else 1
  grouped = lambda a: a.reshape((groups, B * T // groups) + a.shape[2:])
  x = sharding.constrain(grouped(h_BxTxD), ("batch", None, "act_embed"))

  def one_group(x_TxD, replay_TxK):
    logits = moe.router_logits(x_TxD, lp["router"])
    gates, own = moe.route(logits, K, cfg.norm_topk_prob)
    experts = own
    if replay_TxK is not None:
      experts = moe.replayed(own, replay_TxK)
      gates = moe.replayed_gates(logits, experts, cfg.norm_topk_prob)
    weights = (lp["experts_gate"], lp["experts_up"], lp["experts_down"])
    out = moe.experts_ffn(x_TxD, experts, gates, *weights, impl=cfg.experts_impl)
    return out, own, logits, experts

  replay = None if replay_BxTxK is None else grouped(replay_BxTxK)
  out, own, logits, used = jax.vmap(one_group)(x, replay)
  flat = lambda a: a.reshape((B * T,) + a.shape[2:])
  mask = None if mask_BxT is None else mask_BxT.reshape(B * T)
  stats = moe.balance_stats(flat(logits), flat(used), mask)
  return out.reshape(B, T, D), (own.reshape(B, T, K),) + stats


def _mlp_block(cfg: Qwen3Config, lp: Params, x_BxTxD, sparse: bool, replay=None, mask=None):
  """The feed-forward half of a layer, residual included: (x, what a sparse layer saw
  or None)."""
  h = rms_norm(x_BxTxD, lp["mlp_norm"], cfg.rms_norm_eps)
  if not sparse:
    return sharding.constrain(x_BxTxD + _dense_mlp(lp, h), _X), None
  out, seen = _sparse_mlp(cfg, lp, h, replay, mask)
  return sharding.constrain(x_BxTxD + out, _X), seen


def _causal_layer(
    cfg: Qwen3Config, lp: Params, x_BxTxD, positions_BxT, segments_BxT, sparse, replay, mask
):
  """One decoder layer over a whole sequence; also returns its k, v for a cache and what
  its experts did (None in a dense layer)."""
  q, k, v = _qkv(cfg, lp, x_BxTxD, positions_BxT)
  attn = attention_lib.causal_attention(q, k, v, cfg.attention, cfg.attention_chunk, segments_BxT)
  attn = sharding.constrain(attn, ("batch", "seq", "heads", "head_dim"))
  x, seen = _mlp_block(cfg, lp, _attn_out(lp, x_BxTxD, attn), sparse, replay, mask)
  return x, (k, v), seen


def _over_layers(cfg: Qwen3Config, step, x, params: Params, adapters, routes=None, remat=False):
  """x through every layer, each run of one kind (layer_runs) one scan of
  `step(sparse, x, ((weights, adapters), index, replay)) -> (x, (kv, seen))`. routes
  [B, T, Ls, k] (or None): each sparse layer's recorded experts, given as `replay`.
  Returns (x, kv stacked over all layers, what the sparse layers saw stacked over them)."""
  layers, adapter_layers = _layers(params, adapters)
  replay = None if routes is None else jnp.moveaxis(routes, 2, 0)
  kvs, seen = [], []
  for run in layer_runs.runs(cfg):
    weights = (layer_runs.of_run(cfg, layers, run), layer_runs.of_run(cfg, adapter_layers, run))
    index = jnp.arange(run.start, run.stop, dtype=jnp.int32)
    run_replay = None
    if replay is not None and run.sparse:
      run_replay = replay[run.first : run.first + run.stop - run.start]
    body = functools.partial(step, run.sparse)
    if remat:
      body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    x, (kv, run_seen) = jax.lax.scan(body, x, (weights, index, run_replay))
    kvs.append(kv)
    if run.sparse:
      seen.append(run_seen)
  joined = lambda parts: (
      parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *parts)
  )  # one run (dense, or every layer sparse): its own arrays, no copy
  return x, joined(kvs), (joined(seen) if seen else None)


def _moe_out(seen) -> MoeOut | None:
  """The sparse layers' stacked record as a MoeOut (experts moved to [B, T, Ls, k])."""
  if seen is None:
    return None
  experts, fraction, mean_prob = seen
  return MoeOut(jnp.moveaxis(experts, 0, -2), fraction, mean_prob)


def _head_weight_DxV(cfg: Qwen3Config, params: Params) -> jax.Array:
  return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def _in_dtype(cfg: Qwen3Config, params: Params, dtype, *path: str):
  """The weights at `path` cast to the compute dtype where they lie (each device its
  shard, so FSDP gathers 16-bit weights); unchanged when dtype is None."""
  if dtype is None:
    return params
  axes = param_logical_axes(cfg)
  for key in path:
    axes = axes[key]
  if isinstance(params, dict):  # one layer's weights: axes without the leading "layers"
    return {
        k: v if k == "router" else sharding.constrain(v.astype(dtype), axes[k][1:])
        for k, v in params.items()
    }  # the router stays float32 (moe.router_logits)
  return sharding.constrain(params.astype(dtype), axes)


def compute_view(cfg: Qwen3Config, params: Params, dtype) -> Params:
  """The top-level weights (embedding, final norm, head) in the compute dtype; layers are
  cast one at a time inside the layer scan (`hidden_states(..., compute_dtype=)`)."""
  if dtype is None:
    return params
  out = dict(params)
  for key in ("embed", "final_norm", "lm_head"):
    if key in params:
      out[key] = _in_dtype(cfg, params[key], dtype, key)
  return out


def logits_from_hidden(cfg: Qwen3Config, params: Params, h_BxTxD) -> jax.Array:
  """The output head, in float32."""
  logits = jnp.einsum(
      "btd,dv->btv", h_BxTxD, _head_weight_DxV(cfg, params), preferred_element_type=jnp.float32
  )
  return sharding.constrain(logits, ("batch", "seq", "vocab"))


def _layers(params: Params, adapters) -> tuple:
  """What the layer scan runs over: the stacked layers and their adapters (or None). A
  sampler's unmerged LoRA params carry theirs, scaled, as params["adapters"]
  (models/lora.py's decode_view)."""
  if adapters is None:
    adapters = params.get("adapters")
  return params["layers"], (None if adapters is None else adapters["layers"])


def _with_adapters(cfg: Qwen3Config, layer, dtype, scale: float) -> Params:
  """One layer's weights in the compute dtype, carrying its adapters (if any) as lp["lora"]."""
  lp, adapters = layer
  lp = _in_dtype(cfg, lp, dtype, "layers")
  if adapters is None:
    return lp
  in_dtype = lp["attn_norm"].dtype
  adapters = jax.tree.map(lambda a: a.astype(in_dtype), adapters)
  return {**lp, "lora": {"adapters": adapters, "scale": scale}}


# ------------------------------------------------------------------------- the four uses


def hidden_states(
    cfg: Qwen3Config,
    params: Params,
    tokens_BxT: jax.Array,
    *,
    remat: bool = False,
    return_kv: bool = False,
    compute_dtype=None,
    positions_BxT=None,
    segments_BxT=None,
    adapters=None,
    adapter_scale: float = 1.0,
    routes=None,
    token_mask_BxT=None,
    moe_out: bool = False,
):
  """Final-normed hidden states [B, T, D]; with return_kv also per-layer k, v
  [L, B, T, K, H], with moe_out also a MoeOut (None for a dense model), in that order.

  With compute_dtype, float32 (master) params are cast one layer at a time inside the
  scan: no whole-model copy in the compute dtype exists, and gradients flow back to
  the float32 params. Positions default to 0..T-1; segments (packed rows) to none.
  adapters: LoRA factors (models/lora.py) applied unmerged, scaled by adapter_scale.
  routes [B, T, Ls, k]: experts to replay in the sparse layers (routing replay; a token
  whose route holds moe.UNRECORDED computes its own top k there);
  token_mask_BxT: the tokens the load-balancing terms count (default all).
  """
  B, T = tokens_BxT.shape
  if positions_BxT is None:
    positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  params = compute_view(cfg, params, compute_dtype)
  x = sharding.constrain(params["embed"][tokens_BxT], _X)

  def step(sparse, x, xs):
    layer, _, replay = xs
    lp = _with_adapters(cfg, layer, compute_dtype, adapter_scale)
    x, kv, seen = _causal_layer(
        cfg, lp, x, positions_BxT, segments_BxT, sparse, replay, token_mask_BxT
    )
    return x, ((kv if return_kv else None), seen)

  x, kv, seen = _over_layers(cfg, step, x, params, adapters, routes, remat)
  h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  out = (h,) + ((KVCache(*kv),) if return_kv else ()) + ((_moe_out(seen),) if moe_out else ())
  return out if len(out) > 1 else h


def forward(
    cfg: Qwen3Config, params: Params, tokens_BxT: jax.Array, *, remat: bool = False
) -> jax.Array:
  """Causal LM logits, float32 [B, T, V], positions 0..T-1."""
  return logits_from_hidden(cfg, params, hidden_states(cfg, params, tokens_BxT, remat=remat))


def prefill(
    cfg: Qwen3Config, params: Params, tokens_BxT: jax.Array, lengths_B: jax.Array
) -> tuple[jax.Array, KVCache]:
  """Runs right-padded prompts; returns logits at position length-1 and the KV.

  Padding sits after each prompt, so causality keeps it out of the valid positions;
  the KV beyond `length` is garbage that decode masks out and later overwrites.
  Returns (logits [B, V] float32, KVCache with k, v [L, B, T, K, H]).
  """
  h, kv = hidden_states(cfg, params, tokens_BxT, return_kv=True)
  last_BxD = jnp.take_along_axis(h, (lengths_B - 1)[:, None, None], axis=1)
  return logits_from_hidden(cfg, params, last_BxD)[:, 0], kv


def decode_step(
    cfg: Qwen3Config,
    params: Params,
    tokens_B: jax.Array,
    positions_B: jax.Array,
    cache: KVCache,
    live_B: jax.Array | None = None,
    block: int = 1024,
    write=None,
    attend=None,
    adapters=None,
    adapter_scale: float = 1.0,
    return_experts: bool = False,
):
  """One token per row at its own position; returns logits [B, V] and the updated cache
  (and, with return_experts, each row's experts in every sparse layer [B, Ls, k]).

  cache: k, v [L, B, K, S, H]. Row b attends to cache entries 0..positions_B[b]-1 and
  to itself (rows not in live_B attend to nothing past themselves); the cache is read
  in blocks up to the longest row (attention.decode_attention), never copied. Each
  row's k, v are written at index positions_B[b] after all layers ran, in place when
  the cache is donated, by `write` (default `write_positions`; the sampler passes one
  that runs per device on its own slots). The caller keeps positions below S.

  `attend(q_BxKxGxH, k_new_BxKxH, v_new_BxKxH, layer, past_B)` replaces the attention
  over a dense cache (the sampler passes ragged attention over its page pool; `cache`
  is then the pool, which only `attend` and `write` read). adapters: LoRA factors applied
  unmerged (see hidden_states); the sampler decodes merged params instead.
  """
  x = sharding.constrain(params["embed"][tokens_B][:, None, :], _X)  # [B, 1, D]
  pos_Bx1 = positions_B[:, None]
  past_B = positions_B if live_B is None else jnp.where(live_B, positions_B, 0)

  def step(sparse, x, xs):
    weights, index, _ = xs
    lp = _with_adapters(cfg, weights, None, adapter_scale)
    q, k, v = _qkv(cfg, lp, x, pos_Bx1)
    B, _, N, H = q.shape
    q_BxKxGxH = q.reshape(B, cfg.num_kv_heads, N // cfg.num_kv_heads, H)
    if attend is None:
      attn = attention_lib.decode_attention(
          q_BxKxGxH, k[:, 0], v[:, 0], cache.k, cache.v, index, past_B, block, kv_view
      )
    else:
      attn = attend(q_BxKxGxH, k[:, 0], v[:, 0], index, past_B)
    attn = attn.reshape(B, 1, N, H).astype(x.dtype)  # a cache may be wider than the params
    attn = sharding.constrain(attn, ("batch", "seq", "heads", "head_dim"))
    x, seen = _mlp_block(cfg, lp, _attn_out(lp, x, attn), sparse)
    return x, ((k[:, 0], v[:, 0]), seen)

  x, (k_new_LxBxKxH, v_new_LxBxKxH), seen = _over_layers(cfg, step, x, params, adapters)
  cache = (write or write_positions)(cache, k_new_LxBxKxH, v_new_LxBxKxH, positions_B)
  h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  logits = logits_from_hidden(cfg, params, h)[:, 0]
  if return_experts:
    return logits, cache, _experts_of(seen, tokens_B.shape[0], 1)[:, 0]
  return logits, cache


def _experts_of(seen, B: int, T: int) -> jax.Array:
  """The sparse layers' own experts [B, T, Ls, k] (Ls = 0 for a dense model)."""
  moe_out = _moe_out(seen)
  return jnp.zeros((B, T, 0, 1), jnp.int32) if moe_out is None else moe_out.experts


def chunk_kv(
    cfg: Qwen3Config,
    params: Params,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array,
    attend,
    adapters=None,
    adapter_scale: float = 1.0,
    logits: bool = False,
    return_experts: bool = False,
):
  """The KV [L, B, T, K, H] of a chunk of T tokens per row that continues a cached
  sequence (a slot's given tokens, written into its pages in one call, not one decode
  step a token): row b's tokens sit at positions_BxT[b]. `attend(q_BxTxKxGxH,
  k_BxTxKxH, v_BxTxKxH, layer)` gives each query's attention over the row's cache and,
  causally, over the chunk itself (the sampler's: paged_attention.paged_chunk_attention
  over its pool). adapters: as in decode_step. Returns the KVCache; with `logits`,
  (logits [B, T, V] float32, KVCache): the next-token logits after every position (a
  speculative verify pass). Without, the chunk's last token stays pending, as a decode
  step leaves it. return_experts appends each token's experts [B, T, Ls, k]."""
  x = sharding.constrain(params["embed"][tokens_BxT], _X)

  def step(sparse, x, xs):
    weights, index, _ = xs
    lp = _with_adapters(cfg, weights, None, adapter_scale)
    q, k, v = _qkv(cfg, lp, x, positions_BxT)
    B, T, N, H = q.shape
    attn = attend(q.reshape(B, T, cfg.num_kv_heads, N // cfg.num_kv_heads, H), k, v, index)
    attn = attn.reshape(B, T, N, H).astype(x.dtype)
    attn = sharding.constrain(attn, ("batch", "seq", "heads", "head_dim"))
    x, seen = _mlp_block(cfg, lp, _attn_out(lp, x, attn), sparse)
    return x, ((k, v), seen)

  x, (k, v), seen = _over_layers(cfg, step, x, params, adapters)
  out = (KVCache(k, v),)
  if logits:
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    out = (logits_from_hidden(cfg, params, h),) + out
  if return_experts:
    out += (_experts_of(seen, *tokens_BxT.shape),)
  return out if len(out) > 1 else out[0]


def write_positions(
    cache: KVCache, new_k_LxBxKxH: jax.Array, new_v_LxBxKxH: jax.Array, positions_B: jax.Array
) -> KVCache:
  """cache with row b's new k, v written at position positions_B[b], every layer.

  One dynamic_update_slice per row, unrolled: each is in place on a donated cache.
  (A scatter over rows makes XLA copy the whole cache, twice on CPU.)
  """
  k, v = cache.k, cache.v
  new_k_LxBxKxH, new_v_LxBxKxH = kv_store(new_k_LxBxKxH, k.dtype), kv_store(new_v_LxBxKxH, v.dtype)
  for b in range(k.shape[1]):
    at = (0, b, 0, positions_B[b], 0)
    k = jax.lax.dynamic_update_slice(k, new_k_LxBxKxH[:, b : b + 1, :, None, :], at)
    v = jax.lax.dynamic_update_slice(v, new_v_LxBxKxH[:, b : b + 1, :, None, :], at)
  return KVCache(k, v)


def token_logprobs(
    cfg: Qwen3Config,
    params: Params,
    tokens_BxT: jax.Array,
    targets_BxT: jax.Array,
    *,
    chunk_size: int = 512,
    temperature: float = 1.0,
    remat: bool = False,
    compute_dtype=None,
    positions_BxT=None,
    segments_BxT=None,
    adapters=None,
    adapter_scale: float = 1.0,
    routes=None,
    token_mask_BxT=None,
    moe_out: bool = False,
):
  """log p(targets[:, t] | tokens[:, :t+1]) and the entropy at t, both float32 [B, T]
  (and, with moe_out, the sparse layers' MoeOut: hidden_states).

  Logits exist for `chunk_size` positions at a time (forward and backward: each
  chunk is rematerialized), never as [B, T, V]. Logits are divided by
  `temperature`, as the sampler's behavior logprobs are. compute_dtype, positions,
  segments (packed rows, where t sees only its own segment) and LoRA adapters: see
  hidden_states; routes (routing replay) and token_mask_BxT too.
  """
  h = hidden_states(
      cfg,
      params,
      tokens_BxT,
      remat=remat,
      compute_dtype=compute_dtype,
      positions_BxT=positions_BxT,
      segments_BxT=segments_BxT,
      adapters=adapters,
      adapter_scale=adapter_scale,
      routes=routes,
      token_mask_BxT=token_mask_BxT,
      moe_out=True,
  )
  h, moe_seen = h
  params = compute_view(cfg, params, compute_dtype)
  logp, entropy = _chunked_logprobs(cfg, params, h, targets_BxT, chunk_size, temperature)
  return (logp, entropy, moe_seen) if moe_out else (logp, entropy)


def _chunked_logprobs(cfg: Qwen3Config, params: Params, h, targets_BxT, chunk_size, temperature):
  """token_logprobs' head: logprobs and entropy [B, T] from hidden states, `chunk_size`
  positions at a time (each chunk rematerialized)."""
  B, T, D = h.shape
  chunk = min(chunk_size, T)
  pad = -T % chunk
  h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
  targets = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
  num_chunks = (T + pad) // chunk
  h_CxBxTcxD = h.reshape(B, num_chunks, chunk, D).transpose(1, 0, 2, 3)
  t_CxBxTc = targets.reshape(B, num_chunks, chunk).transpose(1, 0, 2)

  @jax.checkpoint
  def one_chunk(h_BxTcxD, t_BxTc):
    logits = logits_from_hidden(cfg, params, h_BxTcxD) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, t_BxTc[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy

  logp, entropy = jax.lax.map(lambda xs: one_chunk(*xs), (h_CxBxTcxD, t_CxBxTc))
  unchunk = lambda a: a.transpose(1, 0, 2).reshape(B, -1)[:, :T]
  return unchunk(logp), unchunk(entropy)


@functools.partial(jax.jit, static_argnums=0)
def forward_jit(cfg: Qwen3Config, params: Params, tokens_BxT: jax.Array) -> jax.Array:
  """`forward`, jitted (cfg static)."""
  return forward(cfg, params, tokens_BxT)
