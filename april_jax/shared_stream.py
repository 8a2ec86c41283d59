"""The prompt stream of a multi-host run: each process reads its share, all see one order.

Process p of P takes positions p, p + P, p + 2P, ... of the dataset's (shuffled) order, or
of the built-in task's stream, and tokenizes only those. Whenever the scheduler wants a
prompt and none is queued, every process contributes its next prompt and they are
exchanged (an all-gather of the encoded items), so each process queues the same P
prompts in process order: the same stream, item for item, as one process reading
everything when no prompt is skipped and the record count divides by the process count
(otherwise shards end their epochs at different exchanges: the order differs from one
process's, but is still the same on every process). The scheduler calls the source at the same
points on every process, as the exchange needs.

The checkpointed state holds every process's own position and the queued prompts, so a
restart with the same number of processes continues exactly.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np

from april_jax.distributed import gather
from april_jax.rollout.scheduler import PromptItem


def encode_item(item: PromptItem | None) -> bytes:
  if item is None:
    return b"null"
  return json.dumps({"id": item.prompt_id, "tokens": item.tokens.tolist(),
                     "answer": item.answer, "budgets": item.budgets}).encode("utf-8")


def decode_item(data: bytes) -> PromptItem | None:
  d = json.loads(data.decode("utf-8"))
  if d is None:
    return None
  return PromptItem(prompt_id=d["id"], tokens=np.asarray(d["tokens"], np.int32),
                    answer=d["answer"], budgets=d.get("budgets"))


def allgather_bytes(data: bytes) -> list[bytes]:
  """Every process's bytes, in process order (two all-gathers: lengths, then payloads)."""
  lengths = gather(np.array([len(data)], np.int32)).reshape(-1)
  # Payload sizes rounded up to a power of two: each new shape compiles a gather.
  padded = np.zeros(1 << int(max(int(lengths.max()), 1) - 1).bit_length(), np.uint8)
  padded[:len(data)] = np.frombuffer(data, np.uint8)
  rows = gather(padded).reshape(len(lengths), -1)
  return [rows[i, :n].tobytes() for i, n in enumerate(lengths)]


class SharedPromptStream:
  """One prompt stream for all processes, built from each process's shard."""

  def __init__(self, local: Any, process_index: int, process_count: int,
               gather: Callable[[bytes], list[bytes]] = allgather_bytes) -> None:
    """Initializes the stream.

    Args:
      local: This process's shard: a callable source with state() / restore().
      process_index: This process.
      process_count: Processes in the run.
      gather: The exchange (bytes of each process, in process order); a collective.
    """
    self.local, self.index, self.count, self._gather = local, process_index, process_count, gather
    self._queue: list[PromptItem] = []

  def __call__(self) -> PromptItem:
    """The stream's next prompt (collective when the queue is empty).

    Raises:
      ValueError: If no process has a prompt left that fits.
    """
    if not self._queue:
      try:
        mine = self.local()
      except ValueError:  # this shard holds no prompt that fits; the others may
        mine = None
      items = [decode_item(b) for b in self._gather(encode_item(mine))]
      self._queue = [item for item in items if item is not None]
      if not self._queue:
        raise ValueError("No process has a prompt that fits max_prompt_len")
    return self._queue.pop(0)

  def state(self) -> dict[str, Any]:
    """Every process's position and the queued prompts (collective); JSON-serialisable."""
    states = self._gather(json.dumps(self.local.state()).encode("utf-8"))
    return {"processes": [json.loads(s.decode("utf-8")) for s in states],
            "queue": [encode_item(item).decode("utf-8") for item in self._queue]}

  def restore(self, state: dict[str, Any]) -> None:
    """Continues from `state()`.

    Raises:
      ValueError: If the state was saved by a different number of processes.
    """
    if "processes" not in state:
      raise ValueError("the prompt position was saved by a single-process run; resume it "
                       f"with one process, not {self.count}")
    if len(state["processes"]) != self.count:
      raise ValueError(f"the prompt position was saved by {len(state['processes'])} "
                       f"processes; resume with that many, not {self.count}")
    self.local.restore(state["processes"][self.index])
    self._queue = [decode_item(s.encode("utf-8")) for s in state["queue"]]
