"""Where a run's numbers go: workdir/metrics.jsonl, TensorBoard, rollouts.jsonl, a progress line.

  metrics.jsonl    one JSON object per step: {"step": k, "rollout/...": ..., "train/...": ...};
                   step k is the k-th update (from 1, as the console and the checkpoint
                   folders count); the evaluation before training, if any, is step 0
  rollouts.jsonl   one line per trained group: step, prompt id, rewards, response lengths,
                   the policy versions of each sample's tokens (first and last), finish reasons
  tb/              TensorBoard event files (tensorboardX), the same scalars
Both files are strict JSON: a value that is not a finite number (a reward's NaN or inf
metric) is written as null, and the line counts them as `metrics/non_finite`.
On resume, lines for steps after the restored checkpoint are dropped first (the file is
rewritten whole and renamed into place, so a kill mid-way leaves the old or the new one),
so a file never holds a step twice; the checkpointed step's own line comes back from the
checkpoint if a kill fell between the two. TensorBoard is told to purge the dropped steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from typing import Any

from absl import logging

from april_jax.errors import disk_full, is_no_space


def _finite(value) -> tuple[Any, int]:
  """value with every number that is not finite (NaN, inf) as None, in lists too; and
  how many there were."""
  if isinstance(value, (list, tuple)):
    parts = [_finite(v) for v in value]
    return [v for v, _ in parts], sum(n for _, n in parts)
  if hasattr(value, "item") and not isinstance(value, (str, bytes)):
    value = value.item()  # a numpy scalar
  if isinstance(value, float) and not math.isfinite(value):
    return None, 1
  return value, 0


def strict_line(line: dict[str, Any]) -> str:
  """One JSON line that strict parsers read: non-finite numbers as null, counted in
  `metrics/non_finite` (when there are any)."""
  out, bad = {}, 0
  for key, value in line.items():
    out[key], n = _finite(value)
    bad += n
  if bad:
    out["metrics/non_finite"] = bad
  return json.dumps(out, allow_nan=False)


def _truncate_jsonl(path: str, last_step: int, last_line: dict | None = None) -> None:
  """Keeps the lines of steps <= last_step, atomically; appends `last_line` (the line of
  last_step) if the file lacks it."""
  keep, steps = [], set()
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
          continue  # a torn last line from a killed run
        if not isinstance(step, int) or isinstance(step, bool):
          continue  # not a line this writer wrote (a hand edit)
        if step <= last_step:
          keep.append(line if line.endswith("\n") else line + "\n")
          steps.add(step)
  if last_line is not None and last_step not in steps:
    keep.append(strict_line(last_line) + "\n")
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(keep)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


@contextlib.contextmanager
def _room_for(path: str):
  """A write into `path` that finds no room becomes one DiskFull naming it (a torn last
  line is dropped on resume, see _truncate_jsonl)."""
  try:
    yield
  except OSError as e:
    if is_no_space(e):
      raise disk_full(path) from e
    raise


def _summary_writer():
  """tensorboardX's SummaryWriter, imported without torch and boto3. tensorboardX tries
  both at import when they are installed (torch for tensor types, boto3 for S3 paths): 1.4 s
  at every start-up, for scalars that need neither. Left importable for everyone else."""
  blocked = [name for name in ("torch", "boto3") if name not in sys.modules]
  for name in blocked:
    sys.modules[name] = None  # `import name` raises ImportError: tensorboardX goes on
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  finally:
    for name in blocked:
      if sys.modules.get(name, False) is None:
        del sys.modules[name]
  return SummaryWriter


class MetricsWriter:
  """metrics.jsonl, rollouts.jsonl and TensorBoard; `enabled=False` (processes other
  than 0 of a multi-host run) writes nothing."""

  def __init__(self, workdir: str, tensorboard: bool = True, enabled: bool = True):
    self.enabled = enabled
    os.makedirs(workdir, exist_ok=True)
    self.metrics_path = os.path.join(workdir, "metrics.jsonl")
    self.rollouts_path = os.path.join(workdir, "rollouts.jsonl")
    self._tb = None
    if tensorboard and enabled:
      self._tb_dir = os.path.join(workdir, "tb")
      self._tb = _summary_writer()(self._tb_dir)

  def truncate_after(self, step: int, metrics_line: dict | None = None) -> None:
    """Drops lines of steps > step (they are about to be run again); `metrics_line`, the
    checkpoint's copy of step's metrics, goes back in if the kill fell before its write."""
    if not self.enabled:
      return
    _truncate_jsonl(self.metrics_path, step, metrics_line)
    _truncate_jsonl(self.rollouts_path, step)
    if self._tb is not None:  # a new event file that hides the old files' later steps
      self._tb.close()
      self._tb = _summary_writer()(self._tb_dir, purge_step=step + 1)

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self.enabled:
      return
    with _room_for(self.metrics_path), open(self.metrics_path, "a", encoding="utf-8") as f:
      f.write(strict_line({"step": step, **metrics}) + "\n")
    if self._tb is not None:
      with _room_for(self._tb_dir):
        for name, value in metrics.items():
          self._tb.add_scalar(name, value, step)
        self._tb.flush()

  def write_rollouts(self, step: int, groups) -> None:
    if not self.enabled:
      return
    with _room_for(self.rollouts_path), open(self.rollouts_path, "a", encoding="utf-8") as f:
      for g in groups:
        f.write(
            strict_line(
                {
                    "step": step,
                    "prompt_id": g.prompt_id,
                    "group_id": g.group_id,
                    "first_step": g.first_step,
                    "rewards": g.rewards,
                    "response_lens": [len(s.response) for s in g.samples],
                    "versions": [
                        [int(s.versions.min()), int(s.versions.max())] if len(s.versions) else []
                        for s in g.samples
                    ],
                    "finish_reasons": [s.finish_reason for s in g.samples],
                }
            )
            + "\n"
        )

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def progress_line(step: int, num_steps: int, m: dict[str, Any]) -> str:
  line = (
      f"step {step}/{num_steps}  reward {m.get('rollout/reward_mean', 0):.3f}  "
      f"tok/s {m.get('rollout/tokens_per_s', 0):,.0f}  "
      f"occupancy {m.get('rollout/slot_occupancy', 0):.2f}  "
      f"buffer {m.get('rollout/buffer_groups', 0):.0f} groups  "
      f"off-policy {m.get('rollout/off_policy_token_frac', 0):.2f}  "
      f"loss {m.get('train/loss', 0):+.4f}"
  )
  if "eval/pass@1" in m:
    line += f"  eval pass@1 {m['eval/pass@1']:.3f}"
  return line


def log_progress(step: int, num_steps: int, m: dict[str, Any]) -> None:
  line = progress_line(step, num_steps, m)
  print(line, flush=True)
  logging.info("%s", line)
