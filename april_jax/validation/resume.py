"""What a resume may change: the config is saved with every checkpoint, and a resume with
another config is refused with the fields that differ, except those of RESUMABLE.

Everything that decides what is trained and how (model, data, rollout, train, seed, mesh
layout) must match: a changed batch size or response budget would mix two runs in one
metrics file, or not fit the saved partial buffer. How long to run, how often to log,
evaluate and save, how evaluation samples, where the model files lie and how processes
find each other may change. A field added to the code since the checkpoint was saved
resumes at its default (which keeps the old behaviour).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from april_jax.settings.run import RunSettings
from april_jax.errors import InputError

RESUMABLE = (
    "num_steps",
    "log_every",
    "eval_every",
    "checkpoint_every",
    "compilation_cache_dir",
    "eval.",
    "distributed.",
    "mesh.device_memory_gb",
    "mesh.rollout_devices",  # where the rollout runs: a resume may split or join the meshes
    "mesh.rollout_shape",
    "rollout.in_flight_updates",
    "model.path",
    "model.tokenizer_path",
    "train.lora_path",  # read at the start only: a resume takes the checkpoint's adapters
    "train.warm_up",
    "rollout.reward_url",  # where the reward server lies and how to reach it
    "rollout.reward_url_timeout_s",
    "rollout.reward_url_retries",
    "rollout.reward_workers",  # how many score at once, not what they score
    "rollout.max_failed_steps",
    "env.workers",
    "env.overlap",  # when calls are waited for, not what they answer
)


def as_json(settings) -> dict[str, Any]:
  """The settings (or a config's ConfigDict) as the JSON a checkpoint keeps (tuples
  become lists)."""
  settings = RunSettings.from_config(settings)
  return json.loads(json.dumps(dataclasses.asdict(settings), sort_keys=True))


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def differences(saved: dict[str, Any], config) -> list[str]:
  """`field: saved -> now` for every field that differs and may not change on resume."""
  before, now = _flat(saved), _flat(as_json(config))
  defaults = _flat(as_json(RunSettings()))
  changed = []
  for key in sorted(set(before) | set(now)):
    if any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE):
      continue
    if key not in before and key in defaults and now.get(key) == defaults[key]:
      continue  # a field added since the checkpoint, at its default: the old behaviour
    if before.get(key, "<unset>") != now.get(key, "<unset>"):
      changed.append(f"{key}: {before.get(key, '<unset>')!r} -> {now.get(key, '<unset>')!r}")
  return changed


def check_resumable(saved: dict[str, Any] | None, config, step: int, directory: str) -> None:
  """Raises InputError naming every field that differs from checkpoint `step`'s config."""
  if saved is None:
    return  # a checkpoint from before configs were saved with it
  changed = differences(saved, config)
  if changed:
    raise InputError(
        f"the config differs from the one checkpoint {step} in {directory} was saved with, "
        f"in fields a resume may not change: {'; '.join(changed)}. Resume with the saved "
        f"values, or start a new run in another workdir (may change on resume: "
        f"{', '.join(RESUMABLE)})"
    )


def check_same_model(saved: dict[str, Any] | None, cfg, step: int, directory: str) -> None:
  """Raises InputError if the model the config names now (model.path may move) is not the
  one checkpoint `step` was trained as (`saved`: hf_io.architecture of that model)."""
  if saved is None:
    return  # a checkpoint from before the model was saved with it
  now = json.loads(json.dumps(dataclasses.asdict(cfg)))  # as the checkpoint keeps it
  changed = [
      f"{k}: {v!r} -> {now.get(k, '<unset>')!r}" for k, v in saved.items() if now.get(k) != v
  ]
  if changed:
    raise InputError(
        f"the model the config names now is not the one checkpoint {step} in {directory} "
        f"was trained from: {'; '.join(changed)}. model.path may change on resume only to "
        "a copy of the same model"
    )
