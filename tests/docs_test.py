"""The documents hold together: every relative link in README.md, BENCHMARKS.md and docs/
names a file of the repository (and a heading there, where it names one), every docs page
is linked from another document, every file the documents cite exists, README.md stays a
front page, docs/config.md is what settings/base.py says, and docs/metrics.md names every
metric the code writes."""

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
  """The anchors a Markdown file's headings get (GitHub's rule: lower case, punctuation
  dropped, spaces to hyphens, a repeated one numbered)."""
  out, seen = set(), {}
  for line in path.read_text(encoding="utf-8").splitlines():
    if re.match(r"#{1,6} ", line):
      slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
      out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
      seen[slug] = seen.get(slug, 0) + 1
  return out


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_relative_link_names_a_file_of_the_repository(document):
  broken = []
  for target in _LINK.findall(document.read_text(encoding="utf-8")):
    if re.match(r"[a-z]+://|#|mailto:", target):
      continue
    file, _, anchor = target.partition("#")
    path = (document.parent / file).resolve()
    if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
      broken.append(target)
  assert not broken, broken


def test_the_design_pages_tests_and_modules_exist():
  text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
  cited = set(re.findall(r"`((?:tests|april_jax|configs)/[\w/]+\.py)`", text))
  assert len(cited) > 15
  missing = [path for path in sorted(cited) if not (ROOT / path).exists()]
  assert not missing, missing


def test_the_config_reference_is_what_the_settings_say():
  """docs/config.md is written from the settings' sections (python -m
  april_jax.settings.reference): a field added or changed there must be written again here."""
  from april_jax.settings import base, reference  # pylint: disable=g-import-not-at-top

  assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == reference.render()
  comments = reference.field_comments()
  assert set(comments) == set(reference._flat(base.get_config()))  # every field, found
  assert not [name for name, text in comments.items() if not text]  # and described


def _linked_pages(document: Path) -> set[Path]:
  """The Markdown files a document links to."""
  out = set()
  for target in _LINK.findall(document.read_text(encoding="utf-8")):
    if not re.match(r"[a-z]+://|#|mailto:", target):
      out.add((document.parent / target.partition("#")[0]).resolve())
  return out


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_every_docs_page_is_linked_from_another_document(page):
  """A page no other document links to is a page no reader finds."""
  assert any(page.resolve() in _linked_pages(d) for d in DOCUMENTS if d != page)


# benchmarks_log.md is a lab notebook: it cites files as they were then.
CURRENT = [d for d in DOCUMENTS if d.name != "benchmarks_log.md"]


@pytest.mark.parametrize("document", CURRENT, ids=lambda p: p.name)
def test_every_file_a_document_cites_exists(document):
  """Paths in inline code (`april_jax/...`, `configs/...`, `launch/...`, `tests/...`),
  a config's `:variant` dropped; placeholders such as `configs/<name>.py` are skipped."""
  text = document.read_text(encoding="utf-8")
  cited = set()
  for span in re.findall(r"`([^`]+)`", text):
    for path in re.findall(r"(?<![\w./-])((?:april_jax|configs|launch|tests)/[\w./*<>-]*)", span):
      path = path.split(":")[0].rstrip(".,")
      if not re.search(r"[*<>]", path):
        cited.add(path)
  missing = [path for path in sorted(cited) if not (ROOT / path).exists()]
  assert not missing, missing


def test_the_readme_is_a_front_page():
  """What it is, results, install, the first run, where to go next: the rest is in docs/."""
  lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
  assert len(lines) < 150, f"README.md has {len(lines)} lines: move the details into docs/"


def _metric_keys() -> set[str]:
  """The metric keys the code writes, as it names them: string literals in april_jax (the
  benchmarks only read them), the episodes' counters (logged under rollout/), and the
  importance weights' metrics (under train/)."""
  from april_jax.rl import corrections  # pylint: disable=g-import-not-at-top

  keys = set()
  for path in (ROOT / "april_jax").rglob("*.py"):
    if "benchmarks" not in path.parts:
      text = path.read_text(encoding="utf-8")
      keys |= set(re.findall(r'"((?:rollout|train|eval|critic|time|metrics)/\w[\w@/]*)"', text))
  episodes = (ROOT / "april_jax" / "rollout" / "episodes.py").read_text(encoding="utf-8")
  keys |= {f"rollout/{name}" for name in re.findall(r'"(env/\w+)"', episodes)}
  zeros, ones = np.zeros((1, 2)), np.ones((1, 2))
  weights = corrections.importance_weights("token", "truncate", 0.0, 2.0, zeros, zeros, ones)
  keys |= {f"train/{name}" for name in weights.metrics}
  return {key + "<k>" if key.endswith("@") else key for key in keys}  # eval/avg@<k>


def test_the_metrics_reference_names_every_metric_the_code_writes():
  keys = _metric_keys()
  assert {"rollout/tokens_per_s", "train/loss", "rollout/env/turns", "train/is_weight_max"} <= keys
  page = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
  named = set(re.findall(r"`([a-z]+/[\w@/<>]+)`", page))
  missing = sorted(keys - named)
  assert not missing, f"docs/metrics.md lacks {missing}"


def test_every_private_name_a_comment_or_page_gives_a_class_of_ours_exists():
  """A private name such as `SomeClass._table` in a comment outlives a refactor that moves
  it; each must exist in its class's module (docs/benchmarks_log.md, a log of past
  states, aside)."""
  sources = list((ROOT / "april_jax").rglob("*.py"))
  classes: dict[str, str] = {}
  for path in sources:
    text = path.read_text(encoding="utf-8")
    for match in re.finditer(r"^class (\w+)", text, re.M):
      classes[match.group(1)] = classes.get(match.group(1), "") + text
  named = re.compile(r"\b([A-Z][A-Za-z0-9]+)\.(_[a-z][a-z0-9_]*)\b")
  documents = sources + sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "docs").glob("*.md"))
  gone = []
  for path in [*documents, ROOT / "README.md"]:
    if path.name == "benchmarks_log.md":
      continue
    text = path.read_text(encoding="utf-8")
    for match in named.finditer(text):
      cls, attr = match.groups()
      source = classes.get(cls)
      if source is None:
        continue
      if not re.search(rf"(def {attr}\b|self\.{attr}\b|^\s+{attr}\s*[:=])", source, re.M):
        line = text[: match.start()].count("\n") + 1
        gone.append(f"{path.relative_to(ROOT)}:{line} {cls}.{attr}")
  assert not gone, gone


def test_the_layout_names_every_module():
  """docs/layout.md names each module of april_jax/ (by its path in the package, or by
  its file name in the row of its package)."""
  page = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
  named = set(re.findall(r"`([\w/]+\.py)`", page))
  package = ROOT / "april_jax"
  missing = []
  for path in sorted(package.rglob("*.py")):
    rel = path.relative_to(package).as_posix()
    if path.name == "__init__.py" or rel.startswith("benchmarks/"):
      continue
    if rel not in named and path.name not in named:
      missing.append(rel)
  assert not missing, f"docs/layout.md does not name {missing}"
