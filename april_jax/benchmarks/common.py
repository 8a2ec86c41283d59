"""Small helpers shared by the benchmark modes: timing, machine facts, JSON output."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Any, Callable

import jax


def machine() -> dict[str, Any]:
  return {"platform": jax.default_backend(), "devices": len(jax.devices()),
          "device_kind": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
          "python": platform.python_version(), "jax": jax.__version__}


def best_of(repeats: int, fn: Callable[[], Any]) -> tuple[float, Any]:
  """Runs fn `repeats` times; returns the fastest wall time and the last result."""
  best, out = float("inf"), None
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - start)
  return best, out


def emit(result: dict[str, Any]) -> None:
  """The last stdout line of every mode: one JSON object."""
  print(json.dumps(result, sort_keys=True), flush=True)
