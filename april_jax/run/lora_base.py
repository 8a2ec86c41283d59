"""Where a LoRA run's frozen base model lives, so that resume and export find it, and the
adapters it starts from (train.lora_path).

Checkpoints of a LoRA run hold the adapters and their optimizer, never the base
(rl/update.py). A base loaded from model.path is read from there again. A base that no
file holds (a random init, or a model the supervised warm start trained) is written once,
when the run starts, to `<workdir>/lora_base` as a Hugging Face folder: resume loads it
instead of drawing or training it again, and export merges onto it. The base's
fingerprint in every checkpoint proves that what is loaded is what the adapters trained
over.
"""

from __future__ import annotations

import os
import shutil

import jax
from jax.experimental import multihost_utils

from april_jax.runtime import distributed
from april_jax.errors import InputError
from april_jax.models import hf_io, lora, peft_io

FOLDER = "lora_base"


def saved(workdir: str) -> str | None:
  """The run's saved base folder, or None when it has none."""
  path = os.path.join(workdir, FOLDER)
  return path if os.path.isfile(os.path.join(path, hf_io.CONFIG_NAME)) else None


def must_save(config) -> bool:
  """Whether the run's base is in no file: a random init, or trained by the warm start."""
  return not config.model.path or config.train.sft_steps > 0


def save(workdir: str, cfg, params) -> str:
  """Writes the base (every process calls it: the tensors are gathered collectively;
  process 0 writes) to <workdir>/lora_base through a staging folder, so a kill mid-write
  leaves no half base behind. Process 0 alone clears and renames; all wait for it."""
  path = os.path.join(workdir, FOLDER)
  staging = path + ".writing"
  primary = jax.process_index() == 0
  if primary:
    shutil.rmtree(staging, ignore_errors=True)
  hf_io.save_pretrained(staging, cfg, params)
  if primary:
    shutil.rmtree(path, ignore_errors=True)
    os.rename(staging, path)
  if distributed.process_count() > 1:
    multihost_utils.sync_global_devices("lora_base saved")
  return path


def keep(workdir: str, config, cfg, params) -> None:
  """At a fresh start: saves the base as the run freezes it (in model.dtype) when no file
  holds it, else removes any base an earlier start of this workdir saved."""
  if must_save(config):
    dtype = jax.numpy.dtype(config.model.dtype)
    save(workdir, cfg, jax.tree.map(lambda x: x.astype(dtype), params))
  else:
    forget(workdir)


def forget(workdir: str) -> None:
  """Removes a base an earlier start of this workdir saved (process 0): a fresh start
  over model.path must not resume or export over it."""
  if jax.process_index() == 0:
    shutil.rmtree(os.path.join(workdir, FOLDER), ignore_errors=True)


def source(workdir: str, config) -> str:
  """The folder a LoRA run's base is read from: its saved copy, or model.path."""
  found = saved(workdir)
  if found:
    return found
  if must_save(config) or not os.path.isdir(config.model.path):
    raise InputError(
        f"the base model of the LoRA run in {workdir} is gone: "
        + (f"its {FOLDER} folder" if must_save(config) else f"model.path {config.model.path}")
        + " holds it, and the adapters merge onto it"
    )
  return config.model.path


def start_adapters(path: str, spec: lora.LoraSpec | None, cfg):
  """The adapters of the PEFT folder at train.lora_path (host arrays), or None (no LoRA,
  or no path: a fresh init); an InputError naming the field if they do not fit."""
  if spec is None or not path:
    return None
  if not os.path.isdir(path):
    raise InputError(f"train.lora_path {path!r}: no such folder (a PEFT adapter to start from)")
  try:
    found, adapters = peft_io.load_peft(path, cfg)
  except peft_io.AdapterError as e:
    raise InputError(f"train.lora_path {path!r}: {e}") from None
  if found != spec:
    raise InputError(
        f"train.lora_path {path!r} holds adapters {found.describe()}, train.lora asks for "
        f"{spec.describe()}"
    )
  return adapters
