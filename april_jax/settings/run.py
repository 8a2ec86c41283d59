"""A run's settings: the top-level fields and every section, typed and frozen.

  RunSettings.from_config(config)   the ConfigDict of a config file and its command-line
                                    overrides (settings/base.py's surface), turned into
                                    these once, at start-up; what every part of a run reads
  RunSettings().to_config()         the ConfigDict a config file starts from

Each section's defaults are written once, in its own module here; settings/reference.py
writes docs/config.md from them, comments included.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from april_jax.settings import convert
from april_jax.settings.data import DataSettings
from april_jax.settings.env import EnvSettings
from april_jax.settings.evaluation import EvalSettings
from april_jax.settings.mesh import DistributedSettings, MeshSettings
from april_jax.settings.model import ModelSettings
from april_jax.settings.rollout import RolloutSettings
from april_jax.settings.train import TrainSettings


@dataclasses.dataclass(frozen=True)
class RunSettings:
  seed: int = 0  # params init, data order, sampling keys: a run is reproducible for a seed
  num_steps: int = 100  # RL steps (updates); may change on resume
  checkpoint_every: int = 50  # steps; 0 = only at the end and on SIGTERM
  eval_every: int = 0  # steps; 0 = never
  log_every: int = 1  # steps between progress lines on the console
  # XLA's persistent compilation cache, so a resumed or repeated run does not compile every
  # program again. None: <workdir>/xla_cache; "" = off. JAX_COMPILATION_CACHE_DIR wins.
  compilation_cache_dir: str | None = None
  model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
  mesh: MeshSettings = dataclasses.field(default_factory=MeshSettings)
  distributed: DistributedSettings = dataclasses.field(default_factory=DistributedSettings)
  data: DataSettings = dataclasses.field(default_factory=DataSettings)
  rollout: RolloutSettings = dataclasses.field(default_factory=RolloutSettings)
  env: EnvSettings = dataclasses.field(default_factory=EnvSettings)
  train: TrainSettings = dataclasses.field(default_factory=TrainSettings)
  eval: EvalSettings = dataclasses.field(default_factory=EvalSettings)

  @classmethod
  def from_config(cls, config) -> "RunSettings":
    """A config's ConfigDict (or a RunSettings, given back as it is) as RunSettings; a
    field the settings do not know, or a value of the wrong type, is a
    convert.SettingsError naming it."""
    if isinstance(config, cls):
      return config
    return convert.from_mapping(cls, config)

  @classmethod
  def from_saved(cls, saved: dict) -> "RunSettings":
    """The settings a checkpoint saved (validation/resume.py's as_json); fields the code
    no longer has are left out, fields it has since gained take their defaults."""
    return convert.from_mapping(cls, saved, known_only=True)

  def to_config(self):
    """These settings as the ConfigDict config files and flags change."""
    return convert.to_config_dict(self)

  def replace(self, **sections) -> "RunSettings":
    """These settings with some fields or whole sections replaced (dataclasses.replace)."""
    return dataclasses.replace(self, **sections)

  def overridden(self, changes: dict[str, Any]) -> "RunSettings":
    """These settings with the fields named as on the command line changed:
    `overridden({"rollout.kv_pages": 64, "num_steps": 3})`; an unknown name is a
    convert.SettingsError."""
    return convert.overridden(self, changes)
