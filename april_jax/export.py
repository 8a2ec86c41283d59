"""Exports a run's policy as a Hugging Face Qwen3 folder that transformers loads.

  python -m april_jax.export --workdir=runs/qwen3_8b --out=exports/qwen3_8b \\
      [--step=N] [--dtype=bfloat16]

Reads the params alone of checkpoint `step` (default: the latest; the optimizer state is
not read), and the run's config from the checkpoint itself, so no --config is needed.
Writes config.json and safetensors (in `dtype`, default float32: the masters as trained)
and, when the run loaded a pretrained model, copies its tokenizer files beside them.
"""

from __future__ import annotations

import os
import shutil
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import ml_collections

from april_jax.checkpoint import Checkpointer
from april_jax.errors import InputError
from april_jax.models import hf_io, qwen3

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "generation_config.json",
)


def export(workdir: str, out: str, step: int | None = None, dtype: str = "float32") -> int:
  """Writes checkpoint `step` of `workdir` (latest if None) to `out`; returns the step."""
  checkpointer = Checkpointer(workdir)
  try:
    step = checkpointer.latest_step() if step is None else step
    if step is None or step not in checkpointer.steps():
      raise InputError(f"no checkpoint {'' if step is None else step} in {checkpointer.directory}")
    saved = checkpointer.read_host(step).get("config")
    if saved is None:
      raise InputError(f"checkpoint {step} in {workdir} has no saved config to export with")
    config = ml_collections.ConfigDict(saved)
    cfg = hf_io.model_config(config)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.key(0), jnp.float32))
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes
    )
    params = checkpointer.restore_params(step, abstract)
  finally:
    checkpointer.close()
  params = jax.tree.map(lambda x: x.astype(dtype), params)
  hf_io.save_pretrained(out, cfg, params)
  tokenizer_dir = config.model.tokenizer_path or config.model.path
  for name in TOKENIZER_FILES if tokenizer_dir else ():
    if os.path.isfile(os.path.join(tokenizer_dir, name)):
      shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(out, name))
  return step


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    step = export(f.workdir, f.out, None if f.step < 0 else f.step, f.dtype)
  except InputError as e:
    print(f"april_jax.export: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"exported checkpoint {step} of {f.workdir} to {f.out}")


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "The run's workdir (its checkpoints/).")
  flags.DEFINE_string("out", None, "The folder to write.")
  flags.DEFINE_integer("step", -1, "Checkpoint step to export (-1: the latest).")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights' dtype.")
  flags.mark_flags_as_required(["workdir", "out"])
  app.run(main)
