"""Rule-based math rewards: pull the final answer out of a response, check it against gold.

    extract_answer(response)   # the final answer after the thinking: the later of the last
                               # \\boxed{...} and the last "Answer: ...", else "#### X"
    gold_answer(raw)           # a dataset's gold ("... #### 72", "\\boxed{..}", "27.0") -> str
    is_equivalent(pred, gold)  # same text; same exact number; else math-verify, bounded

Registers two rewards: "math" (1.0 / 0.0) and "math_dapo" (+1.0 / -1.0, DAPO's
convention). `dapo_strict` (dapo_strict.py) scores as the DAPO reference does instead.

Exact numbers first. Integers, decimals, fractions (`a/b`, `\\frac{a}{b}`, `\\dfrac12`)
and thousands separators are read as rationals (fractions.Fraction) and compared exactly:
`1000001` is not `1000000`, `0.5` is `\\frac{1}{2}`. Two plain numbers never reach
math-verify, which is the slow path (sympy).

Bounded. Every call returns within a bound on any input, in any thread: extraction is
linear in the response, and math-verify runs in a child process of the calling thread
(math_verify_child.py) that is killed past `MATH_VERIFY_TIMEOUT_S`; an answer that takes
longer (`10^{10^{10}}`) is wrong, not a timeout (whose fallback could pay more than a
wrong answer does).

Model text is only ever matched with regexes and parsed by math-verify's LaTeX parser
(ANTLR -> SymPy objects); it is never passed to eval, exec or sympify.
"""

from __future__ import annotations

import fractions
import functools
import re

from april_jax.rewards import math_verify_child
from april_jax.rewards.registry import register

# Seconds math-verify may take for one comparison; past it the answer counts as wrong.
MATH_VERIFY_TIMEOUT_S = 2.0
# Digits a number may have to be read exactly (Python refuses longer int strings).
_MAX_DIGITS = 4000
VERDICT_CACHE_SIZE = 65536  # math-verify verdicts kept, per process
# What one finite number never holds (besides a comma).
_NOT_ONE_NUMBER = ("\\cup", "\\cap", "matrix", "\\infty", "\\emptyset", "\\varnothing")
_IRRATIONAL = ("\\sqrt", "\\pi", "\\log", "\\ln", "\\sin", "\\cos", "\\tan", "\\exp", "e^")
# Verdicts of answers longer than this are not cached (a cache entry holds both texts).
_CACHED_CHARS = 1000

_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_THINK_START, _THINK_END = "<think>", "</think>"
# "Answer:" then any whitespace, newlines included, then the answer's line. Any case at
# the start of a line (after markdown: "**Answer:** 42", "## Final answer: 42"), and
# "Answer" capitalised anywhere else, so prose ("is this answer: correct?") is not one.
_DAPO_ANSWER = re.compile(
    r"(?:(?:^|(?<=\n))[ \t>*#_-]*(?i:(?:final\s+)?answer)|(?<![A-Za-z])Answer)"
    r"[ \t*_]*:[ \t*_]*\s*([^\n]+)"
)
_GSM8K_ANSWER = re.compile(r"####[ \t]*([^\n]*)")
_THOUSANDS_NUMBER = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)")
_SLASH_FRACTION = re.compile(r"([+-]?\d+)\s*/\s*([+-]?\d+)")
# \frac{a}{b}, \dfrac{a}{b}, \tfrac{a}{b}, and the brace-less \frac12; a sign before it.
_LATEX_FRACTION = re.compile(
    r"([+-]?)\\[dt]?frac(?:\{\s*([+-]?\d+)\s*\}\{\s*([+-]?\d+)\s*\}|(\d)(\d))"
)
# Wrappers that do not change a number: math delimiters, a dollar sign, braces, \text{...}.
_WRAPPERS = re.compile(r"^\$+|\$+$|^\\\(|\\\)$|^\\\[|\\\]$|^\\\$")
_TEXT_WRAPPED = re.compile(r"^\\(?:text|textbf|mathrm|mathbf)\{(.*)\}$|^\{(.*)\}$")
# Space between a digit and a group of three digits (1\,000, 1 000): a separator.
_GROUP_SPACE = re.compile(r"(?<=\d)(?:\\[,;: ]|\\q?quad|[ \t])+(?=\d{3}(?!\d))")
_THOUSANDS_ANYWHERE = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)")


