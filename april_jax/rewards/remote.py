"""A reward served over HTTP: `rollout.reward_url` scores each sample by a POST.

The request body is one JSON object: "response", "answer", "prompt", "prompt_id" and
"row" (the dataset row's other columns).
The reply is a JSON number, or an object with a numeric "score" (its other numbers are
logged as `reward/<key>`, as a local reward's would be). Each request has its own time
limit (`reward_url_timeout_s`); a failed one (no connection, a timeout, an HTTP error, a
reply that is not JSON or has no score) is retried `reward_url_retries` times with
doubling waits, and the last failure raises, so the runner scores the sample with
`reward_fallback` and counts an error. The whole sample stays under the runner's
`reward_timeout_s`, which ends a server that answers too slowly however often it is
retried. Successful samples report how many retries they needed as
`reward/remote_retries`.

Only the standard library is used, and a `RemoteReward` is picklable, so samples are
scored in the runner's worker processes like any reward.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request


class RemoteRewardError(RuntimeError):
  """The server gave no usable score for a sample, after every retry."""


@dataclasses.dataclass(frozen=True)
class RemoteReward:
  url: str
  timeout_s: float = 10.0
  retries: int = 2
  backoff_s: float = 0.25
  takes_context = True  # the runner passes the prompt and its id

  def __call__(self, response: str, answer: str, context: dict | None = None) -> dict:
    sample = {**(context or {}), "response": response, "answer": answer}
    body = json.dumps(sample, default=_plain).encode()
    last = "no attempt"
    for attempt in range(self.retries + 1):
      if attempt:
        time.sleep(self.backoff_s * 2 ** (attempt - 1))
      try:
        reply = self._post(body)
      except (urllib.error.URLError, OSError, ValueError) as e:  # HTTPError is a URLError
        last = _describe(e)
        continue
      return {**reply, "remote_retries": float(attempt)}
    raise RemoteRewardError(f"{self.url}: {last} (after {self.retries + 1} attempts)")

  def _post(self, body: bytes) -> dict:
    request = urllib.request.Request(
        self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
      text = reply.read()
    try:
      value = json.loads(text)
    except ValueError:
      raise ValueError(f"the reply is not JSON: {text[:80]!r}") from None
    if isinstance(value, dict):
      if not isinstance(value.get("score"), (int, float)) or isinstance(value["score"], bool):
        raise ValueError(f"the reply has no numeric 'score': {text[:80]!r}")
      return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return {"score": float(value)}
    raise ValueError(f"the reply is neither a number nor an object: {text[:80]!r}")


def _describe(error: Exception) -> str:
  if isinstance(error, urllib.error.HTTPError):
    return f"HTTP {error.code}"
  reason = getattr(error, "reason", None)
  return f"{type(error).__name__}: {reason or error}"[:200]


def _plain(value):
  """A value json cannot write (a numpy prompt id): its Python number, else its text."""
  return value.item() if hasattr(value, "item") else str(value)
