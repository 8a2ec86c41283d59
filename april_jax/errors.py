"""Errors in what the user gave: a file, a config field, a flag, a workdir.

`main` prints an InputError as one line naming what is at fault and exits with status 2;
the traceback goes to the log (`--verbosity=1` shows it). Everything else is a bug or a
failure of the machine and keeps its traceback.
"""


class InputError(Exception):
  """Bad input the user can fix; the message names the file, field or flag."""


class InputFileMissing(InputError, FileNotFoundError):
  """A file or folder the config names is not there."""