def final_part(text: str) -> str:
  """The text after the thinking: what follows the last `</think>` (all of it if none);
  nothing when a `<think>` opened after it is never closed (the response ended while
  thinking: a box in there is not an answer)."""
  end = text.rfind(_THINK_END)
  if text.rfind(_THINK_START) > end:
    return ""
  return text if end < 0 else text[end + len(_THINK_END) :]


def _closing_braces(text: str) -> dict[int, int]:
  """For each `{` in `text` that is closed, the index of its `}` (one pass)."""
  closing, open_at = {}, []
  for i, char in enumerate(text):
    if char == "{":
      open_at.append(i)
    elif char == "}" and open_at:
      closing[open_at.pop()] = i
  return closing


def _last_box(text: str) -> tuple[int, int, str] | None:
  """(start, end, content) of the last balanced, non-empty \\boxed{...} or \\fbox{...}."""
  starts = []
  for opener in _BOX_OPENERS:
    i = text.find(opener)
    while i != -1:
      starts.append(i)
      i = text.find(opener, i + 1)
  if not starts:
    return None
  closing = _closing_braces(text)
  for start in sorted(starts, reverse=True):
    open_at = text.index("{", start)
    close_at = closing.get(open_at)
    if close_at is not None and text[open_at + 1 : close_at].strip():
      return start, close_at + 1, text[open_at + 1 : close_at].strip()
  return None


def last_boxed(text: str) -> str | None:
  """Content of the last balanced, non-empty \\boxed{...} or \\fbox{...}; None if none."""
  found = _last_box(text)
  return None if found is None else found[2]


def _last_match(pattern: re.Pattern[str], text: str) -> tuple[int, str] | None:
  """(start, group 1 stripped) of the last match of `pattern` with a non-empty group 1."""
  last = None
  for m in pattern.finditer(text):
    if m.group(1).strip():
      last = (m.start(), m.group(1).strip())
  return last


def _without_thousands_commas(s: str) -> str:
  """'1,234' -> '1234'; anything not a number with thousands separators is unchanged."""
  return s.replace(",", "") if _THOUSANDS_NUMBER.fullmatch(s) else s


def _dapo_answer(text: str, box: tuple[int, int] | None = None) -> tuple[int, str] | None:
  """(start, X) of the last 'Answer: X' outside the span `box` (the last box's: an
  'Answer:' written inside a box is the box's text), with surrounding '$' and markdown
  emphasis and a trailing period removed."""
  last = None
  for m in _DAPO_ANSWER.finditer(text):
    inside = box is not None and box[0] <= m.start() < box[1]
    answer = m.group(1).strip().lstrip("$*_ \t").rstrip("$.* \t")
    if answer and not inside:
      last = (m.start(), answer)
  return last


def _gsm8k_answer(text: str) -> str | None:
  """The last '#### X' in `text`, thousands separators removed."""
  found = _last_match(_GSM8K_ANSWER, text)
  return None if found is None else _without_thousands_commas(found[1])


def extract_answer(text: str) -> str | None:
  """The model's final answer, looked for after the thinking (`final_part`): the later of
  the last \\boxed{} and the last DAPO 'Answer:' line (a box on that line is its answer),
  else GSM8K's '####'. None when there is none: a box inside the thinking is not one."""
  text = final_part(text)
  box = _last_box(text)
  line = _dapo_answer(text, box[:2] if box else None)
  if box is not None and (line is None or box[0] > line[0]):
    return box[2]
  if line is not None:
    return line[1]
  return _gsm8k_answer(text)


def gold_answer(raw: str) -> str:
  """A dataset's gold answer as a plain string: GSM8K '#### 72' -> '72', boxed -> content."""
  raw = str(raw).strip()  # some sets (AMC) store numbers, e.g. 27.0
  if "####" in raw:
    return _gsm8k_answer(raw) or ""
  return last_boxed(raw) or raw


def _normalised(s: str) -> str:
  """`s` with runs of whitespace collapsed to one space, ends stripped."""
  return " ".join(s.split())


