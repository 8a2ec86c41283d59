"""Which split of a node's devices between rollout and learner (mesh.rollout_devices) to
choose, from what the two phases of a colocated step cost (`python -m april_jax.plan
--rollout_s=R --learn_s=L`; bench --mode=async measures them and prints the projection).

Given a colocated step's phase times on all n devices (rollout R seconds, learner L
seconds), a split of k rollout devices takes, per batch, about
max(R (n / k)^a, L n / (n - k)) once overlapped. The learner is compute-bound and scales
with its devices; the rollout's time scales as (n / k)^a, a = rollout_scaling: 1 when
it shrinks in proportion to its devices (then no split beats colocated: the overlap only
repays what fewer devices cost), below 1 when it does not (decode is bound by reading
the weights and KV, and a step's tail by its few longest samples, whatever the devices).
Measure a at two device counts. `choose_split` picks the k with the least time among the
splits whose meshes fit (planning/memory.py) and shard the model.
"""

from __future__ import annotations

import dataclasses

from april_jax.planning.memory import GB, make_split_plan
from april_jax.validation import split as validate_split


def choose_split(
    config,
    cfg,
    num_devices: int,
    rollout_s: float,
    learn_s: float,
    device_bytes: float = 0.0,
    rollout_scaling: float = 1.0,
) -> dict:
  """The split with the least overlapped time per batch, from a colocated step's phase
  times on all devices; every split considered (with the microbatches that keep each
  learner device's rows per call), with why one was refused."""
  n, R, L = num_devices, float(rollout_s), float(learn_s)
  rows = []
  for k in range(1, n):
    mesh = dataclasses.replace(
        config.mesh, rollout_devices=k, rollout_shape=_any_size(tuple(config.mesh.rollout_shape))
    )
    c = config.replace(mesh=mesh)
    # Each learner device keeps the rows per call the config gives it: more microbatches
    # on fewer learner devices.
    samples = config.rollout.batch_size * config.rollout.n_samples_per_prompt
    learners = n - int(config.mesh.rollout_devices)  # the config's own learner devices
    micro = max(1, config.train.num_microbatches * learners // (n - k))
    if samples % (micro * config.train.num_minibatches) == 0:
      c = c.replace(train=dataclasses.replace(c.train, num_microbatches=micro))
    problems = validate_split.device_problems(c, n, cfg)
    row = {"rollout_devices": k, "num_microbatches": c.train.num_microbatches}
    if problems:
      row["refused"] = problems[0]
    else:
      plan = make_split_plan(c, cfg, n, device_bytes)
      if not plan.fits:
        row["refused"] = f"needs {plan.device_total / GB:.1f} GB per device"
      else:
        per_batch = max(R * (n / k) ** rollout_scaling, L * n / (n - k))
        row.update(seconds_per_batch=per_batch, speedup=(R + L) / per_batch)
    rows.append(row)
  ok = [r for r in rows if "speedup" in r]
  best = max(ok, key=lambda r: r["speedup"]) if ok else None
  return {
      "colocated_seconds_per_batch": R + L,
      "rollout_scaling": rollout_scaling,
      "chosen": None if best is None else best["rollout_devices"],
      "splits": rows,
  }


def _any_size(shape: tuple) -> tuple:
  """The rollout mesh's shape for any device count: its -1 kept, else its largest axis
  made -1 (tensor parallel stays tensor parallel)."""
  if -1 in shape:
    return shape
  i = max(range(len(shape)), key=lambda j: shape[j])
  return tuple(-1 if j == i else s for j, s in enumerate(shape))


def describe_split(chosen: dict) -> str:
  """The lines `plan` prints for choose_split's answer."""
  lines = [f"{'split (rollout devices)':<26}{'s/batch':>10}{'vs colocated':>14}"]
  for row in chosen["splits"]:
    k = row["rollout_devices"]
    if "refused" in row:
      lines.append(f"  {k:<24}  refused: {row['refused']}")
    else:
      lines.append(f"  {k:<24}{row['seconds_per_batch']:>10.2f}{row['speedup']:>13.2f}x")
  pick = chosen["chosen"]
  if pick is None:
    lines.append("no split fits: stay colocated")
  else:
    row = next(r for r in chosen["splits"] if r["rollout_devices"] == pick)
    lines.append(
        f"chosen: mesh.rollout_devices={pick} (train.num_microbatches={row['num_microbatches']})"
    )
  return "\n".join(lines)
