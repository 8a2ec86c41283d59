"""Runs of `python -m april_jax.main` with rollout and learner on their own devices
(mesh.rollout_devices=4 of 8 fake CPU devices): with max_staleness 0 the split run draws
the tokens the colocated run draws on the same mesh shape, and trains to the same
numbers; no token updated in flight is staler than the bound; a split the devices or the
model cannot take is one line and exit 2, with nothing written. (A killed split run's
resume: async_resume_test.py.)

The runs are short and mostly compile: XLA's optimisations off (cli.launch)."""

import math

import pytest

import cli

# The tiny task, short: a short warm start and a few steps; the learner's mesh and the
# rollout's alike (4 devices, data parallel), so that the colocated run on 4 devices runs
# the same programs.
SHORT = [
    "--config.train.sft_steps=20",
    "--config.eval_every=0",
    "--config.mesh.shape=4,1,1",
    "--config.mesh.rollout_shape=4,1,1",
]
SPLIT = ["--config.mesh.rollout_devices=4"]


def _run(workdir, *flags, devices=8, steps=3):
  proc = cli.run(
      *SHORT, f"--config.num_steps={steps}", *flags, config="tiny.py", workdir=workdir,
      devices=devices, optimised=False,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _assert_same_runs(a, b, rtol=0.0):
  """rollouts.jsonl equal line for line; metrics.jsonl's untimed numbers equal (to rtol)."""
  ra, rb = cli.read_jsonl(a / "rollouts.jsonl"), cli.read_jsonl(b / "rollouts.jsonl")
  assert ra == rb
  ma = [cli.untimed(m) for m in cli.read_jsonl(a / "metrics.jsonl")]
  mb = [cli.untimed(m) for m in cli.read_jsonl(b / "metrics.jsonl")]
  assert [sorted(m) for m in ma] == [sorted(m) for m in mb]
  for x, y in zip(ma, mb):
    for key in x:
      assert math.isclose(x[key], y[key], rel_tol=rtol, abs_tol=rtol), (x["step"], key)


def test_with_staleness_0_the_split_run_draws_what_the_colocated_run_draws(tmp_path):
  stale0 = ["--config.rollout.max_staleness=0"]
  colocated = cli.launch(
      *SHORT, "--config.num_steps=3", *stale0, config="tiny.py", workdir=tmp_path / "colocated",
      devices=4, optimised=False,
  )  # fmt: skip
  split = _run(tmp_path / "split", *SPLIT, *stale0)
  out, err = colocated.communicate(timeout=600)
  assert colocated.returncode == 0, err[-3000:]
  # The same tokens, groups and rewards; the updates (on other devices) to float tolerance.
  _assert_same_runs(tmp_path / "colocated", tmp_path / "split", rtol=1e-5)
  metrics = cli.read_jsonl(tmp_path / "split" / "metrics.jsonl")[1:]
  assert all(m["rollout/lag_token_max"] == 0 for m in metrics)
  assert all(m["async/publish_bytes"] > 0 for m in metrics)
  del out, split


def _lags(workdir) -> list[int]:
  """Every trained sample's oldest token's lag: the version that trained it - its tag."""
  lags = []
  for group in cli.read_jsonl(workdir / "rollouts.jsonl"):  # a line a trained group
    trained_at = group["step"] - 1  # step k's data trains update k, on version k - 1
    lags += [trained_at - oldest for oldest, _ in filter(None, group["versions"])]
  return lags


def test_no_token_updated_in_flight_is_staler_than_the_bound(tmp_path):
  bound = 1
  _run(tmp_path, *SPLIT, f"--config.rollout.max_staleness={bound}",
       "--config.rollout.in_flight_updates=True", steps=4)  # fmt: skip
  lags = _lags(tmp_path)
  assert lags and max(lags) <= bound and 1 in lags
  metrics = cli.read_jsonl(tmp_path / "metrics.jsonl")[1:]
  assert max(m["rollout/lag_token_max"] for m in metrics) <= bound


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--config.mesh.rollout_devices=8"], "mesh.rollout_devices=8 leaves no device"),
        (
            ["--config.mesh.rollout_devices=4", "--config.mesh.rollout_shape=1,1,4"],
            "splits the model's 2 KV heads 4 ways",
        ),
        (["--config.rollout.in_flight_updates=True"], "needs mesh.rollout_devices > 0"),
        (["--config.mesh.rollout_devices=-1"], "mesh.rollout_devices must be an integer >= 0"),
    ],
    ids=["no_learner", "heads", "in_flight_colocated", "negative"],
)
def test_a_split_that_cannot_run_is_one_line_and_exit_2(tmp_path, flags, words):
  workdir = tmp_path / "run"
  proc = cli.run(*flags, config="tiny.py", workdir=workdir, devices=8, optimised=False)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert words in proc.stderr
  assert "Traceback" not in proc.stderr
  assert not workdir.exists()
