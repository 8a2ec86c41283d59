"""Multi-host runs on JAX's multi-controller runtime: one process per host, one program.

Every process runs the whole loop on the same config, seed and prompt stream (each reads
all of the data and walks the same seeded order; data.py); the mesh
spans the devices of all processes, so each process holds its share of the params and
of the sampler's slots (slots lie along the mesh's data axis: a process owns the slots
on its own devices), and XLA's collectives (NCCL, RCCL, or gloo on CPUs) join them.
The rollout scheduler is host code, so it must decide the same on every process: it is
deterministic in its inputs (completion order, seeded sampling), and the one input that
depends on wall-clock time, a reward that ran past its time limit, is agreed on by
taking process 0's rewards (`agree`). Every host read of a device array goes through
`to_host`, and only process 0 writes metrics and logs. Orbax checkpoints are written
and read by all processes together (the workdir must be shared between hosts).

  initialize(c.distributed)   jax.distributed.initialize from the config, or from the
                              cluster's environment (SLURM, Open MPI) with `auto`
  is_primary()                process 0
  to_host(tree)               numpy copies of device arrays, whichever devices hold them
  agree(values)               process 0's numpy array, on every process
  any_process(flag)           True on every process if it is True on any one
  process_count(), process_index()
                              the processes that run this one's loop: all of them, or
                              only itself when rollout and learner are on different
                              processes (`work_alone`, docs/async.md)

A process that loses a peer fails in bounded time: the next collective errors when the
peer's connection drops (main.py then exits with status 4 and says so), and JAX's
coordination service ends a process whose peers stop sending heartbeats after
`distributed.heartbeat_timeout_s`.
"""

from __future__ import annotations

import functools
import json

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from april_jax.runtime.rendezvous import PeersMissing, wait_for_peers

PEER_FAILURE_EXIT = 4
PEERS_MISSING_EXIT = 5  # not every process joined within initialization_timeout_s

__all__ = ["PeersMissing"]  # raised by initialize


def parse_device_ids(text: str) -> list[int] | None:
  """ "0,1,2,3" -> [0, 1, 2, 3]; "" -> None (JAX's default)."""
  text = text.strip()
  return [int(x) for x in text.split(",")] if text else None


def initialize(c) -> None:
  """Joins the processes of a multi-host run; a no-op for a single process.

  `c.local_device_ids` ("0,1,...,7") gives one process all of its host's GPUs: under
  SLURM, JAX otherwise assumes one process per GPU and hands each only GPU SLURM_LOCALID.
  """
  options = dict(
      initialization_timeout=int(c.initialization_timeout_s),
      heartbeat_timeout_seconds=int(c.heartbeat_timeout_s),
      local_device_ids=parse_device_ids(c.local_device_ids),
  )
  if c.auto:
    found = _cluster_params(options["local_device_ids"], options["initialization_timeout"])
    if found is not None:
      wait_for_peers(*found, c.initialization_timeout_s)
    jax.distributed.initialize(**options)
  elif c.coordinator_address:
    wait_for_peers(
        c.coordinator_address, int(c.num_processes), int(c.process_id), c.initialization_timeout_s
    )
    jax.distributed.initialize(
        coordinator_address=c.coordinator_address,
        num_processes=int(c.num_processes),
        process_id=int(c.process_id),
        **options,
    )
  else:
    return
  logging.info(
      "process %d of %d: %d local devices, %d in all",
      jax.process_index(),
      jax.process_count(),
      jax.local_device_count(),
      jax.device_count(),
  )


def _cluster_params(local_device_ids, timeout):
  """(coordinator address, processes, process id) as JAX finds them in the cluster's
  environment (SLURM, Open MPI), or None where it cannot say (then JAX's own join,
  without the plain message, is all there is)."""
  try:
    from jax._src import clusters  # pylint: disable=g-import-not-at-top

    address, n, pid, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, local_device_ids, None, timeout
    )
  except Exception:  # pylint: disable=broad-except  # a private API: any change, no rendezvous
    return None
  if address is None or n is None or pid is None:
    return None
  return address, int(n), int(pid)


_alone = False  # a split run across processes: this process runs its side's loop alone


def work_alone() -> None:
  """This process runs its own loop, apart from the others (the rollout on one process,
  the learner on another): its collectives involve only itself."""
  global _alone
  _alone = True


def working_alone() -> bool:
  """Whether this process runs its side of a split run apart from the others."""
  return _alone


def coordinator_host() -> str:
  """The host part of the coordinator's address (process 0's host: a split run's
  learner), where other processes reach it."""
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top

  address = jax_distributed.global_state.coordinator_address or "localhost:0"
  return address.rpartition(":")[0].strip("[]") or "localhost"


