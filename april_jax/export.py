"""Exports a run's policy as a Hugging Face Qwen3 folder that transformers loads.

  python -m april_jax.export --workdir=runs/qwen3_8b --out=exports/qwen3_8b \\
      [--step=N] [--dtype=bfloat16] [--overwrite] [--format=merged|peft]

A LoRA run (train.lora) exports either way: `merged` (the default) writes the base with
the adapters merged in, a plain model folder; `peft` writes the adapters alone as a PEFT
folder (adapter_config.json + adapter_model.safetensors, float32 whatever --dtype) that
`peft.PeftModel.from_pretrained(base, folder)` loads onto the base model, which its
base_model_name_or_path names. The base is read from the run's model.path, or from the
copy a run of a random or warm-started base keeps in its workdir
(april_jax/run/lora_base.py), and must be the one the adapters were trained over (its
fingerprint in the checkpoint): unlike a full fine-tune's export, a merged one needs it.

Reads the params alone of checkpoint `step` (the state after N updates; default: the
latest; the optimizer state is not read), and the run's config and model shape from the
checkpoint itself, so no --config is needed and the model folder the run started from
may have moved. Writes config.json and safetensors (in `dtype`, default
float32: the masters as trained) and, when the run loaded a pretrained model, copies its
tokenizer files beside them.

It never destroys a model or a run: `--out` may not be the folder the run loaded its model,
tokenizer, LoRA adapters or critic from, nor the run's workdir (its checkpoints, the
base a LoRA run keeps there), nor be inside any of them or hold one, with or without
--overwrite. An existing non-empty `--out` is replaced only with --overwrite, and
only when it holds nothing but what an export writes (an earlier export): a folder with
anything else in it (a model's README, a run's checkpoints, a subfolder) is refused, naming
what it holds. The export is written into a new folder beside `--out` and renamed into
place, so a failed export leaves `--out` as it was; what an export killed mid-way left
beside `--out` (its staging folder, a previous export moved aside) is tidied by the next
export to it. Checkpoints are opened read-only:
nothing is created at a mistyped --workdir.
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax loads: Ctrl-C is one line and exit 130
  from april_jax.runtime import interrupt  # pylint: disable=g-import-not-at-top

  interrupt.install("--out is as it was; the next export to it tidies what this one left")

import errno
import os
import re
import shutil
import sys
import tempfile

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp

from april_jax.run import lora_base
from april_jax.settings.convert import SettingsError
from april_jax.settings.run import RunSettings
from april_jax.checkpoint import Checkpointer
from april_jax.errors import InputError
from april_jax.models import hf_io, lora, peft_io, qwen3

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "generation_config.json",
)


_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _written_by_export(folder: str, name: str) -> bool:
  """Whether `name` in `folder` is a file an export writes (what --overwrite may replace)."""
  own = (hf_io.CONFIG_NAME, hf_io.INDEX_NAME, hf_io.SINGLE_NAME, *TOKENIZER_FILES)
  own += (peft_io.CONFIG_NAME, peft_io.WEIGHTS_NAME)
  path = os.path.join(folder, name)
  return (name in own or _SHARD_NAME.fullmatch(name) is not None) and (
      os.path.isfile(path) and not os.path.islink(path)
  )


def _check_out(out: str, workdir: str, config, overwrite: bool) -> str:
  """`out`, resolved (symlinks too), once it is safe to write; else an InputError."""
  target = os.path.realpath(out)
  sources = {f"model.{f}": getattr(config.model, f) for f in ("path", "tokenizer_path")}
  sources.update({f"train.{f}": getattr(config.train, f) for f in ("lora_path", "critic_path")})
  for field, source in sources.items():
    if not source:
      continue
    source = os.path.realpath(source)
    if os.path.commonpath([target, source]) in (target, source):
      raise InputError(
          f"--out={out} is {'' if target == source else 'inside or above '}the folder the "
          f"run loaded its model from ({field}={sources[field]}); export "
          "never writes there, even with --overwrite: choose a new folder"
      )
  run = os.path.realpath(workdir)
  if os.path.commonpath([target, run]) in (target, run):
    where = (
        ""
        if target == run
        else "above "
        if os.path.commonpath([target, run]) == target
        else "inside "
    )
    raise InputError(
        f"--out={out} is {where}the run's workdir (--workdir={workdir}), which holds its "
        "checkpoints and the base a LoRA run trains over; export never writes there, even "
        "with --overwrite: choose a new folder"
    )
  if os.path.exists(target) and not os.path.isdir(target):
    raise InputError(f"--out={out} is a file, not a folder")
  entries = sorted(os.listdir(target)) if os.path.isdir(target) else []
  if entries and not overwrite:
    raise InputError(
        f"--out={out} is not empty ({len(entries)} entries); pass --overwrite to "
        "replace it, or choose a new folder"
    )
  foreign = [name for name in entries if not _written_by_export(target, name)]
  if foreign:
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    raise InputError(
        f"--out={out} holds what an export does not write ({shown}); --overwrite replaces "
        "only an earlier export: choose a new folder"
    )
  return target


def _open_checkpoints(workdir: str) -> Checkpointer:
  if not os.path.isdir(workdir):
    raise InputError(f"--workdir={workdir} does not exist")
  try:
    return Checkpointer(workdir, read_only=True)
  except FileNotFoundError as e:
    raise InputError(f"--workdir={workdir} holds no checkpoints ({e})") from e


def _pick_step(checkpointer: Checkpointer, step: int | None) -> int:
  steps = checkpointer.steps()
  if not steps:
    raise InputError(f"no checkpoint in {checkpointer.directory}")
  if step is None:
    return steps[0]
  if step not in steps:
    raise InputError(
        f"no checkpoint {step} in {checkpointer.directory}; the steps there: "
        f"{', '.join(map(str, sorted(steps)))}"
    )
  return step


def _tidy_interrupted(target: str) -> None:
  """Undoes what an export to `target` that was killed left beside it: its staging folder
  (a partial copy) goes, and a previous export it had moved aside comes back."""
  parent, base = os.path.split(target)
  if not os.path.isdir(parent):
    return
  for name in os.listdir(parent):
    path = os.path.join(parent, name)
    if name.startswith(f".{base}.export-"):
      shutil.rmtree(path, ignore_errors=True)
    elif name.startswith(f".{base}.old-"):
      moved = os.path.join(path, "out")
      if os.path.isdir(moved) and not os.path.lexists(target):
        os.rename(moved, target)  # killed between its two renames: the old one comes back
      shutil.rmtree(path, ignore_errors=True)  # else the new one is in place: the old goes


# Errors that say --out is not a place this process can write (a read-only mount, no
# permission, a mount point that cannot be moved): one line, not a traceback.
_CANNOT_WRITE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.EBUSY, errno.EXDEV)


def _write_folder(target: str, write, tokenizer_dir: str | None) -> None:
  """Writes the export (write(folder) writes the weights) into a new folder beside
  `target`, then renames it into place (a previous `target` is moved aside first and
  removed last). A place that cannot be written is an InputError naming it, with nothing
  left behind."""
  try:
    _write_and_rename(target, write, tokenizer_dir)
  except OSError as e:
    if e.errno not in _CANNOT_WRITE:
      raise
    raise InputError(f"--out {target}: cannot write there: {e.strerror or e}") from None


def _write_and_rename(target: str, write, tokenizer_dir: str | None) -> None:
  parent = os.path.dirname(target)
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.export-", dir=parent)
  old = None
  try:
    write(staging)
    for name in TOKENIZER_FILES if tokenizer_dir else ():
      if os.path.isfile(os.path.join(tokenizer_dir, name)):
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(staging, name))
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes it 0700; a model folder is shared
    if os.path.exists(target):
      old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=parent)
      os.rename(target, os.path.join(old, "out"))
    os.rename(staging, target)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    if old is not None and not os.path.exists(os.path.join(old, "out")):
      os.rmdir(old)  # target never moved: the folder made for it goes too
    raise
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def export(
    workdir: str,
    out: str,
    step: int | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
    format: str = "merged",  # pylint: disable=redefined-builtin
) -> int:
  """Writes checkpoint `step` of `workdir` (latest if None) to `out`; returns the step.
  format: merged (a model folder) or peft (a LoRA run's adapters alone)."""
  checkpointer = _open_checkpoints(workdir)
  try:
    step = _pick_step(checkpointer, step)
    host = checkpointer.read_host(step)
    if host.get("config") is None:
      raise InputError(f"checkpoint {step} in {workdir} has no saved config to export with")
    try:
      config = RunSettings.from_saved(host["config"])
    except SettingsError as e:  # a saved value this version's settings cannot hold
      raise InputError(f"checkpoint {step} in {workdir}: its saved config: {e}") from None
    _tidy_interrupted(os.path.realpath(out))
    target = _check_out(out, workdir, config, overwrite)
    # The model as trained, from the checkpoint; from model.path's folder for checkpoints
    # saved before they held it (that folder must then still be there).
    cfg = (
        hf_io.from_architecture(host["model"]) if host.get("model") else hf_io.model_config(config)
    )
    spec = _lora_spec(host, format)
    if spec is None:
      shapes = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.key(0), jnp.float32))
    else:
      shapes = jax.eval_shape(lambda: lora.init(cfg, spec, jax.random.key(0)))
    params = checkpointer.restore_params(step, _on_one_device(shapes))
  finally:
    checkpointer.close()
  if format == "peft":
    base_model = lora_base.source(workdir, config)
    write = lambda folder: peft_io.save_peft(folder, spec, params, base_model)
  else:
    if spec is not None:
      params = _merged(workdir, config, host["learner"]["lora"], spec, params, dtype)
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    write = lambda folder: hf_io.save_pretrained(folder, cfg, params)
  tokenizer_dir = config.model.tokenizer_path or config.model.path
  if tokenizer_dir and not os.path.isdir(tokenizer_dir):
    print(
        f"april_jax.export: warning: the run's tokenizer folder {tokenizer_dir} is gone: the "
        "export has no tokenizer files (copy them in from the model the run started from)",
        file=sys.stderr,
    )
  _write_folder(target, write, tokenizer_dir)
  return step


