"""The config reference, docs/config.md, written from the settings (settings/run.py and its
sections): every field, its default and the comment beside it in the source, section by
section.

  python -m april_jax.settings.reference > docs/config.md

A test keeps docs/config.md equal to what this writes, so a field added to a section with
its comment is in the reference too.
"""

from __future__ import annotations

import ast
import dataclasses
import io
from pathlib import Path
import sys
import tokenize

from april_jax.settings import base
from april_jax.settings.run import RunSettings

_SECTIONS = {  # the page's words for each section, in RunSettings' order
    "": "the run",
    "model": "the model: an HF folder or a random init, its dtypes and attention",
    "mesh": "the device mesh and how params and activations are laid out on it",
    "distributed": "several hosts",
    "data": "prompts, and the built-in task",
    "rollout": "rollouts: APRIL, the sampler and its KV pool, rewards",
    "env": "a multi-turn environment",
    "train": "the learner: algorithm, optimizer, corrections, layout",
    "eval": "held-out evaluation",
}


def _comments(source: str) -> dict[int, str]:
  """Line -> its comment's text."""
  out = {}
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      out[tok.start[0]] = tok.string.lstrip("#").strip()
  return out


def _class_comments(cls) -> dict[str, str]:
  """Field -> the comment beside its line in the class's source, or the comment lines
  right above it."""
  path = Path(sys.modules[cls.__module__].__file__)
  source = path.read_text(encoding="utf-8")
  comments, lines = _comments(source), source.splitlines()
  (node,) = [
      n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__
  ]
  out = {}
  for item in node.body:
    if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
      continue
    beside = [comments[n] for n in range(item.lineno, item.end_lineno + 1) if n in comments]
    above, n = [], item.lineno - 1
    while not beside and n >= 1 and lines[n - 1].strip().startswith("#"):
      above.insert(0, comments[n])
      n -= 1
    out[item.target.id] = " ".join(beside or above)
  return out


def field_comments(cls=RunSettings, prefix: str = "") -> dict[str, str]:
  """Field path -> its comment, every field of the settings (sections' fields under
  their path), in the source's order."""
  own, out = _class_comments(cls), {}
  for field in dataclasses.fields(cls):
    value = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
    if dataclasses.is_dataclass(value):
      out.update(field_comments(type(value), f"{prefix}{field.name}."))
    else:
      out[prefix + field.name] = own.get(field.name, "")
  return out


def _flat(config, prefix: str = "") -> dict:
  out = {}
  for key, value in config.items():
    if hasattr(value, "items"):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _default(value) -> str:
  text = repr(value)
  return text if len(text) <= 48 else text[:45] + "..."


def render() -> str:
  """The whole page."""
  values, comments = _flat(base.get_config()), field_comments()
  order = list(comments) + sorted(set(values) - set(comments))
  unnamed = {n.split(".")[0] for n in values if "." in n} - set(_SECTIONS)
  if unnamed:
    raise ValueError(f"sections without words in reference._SECTIONS: {sorted(unnamed)}")
  out = [
      "# Config reference",
      "",
      "Every field of a run's settings (`april_jax/settings/run.py` and its sections), its",
      "default and what it does, as its comment there says (this page is written from them:",
      "`python -m april_jax.settings.reference > docs/config.md`). A config file changes",
      "what it needs from `april_jax/settings/base.py`; any field can be set on the",
      "command line, e.g. `--config.rollout.over_sampling_batch_size=64`. Checked once at",
      "start-up by `april_jax/validation/checks.py`, which names the field at fault.",
  ]
  for section, words in _SECTIONS.items():
    names = [n for n in order if n in values and (n.split(".")[0] if "." in n else "") == section]
    out += [
        "",
        f"## `{section or 'top level'}`: {words}",
        "",
        "| field | default | |",
        "|---|---|---|",
    ]
    for name in names:
      comment = comments.get(name, "").replace("|", "\\|")
      out.append(f"| `{name}` | `{_default(values[name])}` | {comment} |")
  return "\n".join(out) + "\n"


if __name__ == "__main__":
  print(render(), end="")
