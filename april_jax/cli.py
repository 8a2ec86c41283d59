"""How the command lines (`main`, `plan`) report bad input: one line on stderr, naming
the program and the flag, and exit status 2; never a traceback."""

from __future__ import annotations

import sys
from typing import Callable, NoReturn

from absl import flags


def fail(program: str, message: str) -> NoReturn:
  """One line, status 2."""
  print(f"{program}: {'; '.join(message.strip().splitlines())}", file=sys.stderr, flush=True)
  sys.exit(2)


def flags_parser(program: str, module: str) -> Callable[[list[str]], list[str]]:
  """absl's flag parsing for `python -m <module>`, with every error as one line and
  status 2: an unknown flag, a bad value (validators included), a missing required flag,
  a --config file that cannot be loaded or raises, a --config.* override naming no field."""
  die = lambda message: fail(program, message)

  def parse(argv: list[str]) -> list[str]:
    try:
      rest = flags.FLAGS(argv)
      if "config" in flags.FLAGS:
        flags.FLAGS.config.keys()  # a config file that failed to load raises on first use
      return rest
    except flags.Error as e:
      text = str(e)
      if "Traceback (most recent call last)" in text:  # the config file raised: its last line
        lines = [l.strip() for l in text.splitlines() if l.strip()]
        flag = text.split(": Error whilst", 1)[0].removeprefix("flag ")
        die(f"{flag}: the config file failed: {lines[-1]}")
      die(f"{text} (python -m {module} --helpshort lists the flags)")
    except OSError as e:  # the --config file cannot be loaded
      reason = str(e.__cause__ or e).strip().splitlines()[-1].strip()
      die(f"--config: cannot load the config file: {reason}")
    except (KeyError, AttributeError) as e:  # --config.<field> names no field
      die(
          f"a --config.* override names a field the config does not have: {e} (every field "
          "and its default: docs/config.md)"
      )
    except Exception as e:  # pylint: disable=broad-except  # e.g. an error inside the config file
      die(f"--config: the config file failed: {type(e).__name__}: {e}")

  return parse
