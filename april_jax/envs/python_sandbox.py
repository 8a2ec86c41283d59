"""The child side of the Python tool (python_tool.py): it runs the model's code.

python_tool.run_python starts a fresh interpreter on the child's source,
`python -I -c <source> <settings JSON>`: sandbox_confine.py's source, then this file's
(kernel_isolation.runner_source), in its working folder (under kernel isolation,
kernel_isolation.py, inside a sandbox of namespaces). The child reads the code from its
stdin, then, before any of it runs:

  * confines itself by the kernel (sandbox_confine.py): under kernel isolation its scratch
    folder, bounded in bytes and inodes, with every capability dropped after (status 4
    if it cannot be made); its one thread, which ends it when its caller's end of a pipe
    closes; rlimits; a seccomp filter on every thread that refuses new processes and
    threads, sockets, signals to others, mounts and namespaces and what draws on budgets
    the whole host shares (under `seccomp: "required"`, status 3 if it cannot load). One
    call adds a fixed number of tasks to the host, whatever the code does;
  * takes away what math code has no use for and no audit event covers: fork_exec of
    `_posixsubprocess`, mkfifo, mknod, memfd_create, pidfd_open and pidfd_send_signal;
  * installs an audit hook (sys.addaudithook, which cannot be removed) that refuses, with
    a PermissionError naming the event: sockets, new processes (subprocess, os.system,
    os.exec*, os.fork*, os.posix_spawn*), ctypes, signals to other processes, changing
    directory, links, chmod/chown, rlimits, tracing, gc's object lists, subinterpreters,
    a fresh import of the modules disarmed here; reading a frame (tb_frame, gi_frame,
    ...) anywhere but in _frame_entries, and replacing a function's code, so that the
    hook's own objects are harder to reach (not out of reach: code that corrupts its own
    interpreter's memory, through numpy's raw buffers say, gets past any hook, which is
    why the kernel is the barrier); any write, remove, rename or mkdir outside the
    working folder, or more than MAX_FILES_WRITTEN files and folders made or written; any
    read outside it but Python's own stdlib and site-packages; opening a directory
    outside it, or a device other than /dev/null, /dev/zero and /dev/urandom.

It then runs the code as `__main__` (a fresh module in sys.modules: the child's own
module, and the hook's objects with it, are not reachable from there) and, like a
notebook, prints the repr of a last expression when nothing else was printed. An
exception becomes the last lines of its traceback on stderr (the runner's own frames left
out) and exit status 1; a MemoryError one line naming the memory limit.

The hook checks paths with functions bound before the model's code runs (posix.lstat,
posix.readlink, ...), never with os.path or builtins the code could rebind, and it calls
no method of an argument that is not a plain str, bytes or int, so no model code runs
inside the hook. The child imports nothing of the package: it runs alone.
"""

import _stat
import ast
import builtins
import errno
import io
import itertools
import json
import linecache
import os
import posix
import signal
import sys
import traceback
import types

if __name__ != "__main__":  # imported as a module; as the child, these names come before
  from april_jax.envs.sandbox_confine import (  # pylint: disable=g-import-not-at-top
      SCRATCH_FAILED_EXIT,
      SECCOMP_FAILED_EXIT,
      confine_syscalls,
      die_with_parent,
      end_with_caller,
      limit_resources,
      make_scratch,
  )

CODE_FILENAME = "<code>"  # the model's code, as tracebacks name it
TRACEBACK_LINES = 20  # the last lines of a traceback kept
LINE_CHARS = 300  # a traceback line longer than this is cut
MAX_FILES_WRITTEN = 64  # opens for writing, each file at most the file size limit
READABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
WRITABLE_DEVICES = ("/dev/null",)

