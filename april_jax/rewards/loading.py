"""The run's reward from `rollout.reward`: a registered name, or a user's own function.

  rollout.reward = "math"                          a registered reward (registry.py)
  rollout.reward = "path/to/my_reward.py:score"    a function in a file
  rollout.reward = "my_package.rewards:score"      a function in an importable module

A user's function takes one of
  (response, answer)   the decoded response text and the dataset's gold answer,
  (sample)             one dict: "prompt" (text), "prompt_id", "response", "answer",
                       "row" (the dataset row's columns, as JSON values), and for a
                       multi-turn episode "turns" and "env_reward" (rollout/episodes.py;
                       its "response" holds the observations too),
  (samples)            the list of a prompt's n sample dicts, scored together (a pairwise
                       judge, a ranking), returning one result per sample in order,
and each result is a float, or a dict with a float "score" and any other numbers, which
are logged per step as `reward/<key>` (their mean over the trained samples).

A user's reward is held as a `UserReward`, a picklable handle that carries the spec
string, not the function: each worker process loads the function itself, so a function
from a file outside any package is scored in the killable worker processes, under the
same time limit and fallback as the built-in rewards. `problem(spec)` loads it once in
the trainer at start-up, so a missing file, a missing function, a wrong signature or an
import that fails is one line before anything compiles.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
from typing import Callable

from april_jax.rewards import remote
from april_jax.rewards.registry import REWARDS

_LOADED: dict[str, tuple[Callable, str]] = {}  # spec -> (function, form), per process


def is_user_spec(spec: str) -> bool:
  return ":" in spec


def _load_module(target: str):
  if target.endswith(".py") or os.sep in target or "/" in target:
    path = os.path.abspath(os.path.expanduser(target))
    if not os.path.isfile(path):
      raise LookupError(f"no file {path}")
    name = "april_jax_user_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
      return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
      spec.loader.exec_module(module)
    except BaseException:
      del sys.modules[name]
      raise
    return module
  return importlib.import_module(target)


def _form(fn: Callable) -> str:
  """'pair' for (response, answer), 'sample' for (sample), 'group' for (samples);
  ValueError otherwise."""
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    return "pair"  # a builtin or C function: called as (response, answer)
  positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  required = [p for p in positional if p.default is p.empty]
  varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
  if len(positional) >= 1 and positional[0].name in ("sample", "samples") and len(required) <= 1:
    return positional[0].name.removesuffix("s") if positional[0].name == "sample" else "group"
  if len(required) <= 2 and (len(positional) >= 2 or varargs):
    return "pair"
  names = ", ".join(p.name for p in params)
  raise ValueError(f"takes ({names}); a reward takes (response, answer), (sample) or (samples)")


def load(spec: str) -> tuple[Callable, str]:
  """(function, form) for a "target:function" spec, loaded once per process."""
  if spec not in _LOADED:
    target, _, name = spec.rpartition(":")
    module = _load_module(target)
    if not hasattr(module, name):
      raise LookupError(f"{target} has no function {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
      raise LookupError(f"{target}:{name} is a {type(fn).__name__}, not a function")
    _LOADED[spec] = (fn, _form(fn))
  return _LOADED[spec]


def problem(spec: str) -> str | None:
  """What is wrong with `rollout.reward`, in one line (None: it can be used)."""
  if not is_user_spec(spec):
    if spec in REWARDS:
      return None
    return (
        f"rollout.reward {spec!r} is neither a registered reward ({sorted(REWARDS)}) nor "
        "a function given as path/to/file.py:name or package.module:name"
    )
  try:
    load(spec)
  except Exception as e:  # pylint: disable=broad-except  # the user's import, with its cause
    cause = (str(e).strip().splitlines() or [""])[-1][:300]
    return f"rollout.reward {spec!r}: {type(e).__name__}: {cause}".rstrip(": ")
  return None


@dataclasses.dataclass(frozen=True)
class UserReward:
  """A user's reward by its spec (picklable: a worker process loads the function)."""

  spec: str
  takes_context = True  # the runner passes the prompt (for the (sample) forms)

  @property
  def form(self) -> str:
    return load(self.spec)[1]

  def __call__(self, response, answer: str, context: dict | None = None):
    """One sample's result; in the group form `response` is the list of the group's
    responses and the result a list."""
    fn, form = load(self.spec)
    context = dict(context or {})
    episodes = context.pop("episodes", None)  # the group form's per-sample episode fields
    sample = lambda text, extra={}: {**context, **extra, "response": text, "answer": answer}
    if form == "group":
      return fn([sample(text, episodes[i] if episodes else {}) for i, text in enumerate(response)])
    if form == "sample":
      return fn(sample(response))
    return fn(response, answer)


def resolve(spec: str) -> Callable:
  """The reward `rollout.reward` names: a registered function, or a UserReward."""
  return UserReward(spec) if is_user_spec(spec) else REWARDS.lookup(spec)


def from_config(r) -> Callable:
  """The run's reward from the `rollout` section: the server at reward_url if one is
  given, else what `reward` names."""
  if r.reward_url:
    return remote.RemoteReward(
        r.reward_url, timeout_s=r.reward_url_timeout_s, retries=r.reward_url_retries
    )
  return resolve(r.reward)


def score(fn: Callable, response, answer: str, context: dict | None = None):
  """(score, extra metrics) of one sample, or for a group-form reward (`response` a list)
  the list of them. A reward's dict gives "score" and its other numbers; a value that is
  not a number is a TypeError, NaN or an infinite (or float32-overflowing) one a ValueError
  (the runner scores both as the fallback and counts an error)."""
  if getattr(fn, "takes_context", False):
    out = fn(response, answer, context)
  else:
    out = fn(response, answer)
  if isinstance(response, list):
    if not isinstance(out, (list, tuple)) or len(out) != len(response):
      raise TypeError(
          f"a group reward returns one result per sample ({len(response)}), got "
          f"{type(out).__name__}{f' of {len(out)}' if isinstance(out, (list, tuple)) else ''}"
      )
    return [_one(o) for o in out]
  return _one(out)


def _one(out) -> tuple[float, dict[str, float]]:
  extras: dict[str, float] = {}
  if isinstance(out, dict):
    if "score" not in out:
      raise TypeError(f"a reward's dict needs a 'score', got keys {sorted(out)[:8]}")
    extras = {str(k): float(v) for k, v in out.items() if k != "score"}
    out = out["score"]
  try:
    value = float(out)
  except (TypeError, ValueError):
    raise TypeError(
        f"a reward returns a number or a dict with a 'score', got {type(out).__name__}"
    ) from None
  if math.isnan(value):
    raise ValueError("the reward is NaN")
  if not abs(value) <= _LARGEST:  # inf, or past float32: the advantages would be inf or NaN
    raise ValueError(f"the reward is {value}, past the largest float32 ({_LARGEST:.3g})")
  return value, extras


_LARGEST = 3.4028234663852886e38  # float32's largest finite number