def _unwrapped(s: str) -> str:
  """`s` without what does not change a number: $...$, \\(...\\), a dollar sign, braces
  or \\text{...} around it, `{,}` and `\\!` in a thousands separator, space between
  digit groups. Other spaces stay (`2 1/2` is not `21/2`)."""
  s = s.strip().replace("{,}", ",").replace("\\!", "")
  s = _GROUP_SPACE.sub("", s)
  for _ in range(4):
    s = _WRAPPERS.sub("", s).strip()
    inner = _TEXT_WRAPPED.match(s)
    if inner:
      s = (inner.group(1) if inner.group(1) is not None else inner.group(2)).strip()
  return s


def as_rational(s: str) -> fractions.Fraction | None:
  """`s` as an exact rational when it is a plain number: an integer, a decimal, `a/b`,
  `\\frac{a}{b}` or `\\dfrac12` (a sign before it allowed), thousands separators allowed.
  None otherwise (an expression, a set, text, a number past _MAX_DIGITS digits)."""
  s = _without_thousands_commas(_unwrapped(s))
  if not s or len(s) > _MAX_DIGITS:
    return None
  try:
    if _DECIMAL.fullmatch(s):
      return fractions.Fraction(s)
    m = _SLASH_FRACTION.fullmatch(s)
    if m:
      return fractions.Fraction(int(m.group(1)), int(m.group(2)))
    m = _LATEX_FRACTION.fullmatch(s)
    if m:
      sign, numerator, denominator = m.group(1), m.group(2) or m.group(4), m.group(3) or m.group(5)
      value = fractions.Fraction(int(numerator), int(denominator))
      return -value if sign == "-" else value
  except (ValueError, ZeroDivisionError):
    return None
  return None


def _several_or_unbounded(s: str) -> bool:
  """Whether `s` is plainly not one finite number: a tuple, interval, set or list (a comma
  that is not a thousands separator), a union or intersection, a matrix, or infinity."""
  s = _THOUSANDS_ANYWHERE.sub("", _unwrapped(s))
  return "," in s or any(marker in s for marker in _NOT_ONE_NUMBER)


def _irrational(s: str) -> bool:
  """Whether `s` names an irrational constant or function value (a decimal, however
  many digits it has, is never equal to it)."""
  return any(marker in s for marker in _IRRATIONAL)


@functools.lru_cache(maxsize=VERDICT_CACHE_SIZE)
def _cached_verdict(pred: str, gold: str, timeout_s: float) -> bool:
  return math_verify_child.verdict(pred, gold, timeout_s) is True


def clear_verdict_cache() -> None:
  """Forgets the cached math-verify verdicts."""
  _cached_verdict.cache_clear()


def math_verify_equal(pred: str, gold: str, timeout_s: float | None = None) -> bool:
  """math-verify's verdict on `pred` against `gold`, both read as boxed LaTeX, in a
  child process killed past `timeout_s` (MATH_VERIFY_TIMEOUT_S): False then. Verdicts
  of short answers are cached, a time-out's too (a group's samples often give the same
  answer)."""
  if timeout_s is None:
    timeout_s = MATH_VERIFY_TIMEOUT_S
  if len(pred) + len(gold) > _CACHED_CHARS:
    return math_verify_child.verdict(pred, gold, timeout_s) is True
  return _cached_verdict(pred, gold, timeout_s)


def is_equivalent(pred: str, gold: str) -> bool:
  """Whether the answer `pred` equals `gold`: same text, the same exact number, or
  math-verify says so within its time bound."""
  if not _normalised(pred):
    return False
  if _normalised(pred) == _normalised(gold):
    return True
  pred_number, gold_number = as_rational(pred), as_rational(gold)
  # Two plain numbers are settled here, exactly, either way; math-verify is the slow path.
  if pred_number is not None and gold_number is not None:
    return pred_number == gold_number
  # So is one number against what is plainly not one number.
  if pred_number is not None and _several_or_unbounded(gold):
    return False
  if gold_number is not None and _several_or_unbounded(pred):
    return False
  # And a decimal against an irrational: exact, where math-verify would round.
  if pred_number is not None and pred_number.denominator != 1 and _irrational(gold):
    return False
  return math_verify_equal(pred, gold)


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
