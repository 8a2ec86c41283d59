"""Whole runs of `python -m april_jax.main` with speculation: the synchronous baseline
(partial_rollout=False, N' = N) trains on every group it admits, so with
rollout.speculative_tokens=4, stopped by SIGTERM and resumed, it trains on the same
groups, samples and rewards as without, to the same numbers, in fewer decode passes.

The runs are short and mostly compile: XLA's optimisations off (cli.launch)."""

import math
import signal
import time

import cli

SYNC = [
    "--config.train.sft_steps=20",  # a little structure: the group's rows draft well
    "--config.eval_every=0",
    "--config.checkpoint_every=0",
    "--config.rollout.batch_size=4",
    "--config.rollout.over_sampling_batch_size=4",
    "--config.rollout.n_samples_per_prompt=4",
    "--config.rollout.num_slots=8",
    "--config.rollout.partial_rollout=False",
    "--config.num_steps=3",
]
SPECULATE = ["--config.rollout.speculative_tokens=4"]
# Metrics that count how the rollout ran, not what it drew: speculation's own, its
# passes, and what a cut and resume count (samples continued).
HOW_IT_RAN = ("rollout/slot_occupancy", "rollout/tokens_per_decode_step", "rollout/spec/")
CUT = ("rollout/partial_samples", "rollout/off_policy_token_frac", "rollout/buffer_")
# Slots set aside while their environment answered: how long a turn's call took against
# the other slots' decoding.
HELD = ("rollout/env/set_aside", "rollout/partial_samples")


def _launch(workdir, *flags):
  return cli.launch(*SYNC, *flags, config="tiny.py", workdir=workdir, optimised=False)


def _wait(proc, what="the run"):
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, f"{what}: {err[-3000:]}"
  return out


def test_the_synchronous_baseline_with_speculation_cut_and_resumed_trains_what_it_trains_without(
    tmp_path,
):
  plain = _launch(tmp_path / "plain")
  spec_dir = tmp_path / "spec"
  spec = _launch(spec_dir, *SPECULATE)
  metrics = spec_dir / "metrics.jsonl"
  deadline = time.monotonic() + 600
  while spec.poll() is None and time.monotonic() < deadline:
    if metrics.exists() and len(cli.read_jsonl(metrics)) >= 1:
      break
    time.sleep(0.1)
  assert spec.poll() is None, spec.communicate()[1][-3000:]
  spec.send_signal(signal.SIGTERM)
  _, err = spec.communicate(timeout=300)
  assert spec.returncode == 143, err[-3000:]
  assert len(cli.read_jsonl(metrics)) < 3  # stopped before its last step
  _wait(_launch(spec_dir, *SPECULATE), "the resumed run")
  _wait(plain, "the plain run")

  assert cli.read_jsonl(spec_dir / "rollouts.jsonl") == cli.read_jsonl(
      tmp_path / "plain" / "rollouts.jsonl"
  )
  ours = [cli.untimed(m) for m in cli.read_jsonl(metrics)]
  theirs = [cli.untimed(m) for m in cli.read_jsonl(tmp_path / "plain" / "metrics.jsonl")]
  assert [m["step"] for m in ours] == [m["step"] for m in theirs] == [1, 2, 3]
  for x, y in zip(ours, theirs):
    for key in y:
      if key.startswith(HOW_IT_RAN + CUT):
        continue
      assert math.isclose(x[key], y[key], rel_tol=1e-5, abs_tol=1e-5), (x["step"], key)
  # The same tokens in fewer passes over the slots.
  drawn = lambda ms: sum(m["rollout/tokens_per_decode_step"] for m in ms)
  assert sum(m["rollout/spec/accepted"] for m in ours) > 0
  assert drawn(ours) > drawn(theirs)
  assert not any(k.startswith("rollout/spec/") for m in theirs for k in m)


def test_the_multi_turn_config_with_speculation_draws_and_trains_what_it_does_without(tmp_path):
  # Tool turns: the observations are given tokens, never drafted; the model's turns are.
  # Calls answered right after the decode call that ends their turn (env.overlap off), so
  # the two runs do not depend on when a call returns (docs/design.md).
  flags = [*SYNC[:-1], "--config.num_steps=1", "--config.env.overlap=False"]
  runs = {
      name: cli.launch(*flags, *extra, config="tiny_lookup.py", workdir=tmp_path / name,
                       optimised=False)
      for name, extra in (("plain", []), ("spec", SPECULATE))
  }  # fmt: skip
  for name, proc in runs.items():
    _wait(proc, name)
  plain, spec = (cli.read_jsonl(tmp_path / n / "rollouts.jsonl") for n in ("plain", "spec"))
  assert spec == plain and len(plain) == 4
  ours = [cli.untimed(m) for m in cli.read_jsonl(tmp_path / "spec" / "metrics.jsonl")]
  theirs = [cli.untimed(m) for m in cli.read_jsonl(tmp_path / "plain" / "metrics.jsonl")]
  assert theirs[0]["rollout/env/turns"] > 0
  differ = [
      (x["step"], key, x[key], y[key])
      for x, y in zip(ours, theirs, strict=True)
      for key in y
      if not key.startswith(HOW_IT_RAN + HELD)
      and not math.isclose(x[key], y[key], rel_tol=1e-5, abs_tol=1e-5)
  ]
  assert not differ
  assert sum(m["rollout/spec/drafted"] for m in ours) > 0
