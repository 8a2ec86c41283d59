"""A run with rollout and learner on their own devices (mesh.rollout_devices=4 of 8 fake
CPU devices), killed with SIGKILL, resumes exactly as if never stopped; no trained token
of it is staler than the bound; and from its checkpoint, which holds a batch drawn and
not yet trained, a colocated run goes on. Short runs, mostly compiling: XLA's
optimisations off (cli.launch)."""

from async_run_test import SHORT, SPLIT, _assert_same_runs, _lags
import cli


def test_a_killed_split_run_resumes_exactly_and_a_colocated_run_goes_on_from_it(tmp_path):
  bound = 2  # the pipeline's version, and one more for a partial continued next step
  flags = [*SHORT, "--config.num_steps=4", "--config.checkpoint_every=2", *SPLIT]
  flags.append(f"--config.rollout.max_staleness={bound}")
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  fast = dict(devices=8, optimised=False)
  cli.run_beside_a_killed_one(flags, "tiny.py", straight, killed, checkpoint=2, **fast)
  proc = cli.run(*flags, config="tiny.py", workdir=killed, **fast)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "resumed from step 2" in proc.stdout and "1 drawn batches to train" in proc.stdout
  _assert_same_runs(straight, killed)
  lags = _lags(straight)
  assert max(lags) <= bound and 1 in lags  # drawn while the learner trained the batch before
  # Checkpoint 4 holds batch 4, drawn by version 3: a colocated run trains it first.
  joined = cli.run(
      *SHORT, "--config.num_steps=5", f"--config.rollout.max_staleness={bound}",
      config="tiny.py", workdir=killed, devices=4, optimised=False,
  )  # fmt: skip
  assert joined.returncode == 0, joined.stderr[-3000:]
  assert "1 drawn batches to train" in joined.stdout
  last = [g for g in cli.read_jsonl(killed / "rollouts.jsonl") if g["step"] == 5]
  assert len(last) == 8  # rollout.batch_size groups
  assert max(v[1] for g in last for v in g["versions"] if v) == 3