def _merged(workdir: str, config, saved: dict, spec: lora.LoraSpec, adapters, dtype: str):
  """The adapters merged into the base they were trained over (read as the run froze it,
  in model.dtype, and checked against the checkpoint's fingerprint), in `dtype`; the base
  is donated, so the merge holds one copy of it and the output."""
  folder = lora_base.source(workdir, config)
  base = hf_io.load_pretrained(folder, config.model.dtype)[1]
  found = lora.fingerprint(base)
  if found != saved["base_fingerprint"]:
    raise InputError(
        f"the base model in {folder} is not the one the adapters were trained over "
        f"(fingerprint {found}, the checkpoint's {saved['base_fingerprint']})"
    )

  def merge(base, adapters):  # in float32 when float32 is asked for, else in the base's
    if jnp.dtype(dtype) == jnp.float32:
      base = jax.tree.map(lambda x: x.astype(jnp.float32), base)
    return jax.tree.map(lambda x: x.astype(dtype), lora.merge(base, adapters, spec))

  return jax.jit(merge, donate_argnums=0)(base, adapters)


def _lora_spec(host: dict, format: str) -> lora.LoraSpec | None:  # pylint: disable=redefined-builtin
  """The adapters' spec of a LoRA run's checkpoint (None for a full fine-tune's; then
  --format=peft is an InputError)."""
  saved = (host.get("learner") or {}).get("lora")
  if saved is None:
    if format == "peft":
      raise InputError(
          "--format=peft writes LoRA adapters; this run trained every weight (no train.lora): "
          "export it as a model folder (--format=merged)"
      )
    return None
  return lora.LoraSpec(int(saved["rank"]), float(saved["alpha"]), tuple(saved["targets"]))


def _on_one_device(shapes):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)


def main(argv):
  del argv
  f = flags.FLAGS
  if not f["verbosity"].present:
    logging.set_verbosity(logging.ERROR)  # Orbax's notes on a read-only manager are not news
  try:
    step = export(f.workdir, f.out, None if f.step < 0 else f.step, f.dtype, f.overwrite, f.format)
  except InputError as e:
    print(f"april_jax.export: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"exported checkpoint {step} of {f.workdir} to {f.out}")


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "The run's workdir (its checkpoints/).")
  flags.DEFINE_string("out", None, "The folder to write.")
  flags.DEFINE_integer("step", -1, "Checkpoint step to export (-1: the latest).")
  flags.DEFINE_bool(
      "overwrite", False, "Replace an earlier export at --out (never a model or a run)."
  )
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights' dtype.")
  flags.DEFINE_enum(
      "format",
      "merged",
      ["merged", "peft"],
      "merged: a model folder (a LoRA run's adapters merged into its base); peft: a LoRA "
      "run's adapters alone, as a PEFT folder (float32, whatever --dtype).",
  )
  flags.mark_flags_as_required(["workdir", "out"])
  app.run(main)
