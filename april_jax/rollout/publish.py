"""Weights from the learner's mesh to the rollout's, device to device, one bucket at a time.

When rollout and learner have their own devices (mesh.rollout_devices > 0), each update's
decode weights (the learner's `decode_params()`, on the learner's mesh) are copied to the
rollout mesh in the sampler's layout there (qwen3.param_shardings under the decode
rules). A bucket is one weight (a layer-stacked projection, the embedding): the engine's
old copy of that weight is dropped as its new one lands, so the rollout mesh holds one
set of weights plus one bucket, never two sets.

The copy is `jax.device_put` between the two meshes' shardings (XLA's device-to-device
transfer within a process). It runs on the rollout's thread, between two of its calls,
so no decode reads a weight while it is replaced.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from april_jax.models import qwen3


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
    self._by_path = {
        jax.tree_util.keystr(path): sh
        for path, sh in jax.tree_util.tree_flatten_with_path(
            qwen3.param_shardings(cfg, mesh, rules, dtype)
        )[0]
    }
    self._replicated = NamedSharding(mesh, PartitionSpec())
    self.stats = PublishStats()

  def target(self, path: str) -> NamedSharding:
    """Where a weight goes: its decode sharding (replicated for a leaf the model's tree
    does not name)."""
    return self._by_path.get(path, self._replicated)

  def swap(self, engine, tree, version: int) -> None:
    """Makes `tree` the engine's policy at `version`, a weight at a time: each old copy
    is released before the next weight is copied."""
    start = time.perf_counter()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    old = jax.tree_util.tree_leaves(engine.params) if engine.params is not None else []
    engine.set_policy(None, engine.version)  # the engine's references go with its tree
    new, copied = [], 0
    for i, (path, src) in enumerate(leaves):
      if i < len(old):
        old[i] = None  # this bucket's old copy, released before its new one lands
      dst = jax.device_put(src, self.target(jax.tree_util.keystr(path)))
      dst.block_until_ready()
      new.append(dst)
      copied += int(np.prod(src.shape)) * src.dtype.itemsize
    del old
    engine.set_policy(jax.tree_util.tree_unflatten(treedef, new), version)
    self.stats.copies += 1
    self.stats.bytes += copied
    self.stats.seconds += time.perf_counter() - start

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