REFUSED_EVENTS = frozenset({
    "os.system", "os.kill", "os.killpg", "signal.pthread_kill", "os.chdir", "os.link",
    "os.symlink", "os.chmod", "os.chown", "os.chflags", "os.lchflags", "os.setxattr",
    "os.removexattr", "resource.setrlimit", "resource.prlimit", "sys.settrace",
    "sys.setprofile", "sys._current_frames", "gc.get_objects", "gc.get_referrers",
    "gc.get_referents", "cpython.PyInterpreterState_New",
})  # fmt: skip
REFUSED_PREFIXES = (
    "socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
)  # fmt: skip
# Modules loaded (and disarmed) before the hook: a fresh import of one would undo that.
REFUSED_IMPORTS = frozenset({
    "os", "posix", "signal", "_signal", "_posixsubprocess", "ctypes", "_ctypes", "resource",
    "_posixshmem", "gc",
})  # fmt: skip
REFUSED_IMPORT_PREFIXES = ("_test", "_xx")  # CPython's test modules and subinterpreters
# Events that change the file system: (positions of paths, positions of dir_fd).
CHANGES = {
    "os.remove": ((0,), (1,)),
    "os.rmdir": ((0,), (1,)),
    "os.mkdir": ((0,), (2,)),
    "os.rename": ((0, 1), (2, 3)),
    "os.utime": ((0,), (3,)),
    "os.truncate": ((0,), ()),
}
LISTINGS = ("os.listdir", "os.scandir")
# Frames (and through them the hook's own objects) are read by format_error's code alone;
# functions' code is never replaced.
FRAME_READS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
CODE_WRITES = frozenset({"__code__"})
RUNNER_FILENAME = "<string>"  # this file's, run with -c
SOURCE_BYTES = 1 << 20  # of a file a traceback line is read from
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _refused(name: str):
  def refuse(*args, **kwargs):
    raise PermissionError(f"{name} is not allowed here")

  return refuse


def disarm_modules() -> None:
  """Loads the modules whose import the hook would refuse or that reach past it, and
  takes away what no audit event covers."""
  import _posixsubprocess  # pylint: disable=g-import-not-at-top
  import _signal  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top,unused-import

  _posixsubprocess.fork_exec = _refused("_posixsubprocess.fork_exec")
  for module, names in (
      (os, ("mkfifo", "mknod", "pidfd_open", "memfd_create")),
      (posix, ("mkfifo", "mknod", "pidfd_open", "memfd_create")),
      (signal, ("pidfd_send_signal",)),
      (_signal, ("pidfd_send_signal",)),
  ):
    for name in names:
      if hasattr(module, name):
        delattr(module, name)


def python_roots() -> tuple[str, ...]:
  """The folders of sys.path inside Python's own prefixes (stdlib, lib-dynload,
  site-packages): the code may read there. sys.path keeps only these."""
  prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
  prefixes |= {os.path.realpath(sys.base_exec_prefix)}
  roots = []
  for entry in sys.path:
    real = os.path.realpath(entry) if entry else ""
    if real and any(real == p or real.startswith(p.rstrip("/") + "/") for p in prefixes):
      roots.append(real)
  sys.path[:] = roots
  return tuple(roots)


def _path_tools():
  """text (a path argument as a str), resolve (os.path.realpath), under and mode_of, made
  of objects bound now."""
  lstat, stat, readlink, getcwd = posix.lstat, posix.stat, posix.readlink, posix.getcwd
  is_link, kind, str_, bytes_ = _stat.S_ISLNK, type, str, bytes
  failure, refused = (OSError, ValueError), PermissionError

  def text(path, event):
    if kind(path) is str_:
      return path
    if kind(path) is bytes_:
      return path.decode("utf-8", "surrogateescape")
    raise refused(f"{event}: refused (a path that is not a str)")

  def resolve(path):  # os.path.realpath, from the bound functions only
    pending = ((path if path.startswith("/") else getcwd() + "/" + path).split("/"))[::-1]
    parts, links = [], 0
    while pending:
      part = pending.pop()
      if part in ("", "."):
        continue
      if part == "..":
        parts = parts[:-1]
        continue
      here = "/" + "/".join(parts + [part])
      try:
        mode = lstat(here).st_mode
      except failure:
        mode = 0
      if not is_link(mode):
        parts.append(part)
        continue
      links += 1
      if links > 40:
        raise refused(f"{path}: too many symbolic links")
      target = readlink(here)
      parts = [] if target.startswith("/") else parts
      pending.extend(target.split("/")[::-1])
    return "/" + "/".join(parts)

  def under(path, roots):
    for root in roots:
      if path == root or path.startswith(root.rstrip("/") + "/"):
        return True
    return False

  def mode_of(path):
    try:
      return stat(path).st_mode
    except failure:
      return 0

  return text, resolve, under, mode_of


