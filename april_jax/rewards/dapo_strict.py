"""The DAPO reference scorer, verdict for verdict: for reproducing published DAPO / APRIL numbers.

    dapo_strict_verdict(response, answer)  # -> (score, pred): +1.0 / -1.0 and the parsed answer
    normalize_final_answer(text)           # Minerva's answer normalisation

Registers one reward, "dapo_strict" (+1.0 / -1.0). It scores a response the way the
scorer behind the published DAPO runs does (verl's `math_dapo.compute_score`, which slime
uses too), verdict for verdict:

  1. only the last 300 characters of the response are read;
  2. the answer is what follows the last "Answer:" there (any case, spaces and line breaks
     allowed around the colon) up to the end of its line; an "Answer:" on a line another
     one already started is part of that one's answer, and an "Answer:" with nothing
     after it on its line takes the next line with text; with none, it is "[INVALID]";
  3. answer and gold are both normalised (`normalize_final_answer`), then compared as
     strings: "1,000" equals "1000" and "x = 5" equals "5", but "0.5" is not "\\frac{1}{2}",
     "42." is not "42", and a \\boxed{} outside the "Answer:" line is never read.

That fits integer golds (DAPO-Math-17k, AIME) and little else. Use it to reproduce numbers
that were measured with it; to train or evaluate otherwise, `math_dapo` (the same +1 / -1)
reads boxes too and accepts equivalent forms (`april_jax/rewards/math.py`).

Every step is a bounded scan of plain strings (one regex, with no nested repetition, finds
the "Answer:" lines): a call is linear in the gold's length and in at most 300 characters
of the response.
"""

from __future__ import annotations

import re

from april_jax.rewards.registry import register

WINDOW = 300  # characters at the end of the response that are read
NO_ANSWER = "[INVALID]"  # the answer of a response with no "Answer:" line (normalised too)

# "Answer", optional whitespace (line breaks too), ":", optional whitespace, then the rest
# of a line: at least one character, so trailing spaces before a line break can be it.
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)

# Minerva's normalisation (Lewkowycz et al. 2022, "Solving Quantitative Reasoning Problems
# with Language Models", appendix): replacements, then removals, each in this order.
_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED_EXPRESSIONS = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)


def _per_line(step, text: str, marker: str) -> str:
  """`step` applied to each line of `text` alone (these steps never reach over a line);
  `text` as it is when it holds no `marker`, the string every change starts with."""
  if marker not in text:
    return text
  return "\n".join(step(line) for line in text.split("\n"))


def _first_dollar_pair(line: str) -> str:
  """A line with two '$' or more becomes '$' + what lies between its first two + '$'."""
  first = line.find("$")
  second = line.find("$", first + 1) if first != -1 else -1
  return line if second == -1 else "$" + line[first + 1 : second] + "$"


def _unwrap_to_first_brace(opener: str):
  """A line step: each `opener` + X + '}' becomes X, X ending at the first '}' after it."""

  def step(line: str) -> str:
    out, copied = [], 0
    start = line.find(opener)
    while start != -1:
      close = line.find("}", start + len(opener))
      if close == -1:  # no '}' after this opener: none after any later one either
        break
      out += [line[copied:start], line[start + len(opener) : close]]
      copied = close + 1
      start = line.find(opener, copied)
    return "".join(out) + line[copied:]

  return step


def _unwrap_boxed(line: str) -> str:
  """'\\boxed{' + X + '}' becomes X, from the line's first '\\boxed{' to its last '}'."""
  opener = "\\boxed{"
  start = line.find(opener)
  close = line.rfind("}")
  if start == -1 or close < start + len(opener):
    return line
  return line[:start] + line[start + len(opener) : close] + line[close + 1 :]


def _brace_shorthand(text: str, name: str, arity: int) -> str:
  """Shorthand arguments get braces, left to right: 'frac' + a + b -> 'frac{a}{b}' (arity
  2), 'sqrt' + a -> 'sqrt{a}' (arity 1), where a is any character but '{' (a line break
  too) and each later one any but a line break."""
  out, copied = [], 0
  at = text.find(name)
  while at != -1:
    a = at + len(name)
    args = text[a : a + arity]
    if len(args) == arity and args[0] != "{" and "\n" not in args[1:]:
      out += [text[copied:at], name, *("{" + c + "}" for c in args)]
      copied = a + arity
      at = text.find(name, copied)
    else:
      at = text.find(name, at + 1)
  return "".join(out) + text[copied:]


def normalize_final_answer(text: str) -> str:
  """Minerva's normalisation of a final answer, as the DAPO scorer applies it.

  What follows the last '=', the substitutions and removals above, the first $...$ of a
  line, \\text{}, \\textbf{}, \\overline{} and \\boxed{} unwrapped, \\fracab and \\sqrta
  braced, '$' dropped, commas dropped from a string of digits and commas, ends stripped.
  """
  text = text.rpartition("=")[2]
  for before, after in _SUBSTITUTIONS:
    text = text.replace(before, after)
  for expression in _REMOVED_EXPRESSIONS:
    text = text.replace(expression, "")
  text = _per_line(_first_dollar_pair, text, "$")
  for opener in ("\\text{", "\\textbf{", "\\overline{"):
    text = _per_line(_unwrap_to_first_brace(opener), text, opener)
  text = _per_line(_unwrap_boxed, text, "\\boxed{")
  text = _brace_shorthand(_brace_shorthand(text, "frac", 2), "sqrt", 1).replace("$", "")
  if text.replace(",", "").isdigit():  # str.isdigit: other scripts' digits count too
    text = text.replace(",", "")
  return text.strip()


def answer_line(response: str) -> str:
  """The answer after the last "Answer:" in the response's last 300 characters (matches
  found left to right, each running to the end of a line), else "[INVALID]"; as written."""
  found = NO_ANSWER
  for match in _ANSWER_LINE.finditer(response[-WINDOW:]):
    found = match.group(1)
  return found


def dapo_strict_verdict(response: str, answer: str) -> tuple[float, str]:
  """(+1.0 or -1.0, the normalised answer read from the response), as the DAPO scorer
  gives them; `answer` is the gold, normalised the same way (never cut to 300 characters)."""
  pred = normalize_final_answer(answer_line(response))
  return (1.0 if pred == normalize_final_answer(answer) else -1.0), pred


@register("dapo_strict")
def dapo_strict_reward(response: str, answer: str) -> float:
  """+1.0 if the last "Answer:" line of the response's last 300 characters equals the gold
  after normalisation, else -1.0: the published DAPO runs' scoring, quirks included."""
  return dapo_strict_verdict(response, answer)[0]
