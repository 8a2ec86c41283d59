"""metrics.jsonl on resume: the lines after the checkpoint go, the checkpoint's own line
comes back if it was lost, and lines this writer never wrote (torn, hand-edited) are
dropped without an error."""

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
