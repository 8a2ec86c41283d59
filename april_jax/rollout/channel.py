"""Two ordered streams of messages between a split run's learner process and its rollout
process, through the key-value store of JAX's coordination service (the one
`jax.distributed` starts; docs/async.md).

Message n of a stream is the key `april_jax/<stream>/<n>`; the reader takes the keys in
order and deletes each once read, so the store holds only what is in flight (in process
0's memory, where the service runs). A message over PART_BYTES (a checkpoint's capture
holds the partial buffer's KV) goes in parts under `<key>/<i>`, written before the key
that names how many there are. A peer that dies shows as the store's own error (its
heartbeats stop), which the caller reports.
"""

from __future__ import annotations

import threading

import jax
from jax._src import distributed as jax_distributed  # the coordination service's client

from april_jax.rollout import wire

PART_BYTES = 64 << 20  # well under what one of the service's messages may carry
_PARTS = b"april_jax parts "
TO_ROLLOUT = "to_rollout"
TO_LEARNER = "to_learner"


class Channel:
  """Sends on one stream, receives on the other (a thread may send while another
  receives)."""

  def __init__(self, send_on: str, receive_on: str):
    self._client = jax_distributed.global_state.client
    if self._client is None:
      raise RuntimeError("a split run across processes needs jax.distributed initialized")
    self._send_on, self._receive_on = send_on, receive_on
    self._sent = self._received = 0
    self._lock = threading.Lock()

  def send(self, header: dict, arrays=None) -> None:
    data = wire.encode(header, arrays)
    with self._lock:
      key = f"april_jax/{self._send_on}/{self._sent}"
      if len(data) > PART_BYTES:
        parts = range(0, len(data), PART_BYTES)
        for i, at in enumerate(parts):
          self._client.key_value_set_bytes(f"{key}/{i}", data[at : at + PART_BYTES])
        data = _PARTS + str(len(parts)).encode()
      self._client.key_value_set_bytes(key, data)
      self._sent += 1

  def receive(self, timeout_s: float) -> tuple[dict, dict] | None:
    """The next message, or None when none came within timeout_s."""
    key = f"april_jax/{self._receive_on}/{self._received}"
    try:
      data = self._client.blocking_key_value_get_bytes(key, max(1, int(timeout_s * 1000)))
    except jax.errors.JaxRuntimeError as e:
      if "DEADLINE_EXCEEDED" in str(e) and "GetKeyValue" in str(e):
        return None
      raise
    if data.startswith(_PARTS):
      parts = []
      for i in range(int(data[len(_PARTS) :])):
        parts.append(self._client.blocking_key_value_get_bytes(f"{key}/{i}", 60_000))
        self._client.key_value_delete(f"{key}/{i}")
      data = b"".join(parts)
    self._client.key_value_delete(key)
    self._received += 1
    return wire.decode(data)
