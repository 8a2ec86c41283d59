"""Messages between the processes of a split run (the learner on some, the rollout on
others; docs/async.md): a JSON header and named numpy arrays, as bytes, without pickle.

A batch of groups travels in the checkpoint's own format for drawn batches
(rollout/in_flight.py), so what crosses processes is exactly what a checkpoint keeps and
a resume trains.
"""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np

from april_jax.rollout import in_flight
from april_jax.rollout.scheduler import RolloutResult

_HEADER = "__header__"


def encode(header: dict, arrays: dict[str, np.ndarray] | None = None) -> bytes:
  out = io.BytesIO()
  text = np.frombuffer(json.dumps(header).encode(), np.uint8)
  np.savez(out, **{_HEADER: text}, **(arrays or {}))
  return out.getvalue()


def decode(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
  with np.load(io.BytesIO(data), allow_pickle=False) as z:
    arrays = {k: z[k] for k in z.files}
  header = json.loads(arrays.pop(_HEADER).tobytes().decode())
  return header, arrays


def batch_message(result: RolloutResult) -> tuple[dict, dict[str, np.ndarray]]:
  """A drawn batch (or the cut one) as (header fields, arrays)."""
  arrays, (described,) = in_flight.to_state([result])
  return {"batch": described, "cut": bool(result.cut)}, arrays


def batch_of(header: dict, arrays: dict[str, np.ndarray]) -> RolloutResult:
  _, (result,) = in_flight.from_state(arrays, [header["batch"]])
  return dataclasses.replace(result, cut=bool(header["cut"]))
