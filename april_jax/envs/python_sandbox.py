"""The child side of the Python tool (python_tool.py): it runs the model's code.

python_tool.run_python starts a fresh interpreter with this file's source,
`python -I -c <source> <settings JSON>`, in its working folder (under kernel isolation,
kernel_isolation.py, inside a sandbox of namespaces). The child reads the code from its
stdin, then, before any of it runs:

  * dies with its caller (PR_SET_PDEATHSIG), limits itself (setrlimit, soft and hard):
    address space, CPU seconds, the size of any file it writes (its stdout included),
    open files, no new processes, no core dumps;
  * loads a seccomp filter (libseccomp, through ctypes) that refuses, with EPERM, the system
    calls math code never needs: new processes and programs (fork, vfork, clone without
    CLONE_THREAD, execve), sockets of every family, ptrace and process_vm_*, kill, mounts
    and namespaces, bpf, keyrings, io_uring, perf events, userfaultfd, kernel modules and
    the like (clone3 answers ENOSYS, so that threads fall back to clone, whose flags the
    filter can read). It binds every later line of the process, C code included. Under
    `seccomp: "required"` a filter that cannot load ends the child (status 3);
  * takes away what math code has no use for and no audit event covers: fork_exec of
    `_posixsubprocess`, mkfifo, mknod, memfd_create, pidfd_open and pidfd_send_signal;
  * installs an audit hook (sys.addaudithook, which cannot be removed) that refuses, with a
    PermissionError naming the event: sockets, new processes (subprocess, os.system,
    os.exec*, os.fork*, os.posix_spawn*), ctypes, signals to other processes, changing
    directory, links, chmod/chown, rlimits, tracing, gc's object lists, subinterpreters,
    a fresh import of the modules disarmed here; any write, remove, rename or mkdir outside
    the working folder, or more than MAX_FILES_WRITTEN files and folders made or written; any read outside it
    but Python's own stdlib and site-packages; opening a directory outside it, or a device
    other than /dev/null, /dev/zero and /dev/urandom.

It then runs the code as `__main__` and, like a notebook, prints the repr of a last
expression when nothing else was printed. An exception becomes the last lines of its
traceback on stderr (the runner's own frames left out) and exit status 1; a MemoryError
one line naming the memory limit.

The hook checks paths with functions bound before the model's code runs (posix.lstat,
posix.readlink, ...), never with os.path or builtins the code could rebind, and it calls
no method of an argument that is not a plain str, bytes or int, so no model code runs
inside the hook. This file imports nothing of the package: it runs alone.
"""

import _stat
import ast
import builtins
import errno

try:  # the seccomp filter loads through it; a Python built without libffi has none
  import ctypes
except ImportError:
  ctypes = None
import itertools
import json
import linecache
import os
import posix
import resource
import signal
import sys
import traceback

CODE_FILENAME = "<code>"  # the model's code, as tracebacks name it
TRACEBACK_LINES = 20  # the last lines of a traceback kept
LINE_CHARS = 300  # a traceback line longer than this is cut
MAX_OPEN_FILES = 64
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
# What the seccomp filter refuses with EPERM (names this kernel does not know are skipped).
REFUSED_SYSCALLS = (
    "fork", "vfork", "execve", "execveat", "socket", "socketpair", "ptrace",
    "process_vm_readv", "process_vm_writev", "process_madvise", "kill", "tkill",
    "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "kcmp", "mount", "umount2",
    "pivot_root", "chroot", "unshare", "setns", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "bpf", "keyctl", "add_key",
    "request_key", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "perf_event_open", "userfaultfd", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "reboot", "swapon", "swapoff", "syslog", "acct",
    "quotactl", "open_by_handle_at", "name_to_handle_at", "mknod", "mknodat",
    "memfd_create", "fanotify_init", "lookup_dcookie", "sethostname", "setdomainname",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "ioperm", "iopl",
    "vhangup", "personality", "uselib", "nfsservctl",
)  # fmt: skip
SECCOMP_FAILED_EXIT = 3
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def limit_resources(settings: dict) -> None:
  """The limits as soft and hard limits (a CPU second more for the hard one, so SIGXCPU
  says why); none above a hard limit already set."""
  mb = 1 << 20
  cpu_s = max(1, int(settings["cpu_s"]))
  for which, soft, hard in (
      (resource.RLIMIT_AS, settings["memory_mb"] * mb, settings["memory_mb"] * mb),
      (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),
      (resource.RLIMIT_FSIZE, settings["max_file_mb"] * mb, settings["max_file_mb"] * mb),
      (resource.RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES),
      (resource.RLIMIT_NPROC, 0, 0),
      (resource.RLIMIT_CORE, 0, 0),
  ):
    _, current = resource.getrlimit(which)
    if current != resource.RLIM_INFINITY:
      soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (int(soft), int(hard)))
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead


class _ArgCompare(ctypes.Structure if ctypes else object):
  """libseccomp's struct scmp_arg_cmp."""

  _fields_ = [
      ("arg", ctypes.c_uint),
      ("op", ctypes.c_int),
      ("datum_a", ctypes.c_uint64),
      ("datum_b", ctypes.c_uint64),
  ] if ctypes else []  # fmt: skip


