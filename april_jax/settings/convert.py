"""Settings dataclasses to and from the ConfigDict that config files and command-line
flags change (ml_collections), field by field: a section becomes a ConfigDict, an unset
optional field (`X | None`, default None) a placeholder of X, a tuple stays a tuple."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import ml_collections
from ml_collections import config_dict


class SettingsError(ValueError):
  """A config the settings cannot hold: its fields named, one line."""


def _hints(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _optional_of(hint) -> type | None:
  """X for `X | None`, else None."""
  args = typing.get_args(hint)
  if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
    rest = [a for a in args if a is not type(None)]
    if len(rest) == 1 and len(args) == 2:
      return rest[0]
  return None


def to_config_dict(settings) -> ml_collections.ConfigDict:
  """A settings dataclass (and its sections) as a ConfigDict of the same fields."""
  out = ml_collections.ConfigDict()
  hints = _hints(type(settings))
  for field in dataclasses.fields(settings):
    value = getattr(settings, field.name)
    if dataclasses.is_dataclass(value):
      out[field.name] = to_config_dict(value)
    elif value is None and (inner := _optional_of(hints[field.name])) is not None:
      out[field.name] = config_dict.placeholder(inner)
    else:
      out[field.name] = value
  return out


def _tupled(value):
  """Lists in a value (a config file may write one) as tuples, at every depth."""
  if isinstance(value, (list, tuple)):
    return tuple(_tupled(v) for v in value)
  return value


_KINDS = {int: "an int", float: "a float", bool: "a bool", str: "a string"}


def _coerced(value, hint, path: str):
  inner = _optional_of(hint)
  if value is None:
    if inner is None and hint is not type(None):
      raise SettingsError(f"{path} may not be None")
    return None
  target = inner or hint
  if target is tuple:
    if not isinstance(value, (list, tuple)):
      raise SettingsError(f"{path} must be a tuple, got {value!r}")
    return _tupled(value)
  if target is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if target in _KINDS and not isinstance(value, target):
    raise SettingsError(f"{path} must be {_KINDS[target]}, got {value!r}")
  if target is int and isinstance(value, bool):
    raise SettingsError(f"{path} must be an int, got {value!r}")
  return value


def from_mapping(cls, mapping, prefix: str = "", known_only: bool = False):
  """A settings dataclass from a ConfigDict (or a dict) of its fields, sections included.
  A field missing from the mapping keeps its default; one the dataclass does not have is
  a SettingsError naming it, or left out with known_only (a config saved by an older
  version of the code)."""
  fields = {f.name: f for f in dataclasses.fields(cls)}
  keys = set(mapping.keys()) & set(fields) if known_only else set(mapping.keys())
  unknown = sorted(keys - set(fields))
  if unknown:
    names = ", ".join(prefix + k for k in unknown)
    raise SettingsError(f"{names}: no such config field")
  hints, values, problems = _hints(cls), {}, []
  for name in fields:
    if name not in keys:
      continue
    try:
      values[name] = _field_value(mapping[name], hints[name], f"{prefix}{name}", known_only)
    except SettingsError as e:  # every field at fault named, not the first alone
      problems.append(str(e))
  if problems:
    raise SettingsError("; ".join(problems))
  return cls(**values)


def _field_value(value, hint, path: str, known_only: bool = False):
  """A field's value checked against its type; a section from its mapping (or as it is)."""
  if not dataclasses.is_dataclass(hint):
    return _coerced(value, hint, path)
  if isinstance(value, hint):
    return value
  if not hasattr(value, "keys"):
    raise SettingsError(f"{path} is a section: give its fields, got {value!r}")
  return from_mapping(hint, value, f"{path}.", known_only)


def overridden(settings, changes: dict[str, Any], prefix: str = ""):
  """A settings dataclass with fields changed by dotted name ("rollout.kv_pages"), each
  value checked against its field's type as from_mapping checks it."""
  fields = {f.name for f in dataclasses.fields(settings)}
  hints, own, inner = _hints(type(settings)), {}, {}
  for name, value in changes.items():
    head, _, rest = name.partition(".")
    if head not in fields:
      raise SettingsError(f"{prefix}{name}: no such config field")
    if rest:
      inner.setdefault(head, {})[rest] = value
    else:
      own[head] = _field_value(value, hints[head], prefix + head)
  for head, sub in inner.items():
    section = getattr(settings, head)
    if not dataclasses.is_dataclass(section):
      raise SettingsError(f"{prefix}{head} is not a section (got {head}.{next(iter(sub))})")
    own[head] = overridden(section, sub, f"{prefix}{head}.")
  return dataclasses.replace(settings, **own)
