"""Past samples per prompt, for speculation's `history` drafts (drafts.py).

The engine remembers each finished sample's tokens (prompt and response) under its
prompt: the last `per_prompt` of them, for the `max_prompts` prompts used last. A sample
admitted later drafts from its prompt's rows: the samples of its group that finished in
an earlier step (APRIL carries a group across steps, and a finished sample leaves its
slot) and the prompt's rollouts of an earlier epoch. Host memory only, at most
per_prompt x max_prompts rows; not checkpointed: a resumed run fills it again as its
samples finish (drafts change how many tokens a call yields, never which).
"""

from __future__ import annotations

import collections

import numpy as np

from april_jax.sampler.records import SampleRecord

MAX_PROMPTS = 4096  # prompts remembered at most (the least recently used go first)


class DraftHistory:
  """Finished samples' tokens by prompt, most recent first."""

  def __init__(self, per_prompt: int, max_prompts: int = MAX_PROMPTS):
    if per_prompt < 1 or max_prompts < 1:
      raise ValueError(f"per_prompt and max_prompts must be >= 1, got {per_prompt}, {max_prompts}")
    self.per_prompt, self.max_prompts = per_prompt, max_prompts
    self._rows: collections.OrderedDict[bytes, list[np.ndarray]] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._rows)

  def add(self, record: SampleRecord) -> None:
    """A finished sample's tokens, under its prompt."""
    key = np.asarray(record.prompt, np.int32).tobytes()
    rows = self._rows.pop(key, [])
    rows.insert(0, np.concatenate([record.prompt, record.response]).astype(np.int32))
    self._rows[key] = rows[: self.per_prompt]
    while len(self._rows) > self.max_prompts:
      self._rows.popitem(last=False)

  def rows(self, prompt) -> list[np.ndarray]:
    """The prompt's remembered samples (prompt + response each), most recent first."""
    key = np.asarray(prompt, np.int32).tobytes()
    rows = self._rows.get(key)
    if rows is None:
      return []
    self._rows.move_to_end(key)
    return list(rows)
