"""Sharding on 8 CPU devices: params really sharded, results equal to one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from april_jax import sharding
from april_jax.models import hf_io, qwen3

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")


def test_mesh_shape_minus_one_takes_the_rest():
  assert sharding.resolve_mesh_shape((1, -1, 2), 8) == (1, 4, 2)
  with pytest.raises(ValueError, match="uses 4 devices but 8"):
    sharding.resolve_mesh_shape((2, 2, 1), 8)
  with pytest.raises(ValueError, match="at most one"):
    sharding.resolve_mesh_shape((-1, -1, 1), 8)


def test_logical_rules_skip_used_and_indivisible_axes():
  mesh = sharding.make_mesh((2, 2, 2))
  assert sharding.logical_to_spec(("batch", "seq"), (8, 5), mesh) == P(("data", "fsdp"), None)
  # kv_heads=3 does not divide tensor=2: replicated rather than a crash.
  assert sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), (8, 3, 4), mesh) == P(
      "fsdp", None, None
  )


def test_sharded_forward_equals_unsharded_and_params_are_sharded(hf_model_dir):
  mesh = sharding.make_mesh((2, 2, 2))
  cfg, params = hf_io.load_pretrained(hf_model_dir)
  _, sharded = hf_io.load_pretrained(hf_model_dir, mesh=mesh)
  q = sharded["layers"]["q"]  # [L, D, N, H]: D over fsdp, N over tensor
  assert q.sharding.spec == P(None, "fsdp", "tensor", None)
  assert len(q.sharding.device_set) == 8
  shard_shape = q.addressable_shards[0].data.shape
  assert shard_shape == (q.shape[0], q.shape[1] // 2, q.shape[2] // 2, q.shape[3])
  assert sharded["embed"].sharding.spec == P("tensor", "fsdp")

  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 16)).astype(np.int32)
  batch = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, P(("data", "fsdp"))))
  out_sharded = qwen3.forward_jit(cfg, sharded, batch)
  out_single = qwen3.forward_jit(cfg, params, jnp.asarray(tokens))
  # Sharding changes only the order of float32 sums: each of the ~8 sums deep in the
  # network may differ by a few ulp of its magnitude, so the bound scales with the logits.
  out_single = np.asarray(out_single)
  atol = 2**6 * np.finfo(np.float32).eps * np.abs(out_single).max()
  np.testing.assert_allclose(np.asarray(out_sharded), out_single, atol=atol, rtol=0)


def test_params_initialised_directly_sharded_match_unsharded_init():
  mesh = sharding.make_mesh((1, 4, 2))
  cfg = qwen3.Qwen3Config(
      vocab_size=64,
      hidden_size=32,
      intermediate_size=64,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      head_dim=8,
  )
  sharded = qwen3.init_params_sharded(cfg, jax.random.key(3), mesh)
  plain = qwen3.init_params(cfg, jax.random.key(3))
  assert sharded["layers"]["gate"].sharding.spec == P(None, "fsdp", "tensor")
  # Same random stream; jit vs eager may differ by an ulp in the normal transform.
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6),
      sharded,
      plain,
  )
