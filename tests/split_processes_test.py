"""A split run across processes: the learner in one process (2 CPU devices), the rollout in
another (2), joined by jax.distributed (a local coordinator); batches, requests and
checkpoint captures cross by the coordination service's store, weights by JAX's transfer
API (docs/async.md).

Against the same split in one process (4 devices, the same meshes): the same tokens,
groups and rewards, the same updates, the same evaluation, through a checkpoint the pair
is restarted from (which holds a batch drawn and not yet trained). A split that gives a
process devices of both sides is one line and exit 2. Short runs, mostly compiling:
XLA's optimisations off (cli.launch)."""

from async_run_test import _assert_same_runs
import cli
from multihost_test import _free_port

FLAGS = [
    "--config.train.sft_steps=10",
    "--config.eval_every=2",
    "--config.eval.num_prompts=8",
    "--config.checkpoint_every=1",
    "--config.mesh.rollout_devices=2",
]


def _pair(workdir, *flags):
  """The learner (process 0) and the rollout (process 1), finished: their outputs."""
  port = _free_port()
  procs = [
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
  outs = [p.communicate(timeout=900) for p in procs]
  return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def test_rollout_and_learner_in_two_processes_run_and_resume_as_in_one(tmp_path):
  one = cli.run(
      *FLAGS, "--config.num_steps=3", config="tiny_tail.py", workdir=tmp_path / "one",
      devices=4, optimised=False,
  )  # fmt: skip
  assert one.returncode == 0, one.stderr[-3000:]
  first = _pair(tmp_path / "two", "--config.num_steps=2")
  for code, _, err in first:
    assert code == 0, err[-3000:]
  learner_out, rollout_out = first[0][1], first[1][1]
  assert "before training: eval pass@1" in learner_out
  assert "compiling" not in rollout_out  # the learner's process alone speaks for the run
  # Restarted for a third step: it trains the batch the checkpoint holds drawn first.
  second = _pair(tmp_path / "two", "--config.num_steps=3")
  for code, _, err in second:
    assert code == 0, err[-3000:]
  assert "resumed from step 2" in second[0][1] and "1 drawn batches to train" in second[0][1]
  _assert_same_runs(tmp_path / "one", tmp_path / "two", rtol=1e-5)
  metrics = cli.read_jsonl(tmp_path / "two" / "metrics.jsonl")
  assert [m["step"] for m in metrics] == [0, 1, 2, 3]
  assert "eval/pass@1" in metrics[0] and "eval/pass@1" in metrics[2]
  # The rollout's counts reach the learner with its messages: the weights did cross.
  assert sum(m["async/publish_bytes"] for m in metrics[1:]) > 0
  assert sum(m["async/weight_swaps"] for m in metrics[1:]) >= 1
  assert not (tmp_path / "two" / "user_output.1.log").read_text().strip()


def test_a_split_that_gives_a_process_both_sides_is_refused(tmp_path):
  results = _pair(
      tmp_path / "mixed", "--config.num_steps=1", "--config.mesh.rollout_devices=3",
      "--config.rollout.num_slots=48",
  )  # fmt: skip
  for code, _, err in results:
    assert code == 2, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "april_jax: mesh.rollout_devices=3 gives process 0 devices of both the learner and "
        "the rollout (4 devices, 2 a process): across processes it must give whole processes "
        "to each side"
    )
  assert not (tmp_path / "mixed" / "checkpoints").exists()
