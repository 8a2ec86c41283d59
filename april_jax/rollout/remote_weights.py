"""Decode weights from the learner's process to the rollout's, device to device, one bucket
(one weight) at a time, by JAX's transfer API (`jax.experimental.transfer`).

The transfer API moves shards as they lie: a pull lands source shard j on destination
shard j, so both sides must hold the weight in the same layout. Each weight crosses in
a layout both can give it: split along its first axis (the stacked layers, or the
vocabulary) over m devices, m the largest count up to the smaller side's devices that
divides that axis. The learner puts its copy of the weight in that layout on its first m
devices and offers it under its own id (`WeightServer.offer`), telling the rollout the
weights' names, shapes, dtypes and m; the rollout pulls each onto its first m devices and
lays it out for decoding there (`WeightPublisher.swap` with an `Offered` tree),
releasing its old copy of that weight first, so its mesh never holds two sets. The
learner offers a new version only once the last one was pulled (RemoteRollout), so it
holds at most one offered set beside its own.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental import transfer
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def _uuid(version: int, leaf: int) -> int:
  return (int(version) << 16) | int(leaf)


def pieces(dim0: int, most: int) -> int:
  """How many devices a weight whose first axis is `dim0` long crosses on."""
  return max(m for m in range(1, max(1, most) + 1) if dim0 % m == 0)


def crossing(devices, m: int) -> NamedSharding:
  """The layout a weight crosses in: split along its first axis over devices[:m]."""
  return NamedSharding(Mesh(np.array(list(devices)[:m]), ("crossing",)), PartitionSpec("crossing"))


@dataclasses.dataclass(frozen=True)
class Offered:
  """A version's weights as offered: (path, shape, dtype, m) for each, in tree order."""

  version: int
  leaves: tuple

  def to_json(self) -> dict:
    return {"version": self.version, "leaves": [list(x) for x in self.leaves]}

  @classmethod
  def from_json(cls, d: dict) -> "Offered":
    leaves = tuple((p, tuple(s), t, int(m)) for p, s, t, m in d["leaves"])
    return cls(int(d["version"]), leaves)


def _server(host: str):
  return transfer.start_transfer_server(jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"])


class WeightServer:
  """The learner's side: offers each version's decode weights for one pull."""

  def __init__(self, host: str, devices, rollout_devices: int):
    self._server = _server(host)
    port = self._server.address().rpartition(":")[2]
    self.address = f"{host}:{port}"  # where the rollout connects
    self._devices = list(devices)
    self._most = min(len(self._devices), int(rollout_devices))
    self._held: list = []  # the last version offered: kept alive until it is pulled

  def offer(self, tree, version: int) -> Offered:
    """Offers `tree`; the caller offers the next version only once this one was pulled."""
    self._held = []  # pulled (or never to be): let it go before the next set is copied
    described, held = [], []
    for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
      m = pieces(leaf.shape[0] if leaf.ndim else 1, self._most)
      if not leaf.ndim:
        leaf, m = leaf.reshape(1), 1
      # A copy of its own: the learner may donate its arrays to the next update.
      copy = jax.device_put(leaf, crossing(self._devices, m), may_alias=False)
      self._server.await_pull(_uuid(version, i), [copy])
      held.append(copy)
      described.append((jax.tree_util.keystr(path), tuple(leaf.shape), str(leaf.dtype), m))
    self._held = held
    return Offered(int(version), tuple(described))


class WeightPuller:
  """The rollout's side: pulls one offered weight, then lays it out for decoding."""

  def __init__(self, host: str, address: str, devices):
    self._server = _server(host)
    self._connection = self._server.connect(address)
    self._devices = list(devices)

  def pull(self, version: int, leaf: int, shape, dtype, m: int, sharding) -> jax.Array:
    spec = jax.ShapeDtypeStruct(
        tuple(shape), jax.numpy.dtype(dtype), sharding=crossing(self._devices, m)
    )
    (array,) = self._connection.pull(_uuid(version, leaf), [spec])
    return jax.device_put(array, sharding)
