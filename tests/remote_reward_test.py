"""`rollout.reward_url` against a real HTTP server on loopback: scores and extra numbers
come back; slow answers, HTTP errors, non-JSON replies and a server that goes away
mid-run are retried, then scored with the fallback and counted; nothing hangs."""

import http.server
import json
import threading
import time

import pytest

from april_jax.settings import base
from april_jax.validation.checks import ConfigError, validate
from april_jax.rewards import loading
from april_jax.rewards.remote import RemoteReward, RemoteRewardError
from april_jax.rollout import failures
from april_jax.rollout.reward_runner import RewardRunner
from record_builders import text_group, text_of


class _Server:
  """A reward server whose behaviour the test sets: "ok" (score = response == answer,
  plus the prompt's length), "number", "slow", "error" (HTTP 500), "junk" (not JSON),
  "flaky" (500 twice, then ok). Records every request body."""

  def __init__(self):
    self.mode, self.bodies, self.calls, self.gets = "ok", [], 0, 0
    outer = self

    class Handler(http.server.BaseHTTPRequestHandler):

      def do_POST(self):  # pylint: disable=invalid-name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        outer.bodies.append(body)
        outer.calls += 1
        mode = outer.mode
        if mode == "flaky":
          mode = "error" if outer.calls % 3 else "ok"
        if mode == "slow":
          time.sleep(2.0)
        if mode == "error":
          self.send_response(500)
          self.end_headers()
          return
        if mode == "redirect":  # a POST sent elsewhere: following it would lose the sample
          self.send_response(302)
          self.send_header("Location", "/elsewhere")
          self.end_headers()
          return
        if mode == "junk":
          reply = b"<html>not a score</html>"
        elif mode == "notes":
          reply = json.dumps({"score": 1.0, "note": "x" * 5000, "ok": True, "n": 3}).encode()
        elif mode == "huge":
          reply = json.dumps({"score": 1.0, "pad": "x" * (2 << 20)}).encode()
        elif mode == "number":
          reply = b"0.5"
        else:
          score = float(body["response"] == body["answer"])
          reply = json.dumps({"score": score, "prompt_chars": len(body.get("prompt", ""))}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(reply)

      def do_GET(self):  # pylint: disable=invalid-name
        outer.gets += 1  # a followed redirect: answers a score for no sample
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"1.0")

      def log_message(self, *args):  # quiet
        pass

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
    self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
    self.thread.start()

  def stop(self):
    self.httpd.shutdown()
    self.httpd.server_close()


@pytest.fixture
def server():
  s = _Server()
  yield s
  s.stop()


def _group(group_id, answer, responses, prompt="q?"):
  return text_group(group_id, answer, responses, prompt, prompt_id=f"p{group_id}")


def _score(reward, groups, timeout_s=30.0, fallback=-1.0):
  runner = RewardRunner(reward, text_of, num_workers=2, timeout_s=timeout_s, fallback=fallback)
  for g in groups:
    runner.submit(g)
  start = time.monotonic()
  runner.wait_for(groups)
  runner.close()
  return runner, time.monotonic() - start


def test_scores_extras_and_the_request_body(server):
  reward = RemoteReward(server.url, timeout_s=5.0, retries=0)
  group = _group(0, "7", ["7", "8"], prompt="what is 3+4?")
  runner, _ = _score(reward, [group])
  assert group.rewards == [1.0, 0.0] and runner.errors == 0
  assert group.reward_info["metrics"] == {
      "prompt_chars": [12.0, 12.0],
      "remote_retries": [0.0, 0.0],
  }
  body = server.bodies[0]
  assert body["prompt"] == "what is 3+4?" and body["prompt_id"] == "p0" and body["answer"] == "7"
  server.mode = "number"
  assert reward("x", "y", {}) == {"score": 0.5, "remote_retries": 0.0}


def test_errors_are_retried_and_recovered_then_counted_when_they_persist(server):
  server.mode = "flaky"  # 500, 500, ok
  reward = RemoteReward(server.url, timeout_s=5.0, retries=2, backoff_s=0.01)
  assert reward("a", "a", {})["remote_retries"] == 2.0
  for mode in ("error", "junk"):
    server.mode = mode
    group = _group(1, "a", ["a", "b"])
    runner, _ = _score(reward, [group])
    assert group.rewards == [-1.0, -1.0] and runner.errors == 2, mode
  with pytest.raises(RemoteRewardError, match="not JSON"):
    reward("a", "a", {})


