"""The `mesh` section (the devices and the rules that place arrays on them) and the
`distributed` one (several hosts)."""

from __future__ import annotations

import dataclasses

from april_jax import sharding


@dataclasses.dataclass(frozen=True)
class MeshSettings:
  shape: tuple = (1, -1, 1)  # (data, fsdp, tensor); -1 takes the devices left
  rules: tuple = sharding.TRAIN_RULES  # the learner: FSDP x tensor
  decode_rules: tuple = sharding.DECODE_RULES  # the sampler: tensor parallel, slots over data
  # Rollout and learner on their own devices (docs/async.md): the last rollout_devices
  # devices decode (a mesh of rollout_shape), the rest learn (a mesh of `shape`), and the
  # two overlap. 0: colocated, one mesh taking turns.
  rollout_devices: int = 0
  rollout_shape: tuple = (-1, 1, 1)  # (data, fsdp, tensor) of the rollout mesh
  # Memory per device for the start-up plan; None = ask the device.
  device_memory_gb: float | None = None


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
  """One process per host (runtime/distributed.py)."""

  auto: bool = False  # jax.distributed from the cluster env (SLURM, Open MPI)
  coordinator_address: str = ""  # host:port of process 0; "" = one process (unless auto)
  num_processes: int = 1  # with coordinator_address: the run's processes
  process_id: int = 0  # this process's index, 0 .. num_processes - 1
  local_device_ids: str = ""  # "0,1,...,7": this process's GPUs ("" = JAX decides)
  heartbeat_timeout_s: int = 60  # a peer silent this long ends the run
  initialization_timeout_s: int = 300  # waiting for every process to join
