"""distributed.to_host: numpy copies of device arrays that stay what they were after the
arrays' buffers are donated and reused, whole arrays from sharded ones."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from april_jax.runtime.distributed import to_host


def test_host_copies_outlive_a_donation_of_their_buffers():
  x = jnp.arange(6, dtype=jnp.int32) * 3
  y = jnp.full((2, 3), 0.5, jnp.float32)
  host = to_host({"x": x, "pair": (y, 7)})
  overwrite = jax.jit(lambda a, b: (a.at[:].set(-1), b.at[:].set(-2.0)), donate_argnums=(0, 1))
  jax.block_until_ready(overwrite(x, y))  # x's and y's buffers are reused for the outputs
  np.testing.assert_array_equal(host["x"], [0, 3, 6, 9, 12, 15])
  np.testing.assert_array_equal(host["pair"][0], np.full((2, 3), 0.5, np.float32))
  assert host["pair"][1] == 7
  assert isinstance(host["x"], np.ndarray) and host["x"].dtype == np.int32
  host["x"][0] = 100  # the caller's own copy
  assert host["x"][0] == 100


def test_a_sharded_array_comes_back_whole():
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  x = jax.device_put(
      np.arange(16, dtype=np.float32).reshape(8, 2), NamedSharding(mesh, PartitionSpec("data"))
  )
  assert len(x.addressable_shards) == 4
  np.testing.assert_array_equal(to_host(x), np.arange(16, dtype=np.float32).reshape(8, 2))
