"""Weights from the learner's mesh to the rollout's, device to device, one bucket at a time.

When rollout and learner have their own devices (mesh.rollout_devices > 0), each update's
decode weights (the learner's `decode_params()`, on the learner's mesh) are copied to the
rollout mesh in the sampler's layout there (qwen3.param_shardings under the decode
rules). A bucket is one weight (a layer-stacked projection, the embedding): the engine's
old copy of that weight is dropped as its new one lands, so the rollout mesh holds one
set of weights plus one bucket, never two sets.

Within a process the copy is `jax.device_put` between the two meshes' shardings (XLA's
device-to-device transfer); from the learner's process to the rollout's it is a pull by
JAX's transfer API (rollout/remote_weights.py: `connect`, then `swap` with an `Offered`
tree). It runs on the rollout's thread, between two of its calls, so no decode reads a
weight while it is replaced.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from april_jax.models import qwen3
from april_jax.rollout.remote_weights import Offered, WeightPuller


@dataclasses.dataclass
class PublishStats:
  """What the copies have cost over a run."""

  copies: int = 0  # weight sets published
  bytes: int = 0  # bytes copied (unchanged weights skipped)
  seconds: float = 0.0  # wall time of the copies, each waited for


class WeightPublisher:
  """Copies decode weights onto the rollout mesh in its decode layout."""

  def __init__(self, cfg: qwen3.Qwen3Config, mesh, rules, dtype: str):
    self.mesh = mesh
    leaves, self._treedef = jax.tree_util.tree_flatten_with_path(
        qwen3.param_shardings(cfg, mesh, rules, dtype)
    )
    self._by_path = {jax.tree_util.keystr(path): sh for path, sh in leaves}
    self._replicated = NamedSharding(mesh, PartitionSpec())
    self._puller: WeightPuller | None = None
    self.on_pulled = lambda version: None  # told after each version pulled
    self.stats = PublishStats()

  def connect(self, host: str, address: str) -> None:
    """Pulls offered weights from the learner's process at `address` from now on."""
    self._puller = WeightPuller(host, address, self.mesh.devices.flat)

  def target(self, path: str) -> NamedSharding:
    """Where a weight goes: its decode sharding (replicated for a leaf the model's tree
    does not name)."""
    return self._by_path.get(path, self._replicated)

  def swap(self, engine, tree, version: int) -> None:
    """Makes `tree` the engine's policy at `version`, a weight at a time: each old copy
    is released before the next weight is copied."""
    start = time.perf_counter()
    if isinstance(tree, Offered):  # in another process: pulled
      treedef, names = self._treedef, [leaf[0] for leaf in tree.leaves]
      if names != list(self._by_path):
        raise ValueError(
            f"the learner offers weights {names}, the decode model has {list(self._by_path)}"
        )
      leaves = [
          (path, functools.partial(self._pull, version, i, shape, dtype, m))
          for i, (path, shape, dtype, m) in enumerate(tree.leaves)
      ]
    else:
      flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
      leaves = [(jax.tree_util.keystr(p), functools.partial(jax.device_put, x)) for p, x in flat]
    old = jax.tree_util.tree_leaves(engine.params) if engine.params is not None else []
    engine.set_policy(None, engine.version)  # the engine's references go with its tree
    new, copied = [], 0
    for i, (path, fetch) in enumerate(leaves):
      if i < len(old):
        old[i] = None  # this bucket's old copy, released before its new one lands
      dst = fetch(self.target(path))
      dst.block_until_ready()
      new.append(dst)
      copied += int(np.prod(dst.shape)) * dst.dtype.itemsize
    del old
    engine.set_policy(jax.tree_util.tree_unflatten(treedef, new), version)
    self.stats.copies += 1
    self.stats.bytes += copied
    self.stats.seconds += time.perf_counter() - start
    if isinstance(tree, Offered):
      self.on_pulled(version)

  def _pull(self, version, leaf, shape, dtype, m, sharding):
    if self._puller is None:
      raise RuntimeError("weights offered by another process, and no connection to it")
    array = self._puller.pull(version, leaf, shape, dtype, m, sharding)
    return array.reshape(()) if not shape else array

  def copy_rate(self, nbytes: int = 1 << 24) -> float:
    """Bytes per second of one device-to-device copy of `nbytes` onto this mesh (the
    floor a publish is held to): measured on an array of the learner's kind, once."""
    src = jax.device_put(np.ones(nbytes // 4, np.float32), jax.devices()[-1])
    dst = jax.device_put(src, self._replicated)  # warm: the transfer's first use
    dst.block_until_ready()
    src = (src + 1).block_until_ready()  # a fresh array, not yet on this mesh
    start = time.perf_counter()
    dst = jax.device_put(src, self._replicated)
    dst.block_until_ready()
    return nbytes / max(time.perf_counter() - start, 1e-9)
