"""The relay of what user code prints: each line to the log marked with who printed it, up
to a bound (the rest counted), and a few whole lines a step to the console."""

import os

import pytest

from april_jax.runtime import user_output
from april_jax.runtime import workers


def _drain(relay, role, data: bytes):
  fd = relay.writer(role)
  os.write(fd, data)


def _wait_for(predicate, seconds=10.0):
  import time  # pylint: disable=g-import-not-at-top

  deadline = time.monotonic() + seconds
  while not predicate() and time.monotonic() < deadline:
    time.sleep(0.02)
  assert predicate()


def test_lines_are_logged_marked_and_the_console_gets_a_capped_few_per_step(tmp_path, monkeypatch):
  monkeypatch.setattr(user_output, "CONSOLE_LINES_PER_STEP", 3)
  read_console, console = os.pipe()
  relay = user_output.OutputRelay(str(tmp_path), echo_fd=console)
  _drain(relay, "reward", b"".join(b"line %d\n" % i for i in range(5)) + b"half")
  _wait_for(lambda: relay.echoed + relay.held_back == 5)
  relay.new_step()
  _drain(relay, "environment", b"next step\n")
  _wait_for(lambda: relay.echoed == 1)
  relay.close()
  os.close(console)
  shown = os.read(read_console, 1 << 16).decode().splitlines()
  assert shown == [
      "[reward] line 0",
      "[reward] line 1",
      "[reward] line 2",
      f"april_jax: user code printed 2 more lines this step: {tmp_path / 'user_output.log'}",
      "[environment] next step",
  ]
  log = (tmp_path / "user_output.log").read_text().splitlines()
  assert log == [f"[reward] line {i}" for i in range(5)] + ["[environment] next step"]


def test_the_log_stops_at_its_bound_and_says_how_much_more_came(tmp_path, monkeypatch):
  monkeypatch.setattr(user_output, "MAX_LOG_BYTES", 1000)
  read_console, console = os.pipe()
  relay = user_output.OutputRelay(str(tmp_path), echo_fd=console)
  _drain(relay, "environment", b"y" * 60 + b"\n")
  _wait_for(lambda: relay.logged_bytes > 0)
  fd = relay.writer("environment")
  for _ in range(100):
    os.write(fd, b"z" * 99 + b"\n")
  _wait_for(lambda: relay.logged_bytes + relay.dropped_bytes >= 75 + 100 * 114)
  relay.close()
  os.close(console)
  log = (tmp_path / "user_output.log").read_bytes()
  assert len(log) < 1200 and log.startswith(b"[environment] " + b"y" * 60 + b"\n")
  assert log.decode().splitlines()[-1] == (
      f"[april_jax] {relay.dropped_bytes} bytes more were printed, past the log's 0 MB"
  )
  os.close(read_console)


def _chatty():
  def serve(job):
    print("to stdout", job, flush=True)
    os.write(2, b"to stderr\n")
    return job

  return serve


def test_a_worker_started_under_a_relay_prints_through_it(tmp_path):
  relay = user_output.start(str(tmp_path))
  try:
    pool = workers.WorkerPool(_chatty, 1, preload=(__name__,), name="environment")
    try:
      assert pool.call(7, 60.0)[0] == 7
    finally:
      pool.close()
    _wait_for(
        lambda: relay.logged_bytes >= len(b"[environment] to stdout 7\n[environment] to stderr\n")
    )
  finally:
    user_output.stop()
  log = (tmp_path / "user_output.log").read_text().splitlines()
  assert sorted(log) == ["[environment] to stderr", "[environment] to stdout 7"]
  assert user_output.writer("environment") is None


def test_the_console_gets_no_terminal_escapes_but_the_log_keeps_the_line(tmp_path):
  read_console, console = os.pipe()
  relay = user_output.OutputRelay(str(tmp_path), echo_fd=console)
  _drain(relay, "reward", b"\x1b[2K\rfake april_jax: line\x07\n")
  _wait_for(lambda: relay.echoed == 1)
  relay.close()
  os.close(console)
  assert os.read(read_console, 1 << 16) == b"[reward] ?[2K?fake april_jax: line?\n"
  assert (
      tmp_path / "user_output.log"
  ).read_bytes() == b"[reward] \x1b[2K\rfake april_jax: line\x07\n"
