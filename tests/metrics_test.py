"""metrics.jsonl on resume: the lines after the checkpoint go, the checkpoint's own line
comes back if it was lost, and lines this writer never wrote (torn, hand-edited) are
dropped without an error; non-finite numbers are written as null, counted, so strict
JSON parsers read every line."""

import json

from april_jax.metrics import MetricsWriter


def test_a_resume_keeps_the_checkpointed_steps_and_skips_lines_it_cannot_read(tmp_path):
  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  for step in (1, 2, 4):  # step 3's line was lost to a kill; step 4 ran past the checkpoint
    writer.write(step, {"loss": step / 10})
  with open(writer.metrics_path, "a", encoding="utf-8") as f:
    f.write('{"step": "3", "loss": 0.3}\n{"step": null}\n{"loss": 1}\n{"step": 5, "lo')
  writer.truncate_after(3, {"step": 3, "loss": 0.3})
  lines = [json.loads(l) for l in open(writer.metrics_path, encoding="utf-8")]
  assert lines == [{"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.2}, {"step": 3, "loss": 0.3}]
  writer.write(4, {"loss": 0.41})
  assert json.loads(open(writer.metrics_path, encoding="utf-8").readlines()[-1])["loss"] == 0.41


def test_non_finite_metrics_are_written_as_null_and_counted(tmp_path):
  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  writer.write(1, {"reward/x": float("nan"), "reward/y": float("inf"), "loss": 0.5})
  writer.write(2, {"loss": 0.25})
  text = open(writer.metrics_path, encoding="utf-8").read()
  assert "NaN" not in text and "Infinity" not in text
  strict = lambda token: (_ for _ in ()).throw(ValueError(token))  # refuse NaN / Infinity
  lines = [json.loads(l, parse_constant=strict) for l in text.splitlines()]
  assert lines[0] == {
      "step": 1,
      "reward/x": None,
      "reward/y": None,
      "loss": 0.5,
      "metrics/non_finite": 2,
  }
  assert lines[1] == {"step": 2, "loss": 0.25}  # no count when all are finite
