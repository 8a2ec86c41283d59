"""The documents hold together: every relative link in README.md, BENCHMARKS.md and docs/
names a file of the repository (and a heading there, where it names one), every file
docs/design.md cites exists, and docs/config.md is what configs/base.py says."""

import re
from pathlib import Path

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
  assert not [path for path in sorted(cited) if not (ROOT / path).exists()]


def test_the_config_reference_is_what_base_py_says():
  """docs/config.md is written from configs/base.py (python -m april_jax.configs.reference):
  a field added or changed there must be written again here."""
  from april_jax.configs import base, reference  # pylint: disable=g-import-not-at-top

  assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == reference.render()
  comments = reference.field_comments()
  assert set(comments) == set(reference._flat(base.get_config()))  # every field, found
  assert not [name for name, text in comments.items() if not text]  # and described
