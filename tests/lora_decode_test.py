"""Mode lora_decode (april_jax/benchmarks/lora_decode.py): a LoRA policy decoded with its
adapters merged into a copy of the base, or applied unmerged in each step, gives the same
logits up to float rounding; the benchmark command runs and reports both sides."""

import json

import jax.numpy as jnp

from april_jax.benchmarks import lora_decode
from april_jax.models import lora, qwen3
import cli

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
)


def test_merged_and_unmerged_adapters_decode_the_same_logits():
  out = lora_decode.timed_sides(rows=4, context=16, repeats=1, rank=8, shape=TINY)
  assert out["rows"] == 4 and out["rank"] == 8 and len(out["merged_each_s"]) == 1
  assert out["max_abs_logit"] > 0.1  # the adapters change the logits (B is drawn)
  assert out["max_logit_diff"] <= 1e-5 * max(1.0, out["max_abs_logit"])


def test_the_adapters_change_the_logits_they_are_compared_on():
  cfg, base, adapters, spec = lora_decode.small_model(rank=8, shape=TINY)
  merged = lora.merge(base, adapters, spec)
  cache = qwen3.KVCache(*(jnp.zeros((2, 3, 2, 8, 16), jnp.float32) for _ in range(2)))
  tokens, positions = jnp.array([1, 2, 3]), jnp.array([0, 1, 2])
  with_adapters, _ = qwen3.decode_step(cfg, merged, tokens, positions, cache)
  without, _ = qwen3.decode_step(cfg, base, tokens, positions, cache)
  assert float(jnp.abs(with_adapters - without).max()) > 1e-3


def test_the_compiled_side_counts_every_layer_and_the_decode_copy():
  out = lora_decode.compiled_sides("qwen3_0_6b", rows=8, rank=8, context=16)
  m, u = out["merged"], out["unmerged"]
  assert m["resident_extra_bytes"] == out["weight_bytes"] and u["resident_extra_bytes"] == 0
  assert (
      out["weight_bytes"]
      == qwen3.Qwen3Config(**lora_decode.QWEN3_SHAPES["qwen3_0_6b"]).num_params() * 2
  )
  # The step's FLOPs hold every layer's products (XLA counts a loop's body once).
  cfg = qwen3.Qwen3Config(**lora_decode.QWEN3_SHAPES["qwen3_0_6b"])
  layer_params = (cfg.num_params() - cfg.vocab_size * cfg.hidden_size) / cfg.num_layers
  assert m["flops"] > 2 * 8 * layer_params * cfg.num_layers
  # Unmerged adds each layer's skinny products: 2 x rows x the adapters' numbers, at least.
  extra = 2 * 8 * lora.num_params(cfg, lora.LoraSpec(8, 16.0, lora.TARGETS))
  assert extra <= u["flops"] - m["flops"] < 3 * extra
  assert u["argument_bytes"] - m["argument_bytes"] == out["adapter_bytes"]


def test_the_command_prints_both_sides_and_one_json_line():
  out = cli.run(
      "--mode=lora_decode",
      "--lora_shape=qwen3_0_6b",
      "--lora_rows=8",
      "--repeats=1",
      "--out_dir=",
      module="april_jax.bench",
      devices=None,
      timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert "resident beyond base (GB)" in out.stdout and "logits differ by at most" in out.stdout
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["mode"] == "lora_decode" and result["compiled"]["rows"] == 8
  assert result["timed"]["max_logit_diff"] <= 1e-5 * max(1.0, result["timed"]["max_abs_logit"])