def _path_rules(work: str, read_roots: tuple[str, ...]):
  """check_open, check_listing and check_change for the hook, made of objects bound now."""
  text, resolve, under, mode_of = _path_tools()
  is_dir, is_char, is_block = _stat.S_ISDIR, _stat.S_ISCHR, _stat.S_ISBLK
  kind, str_, int_, len_, next_, refused = type, str, int, len, next, PermissionError
  write_flags, max_written = WRITE_FLAGS, MAX_FILES_WRITTEN
  readable, writable = READABLE_DEVICES, WRITABLE_DEVICES
  writes = itertools.count()

  def check_open(path, mode, flags):
    if kind(path) is int_:
      return  # a file already open
    real = resolve(text(path, "open"))
    writing = kind(mode) is str_ and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
    writing = writing or (kind(flags) is int_ and flags & write_flags)
    st_mode, inside = mode_of(real), under(real, (work,))
    if (is_char(st_mode) or is_block(st_mode)) and real not in readable:
      raise refused(f"open {path!r}: refused (a device)")
    if writing and not (inside or real in writable):
      raise refused(f"open {path!r} for writing: refused (outside the working folder)")
    if writing and next_(writes) >= max_written:
      raise refused(f"open {path!r} for writing: refused (over {max_written} files)")
    if not inside and is_dir(st_mode):
      raise refused(f"open {path!r}: refused (a directory outside the working folder)")
    if not (inside or under(real, read_roots) or real in readable):
      raise refused(f"open {path!r}: refused (outside the working folder)")

  def check_listing(path, event):
    if kind(path) is int_:
      return
    real = resolve("." if path is None else text(path, event))
    if not under(real, (work,) + read_roots):
      raise refused(f"{event} {path!r}: refused (outside the working folder)")

  def check_change(event, args, paths, dir_fds):
    for i in dir_fds:
      if i < len_(args) and not (args[i] is None or (kind(args[i]) is int_ and args[i] < 0)):
        raise refused(f"{event} with dir_fd: refused")
    for i in paths:
      if event in ("os.truncate", "os.utime") and kind(args[i]) is int_:
        continue  # a file already open
      if not under(resolve(text(args[i], event)), (work,)):
        raise refused(f"{event} {args[i]!r}: refused (outside the working folder)")
    if event == "os.mkdir" and next_(writes) >= max_written:  # folders count as files
      raise refused(f"{event} {args[0]!r}: refused (over {max_written} files)")

  return check_open, check_listing, check_change


