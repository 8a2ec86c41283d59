"""The command line in a subprocess, as the tests start it: `python -m april_jax.main` (or
another of april_jax's programs) from the repository root, on CPU devices of its own; and
the jsonl files a run writes."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# The subprocesses' XLA_FLAGS: one CPU device, or `devices` (None: this process's flags,
# conftest.py's 8 devices). The runs of the tiny config share their compiled programs
# through the session's cache (conftest.py) with the first run that teaches (main_test.py,
# 20 steps: there running dominates, so it keeps XLA's optimisations). Runs with programs
# of their own (their own cache, model or shapes) and a few steps are mostly compiling, so
# they turn the optimisations off (`optimised=False`), as conftest.py does for the tests
# (a full disk's three runs: 49 s -> 32 s).
_DEVICES = "--xla_force_host_platform_device_count={} --xla_cpu_use_fusion_emitters=false"
_UNOPTIMISED = " --xla_backend_optimization_level=0"


def launch(
    *flags: str,
    config: str | None = None,
    workdir: str | os.PathLike | None = None,
    module: str = "april_jax.main",
    preload: str | None = None,
    devices: int | None = 1,
    optimised: bool = True,
    env: Mapping[str, str] | None = None,
    **popen: Any,
) -> subprocess.Popen:
  """Starts `python -m <module> --config=configs/<config> --workdir=<workdir> <flags>`
  from the repository root (no --config or --workdir where not given), its stdout and
  stderr piped as text; the caller waits, signals or kills it.

  preload: a module of tests/ imported before main runs (a reward it registers, or code it
  patches): the run starts from `python -c` then, with tests/ on PYTHONPATH (its workers
  import from there too). devices, optimised: its XLA_FLAGS (above). env: variables set
  over os.environ's. popen: more of subprocess.Popen's arguments (start_new_session=True).
  """
  command = [sys.executable, "-m", module]
  variables = dict(os.environ)
  if preload is not None:
    if module != "april_jax.main":
      raise ValueError(f"preload runs april_jax.main, not {module}")
    command[1:] = [
        "-c",
        f"import {preload}; from absl import app; from april_jax import main; "
        "app.run(main.main, flags_parser=main._parse_flags)",
    ]
    tests = str(ROOT / "tests")
    variables["PYTHONPATH"] = os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])
  if config is not None:
    command.append(f"--config=configs/{config}")
  if workdir is not None:
    command.append(f"--workdir={workdir}")
  variables["JAX_ENABLE_COMPILATION_CACHE"] = "true"  # conftest.py: the runs share it
  if devices is not None:
    variables["XLA_FLAGS"] = _DEVICES.format(devices) + ("" if optimised else _UNOPTIMISED)
  variables.update(env or {})
  return subprocess.Popen(
      [*command, *flags],
      cwd=ROOT,
      env=variables,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      **popen,
  )


def run(*flags: str, timeout: float = 600, **options: Any) -> subprocess.CompletedProcess:
  """launch(*flags, **options) to its end: its exit status and output, never raising for
  the status; past `timeout` seconds it is killed and subprocess.TimeoutExpired raised."""
  with launch(*flags, **options) as proc:
    try:
      out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.communicate()
      raise
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_beside_a_killed_one(
    flags: list[str],
    config: str,
    straight,
    killed,
    checkpoint: int,
    timeout: float = 600,
    **options: Any,
) -> None:
  """Runs `flags` to its end in workdir `straight` and, alongside (two cores: each
  compiles mostly on one), in `killed` until its checkpoint `checkpoint` is written,
  then SIGKILLs that one. Asserts the uninterrupted run succeeded. options: launch's."""
  uninterrupted = launch(*flags, config=config, workdir=straight, **options)
  try:
    proc = launch(*flags, config=config, workdir=killed, **options)
    ckpt = Path(killed) / "checkpoints" / str(checkpoint)
    deadline = time.monotonic() + timeout
    while not ckpt.is_dir() and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    assert ckpt.is_dir(), f"no checkpoint {checkpoint} within {timeout} s"
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    _, err = uninterrupted.communicate(timeout=timeout)
  finally:
    uninterrupted.kill()  # a no-op once it has ended
  assert uninterrupted.returncode == 0, err[-3000:]


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  """The JSON lines of a run's metrics.jsonl or rollouts.jsonl (blank lines skipped)."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def timing(key: str) -> bool:
  """Whether a metric is a time or a rate (time/..., ..._per_s), or how the rollout's
  thread met the learner's (async/...: waits, and when weights were taken): numbers two
  runs of one seed need not agree on."""
  return key.startswith(("time/", "async/")) or key.endswith("_per_s")


def untimed(line: dict) -> dict:
  """A metrics line without its times and rates (timing)."""
  return {k: v for k, v in line.items() if not timing(k)}
