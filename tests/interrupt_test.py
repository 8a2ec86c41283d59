"""Ctrl-C at any point of a run (starting, warm-starting, compiling, decoding, learning,
evaluating, saving) ends it with one line and exit 130: no traceback, no crash of the runtime, six
tries at each point; and the run resumes afterwards. (SIGTERM finishes the step and saves:
main_test.py.)"""

import concurrent.futures
import json
import os
import random
import signal
import time

import pytest

import cli

TRIES = 6
QUICK = [
    "--config.train.sft_steps=0",
    "--config.eval.before_training=false",
    "--config.eval.num_prompts=8",
    "--config.num_steps=1000",
    "--config.eval_every=1",  # after step 1 the run decodes, learns, evaluates and saves
    "--config.checkpoint_every=1",
]
CRASH_SIGNS = ("Traceback", "Fatal Python error", "Segmentation fault", "Exception ignored")


def _start(workdir, cache, *extra):
  return cli.launch(
      *QUICK,
      f"--config.compilation_cache_dir={cache}",
      *extra,
      config="tiny.py",
      workdir=workdir,
      optimised=False,
      env={"PYTHONUNBUFFERED": "1"},
      start_new_session=True,  # its own process group, as a terminal's foreground job is
  )


def _wait_for_line(proc, marker: str, timeout: float = 300) -> None:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    line = proc.stdout.readline()
    if not line:
      raise AssertionError(f"the run ended before {marker!r}: {proc.stderr.read()[-3000:]}")
    if marker in line:
      return
  raise AssertionError(f"no {marker!r} within {timeout} s")


def _ctrl_c_and_check(proc) -> None:
  os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the whole group
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-3000:]
  for sign in CRASH_SIGNS:
    assert sign not in err, err[-3000:]
  lines = [l for l in err.splitlines() if l.startswith("april_jax:")]
  assert len(lines) == 1 and "interrupted (Ctrl-C)" in lines[0], err[-3000:]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """One compilation cache for every try: the first compiles, the rest start fast."""
  return tmp_path_factory.mktemp("xla_cache")


def _try_once(point: str, workdir, cache, rng: random.Random) -> None:
  """One run, Ctrl-C'd at `point` after a random delay, and checked."""
  if point == "warm-starting":  # supervised steps before RL: a fresh run each time
    proc = _start(workdir / f"sft{rng.random()}", cache, "--config.train.sft_steps=200")
    _wait_for_line(proc, "warm-start:")
    time.sleep(rng.uniform(0.0, 3.0))
  elif point == "starting":  # importing jax, reading the config, building the model
    proc = _start(workdir, cache)
    time.sleep(rng.uniform(0.1, 3.0))
  elif point == "compiling":
    proc = _start(workdir, cache)
    _wait_for_line(proc, "compiling the sampler")
    time.sleep(rng.uniform(0.0, 3.0))
  else:  # decoding, learning, evaluating and saving, one after the other
    proc = _start(workdir, cache)
    _wait_for_line(proc, "step ")
    time.sleep(rng.uniform(0.0, 2.0))
  _ctrl_c_and_check(proc)


@pytest.mark.parametrize("point", ["starting", "warm-starting", "compiling", "running"])
def test_ctrl_c_at_any_point_is_one_line_and_exit_130(point, cache, tmp_path):
  # Two lanes of TRIES / 2 tries side by side (two cores), each with its own workdir:
  # a lane's later tries resume what its earlier ones saved.
  lanes = [tmp_path / "a", tmp_path / "b"]

  def lane(index: int) -> None:
    rng = random.Random(f"{point}{index}")
    for _ in range(TRIES // len(lanes)):
      _try_once(point, lanes[index], cache, rng)

  with concurrent.futures.ThreadPoolExecutor(len(lanes)) as pool:
    for done in [pool.submit(lane, i) for i in range(len(lanes))]:
      done.result()
  workdir = lanes[0]
  if point == "running":  # what the tries saved resumes, and the jsonl files agree with it
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    proc = _start(workdir, cache)
    _wait_for_line(proc, f"resumed from step {steps[-1]}")
    _wait_for_line(proc, f"step {steps[-1] + 1}/")
    _ctrl_c_and_check(proc)
    lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == list(range(1, len(lines) + 1))
