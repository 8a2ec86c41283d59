"""The commands the documents show work as shown.

README.md's fenced code blocks are read here, so this follows README edits: each command
there is one this file knows. Those that finish in seconds on a CPU run as written (the
memory plan, the config reference); a training run's command line is parsed by `main`'s
own flag parser (`--only_check_args`) and its config loaded with its overrides and
validated; the test command is the one CI runs; installs are not run.

Every `python -m april_jax.<program>` command in README.md and docs/ (code blocks and
inline code) names a program that exists and flags it defines, and every
`--config.<field>` anywhere in them names a field of the config.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from absl import flags
from ml_collections import config_flags
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# benchmarks_log.md is a lab notebook: its commands are as they were run then.
PAGES = [README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks_log.md")]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_SHELL_END = {";", "&", "&&", "|", "||", "done", "then"}
# absl's own flags that the pages use.
_ABSL_FLAGS = {"verbosity", "helpshort", "helpfull", "only_check_args"}


def _split(line: str) -> list[str]:
  """A shell line's words, comments dropped, up to its first `;`, `&`, `|` or redirect."""
  try:
    words = shlex.split(line, comments=True)
  except ValueError:  # an unbalanced quote in prose: plain words
    words = line.split()
  out = []
  for word in words:
    if word in _SHELL_END or word.startswith((">", "2>")):
      break
    out.append(word)
  return out


def _shell_lines(block: str) -> list[str]:
  """A code block's lines, continuation lines (ending in a backslash) joined."""
  return [l.strip() for l in block.replace("\\\n", " ").splitlines() if l.strip()]


def readme_commands() -> list[list[str]]:
  """Every command in README.md's shell code blocks, as words."""
  commands = []
  for lang, block in _FENCE.findall(README.read_text(encoding="utf-8")):
    if lang in ("bash", "sh", "shell", "console"):
      commands += [words for line in _shell_lines(block) if (words := _split(line))]
  return commands


def _kind(words: list[str]) -> str:
  """What a README command is, for what this test does with it."""
  if words[:2] == ["pip", "install"]:
    return "install"
  if words[:2] == ["bash", "launch/install_gpu.sh"]:
    return "install"
  if words[:3] == ["python", "-m", "pytest"]:
    return "tests"
  if words[:3] == ["python", "-m", "april_jax.main"]:
    return "run"
  if words[:3] == ["python", "-m", "april_jax.plan"] and "--compile" not in words:
    return "quick"
  if words[:3] == ["python", "-m", "april_jax.settings.reference"]:
    return "quick"
  return "unknown"


def _ids(commands):
  return [" ".join(words)[:60] for words in commands]


def _of_kind(kind: str) -> list[list[str]]:
  return [words for words in readme_commands() if _kind(words) == kind]


def test_every_readme_command_is_one_this_test_knows():
  commands = readme_commands()
  unknown = [" ".join(words) for words in commands if _kind(words) == "unknown"]
  assert not unknown, f"README.md shows commands this test does not check: {unknown}"
  kinds = {_kind(words) for words in commands}
  assert {"install", "tests", "run", "quick"} <= kinds, kinds


def test_the_readme_test_command_is_the_one_ci_runs():
  ci = [
      shlex.split(line)
      for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
      if line.startswith("python -m pytest")
  ]
  assert ci and _of_kind("tests") == ci


