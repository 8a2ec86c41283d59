"""Qwen3-MoE in JAX against transformers' Qwen3MoeForCausalLM: dense layers among sparse
ones, norm_topk_prob on and off, top-k 1, 2 and 4; the export read back by transformers;
decode and the recorded experts; routing replay; the same under an 8-device mesh."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax import sharding
from april_jax.models import hf_io, layer_runs, qwen3
from conftest import MODEL_CONFIGS_DIR, mesh_or_skip, save_random_hf_qwen3
import hf_oracle

_BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
MOE_CONFIGS = {
    # layer 1 dense (mlp_only_layers) among three sparse ones
    "mlp_only_top2_norm": dict(
        _BASE, num_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False,
    ),
    # every second layer sparse (decoder_sparse_step), one expert a token, gates unnormalised
    "step2_top1": dict(
        _BASE, num_layers=4, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=48,
        norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True,
    ),
    # all sparse (as 30B-A3B), four experts a token, unnormalised
    "all_sparse_top4": dict(
        _BASE, num_layers=2, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=16,
        norm_topk_prob=False, tie_word_embeddings=False,
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(MOE_CONFIGS))
def moe_dir(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(f"moe_{request.param}")
  return save_random_hf_qwen3(path, **MOE_CONFIGS[request.param])


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("moe_mixed")
  return save_random_hf_qwen3(path, **MOE_CONFIGS["mlp_only_top2_norm"])


def _tokens(seed, shape, vocab):
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def test_the_layers_kinds_follow_transformers_rule():
  cfg = hf_io.config_from_hf(
      dict(
          model_type="qwen3_moe", vocab_size=8, hidden_size=8, intermediate_size=8,
          num_hidden_layers=6, num_attention_heads=2, num_experts=4, num_experts_per_tok=2,
          moe_intermediate_size=4, decoder_sparse_step=2, mlp_only_layers=[3],
      )
  )  # fmt: skip
  assert [layer_runs.is_sparse(cfg, i) for i in range(6)] == [0, 1, 0, 0, 0, 1]
  assert [tuple(r) for r in layer_runs.runs(cfg)] == [
      (0, 1, False, 0), (1, 2, True, 0), (2, 5, False, 1), (5, 6, True, 1),
  ]  # fmt: skip
  params = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.key(0)))["layers"]
  assert params["gate"].shape[0] == 4 and params["experts_gate"].shape == (2, 4, 8, 4)
  assert sum(a.size for a in jax.tree.leaves(params)) + 8 * 8 * 2 + 8 == cfg.num_params()


def test_released_moe_configs_parse_to_their_published_sizes():
  c30 = hf_io.config_from_hf(
      json.loads((MODEL_CONFIGS_DIR / "qwen3-30b-a3b.config.json").read_text())
  )
  c235 = hf_io.config_from_hf(
      json.loads((MODEL_CONFIGS_DIR / "qwen3-235b-a22b.config.json").read_text())
  )
  assert (c30.num_experts, c30.num_experts_per_tok, c30.sparse_layers) == (128, 8, 48)
  assert c30.norm_topk_prob and c235.sparse_layers == 94
  assert 30.0e9 < c30.num_params() < 31.0e9 and 3.2e9 < c30.num_params(active=True) < 3.4e9
  assert 234e9 < c235.num_params() < 236e9 and 21e9 < c235.num_params(active=True) < 23e9


def test_forward_matches_transformers_within_1e4(moe_dir):
  hf_oracle.require("torch", "transformers")
  cfg, params = hf_io.load_pretrained(moe_dir)
  assert cfg.num_experts and cfg.sparse_layers
  tokens = _tokens(0, (3, 24), cfg.vocab_size)
  ours = np.asarray(qwen3.forward_jit(cfg, params, jnp.asarray(tokens)))
  theirs = hf_oracle.logits(moe_dir, tokens)
  assert np.abs(theirs).max() > 1.0
  np.testing.assert_array_less(np.abs(ours - theirs).max(), 1e-4)


def test_the_export_is_read_back_by_transformers_and_by_us(mixed_dir, tmp_path):
  hf_oracle.require("torch", "transformers")
  cfg, params = hf_io.load_pretrained(mixed_dir)
  hf_io.save_pretrained(tmp_path / "out", cfg, params, max_shard_bytes=100_000)
  assert (tmp_path / "out" / hf_io.INDEX_NAME).is_file()  # sharded files
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["architectures"] == ["Qwen3MoeForCausalLM"]
  assert written["mlp_only_layers"] == [1]
  tokens = _tokens(1, (2, 16), cfg.vocab_size)
  np.testing.assert_allclose(
      hf_oracle.logits(tmp_path / "out", tokens), hf_oracle.logits(mixed_dir, tokens), atol=1e-6
  )
  cfg2, params2 = hf_io.load_pretrained(tmp_path / "out")
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_decode_steps_match_forward_and_record_the_forwards_experts(mixed_dir):
  cfg, params = hf_io.load_pretrained(mixed_dir)
  T, P = 12, 5
  full = jnp.asarray(_tokens(2, (2, T), cfg.vocab_size))
  h, moe_out = qwen3.hidden_states(cfg, params, full, moe_out=True)
  reference = qwen3.logits_from_hidden(cfg, params, h)
  _, kv = qwen3.hidden_states(cfg, params, full[:, :P], return_kv=True)
  pad = ((0, 0), (0, 0), (0, T - P), (0, 0), (0, 0))
  cache = qwen3.KVCache(*(jnp.pad(a, pad).transpose(0, 1, 3, 2, 4) for a in (kv.k, kv.v)))
  step = jax.jit(qwen3.decode_step, static_argnums=0, static_argnames="return_experts")
  for t in range(P, T):
    positions = jnp.full((2,), t, jnp.int32)
    logits, cache, experts = step(cfg, params, full[:, t], positions, cache, return_experts=True)
    np.testing.assert_allclose(logits, reference[:, t], atol=1e-4)
    np.testing.assert_array_equal(experts, moe_out.experts[:, t])
  assert moe_out.experts.shape == (2, T, cfg.sparse_layers, cfg.num_experts_per_tok)


def test_replayed_routes_decide_the_experts_and_the_router_still_learns(mixed_dir):
  cfg, params = hf_io.load_pretrained(mixed_dir)
  tokens = jnp.asarray(_tokens(3, (2, 10), cfg.vocab_size))
  logp, _, seen = qwen3.token_logprobs(cfg, params, tokens, tokens, moe_out=True)
  same, _ = qwen3.token_logprobs(cfg, params, tokens, tokens, routes=seen.experts)
  np.testing.assert_array_equal(same, logp)  # its own routes: the same computation
  # Other experts for the later half of the tokens: only those positions' logprobs move
  # (causal attention carries the change forward, so positions before it stay).
  other = seen.experts.at[:, 5:].set((seen.experts[:, 5:] + 1) % cfg.num_experts)
  moved, _ = qwen3.token_logprobs(cfg, params, tokens, tokens, routes=other)
  np.testing.assert_array_equal(moved[:, :5], logp[:, :5])
  assert np.abs(np.asarray(moved[:, 5:] - logp[:, 5:])).min() > 1e-6

  def loss(p):
    return qwen3.token_logprobs(cfg, p, tokens, tokens, routes=other)[0].sum()

  grads = jax.grad(loss)(params)["layers"]
  assert np.abs(np.asarray(grads["router"])).min(axis=(1, 2)).max() >= 0
  assert (np.abs(np.asarray(grads["router"])).sum(axis=(1, 2)) > 0).all()  # each sparse layer


def test_the_load_balancing_loss_is_transformers_over_all_layers(mixed_dir):
  """E Σ_e (mean over layers of f_e)(mean over layers of P_e), as load_balancing_loss_func
  pools every layer's tokens: checked against the layers' own router logits."""
  cfg, params = hf_io.load_pretrained(mixed_dir)
  tokens = jnp.asarray(_tokens(4, (1, 16), cfg.vocab_size))
  _, seen = qwen3.hidden_states(cfg, params, tokens, moe_out=True)
  E, K = cfg.num_experts, cfg.num_experts_per_tok
  loss = float(qwen3.moe.balance_loss(seen.fraction, seen.mean_prob))
  f = np.asarray(jax.nn.one_hot(seen.experts[0], E).sum(axis=2).mean(axis=(0)))  # Ls x E
  np.testing.assert_allclose(np.asarray(seen.fraction), f, atol=1e-6)
  assert seen.fraction.shape == (cfg.sparse_layers, E)
  np.testing.assert_allclose(np.asarray(seen.fraction).sum(axis=1), K, rtol=1e-6)
  assert 0.5 * K < loss < 4 * K


@pytest.mark.parametrize("experts_rule", [None, "fsdp"])
def test_an_8_device_mesh_computes_what_one_device_does(mixed_dir, experts_rule):
  mesh = mesh_or_skip((2, 2, 2))
  cfg, params = hf_io.load_pretrained(mixed_dir)
  tokens = jnp.asarray(_tokens(5, (4, 12), cfg.vocab_size))
  ref_logp, _, ref_seen = jax.jit(
      lambda p: qwen3.token_logprobs(cfg, p, tokens, tokens, moe_out=True)
  )(params)
  rules = tuple((a, experts_rule) if a == "experts" else (a, m) for a, m in sharding.TRAIN_RULES)
  shardings = qwen3.param_shardings(cfg, mesh, rules)
  if experts_rule:
    assert shardings["layers"]["experts_gate"].spec[1] == "fsdp"
  placed = jax.device_put(params, shardings)
  fn = sharding.traced_under(
      lambda p, t: qwen3.token_logprobs(cfg, p, t, t, moe_out=True), mesh, rules
  )
  logp, _, seen = jax.jit(fn)(placed, tokens)
  np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
  np.testing.assert_array_equal(seen.experts, ref_seen.experts)

  decode_params = jax.device_put(params, qwen3.param_shardings(cfg, mesh, sharding.DECODE_RULES))
  _, kv = qwen3.hidden_states(cfg, params, tokens[:, :11], return_kv=True)
  cache = qwen3.KVCache(
      *(
          jnp.pad(a, ((0, 0),) * 2 + ((0, 1),) + ((0, 0),) * 2).transpose(0, 1, 3, 2, 4)
          for a in (kv.k, kv.v)
      )
  )
  step = lambda p, c: qwen3.decode_step(
      cfg, p, tokens[:, 11], jnp.full((4,), 11, jnp.int32), c, return_experts=True
  )
  want, _, want_experts = jax.jit(step)(params, cache)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  got, _, got_experts = jax.jit(sharding.traced_under(step, mesh, sharding.DECODE_RULES))(
      decode_params, jax.device_put(cache, replicated)
  )
  np.testing.assert_allclose(got, want, atol=1e-4)
  np.testing.assert_array_equal(got_experts, want_experts)
