"""The expert layer: grouped (ragged) expert matmuls against every expert computed for
every token, the router and the layer against transformers' Qwen3-MoE block, routing
replay's gates, and the load-balancing loss against transformers'."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.models import moe
import hf_oracle

T, D, E, F = 24, 16, 8, 12


def _weights(seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(ks[0], (T, D), jnp.float32)
  router = jax.random.normal(ks[1], (D, E), jnp.float32)
  gate = jax.random.normal(ks[2], (E, D, F), jnp.float32) / np.sqrt(D)
  up = jax.random.normal(ks[3], (E, D, F), jnp.float32) / np.sqrt(D)
  down = jax.random.normal(ks[4], (E, F, D), jnp.float32) / np.sqrt(F)
  return x, router, gate, up, down


def _every_expert(x, experts, gates, gate, up, down):
  """Every expert on every token, weighted by the token's gate where it chose the expert
  and 0 elsewhere: the layer's definition, at E times the compute."""
  all_out = jnp.einsum(
      "tef,efd->ted",
      jax.nn.silu(jnp.einsum("td,edf->tef", x, gate)) * jnp.einsum("td,edf->tef", x, up),
      down,
  )
  weight_TxE = jnp.sum(jax.nn.one_hot(experts, E) * gates[..., None], axis=1)
  return jnp.einsum("te,ted->td", weight_TxE, all_out)


@pytest.mark.parametrize("impl", moe.IMPLS)
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_the_grouped_experts_equal_every_expert_on_every_token_values_and_gradients(top_k, impl):
  x, router, gate, up, down = _weights()
  gates, experts = moe.route(moe.router_logits(x, router), top_k, norm_topk_prob=True)
  got = moe.experts_ffn(x, experts, gates, gate, up, down, impl)
  want = _every_expert(x, experts, gates, gate, up, down)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  def loss(fn, x, gates, gate, up, down):
    return jnp.sum(fn(x, experts, gates, gate, up, down) * jnp.cos(jnp.arange(D)))

  args = (x, gates, gate, up, down)
  ffn = lambda *a: moe.experts_ffn(*a, impl)
  g_got = jax.grad(lambda *a: loss(ffn, *a), argnums=(0, 1, 2, 3, 4))(*args)
  g_want = jax.grad(lambda *a: loss(_every_expert, *a), argnums=(0, 1, 2, 3, 4))(*args)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", moe.IMPLS)
def test_experts_without_tokens_and_one_expert_with_all_of_them(impl):
  x, _, gate, up, down = _weights(1)
  experts = jnp.full((T, 2), 5, jnp.int32).at[:, 1].set(2)  # experts 2 and 5 only
  gates = jnp.full((T, 2), 0.5, jnp.float32)
  got = moe.experts_ffn(x, experts, gates, gate, up, down, impl)
  np.testing.assert_allclose(got, _every_expert(x, experts, gates, gate, up, down), atol=1e-5)
  one = jnp.zeros((T, 1), jnp.int32)  # every token to expert 0: one group of T rows
  got = moe.experts_ffn(x, one, jnp.ones((T, 1)), gate, up, down, impl)
  np.testing.assert_allclose(
      got, _every_expert(x, one, jnp.ones((T, 1)), gate, up, down), atol=1e-5
  )
  got_bf16 = moe.experts_ffn(x.astype(jnp.bfloat16), experts, gates, gate, up, down, impl)
  assert got_bf16.dtype == jnp.bfloat16


def test_the_blocks_pad_each_expert_to_whole_blocks_and_no_more():
  assert moe.block_rows(24 * 2, 8) == 8  # a few rows an expert: the smallest block
  assert moe.block_rows(8192 * 8, 128) == 128  # 512 rows an expert on average: a quarter
  assert moe.block_rows(10**7, 8) == 512
  with pytest.raises(ValueError, match="impl 'dense' is not one of"):
    moe.experts_ffn(
        *_weights()[:1], jnp.zeros((T, 1), jnp.int32), jnp.ones((T, 1)), *_weights()[2:], "dense"
    )