def test_a_slow_server_is_cut_by_the_request_limit_and_the_sample_limit(server):
  server.mode = "slow"  # 2 s an answer
  per_request = RemoteReward(server.url, timeout_s=0.3, retries=1, backoff_s=0.01)
  group = _group(2, "a", ["a"])
  runner, took = _score(per_request, [group])
  assert group.rewards == [-1.0] and runner.errors == 1 and took < 5.0
  patient = RemoteReward(server.url, timeout_s=60.0, retries=0)  # the runner's limit decides
  group = _group(3, "a", ["a"])
  runner, took = _score(patient, [group], timeout_s=0.5)
  assert group.rewards == [-1.0] and runner.timeouts == 1 and took < 5.0


def test_a_server_that_goes_away_mid_run_is_counted_and_never_hangs(server):
  reward = RemoteReward(server.url, timeout_s=1.0, retries=1, backoff_s=0.01)
  before = _group(4, "a", ["a", "a"])
  _score(reward, [before])
  assert before.rewards == [1.0, 1.0]
  server.stop()
  after = _group(5, "a", ["a", "a"])
  runner, took = _score(reward, [after])
  assert after.rewards == [-1.0, -1.0] and runner.errors == 2 and took < 10.0
  server.httpd = type("Stopped", (), {"shutdown": lambda s: None, "server_close": lambda s: None})()


def test_the_config_picks_the_server_and_refuses_a_bad_url():
  c = base.get_config()
  c.rollout.reward_url = "http://127.0.0.1:9/score"
  reward = loading.from_config(c.rollout)
  assert isinstance(reward, RemoteReward) and reward.url == c.rollout.reward_url
  c.rollout.reward_url = "ftp://nowhere"
  c.rollout.reward_url_retries = -1
  with pytest.raises(ConfigError) as error:
    validate(c)
  assert "rollout.reward_url must be an http:// or https:// URL" in str(error.value)
  assert "rollout.reward_url_retries must be >= 0, got -1" in str(error.value)


def test_a_score_is_taken_whatever_else_the_reply_holds(server):
  server.mode = "notes"  # text and a bool beside the score: logged numbers only
  reward = RemoteReward(server.url, timeout_s=5.0, retries=0)
  group = _group(6, "a", ["a", "b"])
  runner, _ = _score(reward, [group])
  assert group.rewards == [1.0, 1.0] and runner.errors == 0
  assert group.reward_info["metrics"] == {"n": [3.0, 3.0], "remote_retries": [0.0, 0.0]}


def test_a_redirect_or_an_oversized_reply_is_a_counted_error_never_a_score(server):
  reward = RemoteReward(server.url, timeout_s=5.0, retries=1, backoff_s=0.01)
  for mode, message in (("redirect", "HTTP 302"), ("huge", "longer than")):
    server.mode = mode
    group = _group(7, "a", ["a", "b"])
    runner, _ = _score(reward, [group])
    assert group.rewards == [-1.0, -1.0] and runner.errors == 2, mode
    with pytest.raises(RemoteRewardError, match=message):
      reward("a", "a", {})
  assert server.gets == 0  # no redirect was followed


@pytest.mark.parametrize(
    "mode, why",
    [
        ("error", ": HTTP 500 "),
        ("junk", "the reply is not JSON: b'<html>not a score</html>'"),
        ("down", "Connection refused"),
    ],
)
def test_a_failing_server_is_named_on_the_console_line_with_its_cause(server, mode, why):
  url = server.url
  if mode == "down":
    server.stop()
  else:
    server.mode = mode
  group = _group(0, "7", ["7", "8"])
  _score(RemoteReward(url, timeout_s=5.0, retries=0), [group])
  tally = failures.StepFailures.of([group])
  assert tally.all_one_cause and tally.kinds == {"reward_error": 2}
  line = tally.line(1)
  assert line.startswith(f"step 1: 2 of 2 samples failed: the reward raised for 2: "
                         f"RemoteRewardError: {url}: ")  # fmt: skip
  assert why in line and line.endswith("(after 1 attempts)"), line
