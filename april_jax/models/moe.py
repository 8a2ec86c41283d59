"""The mixture-of-experts feed-forward of Qwen3-MoE: a float32 router (softmax, top-k,
optionally renormalised over the chosen k), experts that compute only the tokens routed to
them (tokens sorted by expert, each projection grouped by expert: whole blocks of an
expert's rows, or `jax.lax.ragged_dot`), no token dropped, and the router's
load-balancing loss.

Routing replay: `replayed_gates` gives the gate weights of experts chosen elsewhere (the
rollout's) from this router's logits, so the learner computes the sampler's experts while
its router still learns.

Shapes: T tokens, D model width, E experts, K experts a token, F an expert's width."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# A recorded route's value for "not recorded" (routes are uint8, so a model has at most 255
# experts: Qwen3-MoE's have 128). The learner's replay computes its own router's choice
# there.
UNRECORDED = 255


def router_logits(x_TxD: jax.Array, router_DxE: jax.Array) -> jax.Array:
  """The router's logits in float32, whatever the compute dtype."""
  return jnp.einsum("td,de->te", x_TxD.astype(jnp.float32), router_DxE.astype(jnp.float32))


def _gates(probs_TxK: jax.Array, norm_topk_prob: bool) -> jax.Array:
  if norm_topk_prob:
    return probs_TxK / jnp.sum(probs_TxK, axis=-1, keepdims=True)
  return probs_TxK


def route(logits_TxE: jax.Array, top_k: int, norm_topk_prob: bool):
  """(gates_TxK float32, experts_TxK int32): the k most probable experts of each token and
  their softmax probabilities (renormalised to sum to one with norm_topk_prob)."""
  probs = jax.nn.softmax(logits_TxE.astype(jnp.float32), axis=-1)
  top_probs, experts = jax.lax.top_k(probs, top_k)
  return _gates(top_probs, norm_topk_prob), experts.astype(jnp.int32)


def replayed(own_TxK: jax.Array, recorded_TxK: jax.Array) -> jax.Array:
  """The experts to compute: the recorded ones, a token's own top k where its route was
  not recorded (UNRECORDED in any of its k)."""
  recorded_TxK = recorded_TxK.astype(jnp.int32)
  missing = jnp.any(recorded_TxK == UNRECORDED, axis=-1, keepdims=True)
  return jnp.where(missing, own_TxK, recorded_TxK)


