"""Resume under faults, end to end: a damaged latest checkpoint falls back to the one
before (kept for inspection), a step's metrics line lost between its checkpoint and its
write comes back, TensorBoard never shows a step twice, and a changed config, a model of
another shape or no intact checkpoint is refused in one line; a fresh start after every
checkpoint was set aside keeps that run's metrics beside them."""

import glob
import json
import shutil
import struct
from pathlib import Path

import pytest
from tensorboardX.proto import event_pb2

import cli

RUN = ["--config.checkpoint_every=1", "--config.eval_every=0", "--config.train.sft_steps=2"]
RUN += ["--config.rollout.n_samples_per_prompt=4"]


def _tensorboard_scalars(tb_dir):
  """(tag, step) pairs as TensorBoard shows them: event files in order, a SessionLog
  START at step s (purge_step) hides the earlier files' events at steps >= s."""
  shown = []
  for path in sorted(glob.glob(str(Path(tb_dir) / "events.out.tfevents.*"))):
    data, at = Path(path).read_bytes(), 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at : at + 8])
      event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
      at += 12 + length + 4
      if event.HasField("session_log") and event.session_log.status == event.session_log.START:
        shown = [(tag, step) for tag, step in shown if step < event.step]
      for value in event.summary.value:
        shown.append((value.tag, event.step))
  return shown


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
  """A 3-step run checkpointed at every step, and its metrics."""
  workdir = tmp_path_factory.mktemp("three_steps")
  proc = cli.run(*RUN, "--config.num_steps=3", config="tiny.py", workdir=workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return workdir, cli.read_jsonl(workdir / "metrics.jsonl")


def test_a_damaged_checkpoint_and_a_lost_metrics_line_resume_from_the_one_before(
    three_steps, tmp_path
):
  source, original = three_steps
  workdir = tmp_path / "w"
  shutil.copytree(source, workdir)
  # Step 3's checkpoint loses most of its largest array file; the run was killed after
  # checkpoint 2 committed but before step 2's metrics line was written.
  largest = max(
      (workdir / "checkpoints" / "3" / "state").rglob("*"), key=lambda p: p.stat().st_size
  )
  largest.write_bytes(largest.read_bytes()[:1000])
  with open(workdir / "metrics.jsonl", "w", encoding="utf-8") as f:
    f.write(json.dumps(original[0]) + "\n")
  # num_steps may change on resume.
  proc = cli.run(*RUN, "--config.num_steps=4", config="tiny.py", workdir=workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  warnings = [l for l in proc.stderr.splitlines() if l.startswith("april_jax: warning:")]
  assert len(warnings) == 1 and "checkpoint 3 is damaged" in warnings[0], proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  assert (workdir / "damaged_checkpoints" / "3" / "state").is_dir()  # kept for inspection
  assert "resumed from step 2" in proc.stdout
  lines = cli.read_jsonl(workdir / "metrics.jsonl")
  assert [l["step"] for l in lines] == [1, 2, 3, 4]
  assert cli.untimed(lines[1]) == cli.untimed(original[1])  # the checkpoint's copy of its line
  assert cli.untimed(lines[2]) == cli.untimed(original[2])  # step 3 again, exactly
  shown = _tensorboard_scalars(workdir / "tb")
  assert len(shown) == len(set(shown)) and {s for _, s in shown} == {1, 2, 3, 4}


def test_a_damaged_array_file_is_one_clean_line_even_with_read_debris_collected_later(
    three_steps, tmp_path
):
  """Orbax's error for an unreadable array quotes a bound method's repr; the line names
  the file and bytes instead. What the failed read leaves to be collected later (asyncio
  tasks, finalisers that raise; tests/resume_debris.py makes both, after the resume)
  goes to the log, not to stderr."""
  source, _ = three_steps
  workdir = tmp_path / "w"
  shutil.copytree(source, workdir)
  data = max(
      (workdir / "checkpoints" / "3" / "state").glob("ocdbt.process_0/d/*"),
      key=lambda p: p.stat().st_size,
  )
  data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
  # A compilation cache of its own: another test's run writing the shared one at the same
  # time can leave an entry this run would warn about reading.
  cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache")}
  proc = cli.run(
      *RUN,
      "--config.num_steps=3",
      config="tiny.py",
      workdir=workdir,
      preload="resume_debris",
      env=cache,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1, proc.stderr[-3000:]
  (line,) = lines
  assert line.startswith("april_jax: warning: checkpoint 3 is damaged (") and "(from " in line
  assert "<bound method" not in line and "OUT_OF_RANGE" in line, line
  assert "resumed from step 2" in proc.stdout


def test_a_changed_config_or_no_intact_checkpoint_is_refused_in_one_line(three_steps, tmp_path):
  source, _ = three_steps
  workdir = tmp_path / "w"
  shutil.copytree(source, workdir)
  proc = cli.run(
      *RUN,
      "--config.num_steps=4",
      "--config.rollout.max_response_len=32",
      "--config.eval.k=2",
      config="tiny.py",
      workdir=workdir,
  )
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  (message,) = [l for l in proc.stderr.splitlines() if l.startswith("april_jax:")]
  assert (
      "rollout.max_response_len: 64 -> 32" in message
      and "eval.k" not in message.split("(may change")[0]
  )
  for step in (1, 2, 3):
    (workdir / "checkpoints" / str(step) / "host" / "metadata").write_text("not json")
  proc = cli.run(*RUN, "--config.num_steps=4", config="tiny.py", workdir=workdir)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  errors = [
      l for l in proc.stderr.splitlines() if l.startswith("april_jax:") and "warning" not in l
  ]
  assert len(errors) == 1 and "no intact checkpoint in" in errors[0]
  assert sorted(p.name for p in (workdir / "damaged_checkpoints").iterdir()) == ["1", "2", "3"]

  # Running again starts afresh; the set-aside run's metrics are kept beside its checkpoints.
  old = {name: (workdir / name).read_bytes() for name in ("metrics.jsonl", "rollouts.jsonl")}
  proc = cli.run(*RUN, "--config.num_steps=1", config="tiny.py", workdir=workdir)
  assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert "starting afresh; the metrics of the run whose checkpoints" in proc.stderr
  kept = workdir / "damaged_checkpoints" / "metrics"
  assert {name: (kept / name).read_bytes() for name in old} == old
  assert [l["step"] for l in cli.read_jsonl(workdir / "metrics.jsonl")] == [1]


def test_a_model_of_another_shape_is_refused_and_nothing_is_set_aside(three_steps, tmp_path):
  """As when model.path (which may change on resume) names a model of another size: the
  arrays would not fit the checkpoint's, and a failed read would have been taken for
  damage, every checkpoint set aside and the run's history then started afresh."""
  source, _ = three_steps
  workdir = tmp_path / "w"
  shutil.copytree(source, workdir)
  for step in (1, 2, 3):
    path = workdir / "checkpoints" / str(step) / "host" / "metadata"
    host = json.loads(path.read_text())
    layers = host["model"]["num_layers"]
    host["model"]["num_layers"] = layers + 1
    path.write_text(json.dumps(host))
  before = {p: p.read_bytes() for p in sorted(workdir.rglob("*")) if p.is_file()}
  before.pop(workdir / ".lock")
  proc = cli.run(*RUN, "--config.num_steps=4", config="tiny.py", workdir=workdir)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  (message,) = [l for l in proc.stderr.splitlines() if l.startswith("april_jax:")]
  assert "the model the config names now is not the one checkpoint 3" in message
  assert f"num_layers: {layers + 1} -> {layers}" in message
  assert {p: p.read_bytes() for p in before} == before  # every file as it was
  assert not (workdir / "damaged_checkpoints").exists()
