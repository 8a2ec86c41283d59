"""Errors in what the user gave: a file, a config field, a flag, a workdir.

`main` prints an InputError as one line naming what is at fault and exits with status 2;
the traceback goes to the log (`--verbosity=1` shows it). Everything else is a bug or a
failure of the machine and keeps its traceback.
"""

import os


class InputError(Exception):
  """Bad input the user can fix; the message names the file, field or flag."""


class InputFileMissing(InputError, FileNotFoundError):
  """A file or folder the config names is not there."""


class FastPathFailed(InputError):
  """A fast path the config names (model.attention=cudnn, rollout.decode_attention=pallas)
  failed its start-up check on this device (models/path_check.py); the message names the
  setting, the path and what failed."""


class DiskFull(InputError):
  """A write of the run's files found no room; the message names the path and the room."""


# What a write that failed for space says, in an OSError or in Orbax's wrapped errors.
NO_SPACE_ERRNOS = (28, 122)  # ENOSPC, EDQUOT
NO_SPACE_TEXTS = ("No space left on device", "Disk quota exceeded", "os_error_code='28'")


def _chain(error: BaseException | None):
  """`error` and the errors it was raised from, outermost first."""
  while error is not None:
    yield error
    error = error.__cause__ or error.__context__


def is_no_space(error: BaseException | None) -> bool:
  """True if `error`, or an error it was raised from, is a write that found no room."""
  return any(
      (isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS)
      or any(text in str(e) for text in NO_SPACE_TEXTS)
      for e in _chain(error)
  )


# What an allocation that found no room says (XLA's "RESOURCE_EXHAUSTED: Out of memory
# while trying to allocate ..."); other RESOURCE_EXHAUSTED errors are files or quotas.
OUT_OF_MEMORY_TEXTS = (
    "Out of memory while trying to allocate",
    "RESOURCE_EXHAUSTED: Out of memory",
)
OUT_OF_FILES_ERRNOS = (23, 24, 122)  # ENFILE, EMFILE, EDQUOT


def is_out_of_memory(error: BaseException | None) -> bool:
  """True if `error`, or an error it was raised from, is an allocation that found no room
  (host or device): a failure of the machine's size, not of the files being read."""
  return any(
      isinstance(e, MemoryError) or any(text in str(e) for text in OUT_OF_MEMORY_TEXTS)
      for e in _chain(error)
  )


def is_out_of_resources(error: BaseException | None) -> bool:
  """True if `error`, or an error it was raised from, is the machine running short (memory,
  open files, a quota; RESOURCE_EXHAUSTED), not something wrong in what was read."""
  return is_out_of_memory(error) or any(
      "RESOURCE_EXHAUSTED" in str(e) or (isinstance(e, OSError) and e.errno in OUT_OF_FILES_ERRNOS)
      for e in _chain(error)
  )


def disk_full(path: str) -> DiskFull:
  """The DiskFull for a write into `path` that found no room, with the room left."""
  import shutil  # pylint: disable=g-import-not-at-top

  try:
    free = f"{shutil.disk_usage(path if os.path.isdir(path) else os.path.dirname(path) or '.').free / 1e6:.1f} MB left"
  except OSError:
    free = "the room left unknown"
  return DiskFull(
      f"no space left on the device writing {path} ({free}); the newest committed "
      "checkpoint is intact: free some space and rerun the same command to resume"
  )


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _library_file(path: str) -> bool:
  """True for a file of this package, of Python itself or of an installed package."""
  import sysconfig  # pylint: disable=g-import-not-at-top

  path = os.path.abspath(path)
  if path.startswith(_PACKAGE + os.sep) or path.startswith("<"):
    return True
  roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
  return "site-packages" in path.split(os.sep) or any(path.startswith(r + os.sep) for r in roots)


def describe(error: BaseException) -> str:
  """One line for an error raised by a user's code: its type, its text and where in the
  user's own files it was raised ("ValueError: boom (my_reward.py:3)"), the innermost
  frame outside this package, Python and installed packages; no place when there is none
  (the message then names the problem itself)."""
  import traceback  # pylint: disable=g-import-not-at-top

  text = " ".join(str(error).split())[:300]
  line = f"{type(error).__name__}: {text}" if text else type(error).__name__
  frames = [f for f in traceback.extract_tb(error.__traceback__) if not _library_file(f.filename)]
  if frames:
    line += f" ({frames[-1].filename}:{frames[-1].lineno})"
  return line


# Orbax's read errors quote TensorStore's spec through a bound method's repr, hundreds
# of characters that say nothing; the cause it was raised from names the file and bytes.
_NOISE = (" See full TensorStore details:",)


def cause_line(error: BaseException) -> str:
  """One line for a library's error: its type and first line (cut before known noise),
  and the innermost error it was raised from, which usually names the file at fault."""

  def first(e: BaseException, limit: int) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    for noise in _NOISE:
      text = text.split(noise)[0]
    text = text.strip()
    return f"{type(e).__name__}: {text[:limit]}" if text else type(e).__name__

  chain = list(_chain(error))
  line = first(chain[0], 200)
  if len(chain) > 1:
    line += f" (from {first(chain[-1], 300)})"
  return line