def make_hook(work: str, read_roots: tuple[str, ...], formatter_code):
  """The audit hook: refuses what the module docstring lists. Frames are read by
  `formatter_code` (_frame_entries's), run with this module's globals, alone."""
  check_open, check_listing, check_change = _path_rules(work, read_roots)
  kind, str_, len_, refused = type, str, len, PermissionError
  # Copies of the module's constants, strings included, held by the hook alone: the
  # module's own (reachable from a frame's globals) are not the ones it reads.
  copy = lambda names: tuple("".join(list(name)) for name in names)
  events, prefixes = frozenset(copy(REFUSED_EVENTS)), copy(REFUSED_PREFIXES)
  imports, import_prefixes = frozenset(copy(REFUSED_IMPORTS)), copy(REFUSED_IMPORT_PREFIXES)
  listings, changes = copy(LISTINGS), {e: v for e, v in zip(copy(CHANGES), CHANGES.values())}
  frame_reads, code_writes = frozenset(copy(FRAME_READS)), frozenset(copy(CODE_WRITES))
  caller = sys._getframe
  runner_globals = globals()

  def hook(event, args):
    if event == "object.__getattr__":
      if args[1] in frame_reads:
        reader = caller(1)
        if reader.f_code is not formatter_code or reader.f_globals is not runner_globals:
          raise refused(f"reading a frame ({args[1]}) is not allowed here")
    elif event == "object.__setattr__":
      if args[1] in code_writes:
        raise refused(f"setting a function's {args[1]} is not allowed here")
    elif event == "open":
      n = len_(args)
      check_open(args[0], args[1] if n > 1 else None, args[2] if n > 2 else 0)
    elif event in events or event.startswith(prefixes):
      raise refused(f"{event} is not allowed here")
    elif event == "import":
      name = args[0]
      if kind(name) is not str_ or name in imports:
        raise refused(f"import {name if kind(name) is str_ else '?'}: not allowed here")
      if name.startswith(import_prefixes):
        raise refused(f"import {name}: not allowed here")
    elif event in listings:
      check_listing(args[0] if args else None, event)
    elif event in changes:
      check_change(event, args, *changes[event])

  return hook


def _stdout_is_empty() -> bool:
  try:
    sys.stdout.flush()
    return os.fstat(1).st_size == 0
  except Exception:  # pylint: disable=broad-except  # stdout closed or replaced
    return False


def _source_reader(code: str):
  """line(filename, number): the source line a traceback shows; the model's code from its
  own text, any other file through a bound open (the hook decides what it may read), at
  most SOURCE_BYTES of it. Nothing here calls what the model's code can replace."""
  code_lines, open_, stat, is_regular = code.splitlines(), io.open, posix.stat, _stat.S_ISREG
  limit, failure = SOURCE_BYTES, (OSError, ValueError)

  def line(filename, number):
    if filename == CODE_FILENAME:
      return code_lines[number - 1].strip() if 0 < number <= len(code_lines) else ""
    try:
      if not is_regular(stat(filename).st_mode):
        return ""
      with open_(filename, "rb") as f:
        text = f.read(limit).decode("utf-8", "replace").splitlines()
    except failure:
      return ""
    return text[number - 1].strip() if 0 < number <= len(text) else ""

  return line


def _make_frame_entries():
  """frame_entries(tb): (file, line, function) of each frame of a real traceback. The one
  code that may read frames (the hook checks): it keeps their names and numbers only, and
  calls nothing the model's code could have replaced while it holds one."""
  traceback_type, kind = types.TracebackType, type

  def frame_entries(tb):
    entries = []
    while kind(tb) is traceback_type:
      code = tb.tb_frame.f_code
      entries.append((code.co_filename, tb.tb_lineno, code.co_name))
      tb = tb.tb_next
    return entries

  return frame_entries


_frame_entries = _make_frame_entries()


def format_error(error: BaseException, source_line) -> str:
  """The traceback's last lines, from the model's code on, without the runner's own
  frames (the hook's among them); each line at most LINE_CHARS."""
  tb = error.__traceback__
  # Its own lines only: an exception it was raised during would be formatted with frames.
  error.__cause__, error.__context__, error.__suppress_context__ = None, None, True
  try:
    message = traceback.format_exception_only(type(error), error)
  except Exception:  # pylint: disable=broad-except  # its __str__ raised, say
    message = [f"{type(error).__name__}\n"]
  entries = _frame_entries(tb)
  first = next((i for i, entry in enumerate(entries) if entry[0] == CODE_FILENAME), None)
  entries = [] if first is None else [e for e in entries[first:] if e[0] != RUNNER_FILENAME]
  lines = ["Traceback (most recent call last):\n"] if entries else []
  for filename, number, name in entries:
    lines.append(f'  File "{filename}", line {number}, in {name}\n')
    source = source_line(filename, number)
    if source:
      lines.append(f"    {source}\n")
  lines = "".join(lines + message).splitlines()
  lines = [line if len(line) <= LINE_CHARS else line[:LINE_CHARS] + " ..." for line in lines]
  if len(lines) > TRACEBACK_LINES:
    lines = [lines[0], "  ...", *lines[-(TRACEBACK_LINES - 2) :]]
  return "\n".join(lines) + "\n"


