"""Rule-based math rewards: pull the final answer out of a response, check it against gold.

    extract_answer(response)   # last \\boxed{...}, else DAPO's "Answer: ...", else "#### X"
    gold_answer(raw)           # a dataset's gold ("... #### 72", "\\boxed{..}", "27.0") -> str
    is_equivalent(pred, gold)  # exact / numeric check first, then math-verify

Registers two rewards: "math" (1.0 / 0.0) and "math_dapo" (+1.0 / -1.0, DAPO's
convention). Model text is only ever matched with regexes and parsed by math-verify's
LaTeX parser (ANTLR -> SymPy objects); it is never passed to eval, exec or sympify.

The rollout scores samples in worker threads, where signal.alarm() cannot be used, so
math-verify's own (signal-based) timeouts are switched off here; the caller bounds the
time a reward may take.
"""

from __future__ import annotations

import functools
import math
import re

from april_jax.rewards.registry import register

_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_DAPO_ANSWER = re.compile(r"answer\s*:[ \t]*([^\n]*)", re.IGNORECASE)
_GSM8K_ANSWER = re.compile(r"####[ \t]*([^\n]*)")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)")
_THOUSANDS_NUMBER = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# LaTeX only: math-verify's plain-expression extractor goes through sympy's parse_expr.


@functools.cache
def _math_verify():
  """math-verify's parse, verify and LaTeX-only extraction config, imported on first use
  (it pulls in sympy: most of a second at every start-up of a run that never needs it)."""
  from math_verify import LatexExtractionConfig, parse, verify  # pylint: disable=g-import-not-at-top

  return parse, verify, [LatexExtractionConfig(boxed_match_priority=0)]


def _closing_brace(text: str, open_at: int) -> int | None:
  """Index of the brace closing the one at `open_at`, or None if the text ends first."""
  depth = 0
  for i in range(open_at, len(text)):
    if text[i] == "{":
      depth += 1
    elif text[i] == "}":
      depth -= 1
      if depth == 0:
        return i
  return None


def _find_all(text: str, sub: str) -> list[int]:
  """Start indices of every occurrence of `sub` in `text`."""
  out, i = [], text.find(sub)
  while i != -1:
    out.append(i)
    i = text.find(sub, i + 1)
  return out


def last_boxed(text: str) -> str | None:
  """Content of the last balanced, non-empty \\boxed{...} or \\fbox{...}; None if none."""
  starts = sorted(i for opener in _BOX_OPENERS for i in _find_all(text, opener))
  for start in reversed(starts):
    open_at = text.index("{", start)
    close_at = _closing_brace(text, open_at)
    if close_at is not None and text[open_at + 1 : close_at].strip():
      return text[open_at + 1 : close_at].strip()
  return None


def _last_match(pattern: re.Pattern[str], text: str) -> str | None:
  """Group 1 of the last match of `pattern` in `text` that is non-empty, else None."""
  found = [m.group(1).strip() for m in pattern.finditer(text)]
  found = [f for f in found if f]
  return found[-1] if found else None


def _without_thousands_commas(s: str) -> str:
  """'1,234' -> '1234'; anything not a number with thousands separators is unchanged."""
  return s.replace(",", "") if _THOUSANDS_NUMBER.fullmatch(s) else s


def _dapo_answer(text: str) -> str | None:
  """The last 'Answer: X' in `text`, with surrounding '$' and a trailing period removed."""
  found = _last_match(_DAPO_ANSWER, text)
  if found is None:
    return None
  found = found.lstrip("$ \t").rstrip("$. \t")
  return found or None


def _gsm8k_answer(text: str) -> str | None:
  """The last '#### X' in `text`, thousands separators removed."""
  found = _last_match(_GSM8K_ANSWER, text)
  return None if found is None else _without_thousands_commas(found)


def extract_answer(text: str) -> str | None:
  """The model's final answer: last \\boxed{}, else DAPO 'Answer:', else GSM8K '####'."""
  for extract in (last_boxed, _dapo_answer, _gsm8k_answer):
    found = extract(text)
    if found is not None:
      return found
  return None


def gold_answer(raw: str) -> str:
  """A dataset's gold answer as a plain string: GSM8K '#### 72' -> '72', boxed -> content."""
  raw = str(raw).strip()  # some sets (AMC) store numbers, e.g. 27.0
  if "####" in raw:
    return _gsm8k_answer(raw) or ""
  return last_boxed(raw) or raw


def _normalised(s: str) -> str:
  """`s` with runs of whitespace collapsed to one space, ends stripped."""
  return " ".join(s.split())


def _as_number(s: str) -> float | None:
  """`s` as a float if it is a plain decimal number (thousands commas allowed), else None."""
  s = _without_thousands_commas(s.strip())
  return float(s) if _PLAIN_NUMBER.fullmatch(s) else None


def math_verify_equal(pred: str, gold: str) -> bool:
  """math-verify's verdict on `pred` against `gold`, both read as boxed LaTeX.

  Timeouts are off (parsing_timeout=None, timeout_seconds=None): math-verify implements
  them with signal.alarm(), which raises in any thread but the main one. The caller
  enforces the time limit.
  """
  parse, verify, latex_only = _math_verify()
  gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=latex_only, parsing_timeout=None)
  pred_parsed = parse("\\boxed{" + pred + "}", extraction_config=latex_only, parsing_timeout=None)
  if not gold_parsed or not pred_parsed:
    return False
  return verify(gold_parsed, pred_parsed, timeout_seconds=None)


def is_equivalent(pred: str, gold: str) -> bool:
  """Whether the answer `pred` equals `gold`: same text, same number, or math-verify says so."""
  try:
    if _normalised(pred) and _normalised(pred) == _normalised(gold):
      return True
    pred_number, gold_number = _as_number(pred), _as_number(gold)
    # Two plain numbers are settled here, either way; math-verify is the slow path.
    if pred_number is not None and gold_number is not None:
      return math.isclose(pred_number, gold_number, rel_tol=1e-6)
    return math_verify_equal(pred, gold)
  except ImportError:  # a broken install is not a wrong answer
    raise
  except Exception:  # pylint: disable=broad-except
    return False


def is_correct(response: str, answer: str) -> bool:
  """Whether the final answer in `response` is equivalent to the gold `answer`."""
  pred = extract_answer(response)
  return pred is not None and is_equivalent(pred, gold_answer(answer))


@register("math")
def math_reward(response: str, answer: str) -> float:
  """1.0 if the response's final answer equals the gold, else 0.0 (also when none found)."""
  return 1.0 if is_correct(response, answer) else 0.0


@register("math_dapo")
def math_dapo_reward(response: str, answer: str) -> float:
  """DAPO's convention: +1.0 if the final answer equals the gold, else -1.0."""
  return 1.0 if is_correct(response, answer) else -1.0
