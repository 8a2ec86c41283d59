"""The config files' surface: the ConfigDict a file in configs/ starts from.

Configs are Python (ml_collections): `configs/<name>.py` defines `get_config(arg)`,
starting from `base.get_config()` and changing what it needs; any field can be
overridden on the command line, e.g. `--config.rollout.over_sampling_batch_size=64`.
The ConfigDict is made from the typed settings (settings/run.py: every field, its default,
its comment, once) and turned back into them once at start-up (RunSettings.from_config),
where april_jax.validation.checks checks the whole config, before anything compiles,
naming the field at fault.
"""

import importlib.util
from pathlib import Path

import ml_collections

from april_jax.settings.run import RunSettings


def sibling(config_file: str, name: str):
  """The config module `name` (e.g. "tiny.py") beside `config_file` (a config's own
  __file__), loaded by path: configs/ is a folder of files, not a package."""
  path = Path(config_file).resolve().parent / name
  spec = importlib.util.spec_from_file_location(f"april_jax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def no_variants(arg, path: str) -> None:
  """Refuses a variant (`--config=<path>:<arg>`) for a config file that has none."""
  if arg:
    raise ValueError(f"{path} has no variants (got {arg!r}); use it without ':{arg}'")


def get_config() -> ml_collections.ConfigDict:
  """Every field of a run, at its default (settings/run.py's RunSettings)."""
  return RunSettings().to_config()


def qwen3_tool_turns(c: ml_collections.ConfigDict) -> None:
  """Sets c.env's turn fields for Qwen3's tool calls as a deployment serves them: a turn
  ends where a chat turn does (<|im_end|>), so every call of the turn is seen, and each
  tool result comes back as the chat template renders tool messages and the next
  generation prompt (envs/observation_format.py)."""
  c.env.turn_stop = ""
  c.env.observation_format = "chat_template"