def run(code: str, memory_mb: int, max_file_mb: int) -> int:
  """Runs the code as __main__: 0, or 1 with the error written to stderr."""
  source_line = _source_reader(code)
  out_of_memory = f"error: MemoryError: ran past the {memory_mb} MB memory limit\n".encode()
  file_too_big = f"error: a file (or stdout) ran past the {max_file_mb} MB size limit\n"
  write_error = os.write
  # The code's own __main__: this file's module leaves sys.modules, so the hook's objects
  # and the runner's globals are not reachable by name from the code.
  main_module = types.ModuleType("__main__")
  sys.modules["__main__"] = main_module
  namespace = vars(main_module)
  namespace["__builtins__"] = builtins
  linecache.cache[CODE_FILENAME] = (len(code), None, code.splitlines(True), CODE_FILENAME)
  try:
    tree = ast.parse(code, CODE_FILENAME)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, CODE_FILENAME, "exec"), namespace)  # pylint: disable=exec-used
    if last is not None:
      value = eval(compile(ast.Expression(last.value), CODE_FILENAME, "eval"), namespace)
      if value is not None and _stdout_is_empty():
        print(repr(value))
  except MemoryError:
    namespace.clear()
    write_error(2, out_of_memory)
    return 1
  except SystemExit as e:
    if e.code is None or e.code == 0:
      return 0
    write_error(2, f"error: the code called sys.exit({e.code!r})\n".encode())
    return 1
  except BaseException as e:  # pylint: disable=broad-except
    too_big = isinstance(e, OSError) and e.errno == errno.EFBIG
    shown = file_too_big if too_big else format_error(e, source_line)
    write_error(2, shown.encode("utf-8", "replace"))
    return 1
  return 0


def main() -> None:
  settings = json.loads(sys.argv[1])
  die_with_parent()
  code = sys.stdin.buffer.read().decode("utf-8", "replace")
  null = os.open(os.devnull, os.O_RDONLY)  # the code reads an empty stdin
  os.dup2(null, 0)
  os.close(null)
  if settings.get("scratch"):
    why = make_scratch(settings["scratch"])
    if why is not None:
      os.write(2, f"error: the sandbox's scratch folder could not be made: {why}\n".encode())
      os._exit(SCRATCH_FAILED_EXIT)  # pylint: disable=protected-access
  # The one thread, started with no capability left; the filter below covers it too
  # (capabilities and filters are a thread's own).
  end_with_caller(settings.get("lifeline_fd"))
  limit_resources(settings)
  if settings.get("seccomp"):
    why = confine_syscalls()
    if why is not None and settings["seccomp"] == "required":
      os.write(2, f"error: the sandbox's seccomp filter did not load: {why}\n".encode())
      os._exit(SECCOMP_FAILED_EXIT)  # pylint: disable=protected-access
  disarm_modules()
  read_roots = python_roots()
  sys.dont_write_bytecode = True
  sys.argv = [CODE_FILENAME]
  sys.stdout.reconfigure(line_buffering=True)  # what was printed survives a kill
  if settings.get("audit_hook", True):
    work = os.path.realpath(settings["work_dir"])
    sys.addaudithook(make_hook(work, read_roots, _frame_entries.__code__))
  exit_now = os._exit
  status = run(code, settings["memory_mb"], settings["max_file_mb"])
  try:
    sys.stdout.flush()
  except Exception:  # pylint: disable=broad-except  # e.g. past the file size limit
    pass
  exit_now(status)


if __name__ == "__main__":
  main()
