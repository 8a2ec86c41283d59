"""The matmul FLOPs a function asks for, counted on its jaxpr: a scan's body times its
length (XLA's compiled count takes it once), nested programs and ragged products."""

import jax
import jax.numpy as jnp

from april_jax.benchmarks.jaxpr_flops import matmul_flops


def test_a_plain_matmul_counts_as_xla_counts_it():
  a, b = jax.ShapeDtypeStruct((32, 64), jnp.float32), jax.ShapeDtypeStruct((64, 16), jnp.float32)
  cost = jax.jit(jnp.matmul).lower(a, b).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert matmul_flops(jnp.matmul, a, b) == 2 * 32 * 64 * 16 == cost["flops"]


def test_a_scanned_matmul_counts_every_step_and_a_nested_jit_counts_once():
  x, w = jax.ShapeDtypeStruct((10, 8, 64), jnp.float32), jax.ShapeDtypeStruct((64, 64), jnp.float32)
  mapped = lambda x, w: jax.lax.map(jax.jit(lambda a: a @ w), x)
  assert matmul_flops(mapped, x, w) == 10 * 2 * 8 * 64 * 64


def test_a_ragged_product_counts_the_rows_it_asks_for():
  rows, groups = jax.ShapeDtypeStruct((12, 4), jnp.float32), jax.ShapeDtypeStruct(
      (3, 4, 5), jnp.float32
  )
  sizes = jax.ShapeDtypeStruct((3,), jnp.int32)
  assert matmul_flops(jax.lax.ragged_dot, rows, groups, sizes) == 2 * 12 * 4 * 5
