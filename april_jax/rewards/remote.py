"""A reward served over HTTP: `rollout.reward_url` scores each sample by a POST.

The request body is one JSON object: "response", "answer", "prompt", "prompt_id" and
"row" (the dataset row's other columns).
The reply is a JSON number, or an object with a numeric "score" (its other numbers are
logged as `reward/<key>`, as a local reward's would be; its other fields are ignored), of
at most MAX_REPLY_BYTES. A redirect is never followed (a POST redirected becomes a GET
without the sample, whose answer is no score): a 3xx is a failed request. Each request has its own time
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

from april_jax.settings.rollout import RolloutSettings

MAX_REPLY_BYTES = 1 << 20


class RemoteRewardError(RuntimeError):
  """The server gave no usable score for a sample, after every retry."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
  """Turns every redirect into the HTTPError of its 3xx reply."""

  def redirect_request(self, req, fp, code, msg, headers, newurl):  # pylint: disable=too-many-arguments
    return None


_OPENER = urllib.request.build_opener(_NoRedirects)


@dataclasses.dataclass(frozen=True)
class RemoteReward:
  url: str
  timeout_s: float = RolloutSettings.reward_url_timeout_s
  retries: int = RolloutSettings.reward_url_retries
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
    with _OPENER.open(request, timeout=self.timeout_s) as reply:
      text = reply.read(MAX_REPLY_BYTES + 1)
    if len(text) > MAX_REPLY_BYTES:
      raise ValueError(f"the reply is longer than {MAX_REPLY_BYTES} bytes")
    try:
      value = json.loads(text)
    except ValueError:
      raise ValueError(f"the reply is not JSON: {text[:80]!r}") from None
    if isinstance(value, dict):
      if not _number(value.get("score")):
        raise ValueError(f"the reply has no numeric 'score': {text[:80]!r}")
      return {k: float(v) for k, v in value.items() if _number(v)}  # text fields: ignored
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return {"score": float(value)}
    raise ValueError(f"the reply is neither a number nor an object: {text[:80]!r}")


def _number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _describe(error: Exception) -> str:
  if isinstance(error, urllib.error.HTTPError):
    return f"HTTP {error.code}"
  reason = getattr(error, "reason", None)
  return f"{type(error).__name__}: {reason or error}"[:200]


def _plain(value):
  """A value json cannot write (a numpy prompt id): its Python number, else its text."""
  return value.item() if hasattr(value, "item") else str(value)