def test_replayed_gates_at_the_routers_own_choice_are_its_gates_and_elsewhere_its_probabilities():
  x, router, *_ = _weights(2)
  logits = moe.router_logits(x, router)
  for norm in (True, False):
    gates, experts = moe.route(logits, 2, norm)
    np.testing.assert_allclose(moe.replayed_gates(logits, experts, norm), gates, rtol=1e-6)
  other = (jnp.argsort(logits, axis=-1)[:, :2]).astype(jnp.int32)  # the two least likely
  probs = jax.nn.softmax(logits, axis=-1)
  want = jnp.take_along_axis(probs, other, axis=-1)
  np.testing.assert_allclose(moe.replayed_gates(logits, other, False), want, rtol=1e-6)
  np.testing.assert_allclose(
      moe.replayed_gates(logits, other, True), want / want.sum(-1, keepdims=True), rtol=1e-6
  )
  # The router still learns under replay: its gradient is not zero.
  g = jax.grad(lambda r: jnp.sum(moe.replayed_gates(moe.router_logits(x, r), other, True) ** 2))
  assert float(jnp.abs(g(router)).max()) > 0


@pytest.mark.parametrize(
    "top_k,norm,impl",
    [(2, True, "blocks"), (2, False, "ragged"), (4, True, "blocks"), (1, False, "blocks")],
)
def test_the_layer_and_its_balancing_loss_equal_transformers_qwen3_moe(top_k, norm, impl):
  hf_oracle.require("torch", "transformers")
  x, router, gate, up, down = _weights(3)
  want, want_aux = hf_oracle.moe_block(x, router, gate, up, down, top_k, norm)
  logits = moe.router_logits(x, router)
  gates, experts = moe.route(logits, top_k, norm)
  np.testing.assert_allclose(
      moe.experts_ffn(x, experts, gates, gate, up, down, impl), want, rtol=1e-5, atol=1e-5
  )
  np.testing.assert_allclose(moe.load_balancing_loss(logits, experts), want_aux, rtol=1e-5)


def test_the_balancing_loss_is_k_when_balanced_and_ignores_masked_tokens():
  flat = jnp.zeros((E, E), jnp.float32)  # uniform probabilities, each expert chosen twice
  balanced = jnp.stack([jnp.arange(E), (jnp.arange(E) + 1) % E], axis=1)
  np.testing.assert_allclose(moe.load_balancing_loss(flat, balanced), 2.0, rtol=1e-6)
  x, router, *_ = _weights(4)
  logits = moe.router_logits(x, router)
  _, experts = moe.route(logits, 2, True)
  mask = jnp.arange(T) < T // 2
  np.testing.assert_allclose(
      moe.load_balancing_loss(logits, experts, mask),
      moe.load_balancing_loss(logits[: T // 2], experts[: T // 2]),
      rtol=1e-6,
  )


def test_the_blocks_compile_to_the_flops_of_the_routed_tokens_not_of_every_expert():
  """At Qwen3-30B-A3B's widths (128 experts, 8 a token), 1,024 tokens: the blocks path's
  matmul FLOPs (its jaxpr's, every scanned step counted) stay within 1.3x a dense
  feed-forward of the same active width (the padding of the last block of each expert),
  not the 16x of every expert on every row."""
  from april_jax.benchmarks import moe_layer  # pylint: disable=g-import-not-at-top

  compiled = moe_layer._compiled(moe_layer.REAL, 1024, jnp.bfloat16)  # pylint: disable=protected-access
  assert compiled["blocks"]["gflops"] <= 1.3 * compiled["dense"]["gflops"], compiled


def test_the_grouped_matmul_never_copies_more_than_a_step_of_expert_matrices():
  """Blocks in steps of GROUP: the forward and its gradient (dw added into each expert's
  slot, in place) match a plain gather-and-multiply, with no [blocks, D, F] array in
  either program."""
  rng = np.random.default_rng(0)
  N, B, D, F, E = 70, 4, 6, 5, 9  # 70 blocks: three steps of 32, the last padded
  x = jnp.asarray(rng.normal(size=(N, B, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(E, D, F)), jnp.float32)
  expert = jnp.asarray(rng.integers(0, E, N), jnp.int32)
  plain = lambda x, w: jnp.einsum("nbd,ndf->nbf", x, w[expert])
  np.testing.assert_allclose(moe.grouped_matmul(x, w, expert), plain(x, w), rtol=1e-5, atol=1e-5)
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
  ours = jax.grad(loss(lambda x, w: moe.grouped_matmul(x, w, expert)), argnums=(0, 1))(x, w)
  theirs = jax.grad(loss(plain), argnums=(0, 1))(x, w)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  text = (
      jax.jit(jax.grad(loss(lambda x, w: moe.grouped_matmul(x, w, expert)), argnums=1))
      .lower(x, w)
      .as_text()
  )
  assert f"{N}x{D}x{F}" not in text and f"{moe.GROUP}x{D}x{F}" in text
