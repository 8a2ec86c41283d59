"""The config reference, docs/config.md, written from settings/base.py: every field, its
default and the comment beside it in the source, section by section.

  python -m april_jax.settings.reference > docs/config.md

A test keeps docs/config.md equal to what this writes, so a field added to base.py with
its comment is in the reference too.
"""

from __future__ import annotations

import ast
import io
from pathlib import Path
import tokenize

from april_jax.settings import base

SOURCE = Path(base.__file__)
_SECTIONS = {  # the page's words for each section, in base.py's order
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


def _path(node: ast.expr, prefixes: dict[str, str]) -> str | None:
  """`m.init.std` with m -> "model." gives "model.init.std"; None for other targets."""
  names = []
  while isinstance(node, ast.Attribute):
    names.append(node.attr)
    node = node.value
  if not isinstance(node, ast.Name) or node.id not in prefixes:
    return None
  return prefixes[node.id] + ".".join(reversed(names))


def _is_section(value: ast.expr) -> str | None:
  """'' for `ml_collections.ConfigDict()`, the function's name for `_fn()`, else None."""
  if not isinstance(value, ast.Call):
    return None
  fn = value.func
  if isinstance(fn, ast.Attribute) and fn.attr == "ConfigDict":
    return ""
  if isinstance(fn, ast.Name) and fn.id.startswith("_"):
    return fn.id
  return None


def field_comments() -> dict[str, str]:
  """Field path -> the comment beside its assignment in base.py (or the comment lines
  right above it), in the source's order."""
  source = SOURCE.read_text(encoding="utf-8")
  comments, lines = _comments(source), source.splitlines()
  functions = {f.name: f for f in ast.parse(source).body if isinstance(f, ast.FunctionDef)}
  found: dict[str, tuple[int, int, str]] = {}
  todo = [("get_config", "")]
  while todo:
    name, prefix = todo.pop(0)
    # A helper that fills a section it is given (`_objective(t)`) fills it under its prefix.
    prefixes: dict[str, str] = {a.arg: prefix for a in functions[name].args.args}
    for node in ast.walk(functions[name]):
      if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        fn, args = node.value.func, node.value.args
        if isinstance(fn, ast.Name) and fn.id in functions and args:
          todo.append((fn.id, prefixes.get(getattr(args[0], "id", None), prefix)))
    assigns = [n for n in ast.walk(functions[name]) if isinstance(n, ast.Assign)]
    for node in sorted(assigns, key=lambda n: n.lineno):
      section = _is_section(node.value)
      targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
      paths = [_path(t, prefixes) for t in targets if not isinstance(t, ast.Name)]
      for target in node.targets:  # `c = ConfigDict()`, `i = m.init = ConfigDict()`
        if isinstance(target, ast.Name) and section == "":
          prefixes[target.id] = paths[0] + "." if paths and paths[0] else prefix
      for path in paths:
        if path is None:
          continue
        if section:
          todo.append((section, path + "."))
        if section is None:
          found[path] = (len(found), _comment_of(node, comments, lines))
  return {path: comment for path, (_, comment) in sorted(found.items(), key=lambda kv: kv[1][0])}


def _comment_of(node: ast.Assign, comments: dict[int, str], lines: list[str]) -> str:
  beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
  if beside:
    return " ".join(beside)
  above, n = [], node.lineno - 1
  while n >= 1 and lines[n - 1].strip().startswith("#"):
    above.insert(0, comments[n])
    n -= 1
  return " ".join(above)


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
      "Every field of `april_jax/settings/base.py`, its default and what it does, as its",
      "comment there says (this page is written from it: `python -m april_jax.settings.reference",
      "> docs/config.md`). A config file changes what it needs; any field can be set on the",
      "command line, e.g. `--config.rollout.over_sampling_batch_size=64`. Checked once at",
      "start-up by `april_jax/settings/validate.py`, which names the field at fault.",
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