def process_count() -> int:
  """How many processes run this process's loop (and join its collectives)."""
  return 1 if _alone else jax.process_count()


def process_index() -> int:
  """This process's place among those that run its loop."""
  return 0 if _alone else jax.process_index()


def is_primary() -> bool:
  """Process 0: the learner's process, which writes the run's files."""
  return jax.process_index() == 0


def split_sides(rollout_devices: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  """(learner processes, rollout processes) of a run whose rollout has the last
  `rollout_devices` devices, when the two sides are on different processes; None when
  one process holds both (or the run is colocated). Raises ValueError for a split that
  gives a process devices of both sides."""
  if not rollout_devices or jax.process_count() == 1:
    return None
  devices = jax.devices()
  cut = len(devices) - int(rollout_devices)
  learner = sorted({d.process_index for d in devices[:cut]})
  rollout = sorted({d.process_index for d in devices[cut:]})
  if set(learner) & set(rollout):
    both = sorted(set(learner) & set(rollout))
    raise ValueError(
        f"mesh.rollout_devices={rollout_devices} gives process {both[0]} devices of both the "
        f"learner and the rollout ({len(devices)} devices, {jax.local_device_count()} a "
        "process): across processes it must give whole processes to each side"
    )
  return tuple(learner), tuple(rollout)


def _local(x) -> bool:
  return not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated


@functools.lru_cache(maxsize=64)
def _cpu_only(sharding) -> bool:
  return all(d.platform == "cpu" for d in sharding.device_set)


def _on_cpu(x) -> bool:
  return not isinstance(x, jax.Array) or _cpu_only(x.sharding)


def to_host(tree):
  """Numpy copies of a pytree of arrays. Arrays that span other processes' devices are
  gathered (a collective: every process must call this at the same point).

  On accelerators the leaves' copies start together (device_get). On CPU devices each
  leaf is copied where it lies: device_get's asynchronous copies hand every array to
  another thread, which added about 150 us to reading a slot's rows (four small arrays),
  more than the device call that made them."""
  leaves = jax.tree.leaves(tree)
  if jax.process_count() == 1 or all(_local(x) for x in leaves):
    if all(_on_cpu(x) for x in leaves):
      return jax.tree.map(np.array, tree)
    return jax.tree.map(np.asarray, jax.device_get(tree))  # one batched transfer
  return jax.tree.map(
      lambda x: np.asarray(
          jax.device_get(x) if _local(x) else multihost_utils.process_allgather(x, tiled=True)
      ),
      tree,
  )


def gather(values: np.ndarray) -> np.ndarray:
  """Every process's `values` (same shape everywhere), stacked in process order
  [processes, ...] (a collective)."""
  if _alone:
    return np.asarray(values)[None]
  return np.asarray(multihost_utils.process_allgather(np.asarray(values)))


def agree(values: np.ndarray) -> np.ndarray:
  """Process 0's values on every process (a collective); the values themselves when
  there is one process."""
  if process_count() == 1:
    return values
  values = np.ascontiguousarray(values)
  # As raw 32-bit words: device arrays are 32-bit unless x64 is on, and values stay exact.
  words = multihost_utils.broadcast_one_to_all(values.view(np.uint32))
  return np.asarray(words).view(values.dtype).reshape(values.shape)


def agree_json(value):
  """Process 0's JSON value on every process (two collectives; every process must call
  it at the same point). Other processes pass anything: it is not read."""
  if process_count() == 1:
    return value
  data = json.dumps(value).encode() if jax.process_index() == 0 else b""
  (n,) = agree(np.array([len(data)], np.int32))
  # Sizes in powers of two: each new shape is a new program to compile on every process.
  buffer = np.zeros(max(256, 1 << (int(n) - 1).bit_length()), np.uint8)
  buffer[: len(data)] = np.frombuffer(data, np.uint8)
  return json.loads(agree(buffer)[: int(n)].tobytes().decode())


def any_process(flag: bool) -> bool:
  """True on every process when `flag` is True on at least one (a collective)."""
  if process_count() == 1:
    return bool(flag)
  return bool(gather(np.array([flag], np.int32)).any())


# What XLA's runtime says when a collective or the coordination service loses a peer.
_PEER_LOST = (
    "gloo",
    "nccl",
    "rccl",
    "connection",
    "unavailable",
    "heartbeat",
    "deadline_exceeded",
    "coordination",
    "barrier",
    "peer",
)


def is_collective_failure(error: BaseException) -> bool:
  """A runtime error of a multi-process run that says a peer went away."""
  if jax.process_count() == 1 or not isinstance(error, jax.errors.JaxRuntimeError):
    return False
  text = str(error).lower()
  return any(marker in text for marker in _PEER_LOST)
