"""The rules of a LoRA run's config (train.lora, train.lora_path), each problem naming its
field: validation/checks.py reports them with the rest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from april_jax.models import hf_io, lora, peft_io

DECODE_MODES = ("merged", "unmerged")


def checks(c, err: Callable[[str], None]) -> None:
  t = c.train
  if int(t.lora.rank) < 0:
    err(f"train.lora.rank must be >= 0 (0 = train every weight), got {t.lora.rank}")
    return
  spec = lora.LoraSpec.from_config(t.lora)
  if spec is None:
    if t.lora_path:
      err("train.lora_path is set but train.lora.rank is 0: set the adapter's rank to train it")
    return
  if t.lora.lr <= 0:
    err(f"train.lora.lr must be > 0, got {t.lora.lr}")
  if t.lora.decode not in DECODE_MODES:
    err(f"train.lora.decode must be one of {DECODE_MODES}, got {t.lora.decode!r}")
  try:
    cfg = hf_io.model_config(c)
  except (ValueError, OSError):
    return  # the model's own check names what is missing
  for problem in lora.problems(cfg, spec, "train.lora."):
    err(problem)
  if t.lora_path:
    _check_adapter(t.lora_path, spec, cfg, err)
  if t.critic_path and (Path(t.critic_path) / "config.json").is_file():
    _check_critic_base(t.critic_path, cfg, err)


def _check_adapter(path: str, spec: lora.LoraSpec, cfg, err) -> None:
  """train.lora_path holds a PEFT LoRA folder for this base, of train.lora's spec."""
  config_file = Path(path) / peft_io.CONFIG_NAME
  if not Path(path).exists():
    return  # a resume reads the checkpoint's adapters (a fresh start names it missing)
  if not config_file.is_file():
    err(f"train.lora_path {path!r}: no PEFT adapter there (no {peft_io.CONFIG_NAME})")
    return
  try:
    found = peft_io.spec_of(json.loads(config_file.read_text()), str(config_file))
  except (ValueError, KeyError, peft_io.AdapterError) as e:
    err(f"train.lora_path: {e}")
    return
  for problem in lora.problems(cfg, found, "train.lora_path's adapter: "):
    err(problem)
  wanted, got = spec.describe(), found.describe()
  differ = [
      f"{k} {got[k]!r} (train.lora.{k} is {wanted[k]!r})" for k in wanted if got[k] != wanted[k]
  ]
  if differ:
    err(f"train.lora_path {path!r} holds adapters of another shape: {', '.join(differ)}")


def _check_critic_base(path: str, cfg, err) -> None:
  """With LoRA, a critic folder is a frozen base beside the policy's: of its architecture."""
  try:
    found = hf_io.load_config(path)
  except (ValueError, OSError) as e:
    err(f"train.critic_path {path!r}: {e}")
    return
  shape = lambda m: {f: getattr(m, f) for f in hf_io.SHAPE_FIELDS}
  differ = [
      f"{f} {v} (the policy's {shape(cfg)[f]})"
      for f, v in shape(found).items()
      if v != shape(cfg)[f]
  ]
  if differ:
    err(
        f"train.critic_path {path!r} is another architecture than the policy's ({', '.join(differ)}): "
        "a LoRA critic trains adapters over a base of the policy's architecture"
    )


def device_problems(c, num_devices: int) -> list[str]:
  """What needs the device count: unmerged decoding reads the base in the learner's
  layout, which on several devices would gather every weight in every decode step."""
  if int(c.train.lora.rank) > 0 and c.train.lora.decode == "unmerged" and num_devices > 1:
    return [
        f"train.lora.decode='unmerged' decodes with the learner's copy of the base, sharded "
        f"for training: on {num_devices} devices every decode step would gather the weights; "
        "use it on one device, or train.lora.decode='merged'"
    ]
  return []
