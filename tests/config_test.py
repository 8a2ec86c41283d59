"""Config files load, validate, and a wrong config names its field."""

import importlib.util
from pathlib import Path

import pytest

from april_jax.configs.validate import ConfigError, validate

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def load(name):
  spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_tiny_config_is_valid():
  validate(load("tiny"))


@pytest.mark.parametrize("field,value,message", [
    ("rollout.over_sampling_batch_size", 4, r"over_sampling_batch_size \(4\) must be >= "
                                            r"rollout.batch_size \(8\)"),
    ("rollout.resume_mode", "disk", "rollout.resume_mode must be one of"),
    ("rollout.reward", "nope", "rollout.reward 'nope' is not a registered reward"),
    ("rollout.top_p", 0.0, r"rollout.top_p must be in \(0, 1\]"),
    ("model.path", "/nonexistent/model", "model.path '/nonexistent/model' is not a model"),
    ("model.dtype", "float16", "model.dtype must be one of"),
    ("mesh.shape", (1, 2), "mesh.shape must have 3 entries"),
])
def test_wrong_field_is_named(field, value, message):
  config = load("tiny")
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ConfigError, match=message):
    validate(config)


def test_all_problems_are_reported_together():
  config = load("tiny")
  config.rollout.batch_size = 0
  config.rollout.temperature = -1.0
  with pytest.raises(ConfigError) as info:
    validate(config)
  assert "rollout.batch_size" in str(info.value) and "rollout.temperature" in str(info.value)
