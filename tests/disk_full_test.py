"""A run whose disk fills up stops with one line naming the path and the room needed and
left (status 2), before it writes a checkpoint that cannot fit; the checkpoints and jsonl
files already there stay intact, and a copy of the workdir on a roomier disk resumes and
ends exactly as a run that never stopped."""

import shutil
import subprocess
from pathlib import Path

import pytest

import cli

from april_jax import errors

RUN = [
    "--config.num_steps=2",
    "--config.checkpoint_every=1",
    "--config.train.sft_steps=0",
    "--config.eval_every=0",
]


def _main(workdir, cache):
  return cli.run(
      *RUN,
      f"--config.compilation_cache_dir={cache}",
      config="tiny.py",
      workdir=workdir,
      optimised=False,
  )


def _lines(path):
  return [cli.untimed(l) for l in cli.read_jsonl(path)]


@pytest.fixture
def small_disk(tmp_path):
  """Mounts a tmpfs at tmp_path/small (size set by the caller), unmounted after."""
  mounted = []

  def mount(size_bytes: int) -> Path:
    where = tmp_path / "small"
    where.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes // 1024}k", "tmpfs", str(where)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
      pytest.skip(f"cannot mount a small filesystem here: {proc.stderr.strip()[:200]}")
    mounted.append(where)
    return where

  yield mount
  for where in mounted:
    subprocess.run(["umount", str(where)], check=False)


def test_a_full_disk_stops_in_one_line_and_the_copy_resumes_exactly(tmp_path, small_disk):
  cache = tmp_path / "xla_cache"
  straight = tmp_path / "straight"
  proc = _main(straight, cache)
  assert proc.returncode == 0, proc.stderr[-3000:]
  one = sum(p.stat().st_size for p in (straight / "checkpoints" / "2").rglob("*") if p.is_file())
  # Room for checkpoint 1 and the run's small files, not for checkpoint 2 beside it.
  disk = small_disk(int(one + (1.1 * one + (1 << 20)) / 2 + (200 << 10)))
  workdir = disk / "run"
  proc = _main(workdir, cache)
  assert proc.returncode == 2, proc.stderr[-3000:]
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith(f"april_jax: no room for checkpoint 2 in {workdir / 'checkpoints'}")
  assert "it needs about" in line and "is left" in line and "checkpoint 1 is the newest" in line
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1"]
  assert [l["step"] for l in _lines(workdir / "metrics.jsonl")] == [1]

  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy)
  proc = _main(copy, cache)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "resumed from step 1" in proc.stdout
  assert _lines(copy / "metrics.jsonl") == _lines(straight / "metrics.jsonl")


def test_a_write_that_found_no_room_is_recognised_in_orbax_wrapped_errors():
  assert errors.is_no_space(OSError(28, "No space left on device"))
  wrapped = ValueError(
      'RESOURCE_EXHAUSTED: Error writing "params.embed/0.0" in OCDBT database: Failed to '
      "write 365423 bytes to file 17: No space left on device [os_error_code='28']"
  )
  try:
    raise RuntimeError("save failed") from wrapped
  except RuntimeError as e:
    assert errors.is_no_space(e)
  assert not errors.is_no_space(OSError(13, "Permission denied"))
  assert not errors.is_no_space(ValueError("RESOURCE_EXHAUSTED: out of memory"))


def test_a_disk_too_small_for_the_cache_and_the_logs_is_a_warning_and_one_line(small_disk):
  # The compilation cache lives in the workdir here (the default): its writes fail
  # first, then a jsonl or TensorBoard write, or the room check before checkpoint 1.
  workdir = small_disk(600 << 10) / "run"
  proc = cli.run(*RUN, config="tiny.py", workdir=workdir, optimised=False)
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert "Traceback" not in proc.stderr and len(lines) <= 2, proc.stderr[-3000:]
  if len(lines) == 2:
    assert lines[0].startswith("april_jax: warning: the compilation cache in")
  # Whichever write finds the disk full first: a log's, or the check before a checkpoint.
  assert lines[-1].startswith(
      (
          f"april_jax: no space left on the device writing {workdir}",
          "april_jax: no room for checkpoint",
      )
  ), lines[-1]
  assert not [p for p in (workdir / "checkpoints").glob("*") if "tmp" in p.name]
