"""The typed settings: one source for every default, the ConfigDict made from them and
turned back into them unchanged, a bad field or value named, and nothing past start-up
reading a ConfigDict."""

import ast
import dataclasses
from pathlib import Path

import ml_collections
import pytest

from april_jax.settings import base
from april_jax.settings.convert import SettingsError
from april_jax.settings.rollout import RolloutSettings
from april_jax.settings.run import RunSettings
from april_jax.settings.train import TrainSettings

PACKAGE = Path(__file__).resolve().parents[1] / "april_jax"
# Where a ConfigDict may still be read: the settings themselves, the commands that parse
# a config file and its flags and turn it into settings, and the start-up checks that do.
CONFIG_DICT_READERS = {"settings", "validation", "main", "plan", "export", "replay", "bench"}


def _setting_defaults(cls, prefix="") -> dict[str, list[tuple[str, object]]]:
  """Field name -> [(its section.field, its default)] over every section."""
  out: dict[str, list[tuple[str, object]]] = {}
  for field in dataclasses.fields(cls):
    value = getattr(cls(), field.name)
    if dataclasses.is_dataclass(value):
      for name, where in _setting_defaults(type(value), f"{prefix}{field.name}.").items():
        out.setdefault(name, []).extend(where)
    else:
      out.setdefault(field.name, []).append((prefix + field.name, value))
  return out


def _literal(node):
  try:
    return ast.literal_eval(node)
  except ValueError:
    return _NOT_A_LITERAL


_NOT_A_LITERAL = object()


def _dataclass_field_defaults(path: Path):
  """(class, field, literal default, line) of every annotated class field written with a
  literal default (a default taken from another name is not written again)."""
  for node in ast.walk(ast.parse(path.read_text())):
    if not isinstance(node, ast.ClassDef):
      continue
    for item in node.body:
      if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value:
        value = _literal(item.value)
        if value is not _NOT_A_LITERAL:
          yield node.name, item.target.id, value, item.lineno


def test_no_default_of_a_setting_is_written_a_second_time():
  """A class outside settings/ with a field of a setting's name and the same literal
  default writes that default twice: it must take it from the section
  (`page_size: int = RolloutSettings.page_size`) or mean something else."""
  settings = _setting_defaults(RunSettings)
  twice = []
  for path in sorted(PACKAGE.rglob("*.py")):
    if path.relative_to(PACKAGE).parts[0] == "settings":
      continue
    for cls, name, value, line in _dataclass_field_defaults(path):
      for where, default in settings.get(name, ()):
        if value == default and type(value) is type(default):
          twice.append(f"{path.relative_to(PACKAGE)}:{line} {cls}.{name} = {value!r} ({where})")
  assert not twice, "defaults written twice:\n" + "\n".join(twice)


def test_the_check_finds_a_default_written_twice(tmp_path):
  """The scan above on a class that copies rollout.page_size's default, and on one that
  takes it from the section."""
  copy = tmp_path / "copy.py"
  copy.write_text("class Engine:\n  page_size: int = 16\n  kv_dtype: str = X.kv_dtype\n")
  found = list(_dataclass_field_defaults(copy))
  assert found == [("Engine", "page_size", 16, 2)]
  assert ("rollout.page_size", 16) in _setting_defaults(RunSettings)["page_size"]


def test_the_config_dict_is_the_settings_field_for_field():
  config = base.get_config()
  assert isinstance(config, ml_collections.ConfigDict)
  assert RunSettings.from_config(config) == RunSettings()
  config.rollout.over_sampling_batch_size = 64
  config.train.lora.rank = 8
  config.rollout.kv_pages = 100
  config.mesh.shape = [2, -1, 1]  # a config file may write a list
  s = RunSettings.from_config(config)
  assert s.rollout.over_sampling_batch_size == 64 and s.train.lora.rank == 8
  assert s.rollout.kv_pages == 100 and s.mesh.shape == (2, -1, 1)
  assert RunSettings.from_config(s.to_config()) == s


def test_settings_are_frozen_and_replaced_whole():
  s = RunSettings()
  with pytest.raises(dataclasses.FrozenInstanceError):
    s.rollout.batch_size = 3  # type: ignore[misc]
  t = s.replace(rollout=dataclasses.replace(s.rollout, batch_size=3))
  assert t.rollout.batch_size == 3 and s.rollout.batch_size == RolloutSettings.batch_size


def test_an_unknown_field_or_a_value_of_the_wrong_type_is_named():
  config = base.get_config()
  with config.unlocked():
    config.train.lora_rank = 8
  with pytest.raises(SettingsError, match=r"train\.lora_rank: no such config field"):
    RunSettings.from_config(config)
  with pytest.raises(SettingsError, match=r"train\.lr must be a float, got 'fast'"):
    RunSettings.from_config({"train": {"lr": "fast"}})
  with pytest.raises(SettingsError, match=r"rollout\.batch_size must be an int, got True"):
    RunSettings.from_config({"rollout": {"batch_size": True}})
  with pytest.raises(SettingsError, match=r"train\.advantage may not be None"):
    RunSettings.from_config({"train": {"advantage": None}})
  assert RunSettings.from_config({"train": {"lr": 1}}).train.lr == 1.0  # an int is a float


def test_every_field_at_fault_is_named_not_the_first_alone():
  with pytest.raises(SettingsError) as e:
    RunSettings.from_config({"train": {"lr": "fast", "lora": 3}, "rollout": {"batch_size": 1.5}})
  message = str(e.value)
  assert "\n" not in message
  for name in ("train.lr must be a float", "train.lora is a section", "rollout.batch_size"):
    assert name in message, message


def test_a_section_changed_whole_is_checked_as_its_fields_are():
  s = RunSettings()
  t = s.overridden({"train.lora": {"rank": 8}})
  assert t.train.lora == dataclasses.replace(s.train.lora, rank=8)
  assert s.overridden({"train.lora": t.train.lora}).train.lora.rank == 8
  with pytest.raises(SettingsError, match=r"train\.lora\.rank must be an int"):
    s.overridden({"train.lora": {"rank": "eight"}})
  with pytest.raises(SettingsError, match=r"train\.lora is a section"):
    s.overridden({"train.lora": 8})


def test_an_unset_optional_field_stays_optional_in_the_config_dict():
  config = base.get_config()
  assert config.train.eps_clip is None
  config.train.eps_clip = 0.3  # a placeholder of float: takes a float
  with pytest.raises(TypeError):
    config.train.eps_clip = "wide"
  assert RunSettings.from_config(config).train.eps_clip == 0.3
  assert TrainSettings().eps_clip is None


def _reads_a_config_dict(path: Path) -> list[str]:
  """The lines of `path` that import ml_collections or call a ConfigDict's own methods."""
  methods = ("copy_and_resolve_references", "unlocked", "to_json_best_effort", "get_ref")
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
      if any(n.startswith("ml_collections") for n in names):
        out.append(f"{path.name}:{node.lineno} imports ml_collections")
    elif isinstance(node, ast.Attribute) and node.attr in methods:
      out.append(f"{path.name}:{node.lineno} .{node.attr}")
  return out


def test_nothing_past_start_up_reads_a_config_dict():
  found = []
  for path in sorted(PACKAGE.rglob("*.py")):
    part = path.relative_to(PACKAGE).with_suffix("").parts[0]
    if part not in CONFIG_DICT_READERS:
      found += _reads_a_config_dict(path)
  assert not found, found
