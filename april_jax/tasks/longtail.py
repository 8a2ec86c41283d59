"""The built-in task: walk a ring of symbols, with answer lengths that have a long tail.

Prompt `c:<from><to>=`, correct response: the symbols of a ring (64 symbols by default)
from <from> to <to> inclusive, then the stop token (`c:xB'=` -> `xyzAB`). The prompt
writes <to> in a second alphabet of target symbols (`targets`), one per ring symbol, so a
target never appears in a response: the model stops when the symbol it just wrote is the
target's twin. The walk's length d is drawn from a log-normal clipped to [1, max_len]: most
answers are short, a few run to the maximum, like the response lengths of math RL (APRIL
paper, Figure 3).

The supervised warm-start (`sft_batch`) imitates a sloppy demonstrator: with probability
`overshoot` a demonstration walks one symbol past the target before it stops. At 0.9 the
warm-started policy walks well but stops late: greedy decoding is almost never right
(pass@1 < 0.1) while sampling sometimes stops in time. RL with the reward below learns
from those samples to stop at the target: the tiny config's first run that teaches.

Reward `longtail`: symbols matching the correct answer at the same position, divided by
the longer of the two lengths: exactly 1.0 for the right walk, partial credit below it.

The multi-turn variant (`hide_target`, the tiny_lookup config) leaves the target out of
the prompt (`c:<from>=`): only a lookup tool tells it (envs/lookup.py). The model asks by
ending a turn with ':' alone; the observation is `<to>=`; then it walks. Reward `lookup`
scores the walk after the last '=' as `longtail` does.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from april_jax.data import PromptItem
from april_jax.rewards.registry import register
from april_jax.tokenizer import CharTokenizer
from april_jax.settings.data import TaskSettings

RING = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-"
MAX_RING_SIZE = 1024


@functools.lru_cache(maxsize=8)
def ring(size: int = len(RING)) -> str:
  """The ring's symbols: RING, then Latin-extended and later code points past 64."""
  if not 2 <= size <= MAX_RING_SIZE:
    raise ValueError(f"ring size must be in [2, {MAX_RING_SIZE}], got {size}")
  return (RING + "".join(chr(0x100 + i) for i in range(max(0, size - len(RING)))))[:size]


@functools.lru_cache(maxsize=8)
def targets(size: int = len(RING)) -> str:
  """The target alphabet: symbol i of the ring as the prompt writes its walk's last one."""
  ring(size)  # validates the size
  return "".join(chr(0x1000 + i) for i in range(size))


def tokenizer(ring_size: int = len(RING)) -> CharTokenizer:
  """The task's tokenizer: specials, the ring's symbols, ':' and '=', the targets."""
  return CharTokenizer(ring(ring_size) + ":=" + targets(ring_size))


def longtail_lengths(
    rng: np.random.Generator, size: int, max_len: int, median: float, sigma: float
) -> np.ndarray:
  """Log-normal lengths (median, sigma of the log), rounded and clipped to [1, max_len]."""
  lengths = np.rint(median * np.exp(sigma * rng.standard_normal(size)))
  return np.clip(lengths, 1, max_len).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class LongTailTask:
  max_answer_len: int = 64
  median: float = TaskSettings.median
  sigma: float = TaskSettings.sigma
  ring_size: int = len(RING)
  hide_target: bool = TaskSettings.hide_target  # multi-turn: only the lookup tool tells it

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
    last = targets(self.ring_size)[(start + d - 1) % self.ring_size]
    if self.hide_target:
      return {"id": index, "prompt": f"c:{answer[0]}=", "answer": answer}
    return {"id": index, "prompt": f"c:{answer[0]}{last}=", "answer": answer}

  def prompt_len(self) -> int:
    """Tokens in every prompt."""
    return 4 if self.hide_target else 5


LOOKUP_CALL = ":"  # a turn that is this alone asks the lookup tool for the target


def target_of(answer: str) -> str:
  """The target symbol (second alphabet) of a walk's last symbol, for any ring size."""
  return chr(0x1000 + ring(MAX_RING_SIZE).index(answer[-1]))


def copy_score(response: str, answer: str) -> float:
  if not response and not answer:
    return 1.0
  matches = sum(a == b for a, b in zip(response, answer))
  return matches / max(len(response), len(answer))


@register("longtail")
def longtail_reward(response: str, answer: str) -> float:
  return copy_score(response.strip(), answer)


@register("lookup")
def lookup_reward(response: str, answer: str) -> float:
  """The walk after the episode's last observation (`<to>=`) against the answer."""
  return copy_score(response.rpartition("=")[2].strip(), answer)


def sft_batch(
    task: LongTailTask, tok: CharTokenizer, indices, seed: int, seq_len: int, overshoot: float = 0.0
):
  """Supervised examples (prompt + answer + stop): tokens, targets, loss mask [B, T].

  overshoot: the probability that a demonstration walks one symbol past the target."""
  B = len(indices)
  tokens = np.full((B, seq_len), tok.pad_id, np.int32)
  mask = np.zeros((B, seq_len), np.float32)
  for b, index in enumerate(indices):
    item = task.item(int(index), seed)
    prompt = tok.encode(item["prompt"])
    answer = item["answer"]
    if np.random.default_rng([seed, 1, int(index)]).random() < overshoot:
      symbols = ring(task.ring_size)
      answer += symbols[(symbols.index(answer[-1]) + 1) % task.ring_size]
    call, observation = [], []
    if task.hide_target:  # ask the tool, get the target, then walk
      call = tok.encode(LOOKUP_CALL) + [tok.eos_id]
      observation = tok.encode(target_of(item["answer"]) + "=")
    full = (prompt + call + observation + tok.encode(answer) + [tok.eos_id])[:seq_len]
    tokens[b, : len(full)] = full
    mask[b, len(prompt) - 1 : len(full) - 1] = 1.0  # predict the call, the answer and stop
    given = len(prompt) + len(call)
    mask[b, given - 1 : given - 1 + len(observation)] = 0.0  # the observation is given
  targets = np.roll(tokens, -1, axis=1)
  return tokens, targets, mask


class LongTailSource:
  """The built-in synthetic task as a prompt source: item 0, 1, 2, ... of the stream."""

  def __init__(self, task: LongTailTask, tokenizer, seed: int = 0) -> None:
    self.task, self.tokenizer, self.seed = task, tokenizer, int(seed)
    self.index = 0

  def __call__(self) -> PromptItem:
    item = self.task.item(self.index, self.seed)
    self.index += 1
    tokens = np.asarray(self.tokenizer.encode(item["prompt"]), np.int32)
    return PromptItem(prompt_id=item["id"], tokens=tokens, answer=item["answer"])

  def state(self) -> dict[str, int]:
    return {"index": self.index, "seed": self.seed}

  def restore(self, state: dict) -> None:
    self.index, self.seed = int(state["index"]), int(state["seed"])
