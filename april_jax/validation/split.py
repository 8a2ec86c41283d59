"""The checks of a run whose rollout and learner have their own devices
(mesh.rollout_devices > 0, docs/async.md): the fields alone, then against the devices and
the model (each split mesh must hold its part, and shard the heads and the KV pool)."""

from __future__ import annotations

from april_jax import sharding


def problems(c) -> list[str]:
  """What the fields alone get wrong."""
  out = []
  m, r = c.mesh, c.rollout
  k = m.rollout_devices
  if not isinstance(k, int) or isinstance(k, bool) or k < 0:
    out.append(f"mesh.rollout_devices must be an integer >= 0 (0: colocated), got {k!r}")
    return out
  if len(tuple(m.rollout_shape)) != 3:
    out.append(
        f"mesh.rollout_shape must have 3 entries (data, fsdp, tensor), got {tuple(m.rollout_shape)}"
    )
  if r.in_flight_updates and k == 0:
    out.append(
        "rollout.in_flight_updates needs mesh.rollout_devices > 0 (colocated, rollout and "
        "learner take turns: there is no update in flight)"
    )
  if k == 0:
    return out
  if c.train.lora.rank and c.train.lora.decode == "unmerged":
    out.append(
        'train.lora.decode "unmerged" decodes on the learner\'s own base: it needs '
        "mesh.rollout_devices 0"
    )
  if r.in_flight_updates and r.resume_mode == "recompute" and c.env.name:
    out.append(
        "rollout.in_flight_updates with rollout.resume_mode recompute is for single-turn "
        "runs: with an environment use resume_mode kv"
    )
  return out


def device_problems(c, num_devices: int, model_cfg=None) -> list[str]:
  """What a split gets wrong on `num_devices` devices (and this model's heads)."""
  k = int(c.mesh.rollout_devices)
  if k == 0:
    return []
  if k >= num_devices:
    return [
        f"mesh.rollout_devices={k} leaves no device for the learner ({num_devices} devices): "
        f"it must be below {num_devices}"
    ]
  out = []
  try:
    data, fsdp, tensor = sharding.resolve_mesh_shape(tuple(c.mesh.rollout_shape), k)
  except ValueError as e:
    return [f"mesh.rollout_shape on the {k} rollout devices: {e}"]
  try:
    sharding.resolve_mesh_shape(tuple(c.mesh.shape), num_devices - k)
  except ValueError as e:
    out.append(f"mesh.shape on the {num_devices - k} learner devices: {e}")
  slots = c.rollout.num_slots
  if slots % data:
    out.append(
        f"rollout.num_slots={slots} must be a multiple of the rollout mesh's data axis "
        f"({data}, mesh.rollout_shape {tuple(c.mesh.rollout_shape)}): the KV pool is split "
        "by slots over it"
    )
  if model_cfg is not None:
    span = fsdp * tensor
    for name, n in (("attention heads", model_cfg.num_heads), ("KV heads", model_cfg.num_kv_heads)):
      if n % span:
        out.append(
            f"mesh.rollout_shape {tuple(c.mesh.rollout_shape)} splits the model's {n} {name} "
            f"{span} ways (fsdp x tensor): it must divide them"
        )
  return out


def learner_devices(c, num_devices: int) -> int:
  """The devices the learner's mesh has."""
  return num_devices - int(c.mesh.rollout_devices)
