"""The built-in task: walk a ring of symbols, with answer lengths that have a long tail.

Prompt `c:<from><to>=`, correct response: the symbols of a ring (64 symbols by default)
from <from> to <to> inclusive, then the stop token (`c:xB=` -> `xyzAB`). The walk's length
d is drawn from a log-normal clipped to [1, max_len]: most answers are short, a few run to the
maximum, like the response lengths of math RL (APRIL paper, Figure 3). Each next symbol
follows from the previous one and the stop from one prompt symbol, so a tiny Qwen3 learns
the task on a CPU in minutes; a short supervised warm-start (`sft_batch`) gives RL a
policy that walks short distances, and RL carries it along the tail.

Reward `longtail`: symbols matching the correct answer at the same position, divided by
the longer of the two lengths: exactly 1.0 for the right walk, partial credit below it.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from april_jax.rewards.registry import register
from april_jax.tokenizer import CharTokenizer

RING = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-"
MAX_RING_SIZE = 1024


@functools.lru_cache(maxsize=8)
def ring(size: int = len(RING)) -> str:
  """The ring's symbols: RING, then Latin-extended and later code points past 64."""
  if not 2 <= size <= MAX_RING_SIZE:
    raise ValueError(f"ring size must be in [2, {MAX_RING_SIZE}], got {size}")
  return (RING + "".join(chr(0x100 + i) for i in range(max(0, size - len(RING)))))[:size]


def tokenizer(ring_size: int = len(RING)) -> CharTokenizer:
  """The task's tokenizer: specials, the ring's symbols, then ':' and '='."""
  return CharTokenizer(ring(ring_size) + ":=")


def longtail_lengths(
    rng: np.random.Generator, size: int, max_len: int, median: float, sigma: float
) -> np.ndarray:
  """Log-normal lengths (median, sigma of the log), rounded and clipped to [1, max_len]."""
  lengths = np.rint(median * np.exp(sigma * rng.standard_normal(size)))
  return np.clip(lengths, 1, max_len).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class LongTailTask:
  max_answer_len: int = 64
  median: float = 8.0
  sigma: float = 0.9
  ring_size: int = len(RING)

  def __post_init__(self):
    ring(self.ring_size)  # validates the size
    if not 1 <= self.max_answer_len <= self.ring_size:
      raise ValueError(
          f"max_answer_len must be in [1, {self.ring_size}] (the ring's size), "
          f"got {self.max_answer_len}"
      )
    if self.median <= 0 or self.sigma < 0:
      raise ValueError(f"median must be > 0 and sigma >= 0, got {self.median}, {self.sigma}")

  def item(self, index: int, seed: int = 0) -> dict:
    """The index-th prompt of the stream (deterministic in index and seed)."""
    rng = np.random.default_rng([seed, index])
    (d,) = longtail_lengths(rng, 1, self.max_answer_len, self.median, self.sigma)
    start = int(rng.integers(self.ring_size))
    symbols = ring(self.ring_size)
    answer = "".join(symbols[(start + i) % self.ring_size] for i in range(d))
    return {"id": index, "prompt": f"c:{answer[0]}{answer[-1]}=", "answer": answer}

  def prompt_len(self) -> int:
    """Tokens in every prompt."""
    return 5


def copy_score(response: str, answer: str) -> float:
  if not response and not answer:
    return 1.0
  matches = sum(a == b for a, b in zip(response, answer))
  return matches / max(len(response), len(answer))


@register("longtail")
def longtail_reward(response: str, answer: str) -> float:
  return copy_score(response.strip(), answer)


def sft_batch(task: LongTailTask, tok: CharTokenizer, indices, seed: int, seq_len: int):
  """Supervised examples (prompt + answer + stop): tokens, targets, loss mask [B, T]."""
  B = len(indices)
  tokens = np.full((B, seq_len), tok.pad_id, np.int32)
  mask = np.zeros((B, seq_len), np.float32)
  for b, index in enumerate(indices):
    item = task.item(int(index), seed)
    prompt = tok.encode(item["prompt"])
    full = (prompt + tok.encode(item["answer"]) + [tok.eos_id])[:seq_len]
    tokens[b, : len(full)] = full
    mask[b, len(prompt) - 1 : len(full) - 1] = 1.0  # predict answer and stop
  targets = np.roll(tokens, -1, axis=1)
  return tokens, targets, mask
