"""A split run across processes: the learner in one process (2 CPU devices), the rollout in
another (2), joined by jax.distributed (a local coordinator); batches, requests and
checkpoint captures cross by the coordination service's store, weights by JAX's transfer
API (docs/async.md).

The pair is stopped by a SIGTERM to the rollout's process alone (it tells the learner,
which saves); from that checkpoint the pair and the same split in one process (4
devices, the same meshes) go on alike: the same tokens, groups and rewards, the same
updates and the same evaluation. A learner that fails at start ends its rollout's
process too, each with its line; a split that gives a process devices of both sides is
one line and exit 2. Short runs, mostly compiling: XLA's optimisations off
(cli.launch)."""

import shutil
import signal
import time

from async_run_test import _assert_same_runs
import cli
from multihost_test import _free_port

FLAGS = [
    "--config.train.sft_steps=10",
    "--config.eval_every=5",  # before training and at the end: a stopping step skips its own
    "--config.eval.num_prompts=8",
    "--config.checkpoint_every=1",
    "--config.mesh.rollout_devices=2",
    "--config.num_steps=5",
]
STOPPED = 143  # main.STOPPED_EXIT


def _pair(workdir, *flags):
  """The learner (process 0) and the rollout (process 1), started."""
  port = _free_port()
  return [
      cli.launch(
          *FLAGS, *flags,
          f"--config.distributed.coordinator_address=localhost:{port}",
          "--config.distributed.num_processes=2",
          f"--config.distributed.process_id={i}",
          "--config.distributed.heartbeat_timeout_s=20",
          config="tiny_tail.py", workdir=workdir, devices=2, optimised=False,
      )  # fmt: skip
      for i in range(2)
  ]


def _finish(procs):
  """(exit status, stdout, stderr) of each."""
  outs = [p.communicate(timeout=900) for p in procs]
  return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def test_rollout_and_learner_in_two_processes_stop_and_go_on_as_one_process_does(tmp_path):
  two, one = tmp_path / "two", tmp_path / "one"
  pair = _pair(two)
  deadline = time.monotonic() + 600
  while not (two / "checkpoints" / "1").is_dir() and time.monotonic() < deadline:
    assert all(p.poll() is None for p in pair), _finish(pair)
    time.sleep(0.2)
  pair[1].send_signal(signal.SIGTERM)  # the rollout's alone: the learner stops with it
  stopped = _finish(pair)
  for code, _, err in stopped:
    assert code == STOPPED, err[-3000:]
  learner_out, rollout_out = stopped[0][1], stopped[1][1]
  assert "before training: eval pass@1" in learner_out
  assert "stopped by SIGTERM" in learner_out  # after its step, or during the next
  assert "compiling" not in rollout_out  # the learner's process alone speaks for the run
  # From the checkpoint the stop saved (the cut batch's partial samples in its buffer,
  # with their KV): the pair again, and the same split in one process with 4 devices.
  shutil.copytree(two, one)
  alone = cli.launch(*FLAGS, config="tiny_tail.py", workdir=one, devices=4, optimised=False)
  try:
    resumed = _finish(_pair(two))
    out, err = alone.communicate(timeout=900)
  finally:
    alone.kill()  # a no-op once it has ended
  for code, _, err_ in resumed:
    assert code == 0, err_[-3000:]
  assert alone.returncode == 0, err[-3000:]
  assert "resumed from step" in resumed[0][1] and "resumed from step" in out
  _assert_same_runs(one, two, rtol=1e-5)
  metrics = cli.read_jsonl(two / "metrics.jsonl")
  assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4, 5]
  assert "eval/pass@1" in metrics[0] and "eval/pass@1" in metrics[5]
  # The rollout's counts reach the learner with its messages: the weights did cross.
  assert sum(m["async/publish_bytes"] for m in metrics[1:]) > 0
  assert not (two / "user_output.1.log").read_text().strip()


def test_a_learner_that_fails_at_start_ends_its_rollout_process(tmp_path):
  bad = "--config.train.lora_path=" + str(tmp_path / "missing")
  learner, rollout = _finish(_pair(tmp_path / "run", "--config.train.lora.rank=4", bad))
  assert learner[0] == 2, learner[2][-2000:]
  assert learner[2].strip().splitlines()[-1].startswith("april_jax: train.lora_path ")
  assert rollout[0] == 1, rollout[2][-2000:]
  assert rollout[2].strip().splitlines()[-1] == (
      "april_jax: the learner's process ended before it started the rollout: its output says why"
  )


def test_a_split_that_gives_a_process_both_sides_is_refused(tmp_path):
  results = _finish(
      _pair(tmp_path / "mixed", "--config.mesh.rollout_devices=3", "--config.rollout.num_slots=48")
  )
  for code, _, err in results:
    assert code == 2, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "april_jax: mesh.rollout_devices=3 gives process 0 devices of both the learner and "
        "the rollout (4 devices, 2 a process): across processes it must give whole processes "
        "to each side"
    )
  assert not (tmp_path / "mixed" / "checkpoints").exists()