def _python(*args) -> subprocess.CompletedProcess:
  """`python *args` from the repository root, its output captured."""
  run = dict(cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  return subprocess.run([sys.executable, *args], **run)


@pytest.mark.parametrize("words", _of_kind("quick"), ids=_ids(_of_kind("quick")))
def test_a_quick_readme_command_runs_as_shown(words):
  proc = _python(*words[1:])
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.strip().splitlines()
  if words[2] == "april_jax.plan":  # its last line: one JSON object, and it fits
    assert json.loads(lines[-1])["fits"] is True
  else:
    assert proc.stdout == (ROOT / "docs" / "config.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("words", _of_kind("run"), ids=_ids(_of_kind("run")))
def test_a_readme_training_command_parses_and_its_config_validates(words, tmp_path):
  """The run itself takes minutes: its command line goes through main's own flag parser
  (into a workdir of the test's, never created), and its config is loaded with its
  overrides and checked as main checks it before anything compiles."""
  workdir = tmp_path / "workdir"
  args = [f"--workdir={workdir}" if w.startswith("--workdir=") else w for w in words[3:]]
  proc = _python("-m", "april_jax.main", *args, "--only_check_args")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not workdir.exists()

  from april_jax.validation import checks as validate  # pylint: disable=g-import-not-at-top

  config = _load_config([w for w in args if w.startswith("--config")])
  if config.model.path:  # a model of the user's: the checks that need no files
    validate.validate(config, validate.PLAN_CHECKS)
  else:  # runs on a CPU as shown: every check, on one device
    validate.validate(config)
    validate.validate_for_devices(config, 1)


def _load_config(config_args: list[str]):
  """The config `--config=<file>[:variant]` and its `--config.<field>=` overrides give,
  parsed as main parses them, without main's other flags."""
  argv = ["prog", *config_args]  # the overrides are found in the argv given here
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", values, lock_config=True, sys_argv=argv)
  cwd = os.getcwd()
  os.chdir(ROOT)  # config paths are relative to the repository root
  try:
    values(argv)
    return values.config
  finally:
    os.chdir(cwd)


# ------------------------------------------------------------- commands in every page
def _page_commands(page: Path) -> list[list[str]]:
  """Every `python -m april_jax.<program>` command in a page: in shell code blocks and in
  inline code, leading environment settings dropped."""
  text = page.read_text(encoding="utf-8")
  pieces = []
  for lang, block in _FENCE.findall(text):
    if lang in ("bash", "sh", "shell", "console"):
      pieces += _shell_lines(block)
  pieces += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", _FENCE.sub("", text))]
  commands = []
  for piece in pieces:
    start = piece.find("python -m april_jax")
    if start >= 0:
      commands.append(_split(piece[start:]))
  return commands


def _program_flags(module: str) -> set[str]:
  """The flags a program defines, read from its source (some define them only when run)."""
  source = (ROOT / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")
  return set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", source)) | _ABSL_FLAGS


def _has_field(config, dotted: str) -> bool:
  node = config
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node.keys():
      return False
    node = node[part]
  return True


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_commands_in_a_page_name_programs_and_flags_that_exist(page):
  from april_jax.settings import base  # pylint: disable=g-import-not-at-top

  wrong = []
  for words in _page_commands(page):
    module = words[2]
    if not (ROOT / (module.replace(".", "/") + ".py")).is_file():
      wrong.append(f"{module}: no such program")
      continue
    known = _program_flags(module)
    config_args = []
    for word in words[3:]:
      if not word.startswith("--"):  # a value, or an optional "[--flag=...]" placeholder
        continue
      name = word[2:].split("=", 1)[0]
      if name.startswith("config."):
        if not _has_field(base.get_config(), name[len("config.") :]):
          wrong.append(f"{module} {word}: no such config field")
        if not re.search(r"[$<>]", word):  # a value, not "$i" or "<N>"
          config_args.append(word)
      elif name not in known and not (name.startswith("no") and name[2:] in known):
        wrong.append(f"{module} {word}: no such flag (it has {sorted(known)})")
      elif name == "config":
        config_args.append(word)
    given = [w for w in config_args if w.startswith("--config=")]
    if given and not re.search(r"[<>*]", given[0]):  # a real file, not "configs/<name>.py"
      try:
        _load_config(config_args)
      except Exception as e:  # pylint: disable=broad-except
        wrong.append(f"{' '.join(words)}: the config does not load: {e}")
  assert not wrong, wrong


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_config_override_in_a_page_names_a_field(page):
  from april_jax.settings import base  # pylint: disable=g-import-not-at-top

  config = base.get_config()
  text = page.read_text(encoding="utf-8")
  named = set(
      re.findall(r"(?<!\[)--config\.([A-Za-z_][\w.]*\w)", text)
  )  # not "[--config.key=value]"
  wrong = [name for name in sorted(named) if not _has_field(config, name)]
  assert not wrong, f"no such config fields: {wrong}"