def confine_syscalls() -> str | None:
  """Loads the seccomp filter REFUSED_SYSCALLS names (and clone without CLONE_THREAD,
  clone3 as ENOSYS); None when it holds, else why it could not be loaded."""
  if ctypes is None:
    return "ctypes is missing"
  try:
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
  except OSError as e:
    return f"libseccomp.so.2: {e}"
  allow, einval_errno = 0x7FFF0000, 0x00050000  # SCMP_ACT_ALLOW, SCMP_ACT_ERRNO(0)
  lib.seccomp_init.restype = ctypes.c_void_p
  lib.seccomp_init.argtypes = [ctypes.c_uint32]
  lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
  lib.seccomp_rule_add_array.argtypes = [
      ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
      ctypes.POINTER(_ArgCompare),
  ]  # fmt: skip
  lib.seccomp_load.argtypes = [ctypes.c_void_p]
  context = lib.seccomp_init(allow)
  if not context:
    return "seccomp_init failed"
  eperm, enosys = einval_errno | errno.EPERM, einval_errno | errno.ENOSYS

  def refuse(name: str, action: int, *compare: _ArgCompare) -> bool:
    number = lib.seccomp_syscall_resolve_name(name.encode())
    if number < 0:  # __NR_SCMP_ERROR: not a system call of this kernel
      return True
    array = (_ArgCompare * len(compare))(*compare) if compare else None
    return lib.seccomp_rule_add_array(context, action, number, len(compare), array) == 0

  clone_thread, masked_eq = 0x00010000, 7  # CLONE_THREAD, SCMP_CMP_MASKED_EQ
  rules = [refuse(name, eperm) for name in REFUSED_SYSCALLS]
  rules.append(refuse("clone3", enosys))
  rules.append(refuse("clone", eperm, _ArgCompare(0, masked_eq, clone_thread, 0)))
  if not all(rules):
    return "a seccomp rule could not be added"
  if lib.seccomp_load(context) != 0:
    return f"seccomp_load failed (errno {ctypes.get_errno()})"
  return None


def die_with_parent(parent_pid: int | None) -> None:
  """The kernel kills this process when the thread that started it ends (the caller
  killed, say), so that no call outlives its caller."""
  if ctypes is None or parent_pid is None:
    return
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    return
  if os.getppid() != parent_pid:  # the caller went before the call above
    os._exit(1)  # pylint: disable=protected-access


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


def make_hook(work: str, read_roots: tuple[str, ...]):
  """The audit hook: refuses what the module docstring lists."""
  check_open, check_listing, check_change = _path_rules(work, read_roots)
  kind, str_, len_, refused = type, str, len, PermissionError
  events, prefixes, listings = REFUSED_EVENTS, REFUSED_PREFIXES, LISTINGS
  imports, import_prefixes, changes = REFUSED_IMPORTS, REFUSED_IMPORT_PREFIXES, dict(CHANGES)

  def hook(event, args):
    if event == "open":
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


def format_error(error: BaseException) -> str:
  """The traceback's last lines, from the model's code on, without the runner's own
  frames (this module's: the hook's among them); each line at most LINE_CHARS."""
  runner, frames, in_code = globals(), [], False
  for frame, line_number in traceback.walk_tb(error.__traceback__):
    in_code = in_code or frame.f_code.co_filename == CODE_FILENAME
    if in_code and frame.f_globals is not runner:
      frames.append((frame, line_number))
  lines = traceback.format_exception_only(type(error), error)
  if frames:
    stack = traceback.StackSummary.extract(frames)
    lines = ["Traceback (most recent call last):\n", *stack.format(), *lines]
  lines = "".join(lines).splitlines()
  lines = [line if len(line) <= LINE_CHARS else line[:LINE_CHARS] + " ..." for line in lines]
  if len(lines) > TRACEBACK_LINES:
    lines = [lines[0], "  ...", *lines[-(TRACEBACK_LINES - 2) :]]
  return "\n".join(lines) + "\n"


def run(code: str, memory_mb: int, max_file_mb: int) -> int:
  """Runs the code as __main__: 0, or 1 with the error written to stderr."""
  out_of_memory = f"error: MemoryError: ran past the {memory_mb} MB memory limit\n".encode()
  file_too_big = f"error: a file (or stdout) ran past the {max_file_mb} MB size limit\n"
  write_error = os.write
  namespace = {"__name__": "__main__", "__builtins__": builtins}
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
    write_error(2, (file_too_big if too_big else format_error(e)).encode("utf-8", "replace"))
    return 1
  return 0


def main() -> None:
  settings = json.loads(sys.argv[1])
  die_with_parent(settings.get("parent_pid"))
  code = sys.stdin.buffer.read().decode("utf-8", "replace")
  null = os.open(os.devnull, os.O_RDONLY)  # the code reads an empty stdin
  os.dup2(null, 0)
  os.close(null)
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
    sys.addaudithook(make_hook(os.path.realpath(settings["work_dir"]), read_roots))
  exit_now = os._exit
  status = run(code, settings["memory_mb"], settings["max_file_mb"])
  try:
    sys.stdout.flush()
  except Exception:  # pylint: disable=broad-except  # e.g. past the file size limit
    pass
  exit_now(status)


if __name__ == "__main__":
  main()