def replayed_gates(logits_TxE: jax.Array, experts_TxK: jax.Array, norm_topk_prob: bool):
  """The gates of the given experts (recorded by the rollout) from these logits: the same
  softmax and renormalisation as `route`, at the recorded experts instead of the top k."""
  probs = jax.nn.softmax(logits_TxE.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(probs, experts_TxK.astype(jnp.int32), axis=-1)
  return _gates(chosen, norm_topk_prob)


def block_rows(pairs: int, num_experts: int) -> int:
  """The rows of a block in the `blocks` path: a power of two near a quarter of the mean
  rows an expert gets, between 8 and 512. The blocks are shaped for the worst case, every
  expert's last block nearly empty, which then adds at most a quarter of the pairs."""
  mean = pairs / max(num_experts, 1)
  size = 8
  while size * 2 <= mean / 4 and size < 512:
    size *= 2
  return size


def _grouped_blocks(x_RxD, w_ExDxF, sizes_E, block: int):
  """x's rows (sorted by expert, `sizes_E` a group) through their expert's matrix: the
  groups padded to whole blocks of `block` rows, each block one matmul with its expert's
  matrix (grouped_matmul). Computes at most R + E·(block - 1) rows, never every expert on
  every row."""
  R, D = x_RxD.shape
  E = w_ExDxF.shape[0]
  padded = (sizes_E + block - 1) // block * block
  padded_start = jnp.cumsum(padded) - padded
  start = jnp.cumsum(sizes_E) - sizes_E
  expert_of_row = jnp.repeat(jnp.arange(E), sizes_E, total_repeat_length=R)
  row = padded_start[expert_of_row] + jnp.arange(R) - start[expert_of_row]
  blocks = -(-(R + E * (block - 1)) // block)
  x_blocks = jnp.zeros((blocks * block, D), x_RxD.dtype).at[row].set(x_RxD)
  ends = jnp.cumsum(padded)
  expert_of_block = jnp.minimum(
      jnp.searchsorted(ends, jnp.arange(blocks) * block, side="right"), E - 1
  )
  out = grouped_matmul(x_blocks.reshape(blocks, block, D), w_ExDxF, expert_of_block)
  return out.reshape(blocks * block, -1)[row]


# Blocks a grouped_matmul step multiplies at once: their expert matrices are gathered (a
# copy), so this bounds the copy at GROUP matrices, whatever the tokens.
GROUP = 32


def _groups(n: int) -> tuple[int, int]:
  """(blocks a step, steps) for n blocks."""
  size = min(n, GROUP)
  return size, -(-n // size)


def _by_group(a, size: int, steps: int):
  """a [n, ...] padded to steps x size and split into steps of size."""
  pad = steps * size - a.shape[0]
  a = jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
  return a.reshape((steps, size) + a.shape[1:])


@jax.custom_vjp
def grouped_matmul(x_NxBxD: jax.Array, w_ExDxF: jax.Array, expert_N: jax.Array) -> jax.Array:
  """y[n] = x[n] @ w[expert[n]] for N blocks of B rows, [N, B, F], a scan over steps of
  GROUP blocks: each step gathers its blocks' matrices and runs one batched matmul, so
  no more than GROUP expert matrices are ever copied. Its gradient (_grouped_bwd) adds
  each step's weight gradient into its experts' slots in place: no gradient of a gathered
  copy exists either."""
  size, steps = _groups(x_NxBxD.shape[0])
  step = lambda xs: jnp.einsum("gbd,gdf->gbf", xs[0], w_ExDxF[xs[1]])
  y = jax.lax.map(step, (_by_group(x_NxBxD, size, steps), _by_group(expert_N, size, steps)))
  return y.reshape((-1,) + y.shape[2:])[: x_NxBxD.shape[0]]


def _grouped_fwd(x_NxBxD, w_ExDxF, expert_N):
  return grouped_matmul(x_NxBxD, w_ExDxF, expert_N), (x_NxBxD, w_ExDxF, expert_N)


def _grouped_bwd(residuals, dy_NxBxF):
  x, w, expert = residuals
  N = x.shape[0]
  size, steps = _groups(N)
  xs = (_by_group(x, size, steps), _by_group(dy_NxBxF, size, steps), _by_group(expert, size, steps))

  def step(dw, args):
    x_g, dy_g, e_g = args
    dx_g = jnp.einsum("gbf,gdf->gbd", dy_g, w[e_g])
    dw = dw.at[e_g].add(jnp.einsum("gbd,gbf->gdf", x_g, dy_g, preferred_element_type=jnp.float32))
    return dw, dx_g

  dw, dx = jax.lax.scan(step, jnp.zeros(w.shape, jnp.float32), xs)
  dx = dx.reshape((-1,) + dx.shape[2:])[:N].astype(x.dtype)
  return dx, dw.astype(w.dtype), np.zeros(expert.shape, jax.dtypes.float0)


grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)


def experts_ffn(
    x_TxD: jax.Array,
    experts_TxK: jax.Array,
    gates_TxK: jax.Array,
    gate_ExDxF: jax.Array,
    up_ExDxF: jax.Array,
    down_ExFxD: jax.Array,
    impl: str = "blocks",
) -> jax.Array:
  """Σ_k gate_k · expert_k(x) for every token, each expert computing only its own tokens:
  the T·K (token, expert) pairs sorted by expert, then each projection grouped by expert,
  as `impl` says: `blocks` (each expert's rows in whole blocks, a batched matmul over the
  blocks) or `ragged` (`jax.lax.ragged_dot`, which some backends lower to every group on
  every row). Dropless: every pair is computed. Output in x's dtype."""
  if impl not in IMPLS:
    raise ValueError(f"experts_ffn: impl {impl!r} is not one of {IMPLS}")
  T, D = x_TxD.shape
  K = experts_TxK.shape[-1]
  E = gate_ExDxF.shape[0]
  flat_experts = experts_TxK.reshape(T * K)
  order = jnp.argsort(flat_experts, stable=True)
  token_of_pair = order // K
  sizes = jnp.bincount(flat_experts, length=E).astype(jnp.int32)
  x_sorted = x_TxD[token_of_pair]
  dtype = x_TxD.dtype
  if impl == "ragged":
    grouped = lambda rows, w: jax.lax.ragged_dot(rows, w.astype(dtype), sizes)
  else:
    block = block_rows(T * K, E)
    grouped = lambda rows, w: _grouped_blocks(rows, w.astype(dtype), sizes, block)
  hidden = jax.nn.silu(grouped(x_sorted, gate_ExDxF)) * grouped(x_sorted, up_ExDxF)
  out_sorted = grouped(hidden, down_ExFxD)
  weights = gates_TxK.reshape(T * K)[order]
  weighted = out_sorted.astype(jnp.float32) * weights[:, None]
  out = jnp.zeros((T, D), jnp.float32).at[token_of_pair].add(weighted)
  return out.astype(dtype)


IMPLS = ("blocks", "ragged")


def balance_stats(logits_TxE: jax.Array, experts_TxK: jax.Array, mask_T=None):
  """One layer's terms of the load-balancing loss over the tokens the mask keeps (all by
  default): (f_E, P_E), f_e the fraction of tokens that chose e (summed over the k
  choices), P_e its mean router probability."""
  E = logits_TxE.shape[-1]
  probs = jax.nn.softmax(logits_TxE.astype(jnp.float32), axis=-1)
  mask = jnp.ones(probs.shape[0], jnp.float32) if mask_T is None else mask_T.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(mask), 1.0)
  chosen = jax.nn.one_hot(experts_TxK, E, dtype=jnp.float32).sum(axis=1)  # TxE, K per row
  fraction = jnp.sum(chosen * mask[:, None], axis=0) / n
  mean_prob = jnp.sum(probs * mask[:, None], axis=0) / n
  return fraction, mean_prob


def balance_loss(fraction_LxE: jax.Array, mean_prob_LxE: jax.Array) -> jax.Array:
  """Switch Transformer's auxiliary loss over L layers as transformers' Qwen3-MoE
  computes it (every layer's tokens pooled): E · Σ_e mean_l f_le · mean_l P_le. K when
  balanced."""
  E = fraction_LxE.shape[-1]
  return E * jnp.sum(jnp.mean(fraction_LxE, axis=0) * jnp.mean(mean_prob_LxE, axis=0))


def load_balancing_loss(logits_TxE: jax.Array, experts_TxK: jax.Array, mask_T=None) -> jax.Array:
  """The auxiliary loss of one layer (`balance_loss` of its `balance_stats`)."""
  fraction, mean_prob = balance_stats(logits_TxE, experts_TxK, mask_T)
  return balance_loss(fraction[None], mean_prob[None])
