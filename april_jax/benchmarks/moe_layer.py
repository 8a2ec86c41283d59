"""The expert layer against a dense feed-forward of the same active width (K experts of
width F against one MLP of width K·F) at equal tokens: timed here at Qwen3-30B-A3B's
ratios scaled down, and at its real widths the FLOPs the program's matmuls ask for
(benchmarks/jaxpr_flops.py) beside the FLOPs and bytes XLA's compiled count gives.
Both sides carry the router's matmul out of the comparison: the expert side is routing
(softmax, top-k, sort) plus the grouped matmuls, in each of `moe.IMPLS`, the dense side
three matmuls."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from april_jax.benchmarks import common, jaxpr_flops
from april_jax.models import moe

# (D, E, K, F) of Qwen3-30B-A3B (shared/model config) and the same at a quarter width.
REAL = dict(D=2048, E=128, K=8, F=768)
SCALED = dict(D=512, E=64, K=8, F=192)


def _expert_side(x, router, gate, up, down, top_k, impl):
  gates, experts = moe.route(moe.router_logits(x, router), top_k, True)
  return moe.experts_ffn(x, experts, gates, gate, up, down, impl)


def _dense_side(x, gate, up, down):
  return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def _shapes(D, E, K, F, tokens, dtype):
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  expert = (s(tokens, D), s(D, E), s(E, D, F), s(E, D, F), s(E, F, D))
  dense = (s(tokens, D), s(D, K * F), s(D, K * F), s(K * F, D))
  return expert, dense


def _compiled(shape: dict, tokens: int, dtype) -> dict:
  """FLOPs and bytes XLA's cost analysis gives each side, compiled without running."""
  expert, dense = _shapes(**shape, tokens=tokens, dtype=dtype)
  sides = [
      (impl, jax.jit(_expert_side, static_argnums=(5, 6)), (*expert, shape["K"], impl))
      for impl in moe.IMPLS
  ]
  arrays = lambda args: [a for a in args if isinstance(a, jax.ShapeDtypeStruct)]
  out = {}
  for name, fn, args in [*sides, ("dense", jax.jit(_dense_side), dense)]:
    cost = fn.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    static = args[len(arrays(args)) :]
    asked = jaxpr_flops.matmul_flops(
        lambda *a, fn=fn, static=static: fn(*a, *static), *arrays(args)
    )
    out[name] = {
        "gflops": asked / 1e9,
        "xla_gflops": cost.get("flops", 0.0) / 1e9,
        "mb": cost.get("bytes accessed", 0.0) / 1e6,
    }
  return out


def _timed(shape: dict, tokens: int, repeats: int, dtype="float32") -> dict:
  D, E, K, F = (shape[k] for k in "DEKF")
  ks = jax.random.split(jax.random.key(0), 8)
  x = jax.random.normal(ks[0], (tokens, D), dtype)
  router = jax.random.normal(ks[1], (D, E), jnp.float32)
  w = lambda k, *shape: (jax.random.normal(k, shape, jnp.float32) / shape[-2] ** 0.5).astype(dtype)
  expert_args = (x, router, w(ks[2], E, D, F), w(ks[3], E, D, F), w(ks[4], E, F, D))
  dense_args = (x, w(ks[5], D, K * F), w(ks[6], D, K * F), w(ks[7], K * F, D))
  sides = [
      (impl, jax.jit(lambda *a, impl=impl: _expert_side(*a, K, impl)), expert_args)
      for impl in moe.IMPLS
  ]
  out = {}
  for name, fn, args in [*sides, ("dense", jax.jit(_dense_side), dense_args)]:
    jax.block_until_ready(fn(*args))  # compiles
    best, _ = common.best_of(repeats, lambda fn=fn, args=args: jax.block_until_ready(fn(*args)))
    out[f"{name}_ms"] = 1e3 * best
  for impl in moe.IMPLS:
    out[f"{impl}_over_dense"] = out[f"{impl}_ms"] / out["dense_ms"]
  return out


def run(tokens: int = 1024, repeats: int = 5, timed_at: str = "scaled", dtype="float32") -> dict:
  """The layer timed at `timed_at`'s widths ("scaled": a quarter of 30B-A3B's, for a CPU;
  "real": 30B-A3B's, for a GPU) in `dtype`, and compiled at the real widths."""
  shape = {"scaled": SCALED, "real": REAL}[timed_at]
  timed = _timed(shape, tokens, repeats, dtype)
  compiled = _compiled(REAL, tokens, jnp.bfloat16)
  print(
      f"expert layer vs dense of the same active width, {tokens} tokens, timed at "
      f"D={shape['D']} E={shape['E']} K={shape['K']} F={shape['F']} in {dtype} "
      f"({jax.devices()[0].platform}):"
  )
  for impl in moe.IMPLS:
    print(
        f"  experts ({impl}) {timed[f'{impl}_ms']:.2f} ms, dense {timed['dense_ms']:.2f} ms: "
        f"{timed[f'{impl}_over_dense']:.2f}x"
    )
  print(
      f"at Qwen3-30B-A3B's widths (bfloat16), {tokens} tokens: GFLOP the program's matmuls "
      "ask for (each loop's body times its trips); XLA's compiled count (a loop's body once) "
      "and the MB it counts moved"
  )
  for name, c in compiled.items():
    print(f"  {name}: {c['gflops']:.1f} GFLOP; XLA {c['xla_gflops']:.1f} GFLOP, {c['mb']:.0f} MB")
  return {
      "mode": "moe_layer",
      "tokens": tokens,
      "timed_at": timed_at,
      "dtype": str(dtype),
      "scaled": SCALED,
      "real": REAL,
      **timed,
      "compiled": compiled,
  }
