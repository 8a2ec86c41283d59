"""Where a run's numbers go: workdir/metrics.jsonl, TensorBoard, rollouts.jsonl, a progress line.

  metrics.jsonl    one JSON object per step: {"step": k, "rollout/...": ..., "train/...": ...}
  rollouts.jsonl   one line per trained group: step, prompt id, rewards, response lengths,
                   the policy versions of each sample's tokens (first and last), finish reasons
  tb/              TensorBoard event files (tensorboardX), the same scalars
On resume, lines for steps after the restored checkpoint are dropped first, so a file
never holds a step twice.
"""

from __future__ import annotations

import json
import os
from typing import Any

from absl import logging


def _truncate_jsonl(path: str, last_step: int) -> None:
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    lines = [line for line in f if line.strip()]
  keep = []
  for line in lines:
    try:
      if json.loads(line)["step"] <= last_step:
        keep.append(line)
    except (ValueError, KeyError):
      continue  # a torn last line from a killed run
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(keep)


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
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top

      self._tb = SummaryWriter(os.path.join(workdir, "tb"))

  def truncate_after(self, step: int) -> None:
    """Drops lines of steps > step (they are about to be run again)."""
    if not self.enabled:
      return
    _truncate_jsonl(self.metrics_path, step)
    _truncate_jsonl(self.rollouts_path, step)

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self.enabled:
      return
    with open(self.metrics_path, "a", encoding="utf-8") as f:
      f.write(json.dumps({"step": step, **metrics}) + "\n")
    if self._tb is not None:
      for name, value in metrics.items():
        self._tb.add_scalar(name, value, step)
      self._tb.flush()

  def write_rollouts(self, step: int, groups) -> None:
    if not self.enabled:
      return
    with open(self.rollouts_path, "a", encoding="utf-8") as f:
      for g in groups:
        f.write(
            json.dumps(
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
      f"step {step + 1}/{num_steps}  reward {m.get('rollout/reward_mean', 0):.3f}  "
      f"tok/s {m.get('rollout/tokens_per_s', 0):,.0f}  "
      f"occupancy {m.get('rollout/slot_occupancy', 0):.2f}  "
      f"buffer {m.get('rollout/buffer_groups', 0):.0f}  "
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
