"""The matmul FLOPs a JAX function asks for, counted on its jaxpr: every dot_general (and
ragged_dot, at the rows it asks for: a backend may compute more), each scan's body times
its length, every nested program (jit, custom gradients, cond's
costliest branch). XLA's own cost analysis counts a loop's body once, so a program that
scans over blocks would look cheaper than it is; this count does not."""

from __future__ import annotations

import math

import jax
from jax.extend import core as jax_core


def matmul_flops(fn, *args) -> float:
  """2 x multiply-adds of every matrix product `fn(*args)` computes (args may be
  ShapeDtypeStructs). A while loop's body counts once: its trip count is not known."""
  return _count(jax.make_jaxpr(fn)(*args).jaxpr)


def _count(jaxpr) -> float:
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
      continue
    if eqn.primitive.name.startswith("ragged_dot"):  # [m, k] rows by their group's [k, n]: as asked
      total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * eqn.invars[0].aval.shape[-1]
      continue
    inner = [_count(j) for j in _sub_jaxprs(eqn.params)]
    if eqn.primitive.name == "cond":
      total += max(inner, default=0.0)
    else:
      total += sum(inner) * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
  return total


def _sub_jaxprs(params: dict):
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jax_core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax_core.Jaxpr):
        yield item
